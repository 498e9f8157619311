"""What the first passes of a compile need from the traced model: the model
traced (again with stack traces when lowering fails, so errors name the
model's lines), its graph lowered, the host streams of one call, the
overlapped inputs and outputs, and the execution strategy's placement of
the traced blocks."""
import numpy as np
import torch
import torch.utils._pytree as pytree

from ..capture.overlap import overlapped_io
from ..capture.trace import capture_inference, capture_training
from ..errors import Error, UnsupportedOperationError
from .lower import NoActiveBlockError, lower, mark_role
from .pipeline import has_default_block
from .placement import Placement
from .precision import float_statistics_forward


def trace_model(c, stack_traces):
    """The model traced (``capture.trace``), batch norm's statistics kept in
    fp32 as the precision settings ask; ``stack_traces``: record the model's
    line behind each op (slower)."""
    cfg = c.config
    with float_statistics_forward(c.model, cfg.precision):
        if c.optimizer is None:
            return capture_inference(c.model, c.args, c.kwargs, stack_traces=stack_traces)
        return capture_training(c.model, c.args, c.kwargs, c.in_optimizer,
                                stack_traces=stack_traces, loss_scaling=c.plan.loss_scaling)


def lower_model_graph(capture, name, recapture):
    """The model's graph lowered.  When it holds operations the IPU cannot
    run (or ops outside any pipeline block), the model is traced again
    recording stack traces, so the error names the line of the model behind
    each operation (tracing is faster without)."""
    roles = ([(n, "param") for n in capture.param_names]
             + [(n, "buffer") for n in capture.buffer_names]
             + [(f"input{i}", "input") for i in range(len(capture.example_inputs))]
             + ([("lossScaling", "hyper")] if capture.loss_scaling else []))
    n_out = capture.n_tensor_outputs
    graph = None
    try:
        graph = lower(capture.graph, name, roles, n_out)
    except (UnsupportedOperationError, NoActiveBlockError):
        pass
    if graph is None:
        graph = lower(recapture().graph, name, roles, n_out)
    return mark_role(graph, "lossScaling", "loss scaling") if capture.loss_scaling else graph


def nbytes_of(shapes_dtypes):
    return sum(int(np.prod(s)) * torch.empty((), dtype=d).element_size()
               for s, d in shapes_dtypes)


def output_bytes(capture, c):
    """Bytes one call streams back to the host, as the output mode asks."""
    di, ga, rf = c.device_iterations, c.accumulation, c.replicas
    copies = {"All": di * ga * rf,
              "EveryN": (di // max(c.output_return_period, 1)) * ga * rf}.get(c.output_mode, rf)
    return sum(micro_output_bytes(capture)) * copies


def micro_output_bytes(capture):
    """Bytes of each of the model's tensor outputs for one micro-batch."""
    node = next(n for n in capture.graph.graph.nodes if n.op == "output")
    leaves = pytree.tree_leaves(node.args[0])[:capture.n_tensor_outputs]
    return [v.meta["val"].numel() * v.meta["val"].element_size()
            if hasattr(v, "meta") and "val" in v.meta else 0 for v in leaves]


def count_streams(program, c):
    """The bytes and host streams of one call, from the traced inputs and
    outputs."""
    capture, cfg = c.capture, c.config
    di, ga, rf = cfg.device_iterations, cfg.accumulation, cfg.replicas
    program.in_bytes = nbytes_of((t.shape, t.dtype) for t in capture.example_inputs) * ga * rf * di
    program.out_bytes = output_bytes(capture, cfg)
    program.in_streams, program.out_streams = host_streams(capture, program, c.overlap)


def host_streams(capture, program, overlap):
    """(inputs, outputs): the host streams of one call as ``(OverlapMode
    value, copies, bytes)``.

    Poplar streams every input of every micro-batch of every replica as its
    own host copy, and the outputs once per device iteration (all outputs
    together, an overlapped output on its own)."""
    di, ga, rf = program.device_iterations, program.accumulation, program.replicas
    in_modes, out_modes = overlap
    streams = [(in_modes.get(i, "no_overlap"), di * ga * rf,
                nbytes_of([(t.shape, t.dtype)]) * di * ga * rf)
               for i, t in enumerate(capture.example_inputs)]
    micro = micro_output_bytes(capture)
    share = [program.out_bytes * m // max(sum(micro), 1) for m in micro]
    plain = program.out_bytes - sum(share[k] for k in out_modes)
    outputs = [("no_overlap", di, plain)] if plain else []
    outputs += [(mode, di, share[k]) for k, mode in out_modes.items()]
    return streams, outputs


def check_overlap(capture, spec, io_tiles):
    """The overlapped inputs and outputs, PopTorch's preconditions checked."""
    inputs, outputs = overlapped_io(capture)
    if any(mode != "no_overlap" for mode in [*inputs.values(), *outputs.values()]):
        if spec is None or spec.pipelined:
            raise Error("Overlapped IO is not supported with poptorch.PipelinedExecution. "
                        "If you are using only one IPU, please switch to "
                        "poptorch.ShardedExecution.")
        if not io_tiles:
            raise Error("No IO tiles allocated. You must allocate at least 32 IO tiles "
                        "using poptorch.Options().TensorLocations.numIOTiles.")
    return inputs, outputs


def placement_of(spec, capture, graph):
    """The execution strategy's block-to-stage assignment for the traced
    blocks, as ``passes.placement.Placement``.  ``spec``: the strategy as
    data (``passes.stages.StagedSpec`` or ``PhasedSpec``; None: blocks run
    on their ``ipu_id``, one stage per IPU).

    Ops traced before the model's first block form PopTorch's default block
    (stage 0 on IPU 0) when the strategy places it (``assign(..., default=
    True)``); a strategy that does not (the auto-split's) keeps them with
    the first stage."""
    entered = tuple(dict.fromkeys(b for b, _ in capture.blocks))
    stage_of_block = {}
    if capture.blocks:
        default = has_default_block(graph)
        if spec is not None:
            stage_of_block = spec.assign(capture.blocks, default=default)
        else:
            stage_of_block = {b: (ipu or 0, ipu or 0) for b, ipu in capture.blocks}
            if default:
                stage_of_block = {None: (0, 0), **stage_of_block}
    phased = {}
    if spec is not None and spec.phased:
        spec.check(stage_of_block)
        phased = {"phase_of_stage": spec.phase_of_stage(), "serial": spec.serial,
                  "activations_off_chip": spec.activations_off_chip}
    return Placement(stage_of_block, entered,
                     pipelined=spec.pipelined if spec is not None else True, **phased)
