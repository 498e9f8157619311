"""compile: capture -> lower -> program -> tile mapping, costs, memory -> engine.

``compile_training`` and ``compile_inference`` return a ``Compiled``: the
IR program a user can print, the memory report, the cycle estimate, and the
functions the engine runs.
"""
import time
from dataclasses import dataclass, field

import numpy as np
from tqdm.auto import tqdm

from ..capture import optimizers as opt_rules
from ..errors import Error
from ..capture.trace import capture_inference, capture_training, capture_update
from ..ir.graph import (AllReduce, Call, DeviceToHost, HostToDevice, Program, Repeat,
                        Sequence)
from ..machine.cost import op_cost
from ..machine.engine import compile_graph
from ..passes.lower import lower
from ..passes.memory import check_fits, plan_memory
from ..passes.pipeline import input_ipus
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


def _bytes(shapes_dtypes):
    import torch
    return sum(int(np.prod(s)) * torch.empty((), dtype=d).element_size()
               for s, d in shapes_dtypes)


def _graph_cycles(costs):
    keys = ("compute", "exchange", "sync")
    return {k: float(sum(getattr(c, k) for c in costs)) for k in keys}


def _link_cycles(nbytes, src, dst, target):
    """An inter-IPU copy: bytes over one IPU-Link plus a sync that grows with
    the hops between the IPUs (PopLibs' global-sync model, 15 ns a hop)."""
    hops = 1 + abs(dst - src) // 2
    sync = int(np.ceil(15e-9 * target.clock_hz * hops * 2))
    return nbytes / (target.link_bytes_per_s / target.clock_hz) + sync


def _stage_times(graph, costs, target, n_stages):
    """(forward, backward) cycles per stage for one micro-batch, inter-IPU
    copies included (charged to the receiving stage)."""
    fwd, bwd = [0.0] * n_stages, [0.0] * n_stages
    ipu_of = {}
    for op, cost in zip(graph.ops, costs):
        (bwd if op.backward else fwd)[op.stage] += cost.total
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


def _estimate(program, costs, target):
    """Cycles of one call (all device iterations), split by kind."""
    from ..passes.pipeline import schedule
    di, ga, rf = program.device_iterations, program.accumulation, program.replicas
    training = program.kind == "training"
    step_name = "training_step" if training else "inference_forward"
    step = _graph_cycles(costs[step_name])
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
    total["host"] = 0.0
    if training:
        upd = _graph_cycles(costs["optimizer_update"])
        grad_bytes = program.grad_bytes
        if ga > 1:
            # accumulate: one element-wise add of every gradient per micro-batch
            per_tile = grad_bytes / target.tiles / max(len(set(ipu_of_stage)), 1)
            total["compute"] += di * ga * (per_tile / target.vector_bytes)
            total["sync"] += di * ga * target.sync_cycles
        if rf > 1:
            # ring all-reduce over IPU-Links
            link_bytes_per_cycle = target.link_bytes_per_s / target.clock_hz
            total["exchange"] += di * 2 * (rf - 1) / rf * grad_bytes / link_bytes_per_cycle
            total["sync"] += di * 2 * (rf - 1) * 1000
        for k in upd:
            total[k] += upd[k] * di / max(len(set(ipu_of_stage)), 1)
    host_s = target.call_overhead_s
    if not program.synthetic_data:
        host_s += (2 * target.host_latency_s * di
                   + (program.in_bytes + program.out_bytes) / target.host_bytes_per_s)
    total["host"] = host_s * target.clock_hz
    total["total"] = sum(total.values())
    total["seconds"] = total["total"] / target.clock_hz
    total["bubble"] = sched.bubble
    return total


def _stages(show, desc):
    return tqdm(total=5, desc=desc, disable=not show, leave=False,
                bar_format="{desc}: {percentage:3.0f}%|{bar}| {n}/{total} [{elapsed}]")


def _plan(program, target, amp, variables, allow_oom, bar=None):
    """Costs per op, the memory report of every IPU (checked) and the cycle
    estimate.  Returns (costs, memory of IPU 0 with ``.ipus`` = all, cycles)."""
    costs = {name: [op_cost(op, target, amp) for op in g.ops]
             for name, g in program.graphs.items()}
    if bar is not None:
        bar.set_description("Memory planning"); bar.update(1)
    reports = [plan_memory(program, variables, target, costs, ipu)
               for ipu in range(program.n_ipus)]
    for report in reports:
        check_fits(report, target, allow_oom, program.n_ipus)
    memory = reports[0]
    memory.ipus = reports
    cycles = _estimate(program, costs, target)
    return costs, memory, cycles


