"""Stage and IPU placement: every op of the model's graph gets its pipeline
stage and IPU, and the program its stage layout.

``Placement`` is the resolved block-to-stage assignment, as plain data: the
runtime gets it from the execution strategy (``BeginBlock`` user ids to
``(stage, ipu)``, PopTorch's AutoStage numbering, phases) and hands it down;
``place`` applies it.  Contract (an in-place rewrite): ``op.stage`` and
``op.ipu`` of the graph's ops are set, the graph's ``stash_depth`` (pipelined
training), and the program's ``n_stages``, ``ipu_of_stage``, ``n_ipus``,
``pipelined``, ``stage_map`` and, in phased execution, ``phased``,
``phase_of_stage`` and ``activations_off_chip``; PopTorch's rules are
checked (stage order, shared weights, IPU counts, accumulation).
"""
import logging
from dataclasses import dataclass, replace
from typing import Optional

from ..errors import Error
from .pipeline import (
    assign_stages,
    check_rules,
    check_shared_weights,
    dense_stages,
    num_ipus_needed,
    pipeline_stage_count,
    stage_map_text,
)


@dataclass(frozen=True)
class Placement:
    """Where the model's blocks run, resolved from the execution strategy."""
    stage_of_block: dict              # block user id (None: the default block) -> (stage, ipu)
    entered: tuple                    # block user ids in the order the model entered them
    pipelined: bool = True            # PipelinedExecution (not ShardedExecution / phased)
    phase_of_stage: Optional[list] = None    # phased execution: phase of each stage id
    serial: bool = False              # SerialPhasedExecution
    activations_off_chip: bool = False       # phased: activations wait in Streaming Memory


def place(program, graph, placement, tied, *, training, auto_round, hardware=None):
    """``program`` with ``graph`` (its model graph) placed (see the module's
    contract).  ``tied``: the model's tied weights (name -> module paths)."""
    where, keys = dense_stages(placement.stage_of_block, placement.entered)
    assign_stages(graph, where, training)
    check_shared_weights(graph, tied)
    stage_of_block = placement.stage_of_block
    order = [stage_of_block[b][0] for b in (None, *placement.entered) if b in stage_of_block]
    if placement.phase_of_stage is not None:
        # phased: stages of one phase may run in any order; phases ascend
        order = [placement.phase_of_stage[s] for s in order]
    for earlier, later in zip(order, order[1:]):
        if later < earlier:
            raise Error(
                f"Pipeline stage ids must ascend in the order the model runs its blocks, "
                f"but stage {later} runs after stage {earlier} (PopTorch: BeginBlock order "
                "must follow execution order).\nStage map:\n"
                + stage_map_text(graph, where)
                + "\nGive later blocks higher ipu_ids, or use "
                "poptorch.PipelinedExecution(poptorch.AutoStage.AutoIncrement).")
    n = len(keys) or 1
    ipu_of_stage = [ipu for _, ipu in keys] or [0]
    phased = {}
    if placement.phase_of_stage is not None:
        phased = {"phase_of_stage": [placement.phase_of_stage[s]
                                     for s in ([s for s, _ in keys] or [0])],
                  "phased": "serial" if placement.serial else "parallel",
                  "activations_off_chip": placement.activations_off_chip}
    n_ipus = num_ipus_needed(where)
    # PopTorch enables pipelining when the model uses more than one IPU
    pipelined = placement.pipelined and len(set(ipu_of_stage)) > 1
    stage_map = stage_map_text(graph, where) if where else ""
    check_rules(training=training, pipelined=placement.pipelined,
                n_stages=pipeline_stage_count(graph), di=program.device_iterations,
                ga=program.accumulation, rf=program.replicas, n_ipus=n_ipus,
                auto_round=auto_round, hardware=hardware, stage_map=stage_map,
                logger=logging.getLogger("poptorchsim"), stages_with_ops=n)
    graph.stash_depth = ({s: 2 * (n - 1 - s) + 1 for s in range(n)}
                         if pipelined and training else None)
    return replace(program, n_stages=n, ipu_of_stage=ipu_of_stage, n_ipus=n_ipus,
                   pipelined=pipelined, stage_map=stage_map, **phased)
