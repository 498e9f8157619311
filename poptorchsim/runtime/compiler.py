"""compile: capture -> lower -> program -> tile mapping, costs, memory -> engine.

``compile_training`` and ``compile_inference`` return a ``Compiled``: the
IR program a user can print, the memory report, the cycle estimate, and the
functions the engine runs.
"""
import time
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.utils._pytree as pytree
from tqdm.auto import tqdm

from ..capture import optimizers as opt_rules
from ..capture.overlap import overlapped_io
from ..errors import Error, UnsupportedOperationError
from ..capture.trace import capture_inference, capture_training, capture_update
from ..ir.graph import (AllGather, AllReduce, Call, DeviceToHost, HostToDevice, Program,
                        ReduceScatter, RemoteLoad, RemoteStore, Repeat, Sequence)
from ..machine import constants as K
from ..machine.cost import _exchange_cycles, op_cost, with_branches_taken
from ..machine.engine import compile_graph
from ..machine.precision import GradientWatch
from .precision import (apply as apply_precision, float_statistics_forward,
                        floating_point_checks)
from ..machine.targets import with_io_tiles
from ..passes import locations as tensor_locations
from ..passes.loss_scaling import add_gradient_statistics, add_loss_scale_update, mark_watched
from ..passes.lower import NoActiveBlockError, lower, mark_role
from ..passes.host_scalars import mark_host_scalars
from ..passes.memory import check_fits, plan_memory
from ..passes.pipeline import input_ipus
from ..passes import recompute
from ..passes.tile_mapping import map_graph


@dataclass
class Compiled:
    capture: object
    program: Program
    target: object
    memory: object
    costs: dict                       # graph name -> [OpCost]
    cycles: dict                      # breakdown of one call
    step_fn: object
    update_fn: object = None
    optimizer_kind: str = ""
    group_of: list = field(default_factory=list)
    flags: list = field(default_factory=list)
    compile_seconds: float = 0.0
    max_grad_norm: float = None
    shards: dict = field(default_factory=dict)   # param -> replicas its optimizer state is cut over
    plan: object = None               # the optimizer update's UpdatePlan
    slots: list = field(default_factory=list)    # per trainable param: (Slots read, Slots written)
    layouts: list = field(default_factory=list)  # per trainable param: trace.ParamUpdate


def _bytes(shapes_dtypes):
    import torch
    return sum(int(np.prod(s)) * torch.empty((), dtype=d).element_size()
               for s, d in shapes_dtypes)


def _graph_cycles(costs):
    keys = ("compute", "exchange", "sync", "host")     # host: host ops' round trips
    return {k: float(sum(getattr(c, k) for c in costs)) for k in keys}


def _link_cycles(nbytes, src, dst, target):
    """An inter-IPU copy: bytes over one IPU-Link plus a sync that grows with
    the hops between the IPUs (PopLibs' global-sync model, 15 ns a hop)."""
    hops = 1 + abs(dst - src) // 2
    sync = int(np.ceil(K.LINK_HOP_SECONDS * target.clock_hz * hops * 2))
    return nbytes / (target.link_bytes_per_s / target.clock_hz) + sync


def _stage_times(graph, costs, target, n_stages):
    """(forward, backward) cycles per stage for one micro-batch, inter-IPU
    copies included (charged to the receiving stage)."""
    fwd, bwd = [0.0] * n_stages, [0.0] * n_stages
    ipu_of = {}
    for op, cost in zip(graph.ops, costs):
        (bwd if op.backward else fwd)[op.stage] += cost.total
        if op.attrs.get("recompute"):      # run again before its stage's backward
            bwd[op.stage] += cost.total
        for t in op.outputs:
            if t is not None:
                ipu_of[t.id] = op.ipu
    copied = set()
    for op in graph.ops:
        for t in op.input_tensors():
            src = ipu_of.get(t.id, t.mapping.ipu)
            if src != op.ipu and (t.id, op.ipu) not in copied:
                copied.add((t.id, op.ipu))
                (bwd if op.backward else fwd)[op.stage] += _link_cycles(
                    t.nbytes, src, op.ipu, target)
    return fwd, bwd


def estimate_with_branches(compiled, taken):
    """The cycle estimate of one call with each conditional paying the
    branches the device took (``taken``: op name -> [then, else] counts)
    instead of the longer one."""
    costs = {name: [with_branches_taken(op, c, taken, compiled.target)
                    for op, c in zip(graph.ops, compiled.costs[name])]
             for name, graph in compiled.program.graphs.items()}
    return _estimate(compiled.program, costs, compiled.target)