def _place(program, graph, capture, strategy, *, training, di, ga, rf, auto_round):
    """Stages and IPUs of every op, PopTorch's rules checked first."""
    import logging
    from ..passes.pipeline import (assign_stages, check_rules, num_ipus_needed,
                                   stage_map_text)
    if capture.blocks:
        if strategy is not None and hasattr(strategy, "assign"):
            stage_of_block = strategy.assign(capture.blocks)
        else:
            stage_of_block = {b: (ipu or 0, ipu or 0) for b, ipu in capture.blocks}
    else:
        stage_of_block = {}
    assign_stages(graph, stage_of_block, training)
    order = [stage_of_block[b][0] for b, _ in dict.fromkeys(capture.blocks)
             if b in stage_of_block]
    for earlier, later in zip(order, order[1:]):
        if later < earlier:
            raise Error(
                f"Pipeline stage ids must ascend in the order the model runs its blocks, "
                f"but stage {later} runs after stage {earlier} (PopTorch: BeginBlock order "
                "must follow execution order).\nStage map:\n"
                + stage_map_text(graph, stage_of_block)
                + "\nGive later blocks higher ipu_ids, or use "
                "poptorch.PipelinedExecution(poptorch.AutoStage.AutoIncrement).")
    stages = sorted({s for s, _ in stage_of_block.values()}) or [0]
    # renumber stages densely, in order
    dense = {s: i for i, s in enumerate(stages)}
    for op in graph.ops:
        op.stage = dense.get(op.stage, 0)
    ipu_of_stage = [0] * len(stages)
    for s, ipu in stage_of_block.values():
        ipu_of_stage[dense[s]] = ipu
    pipelined = bool(getattr(strategy, "is_pipelined", True))
    program.stage_map = stage_map_text(graph, stage_of_block) if stage_of_block else ""
    program.n_stages, program.ipu_of_stage = len(stages), ipu_of_stage
    program.n_ipus = num_ipus_needed(stage_of_block)
    program.pipelined = pipelined and len(stages) > 1
    n = len(stages)
    graph.stash_depth = ({s: 2 * (n - 1 - s) + 1 for s in range(n)}
                         if program.pipelined and training else None)
    check_rules(training=training, pipelined=pipelined, n_stages=len(stages), di=di, ga=ga,
                rf=rf, n_ipus=program.n_ipus, auto_round=auto_round,
                stage_map=program.stage_map, logger=logging.getLogger("poptorchsim"))


def _map_training(step_graph, update_graph, target):
    """Optimizer updates run on the IPU holding their parameter."""
    from ..passes.pipeline import place_update
    place_update(update_graph, input_ipus(step_graph))


def compile_training(model, optimizer, args, kwargs, *, di, ga, rf, target,
                     amp=0.6, show_progress=True, allow_oom=False, out_bytes_fn=None,
                     synthetic=False, strategy=None, auto_round=False):
    t0 = time.perf_counter()
    bar = _stages(show_progress, "Graph compilation")
    kind = opt_rules.optimizer_kind(optimizer)
    by_id = {id(p): n for n, p in model.named_parameters()}
    in_optimizer = {by_id[id(p)] for g in optimizer.param_groups for p in g["params"]
                    if id(p) in by_id}
    bar.set_description("Tracing"); bar.update(1)
    capture = capture_training(model, args, kwargs, in_optimizer)
    roles = ([(n, "param") for n in capture.param_names]
             + [(n, "buffer") for n in capture.buffer_names]
             + [(f"input{i}", "input") for i in range(len(capture.example_inputs))])
    bar.set_description("Lowering"); bar.update(1)
    step_graph = lower(capture.graph, "training_step", roles)

    update_graph, kind, group_of, flags = _build_update(model, optimizer, capture)
    in_bytes = _bytes((t.shape, t.dtype)
                      for t in capture.example_inputs) * ga * rf * di
    call = Call(step_graph, rf)
    body = Sequence([HostToDevice(in_bytes // di),
                     Repeat(ga, call, "accumulation")])
    grad_bytes = sum(t.nbytes for t in update_graph.inputs if t.role == "accumulator")
    steps = body.steps
    if rf > 1:
        steps.append(AllReduce(grad_bytes, rf))
    steps.append(Call(update_graph, rf))
    out_bytes = out_bytes_fn(capture) if out_bytes_fn else 0
    steps.append(DeviceToHost(out_bytes // max(di, 1), "per output mode"))
    program = Program("training", {"training_step": step_graph,
                                   "optimizer_update": update_graph},
                      Repeat(di, body, "device_iteration"), rf, di, ga)
    program.grad_bytes, program.in_bytes, program.out_bytes = grad_bytes, in_bytes, out_bytes
    program.synthetic_data = synthetic
    _place(program, step_graph, capture, strategy, training=True, di=di, ga=ga, rf=rf,
           auto_round=auto_round)

    bar.set_description("Tile mapping"); bar.update(1)
    _map_training(step_graph, update_graph, target)
    variables = {}
    cursor = map_graph(step_graph, target, None, variables, input_ipus(step_graph))
    map_graph(update_graph, target, cursor, variables, input_ipus(update_graph))
    costs, memory, cycles = _plan(program, target, amp, variables, allow_oom, bar)
    step_fn = compile_graph(step_graph)
    update_fn = compile_graph(update_graph)
    bar.update(1); bar.close()
    return Compiled(capture, program, target, memory, costs, cycles, step_fn, update_fn,
                    kind, group_of, flags, time.perf_counter() - t0, max_grad_norm(optimizer))


def max_grad_norm(optimizer):
    """poptorchsim.optim's global-norm clipping threshold, or None."""
    value = getattr(optimizer, "max_grad_norm", None)
    return None if value is None or value == float("inf") else float(value)


def _build_update(model, optimizer, capture):
    """The optimizer-update graph for ``optimizer`` over the trainable params."""
    kind = opt_rules.optimizer_kind(optimizer)
    group_index, flags = {}, []
    for gi, group in enumerate(optimizer.param_groups):
        flags.append(opt_rules.group_settings(kind, group)[1])
        for p in group["params"]:
            group_index[id(p)] = gi
    params = dict(model.named_parameters())
    names = capture.trainable_names
    group_of = [group_index[id(params[n])] for n in names]
    shapes = [tuple(params[n].shape) for n in names]
    update_fx = capture_update(kind, shapes, group_of, flags, max_grad_norm(optimizer))
    state_names, hyper_names, _ = opt_rules.RULES[kind]
    roles = ([(n, "param") for n in names] + [(f"grad/{n}", "accumulator") for n in names]
             + [(f"{s}/{n}", "state") for n in names for s in state_names]
             + [(f"step/{n}", "state") for n in names]
             + [(f"hyper/{g}/{h}", "hyper") for g in range(len(flags)) for h in hyper_names]
             + [("grad_scale", "hyper")])
    graph = lower(update_fx, "optimizer_update", roles)
    graph.outputs_overwrite_inputs = True     # variables are updated in place
    return graph, kind, group_of, flags


def rebuild_update(compiled, model, optimizer, amp=0.6, allow_oom=False):
    """Re-traces only the optimizer update, for a new optimizer type or flags."""
    graph, kind, group_of, flags = _build_update(model, optimizer, compiled.capture)
    program = compiled.program
    program.graphs["optimizer_update"] = graph
    _replace_call(program.main, graph)
    variables = {}
    step = program.graphs["training_step"]
    _map_training(step, graph, compiled.target)
    cursor = map_graph(step, compiled.target, None, variables, input_ipus(step))
    map_graph(graph, compiled.target, cursor, variables, input_ipus(graph))
    compiled.costs, compiled.memory, compiled.cycles = _plan(
        program, compiled.target, amp, variables, allow_oom)
    compiled.update_fn = compile_graph(graph)
    compiled.optimizer_kind, compiled.group_of, compiled.flags = kind, group_of, flags
    compiled.max_grad_norm = max_grad_norm(optimizer)
    return compiled


def _replace_call(step, graph):
    if isinstance(step, Sequence):
        for s in step.steps:
            _replace_call(s, graph)
    elif isinstance(step, Repeat):
        _replace_call(step.body, graph)
    elif isinstance(step, Call) and step.graph.name == graph.name:
        step.graph = graph


def compile_inference(model, args, kwargs, *, di, rf, target, amp=0.6,
                      show_progress=True, allow_oom=False, out_bytes_fn=None,
                      synthetic=False, strategy=None, auto_round=False):
    t0 = time.perf_counter()
    bar = _stages(show_progress, "Graph compilation")
    bar.set_description("Tracing"); bar.update(1)
    capture = capture_inference(model, args, kwargs)
    roles = ([(n, "param") for n in capture.param_names]
             + [(n, "buffer") for n in capture.buffer_names]
             + [(f"input{i}", "input") for i in range(len(capture.example_inputs))])
    bar.set_description("Lowering"); bar.update(1)
    graph = lower(capture.graph, "inference_forward", roles)
    in_bytes = _bytes((t.shape, t.dtype) for t in capture.example_inputs) * rf * di
    out_bytes = out_bytes_fn(capture) if out_bytes_fn else 0
    body = Sequence([HostToDevice(in_bytes // di), Call(graph, rf),
                     DeviceToHost(out_bytes // max(di, 1), "per output mode")])
    program = Program("inference", {"inference_forward": graph},
                      Repeat(di, body, "device_iteration"), rf, di, 1, in_bytes, out_bytes,
                      synthetic_data=synthetic)
    _place(program, graph, capture, strategy, training=False, di=di, ga=1, rf=rf,
           auto_round=auto_round)
    bar.set_description("Tile mapping"); bar.update(1)
    variables = {}
    map_graph(graph, target, None, variables, input_ipus(graph))
    costs, memory, cycles = _plan(program, target, amp, variables, allow_oom, bar)
    fn = compile_graph(graph)
    bar.update(1); bar.close()
    return Compiled(capture, program, target, memory, costs, cycles, fn,
                    compile_seconds=time.perf_counter() - t0)