def _estimate(program, costs, target):
    """Cycles of one call (all device iterations), split by kind."""
    from ..passes.pipeline import schedule
    di, ga = program.device_iterations, program.accumulation
    training = program.kind == "training"
    step_name = "training_step" if training else "inference_forward"
    graph = program.graphs[step_name]
    again = [c for op, c in zip(graph.ops, costs[step_name]) if op.attrs.get("recompute")]
    step = _graph_cycles(costs[step_name] + again)
    n_stages = program.n_stages
    fwd, bwd = _stage_times(program.graphs[step_name], costs[step_name], target, n_stages)
    ipu_of_stage = program.ipu_of_stage
    if training:
        sched = schedule(fwd, bwd, ipu_of_stage, ga, program.pipelined, True)
        calls = di
    else:
        # inference pipelines device iterations
        sched = schedule(fwd, bwd, ipu_of_stage, di, program.pipelined, False)
        calls = 1
    program.schedule = sched
    step_total = sum(step.values()) or 1.0
    total = {k: sched.cycles * calls * v / step_total for k, v in step.items()}
    # recomputed ops' share of the step's cycles (already in the kinds above)
    recomputed = sched.cycles * calls * sum(c.total for c in again) / step_total
    if training:
        upd = _graph_cycles(costs["optimizer_update"])
        grad_bytes = program.grad_bytes
        if ga > 1:
            # accumulate: one element-wise add of every gradient per micro-batch
            per_tile = grad_bytes / target.tiles / max(len(set(ipu_of_stage)), 1)
            total["compute"] += di * ga * (per_tile / target.vector_bytes)
            total["sync"] += di * ga * target.sync_cycles
        for k in upd:
            total[k] += upd[k] * di / max(len(set(ipu_of_stage)), 1)
    total["collective"], total["streaming"], through_io = _replication_cycles(program, target)
    if through_io:      # Streaming Memory transfers through IO tiles overlap compute
        device = total["compute"] + total["exchange"] + total["sync"]
        total["streaming"] += max(0.0, through_io - device)
    if program.phased:
        device = total["compute"] + total["exchange"] + total["sync"]
        total["streaming"] += _phase_streaming(program, target, device)
    host_s = target.call_overhead_s
    if not program.synthetic_data:
        device_s = sum(total.values()) / target.clock_hz
        streams_s = _host_seconds(program.host_streams, device_s, di, ga, target)
        host_s += _unsynced_host_seconds(program, sched, streams_s, device_s)
    total["host"] += host_s * target.clock_hz       # streams, after host ops' trips
    total["total"] = sum(total.values())
    total["seconds"] = total["total"] / target.clock_hz
    total["bubble"] = sched.bubble
    total["recompute"] = recomputed       # part of "total", not added to it
    return total


def _host_streams(capture, program, overlap):
    """The host streams of one call as ``(OverlapMode value, copies, bytes)``.

    Poplar streams every input of every micro-batch of every replica as its
    own host copy, and the outputs once per device iteration (all outputs
    together, an overlapped output on its own)."""
    di, ga, rf = program.device_iterations, program.accumulation, program.replicas
    in_modes, out_modes = overlap
    streams = [(in_modes.get(i, "no_overlap"), di * ga * rf,
                _bytes([(t.shape, t.dtype)]) * di * ga * rf)
               for i, t in enumerate(capture.example_inputs)]
    node = list(capture.graph.graph.nodes)[-1]
    leaves = pytree.tree_leaves(node.args[0])[:capture.n_tensor_outputs]
    micro = [v.meta["val"].numel() * v.meta["val"].element_size()
             if hasattr(v, "meta") and "val" in v.meta else 0 for v in leaves]
    share = [program.out_bytes * m // max(sum(micro), 1) for m in micro]
    plain = program.out_bytes - sum(share[k] for k in out_modes)
    if plain:
        streams.append(("no_overlap", di, plain))
    streams += [(mode, di, share[k]) for k, mode in out_modes.items()]
    return streams


def _host_seconds(streams, device_s, di, ga, target):
    """Seconds the host streams of one call add to it.  A stream through the
    IO tiles (``set_overlap_for_input``/``_output``) runs while the compute
    tiles work: only what compute cannot hide is paid, and at least its first
    copy of each loop it overlaps (the accumulation loop, once per device
    iteration; or the whole device-iteration loop)."""
    plain = overlapped = 0.0
    by_mode = {}
    for mode, copies, nbytes in streams:
        seconds = copies * target.host_latency_s + nbytes / target.host_bytes_per_s
        if mode == "no_overlap":
            plain += seconds
        else:
            by_mode[mode] = by_mode.get(mode, 0.0) + seconds
    for mode, seconds in by_mode.items():
        windows, steps = (1, di * ga) if mode == "overlap_device_iteration_loop" else (di, ga)
        per_window, compute = seconds / windows, device_s / windows
        overlapped += windows * max(per_window / steps, per_window - compute)
    return plain + overlapped


def _unsynced_host_seconds(program, sched, streams_s, device_s):
    """The host streams' seconds left to pay under ``Options.syncPattern``.

    ``Full``: every host transfer syncs all IPUs, which wait for it: all of
    it is paid.  ``SinglePipeline``: the IPUs that stream (the first stage's
    for inputs, the last stage's for outputs) sync with the host alone, so
    the transfer fills their idle time in the schedule while the other IPUs
    compute; only what that idle time cannot hold is paid (a replica on one
    IPU has none).  ``ReplicaAndLadder``: replicas stream without syncing
    each other, so each replica's transfer overlaps the others' compute; the
    host link still carries all of it (at least ``streams_s`` in all, at
    least one replica's share on the critical path)."""
    from ..enums import SyncPattern
    pattern = program.sync_pattern
    if pattern == SyncPattern.SinglePipeline and program.n_ipus > 1 and sched is not None:
        busy = {}
        for ipu, _, _, duration in sched.events:
            busy[ipu] = busy.get(ipu, 0.0) + duration
        io_ipus = {program.ipu_of_stage[0], program.ipu_of_stage[-1]}
        share = max(busy.get(i, 0.0) for i in io_ipus) / (sched.cycles or 1.0)
        idle_s = device_s * max(0.0, 1.0 - min(share, 1.0))
        return max(0.0, streams_s - idle_s)
    replicas = program.total_replicas
    if pattern == SyncPattern.ReplicaAndLadder and replicas > 1:
        return max(streams_s / replicas, streams_s - device_s)
    return streams_s


def _check_overlap(capture, strategy, io_tiles):
    """The overlapped inputs and outputs, PopTorch's preconditions checked."""
    inputs, outputs = overlapped_io(capture)
    if any(mode != "no_overlap" for mode in [*inputs.values(), *outputs.values()]):
        if getattr(strategy, "is_pipelined", True):
            raise Error("Overlapped IO is not supported with poptorch.PipelinedExecution. "
                        "If you are using only one IPU, please switch to "
                        "poptorch.ShardedExecution.")
        if not io_tiles:
            raise Error("No IO tiles allocated. You must allocate at least 32 IO tiles "
                        "using poptorch.Options().TensorLocations.numIOTiles.")
    return inputs, outputs


def _ring_cycles(nbytes, replicas, phases, target):
    """A ring collective over IPU-Links: ``phases`` = 2 for an all-reduce,
    1 for a reduce-scatter or an all-gather.  Each of the (R-1) steps of a
    phase moves 1/R of the tensor over one link and syncs."""
    if replicas <= 1 or nbytes <= 0:
        return 0.0
    link_bytes_per_cycle = target.link_bytes_per_s / target.clock_hz
    steps = phases * (replicas - 1)
    return steps * (nbytes / replicas / link_bytes_per_cycle + K.RING_STEP_SYNC_CYCLES)


def _streaming_cycles(nbytes, transfers, program, target):
    """Moving ``nbytes`` between one replica's tiles and Streaming Memory in
    ``transfers`` separate copies, while every IPU of the IPU-Machine does
    the same (they share its gateway)."""
    if nbytes <= 0:
        return 0.0
    sharing = min(target.ipus_per_machine, program.n_ipus * program.total_replicas)
    seconds = nbytes * sharing / target.streaming_bytes_per_s + transfers * target.host_latency_s
    return seconds * target.clock_hz


def _replication_cycles(program, target):
    """(collective, streaming) cycles of one call.

    Per weight update: gradients are all-reduced across all replicas (those
    whose optimizer state is sharded are reduce-scattered, and their new
    weights all-gathered); sharded weights are all-gathered for every
    micro-batch; off-chip variables are loaded and stored around the graphs
    that use them (weights and accumulators every micro-batch, optimizer
    state once per update).  Bytes per IPU of one replica: with several
    IPUs per replica, each IPU reduces its own parameters at the same time,
    so the largest IPU share counts."""
    di, ga, R = program.device_iterations, program.accumulation, program.total_replicas
    locs = program.locations
    training = program.kind == "training"
    n_ipus = max(program.n_ipus, 1)
    collective = streaming = 0.0
    if training:
        whole, sharded = _gradient_bytes(program)
        per_update = (_ring_cycles(whole / n_ipus, R, 2, target)
                      + 2 * _ring_cycles(sharded / n_ipus, R, 1, target))
        collective += di * per_update
    weights_rts = sum(loc.nbytes for loc in locs.values() if loc.kind == "weight" and loc.sharded)
    collective += di * ga * _ring_cycles(weights_rts / n_ipus, R, 1, target)
    through_io = 0.0
    for kind, per_update in (("optimizer", 2), ("weight", ga + (1 if training else 0)),
                             ("accumulator", 2 * ga)):
        for io in (False, True):
            off = [loc for loc in locs.values()
                   if loc.kind == kind and loc.off_chip and loc.io_tiles == io]
            nbytes = sum(loc.replica_bytes for loc in off) / n_ipus
            cycles = di * _streaming_cycles(nbytes * per_update, len(off) * per_update,
                                            program, target)
            if io:
                # the IO tiles hold the transfer while compute goes on; the
                # data then crosses the exchange from IO to compute tiles
                through_io += cycles
                streaming += di * per_update * _exchange_cycles(
                    nbytes / max(target.io_tiles, 1), target)
            else:
                streaming += cycles
    return collective, streaming, through_io


def _stages(show, desc):
    return tqdm(total=5, desc=desc, disable=not show, leave=False,
                bar_format="{desc}: {percentage:3.0f}%|{bar}| {n}/{total} [{elapsed}]")


def _plan(program, target, amp, variables, allow_oom, bar=None, settings=None):
    """Costs per op, tensor locations, the memory report of every IPU
    (checked) and the cycle estimate.  Returns (costs, memory of IPU 0 with
    ``.ipus`` = all, cycles).  ``amp``: the available memory proportion, or
    {IPU index: proportion} (setAvailableMemoryProportion per IPU; 0.6 where unset)."""
    costs = {name: [op_cost(op, target, amp.get(op.ipu, 0.6) if isinstance(amp, dict) else amp)
                    for op in g.ops]
             for name, g in program.graphs.items()}
    if bar is not None:
        bar.set_description("Memory planning"); bar.update(1)
    program.locations = tensor_locations.place(
        variables, settings or {}, program.total_replicas, program.sharded_state,
        accumulating=program.accumulation > 1)
    if program.kind == "training":
        _training_main(program)
    reports = [plan_memory(program, variables, target, costs, ipu, program.locations)
               for ipu in range(program.n_ipus)]
    for report in reports:
        check_fits(report, target, allow_oom, program.n_ipus)
    memory = reports[0]
    memory.ipus = reports
    cycles = _estimate(program, costs, target)
    return costs, memory, cycles


def _place(program, graph, capture, strategy, *, training, di, ga, rf, auto_round):
    """Stages and IPUs of every op, PopTorch's rules checked first.

    Ops traced before the model's first block form PopTorch's default block
    (stage 0 on IPU 0) when the strategy places it (``assign(..., default=
    True)``); a strategy that does not (the auto-split's) keeps them with
    the first stage."""
    import logging
    from ..passes.pipeline import (assign_stages, check_rules, check_shared_weights,
                                   dense_stages, has_default_block, num_ipus_needed,
                                   pipeline_stage_count, stage_map_text)
    entered = list(dict.fromkeys(b for b, _ in capture.blocks))
    stage_of_block = {}
    if capture.blocks:
        default = has_default_block(graph)
        if strategy is not None and hasattr(strategy, "assign"):
            stage_of_block = strategy.assign(capture.blocks, default=default)
        else:
            stage_of_block = {b: (ipu or 0, ipu or 0) for b, ipu in capture.blocks}
            if default:
                stage_of_block = {None: (0, 0), **stage_of_block}
    where, keys = dense_stages(stage_of_block, entered)
    assign_stages(graph, where, training)
    check_shared_weights(graph, getattr(capture, "tied", {}))
    order = [stage_of_block[b][0] for b in (None, *entered) if b in stage_of_block]
    if getattr(strategy, "is_phased", False):
        # phased: stages of one phase may run in any order; phases ascend
        order = [strategy.phase_of_stage()[s] for s in order]
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
    if getattr(strategy, "is_phased", False):
        _phases(program, strategy, stage_of_block, [s for s, _ in keys] or [0])
    pipelined = bool(getattr(strategy, "is_pipelined", True))
    program.stage_map = stage_map_text(graph, where) if where else ""
    program.n_stages, program.ipu_of_stage = n, ipu_of_stage
    program.n_ipus = num_ipus_needed(where)
    # PopTorch enables pipelining when the model uses more than one IPU
    program.pipelined = pipelined and len(set(ipu_of_stage)) > 1
    graph.stash_depth = ({s: 2 * (n - 1 - s) + 1 for s in range(n)}
                         if program.pipelined and training else None)
    check_rules(training=training, pipelined=pipelined, n_stages=pipeline_stage_count(graph),
                di=di, ga=ga, rf=rf, n_ipus=program.n_ipus, auto_round=auto_round,
                stage_map=program.stage_map, logger=logging.getLogger("poptorchsim"),
                stages_with_ops=n)


def _phases(program, strategy, stage_of_block, stages):
    """Phased execution: the phase of every stage and where activations wait."""
    from ..enums import Liveness
    strategy.check(stage_of_block)
    phase_of = strategy.phase_of_stage()
    program.phase_of_stage = [phase_of[s] for s in stages]
    program.phased = "serial" if strategy.serial else "parallel"
    program.activations_off_chip = (
        Liveness(getattr(strategy, "tensors_liveness", Liveness.AlwaysLive))
        != Liveness.AlwaysLive)


def _phase_streaming(program, target, device_cycles):
    """Phased execution moves each phase's weights (and its optimizer state,
    at the update) between Streaming Memory and the tiles, and activations
    that cross phases when they wait off chip.  Serial phases wait for their
    loads; parallel phases load the next phase on the other IPUs while the
    current one computes, so only what compute cannot hide is paid."""
    from ..passes.memory import variable_phases
    training = program.kind == "training"
    step = program.graphs["training_step" if training else "inference_forward"]
    di, ga, locs = program.device_iterations, program.accumulation, program.locations
    phases = variable_phases(program)
    n_phases = max(program.phase_of_stage) + 1

    def replica_bytes(t):
        loc = locs.get(t.name)
        return loc.replica_bytes if loc else t.mapping.nbytes

    graphs = list(program.graphs.values())
    weights = sum(replica_bytes(t) for t in step.inputs
                  if t.role in ("param", "buffer") and t.name in phases)
    state = sum(replica_bytes(t) for g in graphs[1:] for t in g.inputs
                if t.role in ("state", "accumulator") and t.name in phases)
    crossing = 0
    if program.activations_off_chip:
        phase_of_op = {}
        for op in step.ops:
            for t in op.outputs:
                if t is not None:
                    phase_of_op[t.id] = program.phase_of_stage[op.stage]
        seen = set()
        for op in step.ops:
            here = program.phase_of_stage[op.stage]
            for t in op.input_tensors():
                if phase_of_op.get(t.id, here) != here and t.id not in seen:
                    seen.add(t.id)
                    crossing += t.nbytes
    per_micro = weights * (2 if training else 1) + 2 * crossing
    per_update = (weights + 2 * state) if training else 0
    # each IPU moves its own phases' tensors; they share the gateway
    n_ipus = max(program.n_ipus, 1)
    nbytes = di * (ga * per_micro + per_update) / n_ipus
    transfers = di * n_phases * (ga * (2 if training else 1) + (3 if training else 0)) / n_ipus
    cycles = _streaming_cycles(nbytes, transfers, program, target)
    if program.phased == "parallel":
        cycles = max(cycles / n_phases, cycles - device_cycles)
    return cycles


def _map_training(step_graph, update_graph, target):
    """Optimizer updates run on the IPU holding their parameter."""
    from ..passes.pipeline import input_stages, place_update
    place_update(update_graph, input_ipus(step_graph), input_stages(step_graph))


def _check_locations(settings, io_tiles=0):
    import logging
    for kind, setting in settings.items():
        # as in PopART, the IO tile set only concerns variables in Streaming
        # Memory: on chip (the default) the setting has nothing to move
        if setting.get("onChip", 1):
            continue
        for key in ("useIOTilesToLoad", "useIOTilesToStore"):
            if setting.get(key) and not io_tiles:
                raise Error(f"TensorLocations {kind} location asks {key}(True), but no IO "
                            "tiles are allocated: allocate them with poptorch.Options()."
                            "TensorLocations.numIOTiles(n) (32 or more), or drop "
                            f"{key}.")
    if settings.get("activation", {}).get("onChip", 1) == 0:
        logging.getLogger("poptorchsim").warning(
            "TensorLocations.setActivationLocation(useOnChipStorage(False)) only moves "
            "activations with phased execution (SerialPhasedExecution or "
            "ParallelPhasedExecution); activations stay on chip.")


def _sharded_state(model, optimizer, capture, settings, replicas, plan=None):
    """{param: replicas} for the parameters whose optimizer state is sharded."""
    params = dict(model.named_parameters())
    numels = {n: params[n].numel() for n in capture.trainable_names}
    names = tensor_locations.sharded_parameters(settings, numels, replicas)
    if plan is not None and plan.kind == "sgd_combined":
        return {}       # the combined variant has no optimizer state to shard
    if names and max_grad_norm(optimizer) is not None:
        raise Error(
            "max_grad_norm needs the global gradient norm, but replicated tensor sharding "
            f"of the optimizer state leaves each replica with a shard of {len(names)} "
            "parameter(s). Drop max_grad_norm, or turn sharding off with "
            "TensorLocationSettings().useReplicatedTensorSharding(False).")
    return {n: replicas for n in names}


def _numeric_update(model, optimizer, capture, plan, shards, update, unit_scale):
    """(update, shards) the engine runs.  LAMB's trust ratio needs the norms
    of whole weights: with sharded state PopART all-reduces the shards'
    partial squared norms, so every replica scales its shard as the whole
    weight would be.  The program (memory, cycles) keeps the sharded
    update; the numerics run the same update over whole weights, which
    gives those values."""
    if not shards or plan.kind != "lamb":
        return update, shards
    return _build_update(model, optimizer, capture, plan, None, unit_scale), {}


def update_plan(optimizer, ga, running_mean=False, auto_loss_scaling=False):
    """(Settings, UpdatePlan) of ``optimizer`` for a program accumulating ``ga``
    micro-batches per update."""
    read = opt_rules.read_settings(optimizer, bool(auto_loss_scaling))
    return read, opt_rules.plan_update(optimizer, read, accumulating=ga > 1,
                                       running_mean=running_mean)


def compile_training(model, optimizer, args, kwargs, *, di, ga, rf, target,
                     amp=0.6, show_progress=True, allow_oom=False, out_bytes_fn=None,
                     synthetic=False, strategy=None, auto_round=False, locations=None,
                     processes=1, io_tiles=0, precision=None, running_mean=False,
                     auto_loss_scaling=None, recomputation=None, sync_pattern=0):
    """``recomputation``: PopART's ``autoRecomputation`` (None when unset:
    Pipeline for a pipeline over several IPUs, otherwise none; see
    ``passes/recompute.py``).
    ``running_mean``: the mean over accumulated micro-batches is a running
    mean (MeanReductionStrategy.Running); ``auto_loss_scaling``: None, or the
    ``passes.loss_scaling.Settings`` of automatic loss scaling
    (Options.Training.setAutomaticLossScaling)."""
    t0 = time.perf_counter()
    settings = locations or {}
    _check_locations(settings, io_tiles)
    target = with_io_tiles(target, io_tiles)
    bar = _stages(show_progress, "Graph compilation")
    _, plan = update_plan(optimizer, ga, running_mean, auto_loss_scaling)
    by_id = {id(p): n for n, p in model.named_parameters()}
    in_optimizer = {by_id[id(p)] for g in optimizer.param_groups for p in g["params"]
                    if id(p) in by_id}
    bar.set_description("Tracing"); bar.update(1)
    with float_statistics_forward(model, precision):
        capture = capture_training(model, args, kwargs, in_optimizer,
                                   stack_traces=floating_point_checks(precision),
                                   loss_scaling=plan.loss_scaling)
    overlap = _check_overlap(capture, strategy, io_tiles)
    bar.set_description("Lowering"); bar.update(1)

    def recapture():
        with float_statistics_forward(model, precision):
            return capture_training(model, args, kwargs, in_optimizer, stack_traces=True,
                                    loss_scaling=plan.loss_scaling)
    step_graph = _lower_model(capture, "training_step", recapture)

    shards = _sharded_state(model, optimizer, capture, settings, rf * processes, plan)
    unit_scale = ga * rf * processes == 1 and not plan.loss_scaling
    update = _build_update(model, optimizer, capture, plan, shards, unit_scale=unit_scale)
    update_graph = update.graph
    numeric, numeric_shards = _numeric_update(model, optimizer, capture, plan, shards,
                                              update, unit_scale)
    in_bytes = _bytes((t.shape, t.dtype)
                      for t in capture.example_inputs) * ga * rf * di
    program = Program("training", {"training_step": step_graph,
                                   "optimizer_update": update_graph},
                      None, rf, di, ga, processes=processes, sharded_state=set(shards))
    program.in_bytes, program.synthetic_data = in_bytes, synthetic
    program.sync_pattern = int(sync_pattern)
    program.out_bytes = out_bytes_fn(capture) if out_bytes_fn else 0
    program.host_streams = _host_streams(capture, program, overlap)
    _place(program, step_graph, capture, strategy, training=True, di=di, ga=ga, rf=rf,
           auto_round=auto_round)
    recompute.plan(step_graph, recompute.default_mode(
        recomputation, program.pipelined and program.n_ipus > 1), program.pipelined)

    watch = _watch_gradients(program, model, auto_loss_scaling)
    if numeric is not update and auto_loss_scaling:
        _add_scale_update(numeric.graph, model, auto_loss_scaling)

    bar.set_description("Tile mapping"); bar.update(1)
    _map_training(step_graph, update_graph, target)
    variables = {}
    _map_variables(program, target, variables)
    rounding = apply_precision(precision, [step_graph, update_graph]
                               + ([numeric.graph] if numeric is not update else []))
    costs, memory, cycles = _plan(program, target, amp, variables, allow_oom, bar, settings)
    step_fn = compile_graph(step_graph)
    update_fn = compile_graph(numeric.graph)
    bar.update(1); bar.close()
    compiled = Compiled(capture, program, target, memory, costs, cycles, step_fn, update_fn,
                        plan.kind, numeric.group_of, numeric.flags, time.perf_counter() - t0,
                        plan.max_grad_norm, numeric_shards, plan, numeric.slots,
                        numeric.layouts)
    compiled.location_settings = settings
    compiled.precision, compiled.rounding = precision, rounding
    compiled.watch, compiled.auto_loss_scaling = watch, auto_loss_scaling
    return compiled


def _watch_gradients(program, model, als):
    """Marks the backward ops of the training step with fp16 results and
    gives it a ``GradientWatch`` (None when it has none); with automatic
    loss scaling (``als``, its ``Settings``), adds PopART's histogram ops to
    the step and the loss-scale update to the optimizer update."""
    step, update = program.graphs["training_step"], program.graphs["optimizer_update"]
    if als:
        if program.pipelined and program.accumulation == 1:
            raise Error("[AutomaticLossScale transform] Automatic loss scaling is not "
                        "currently supported when the 'enablePipelining' SessionOption is set "
                        "to 'true', but the 'enableGradientAccumulation' SessionOption is set "
                        "to 'false'")
        add_gradient_statistics(step, als)
        _add_scale_update(update, model, als)
    mark_watched(step)
    watched = any(op.attrs.get("watched") for op in step.ops)
    step.watch = GradientWatch() if watched else None
    return step.watch


def _add_scale_update(update, model, als):
    clip = any(p.dtype == torch.float16 for p in model.parameters() if p.requires_grad)
    add_loss_scale_update(update, als, clip)


def _map_variables(program, target, variables):
    """Tile mappings of the training step and the optimizer update; gradients
    of sharded state are accumulated whole, so they map at full size."""
    step, update = program.graphs["training_step"], program.graphs["optimizer_update"]
    numel = {t.name: t.numel for t in step.inputs if t.role == "param"}
    full = {}
    for t in update.inputs:
        param = t.name.split("/", 1)[-1]
        if t.role == "accumulator" and param in program.sharded_state:
            full[t.name] = numel[param] * t.nbytes // max(t.numel, 1)
    cursor = map_graph(step, target, None, variables, input_ipus(step))
    map_graph(update, target, cursor, variables, input_ipus(update), full)


def _gradient_bytes(program):
    """(all-reduced, reduce-scattered) gradient bytes of one weight update:
    gradients of parameters with sharded optimizer state are reduce-scattered."""
    grads = [t for t in program.graphs["optimizer_update"].inputs if t.role == "accumulator"]
    sharded = sum(t.mapping.nbytes for t in grads
                  if t.name.split("/", 1)[1] in program.sharded_state)
    return sum(t.mapping.nbytes for t in grads) - sharded, sharded


def _training_main(program):
    """The control program of a training call, from the tensor locations."""
    di, ga, rf = program.device_iterations, program.accumulation, program.replicas
    R = program.total_replicas
    step, update = program.graphs["training_step"], program.graphs["optimizer_update"]
    locs = program.locations

    def off(kind):
        names = [n for n, loc in locs.items() if loc.kind == kind and loc.off_chip]
        return names, sum(locs[n].replica_bytes for n in names)

    whole, sharded = _gradient_bytes(program)
    micro = []
    weights_off, weights_off_bytes = off("weight")
    if weights_off:
        micro.append(RemoteLoad(weights_off, weights_off_bytes))
    rts_weights = sum(loc.nbytes for loc in locs.values() if loc.kind == "weight" and loc.sharded)
    if rts_weights:
        micro.append(AllGather(rts_weights, R))
    micro.append(Call(step, rf))
    body = [HostToDevice(program.in_bytes // di),
            Repeat(ga, Sequence(micro) if len(micro) > 1 else micro[0], "accumulation")]
    if R > 1 and whole:
        body.append(AllReduce(whole, R))
    if R > 1 and sharded:
        body.append(ReduceScatter(sharded, R))
    state_off, state_off_bytes = off("optimizer")
    if state_off:
        body.append(RemoteLoad(state_off, state_off_bytes))
    body.append(Call(update, rf))
    if state_off:
        body.append(RemoteStore(state_off, state_off_bytes))
    if R > 1 and sharded:
        body.append(AllGather(sharded, R))
    if weights_off:
        body.append(RemoteStore(weights_off, weights_off_bytes))
    body.append(DeviceToHost(program.out_bytes // max(di, 1), "per output mode"))
    program.grad_bytes = whole + sharded
    program.main = Repeat(di, Sequence(body), "device_iteration")


def _lower_model(capture, name, recapture):
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


def max_grad_norm(optimizer):
    """poptorchsim.optim's global-norm clipping threshold, or None."""
    value = getattr(optimizer, "max_grad_norm", None)
    return None if value is None or value == float("inf") else float(value)


@dataclass
class _Update:
    graph: object
    group_of: list
    flags: list
    slots: list
    layouts: list


def _build_update(model, optimizer, capture, plan, shards=None, unit_scale=False):
    """The optimizer-update graph for ``optimizer`` over the trainable params.

    A parameter in ``shards`` (name -> R) is updated as one replica's shard:
    a flat tensor of ceil(numel / R) elements.  ``unit_scale``: one
    micro-batch per update on one replica and no loss scaling, so gradients
    need no scaling."""
    from ..capture.trace import ParamUpdate
    shards = shards or {}
    group_index = {}
    for gi, group in enumerate(optimizer.param_groups):
        for p in group["params"]:
            group_index[id(p)] = gi
    params = dict(model.named_parameters())
    names = capture.trainable_names
    group_of = [group_index[id(params[n])] for n in names]
    slots, layouts = [], []
    for n, grp in zip(names, group_of):
        p = params[n]
        shape = (-(-p.numel() // shards[n]),) if n in shards else tuple(p.shape)
        read, written = opt_rules.slots(plan.kind, plan.group_flags(grp))
        slots.append((read, written))
        layouts.append(ParamUpdate(
            shape, p.dtype, opt_rules.grad_dtype(plan, p.dtype), grp,
            tuple((s.name, opt_rules.slot_dtype(plan, s, p.dtype)) for s in read),
            tuple((s.name, opt_rules.slot_dtype(plan, s, p.dtype)) for s in written)))
    n_groups = len(optimizer.param_groups)
    update_fx = capture_update(plan, layouts, n_groups, unit_scale)
    grad = "velocity" if plan.into_state else "grad"     # SGD1: the combined tensor
    roles = ([(n, "param") for n in names] + [(f"{grad}/{n}", "accumulator") for n in names]
             + [(f"{s.name}/{n}", "state") for n, (read, _) in zip(names, slots)
                for s in read]
             + [(f"step/{n}", "state") for n in names]
             + [(f"hyper/{g}/{h}", "hyper") for g in range(n_groups) for h in plan.hyper]
             + [(f"hyper/{h}", "hyper") for h in plan.globals]
             + [("grad_scale", "hyper")])
    graph = mark_role(lower(update_fx, "optimizer_update", roles), "grad_scale",
                      "gradient unscale")
    # bias corrections, lr / bias_correction, the step count: the host's work
    graph = mark_host_scalars(graph, counters=[f"step/{n}" for n in names])
    graph.outputs_overwrite_inputs = True     # variables are updated in place
    return _Update(graph, group_of, [plan.group_flags(g) for g in range(n_groups)],
                   slots, layouts)


def check_loss_scaling(compiled, plan):
    """The step graph is kept when the update changes: a new optimizer's loss
    scaling must be in it, or out of it, as compiled."""
    if plan.loss_scaling != compiled.capture.loss_scaling:
        now = "scales" if compiled.capture.loss_scaling else "does not scale"
        raise Error(
            "Problem with loss scaling. Can not replace a constant value with a non constant "
            f"value. (poptorchsim: the compiled training step {now} the loss, and the new "
            "optimizer's loss_scaling asks the opposite: give it a loss_scaling like the "
            "compiled optimizer's, or wrap the model again)")


def rebuild_update(compiled, model, optimizer, amp=0.6, allow_oom=False, running_mean=False,
                   auto_loss_scaling=None):
    """Re-traces only the optimizer update, for a new optimizer type or
    structure.  The step graph is kept, so the loss scaling must stay in it
    or out of it as compiled."""
    settings = getattr(compiled, "location_settings", {})
    program = compiled.program
    _, plan = update_plan(optimizer, program.accumulation, running_mean, auto_loss_scaling)
    check_loss_scaling(compiled, plan)
    shards = _sharded_state(model, optimizer, compiled.capture, settings,
                            program.total_replicas, plan)
    unit_scale = program.accumulation * program.total_replicas == 1 and not plan.loss_scaling
    update = _build_update(model, optimizer, compiled.capture, plan, shards,
                           unit_scale=unit_scale)
    graph = update.graph
    numeric, numeric_shards = _numeric_update(model, optimizer, compiled.capture, plan,
                                              shards, update, unit_scale)
    graphs = [graph] + ([numeric.graph] if numeric is not update else [])
    for g in graphs:
        if auto_loss_scaling:
            _add_scale_update(g, model, auto_loss_scaling)
        g.rounding = getattr(compiled, "rounding", None)
        g.floating_point_checks = floating_point_checks(getattr(compiled, "precision", None))
    program.graphs["optimizer_update"] = graph
    program.sharded_state = set(shards)
    if (getattr(compiled, "precision", None) or {}).get("partials") == "half":
        apply_precision({"partials": "half"}, graphs)
    variables = {}
    step = program.graphs["training_step"]
    _map_training(step, graph, compiled.target)
    _map_variables(program, compiled.target, variables)
    compiled.costs, compiled.memory, compiled.cycles = _plan(
        program, compiled.target, amp, variables, allow_oom, settings=settings)
    compiled.shards = numeric_shards
    compiled.update_fn = compile_graph(numeric.graph)
    compiled.optimizer_kind, compiled.group_of, compiled.flags = (plan.kind, numeric.group_of,
                                                                  numeric.flags)
    compiled.max_grad_norm = plan.max_grad_norm
    compiled.plan, compiled.slots, compiled.layouts = plan, numeric.slots, numeric.layouts
    return compiled


def compile_inference(model, args, kwargs, *, di, rf, target, amp=0.6,
                      show_progress=True, allow_oom=False, out_bytes_fn=None,
                      synthetic=False, strategy=None, auto_round=False, locations=None,
                      processes=1, io_tiles=0, precision=None, sync_pattern=0):
    t0 = time.perf_counter()
    settings = locations or {}
    _check_locations(settings, io_tiles)
    target = with_io_tiles(target, io_tiles)
    bar = _stages(show_progress, "Graph compilation")
    bar.set_description("Tracing"); bar.update(1)
    with float_statistics_forward(model, precision):
        capture = capture_inference(model, args, kwargs,
                                    stack_traces=floating_point_checks(precision))
    overlap = _check_overlap(capture, strategy, io_tiles)
    bar.set_description("Lowering"); bar.update(1)

    def recapture():
        with float_statistics_forward(model, precision):
            return capture_inference(model, args, kwargs, stack_traces=True)
    graph = _lower_model(capture, "inference_forward", recapture)
    in_bytes = _bytes((t.shape, t.dtype) for t in capture.example_inputs) * rf * di
    out_bytes = out_bytes_fn(capture) if out_bytes_fn else 0
    body = Sequence([HostToDevice(in_bytes // di), Call(graph, rf),
                     DeviceToHost(out_bytes // max(di, 1), "per output mode")])
    program = Program("inference", {"inference_forward": graph},
                      Repeat(di, body, "device_iteration"), rf, di, 1, in_bytes, out_bytes,
                      synthetic_data=synthetic, processes=processes,
                      sync_pattern=int(sync_pattern))
    program.host_streams = _host_streams(capture, program, overlap)
    _place(program, graph, capture, strategy, training=False, di=di, ga=1, rf=rf,
           auto_round=auto_round)
    bar.set_description("Tile mapping"); bar.update(1)
    variables = {}
    map_graph(graph, target, None, variables, input_ipus(graph))
    rounding = apply_precision(precision, [graph])
    costs, memory, cycles = _plan(program, target, amp, variables, allow_oom, bar, settings)
    fn = compile_graph(graph)
    bar.update(1); bar.close()
    compiled = Compiled(capture, program, target, memory, costs, cycles, fn,
                        compile_seconds=time.perf_counter() - t0)
    compiled.precision, compiled.rounding = precision, rounding
    return compiled
