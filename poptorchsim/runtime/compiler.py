"""compile: the ordered list of passes from a module to a ``Compiled``.

``compile_training`` and ``compile_inference`` read top to bottom as the
compile path (docs/architecture.md follows one convolution through it):

==  ======================  ====================================================
 1  trace                   ``capture.trace``: the module (and its loss,
                            backward) as one ATen fx graph
 2  lower                   ``passes.lower``: fx graph -> IR ``Graph``
 3  optimizer update        ``runtime.update``: the update rules traced and
                            lowered over the trainable parameters
 4  place stages            ``passes.placement``: stage and IPU of every op
 5  recompute               ``passes.recompute``: ops run again in backward
 6  watch gradients         ``runtime.precision``: fp16 underflow watch,
                            automatic loss scaling's statistics and update
 7  place update            ``passes.pipeline.place_update``
 8  map tiles               ``passes.tile_mapping``: every tensor on tiles
 9  precision               ``runtime.precision.apply``: half partials,
                            stochastic rounding, floating-point checks
10  op costs                ``estimate.cost``: cycles and temporary bytes per op
11  locate                  ``passes.locations``: Streaming Memory, sharding
12  control program         ``passes.program.build_main``: ``Program.main``
13  memory                  ``passes.memory``: every IPU's tiles, checked
14  estimate                ``estimate.program_cost``: a walk over ``main``
15  generate code           ``machine.codegen``: one Python function per graph
==  ======================  ====================================================

The engine (``machine.engine``) then runs a call by walking the same
``Program.main`` that the estimate charged and ``getIR()`` prints.  With
``VERIFY_EACH_PASS`` (on in the test suite) the verifier checks the IR after
every pass.
"""
import os
import time

import numpy as np
import torch
import torch.utils._pytree as pytree
from tqdm.auto import tqdm

from ..capture.overlap import overlapped_io
from ..capture.trace import capture_inference, capture_training
from ..errors import Error, UnsupportedOperationError
from ..ir.graph import Program
from ..ir.verify import verify_program
from ..machine.codegen import compile_graph
from ..estimate.cost import with_branches_taken
from ..estimate.program_cost import estimate, op_costs
from ..estimate.targets import with_io_tiles
from ..passes import locations as tensor_locations
from ..passes import recompute
from ..passes.lower import NoActiveBlockError, lower, mark_role
from ..passes.memory import check_fits, plan_memory
from ..passes.pipeline import has_default_block, input_ipus, input_stages, place_update
from ..passes.placement import Placement, place
from ..passes.program import build_main
from ..passes.tile_mapping import map_graph
from . import collector
from .compiled import Compiled
from .precision import (add_scale_update, apply as apply_precision, float_statistics_forward,
                        floating_point_checks, watch_gradients)
from .update import (build_update, check_loss_scaling, numeric_update, sharded_state,
                     update_plan)

#: run the IR verifier after every pass (tests/conftest.py turns it on)
VERIFY_EACH_PASS = os.environ.get("POPTORCHSIM_VERIFY_PASSES", "") not in ("", "0")


class _Passes:
    """A compile's bookkeeping: the progress bar, the seconds each pass took
    (``Compiled.pass_seconds``) and, with ``VERIFY_EACH_PASS``, the
    verifier's check of the program after each pass."""

    def __init__(self, show=False):
        self.bar = tqdm(total=5, desc="Graph compilation", disable=not show, leave=False,
                        bar_format="{desc}: {percentage:3.0f}%|{bar}| {n}/{total} [{elapsed}]")
        self.start = self.last = time.perf_counter()
        self.seconds = {}

    def stage(self, description):
        self.bar.set_description(description)
        self.bar.update(1)

    def done(self, name, program=None):
        """Pass ``name`` has run (and left ``program``, which is returned)."""
        now = time.perf_counter()
        self.seconds[name] = self.seconds.get(name, 0.0) + now - self.last
        self.last = now
        if program is not None and VERIFY_EACH_PASS:
            verify_program(program, after=name)
        return program

    def close(self, collect=True):
        self.bar.update(1)
        self.bar.close()
        if collect:
            collector.collect_young()
        return time.perf_counter() - self.start


# -- the compile paths -----------------------------------------------------------------
@collector.paused
def compile_training(model, optimizer, args, kwargs, config, capture=None, traces=None,
                     estimate_only=False):
    """``model`` and ``optimizer`` compiled for the example micro-batch
    ``args``/``kwargs`` under ``config`` (a ``runtime.config.CompileConfig``).

    The planner (``runtime.planner``) compiles one model under many
    configurations: ``capture``, an earlier compile's trace of the same
    model, micro-batch and loss scaling, skips step 1; ``traces`` (a dict
    kept between compiles) keeps the optimizer's traced update rules;
    ``estimate_only`` stops after the estimate (no numerics, no code)."""
    c = config
    run = _Passes(c.show_progress)
    tensor_locations.check_settings(c.locations, c.io_tiles)
    target = with_io_tiles(c.target, c.io_tiles)
    _, plan = update_plan(optimizer, c.accumulation, c.running_mean, c.auto_loss_scaling)
    by_id = {id(p): n for n, p in model.named_parameters()}
    in_optimizer = {by_id[id(p)] for g in optimizer.param_groups for p in g["params"]
                    if id(p) in by_id}

    def trace(stack_traces):
        with float_statistics_forward(model, c.precision):
            return capture_training(model, args, kwargs, in_optimizer, stack_traces=stack_traces,
                                    loss_scaling=plan.loss_scaling)
    run.stage("Tracing")
    if capture is None:
        capture = trace(floating_point_checks(c.precision))                           # 1
    overlap = _check_overlap(capture, c.placement, c.io_tiles)
    run.done("trace")
    run.stage("Lowering")
    step = _lower_model(capture, "training_step", lambda: trace(True))                # 2
    run.done("lower")
    shards = sharded_state(model, optimizer, capture, c.locations, c.total_replicas, plan)
    unit_scale = c.accumulation * c.total_replicas == 1 and not plan.loss_scaling
    update = build_update(model, optimizer, capture, plan, shards, unit_scale, traces)  # 3
    numeric, numeric_shards = (update, shards) if estimate_only else numeric_update(
        model, optimizer, capture, plan, shards, update, unit_scale)
    program = run.done("optimizer update", _program(
        "training", {"training_step": step, "optimizer_update": update.graph}, capture,
        overlap, c, sharded_state=set(shards)))
    program = run.done("place stages", place(                                          # 4
        program, step, _placement(c.placement, capture, step), capture.tied, training=True,
        auto_round=c.auto_round, hardware=c.hardware))
    recompute.plan(step, recompute.default_mode(                                       # 5
        c.recomputation, program.pipelined and program.n_ipus > 1), program.pipelined)
    program = run.done("recompute", program)
    watch = watch_gradients(program, model, c.auto_loss_scaling)                       # 6
    if numeric is not update and c.auto_loss_scaling:
        add_scale_update(numeric.graph, model, c.auto_loss_scaling)
    program = run.done("watch gradients", program)
    place_update(update.graph, input_ipus(step), input_stages(step))                   # 7
    program = run.done("place update", program)
    run.stage("Tile mapping")
    program = run.done("map tiles", _map_tiles(program, target))                       # 8
    rounding = apply_precision(c.precision, [step, update.graph]                        # 9
                               + ([numeric.graph] if numeric is not update else []))
    program = run.done("precision", program)
    program, costs, memory, cycles, schedule = _plan(program, target, c, run,       # 10-14
                                                     warn=not estimate_only)
    step_fn = update_fn = None
    if not estimate_only:
        step_fn, update_fn = compile_graph(step), compile_graph(numeric.graph)        # 15
    run.done("generate code")
    return Compiled(capture=capture, program=program, target=target, memory=memory,
                    costs=costs, cycles=cycles, step_fn=step_fn, update_fn=update_fn,
                    optimizer_kind=plan.kind, group_of=numeric.group_of, flags=numeric.flags,
                    compile_seconds=run.close(not estimate_only),
                    max_grad_norm=plan.max_grad_norm, shards=numeric_shards, plan=plan,
                    slots=numeric.slots, layouts=numeric.layouts, schedule=schedule,
                    location_settings=c.locations, precision=c.precision,
                    rounding=rounding, watch=watch, auto_loss_scaling=c.auto_loss_scaling,
                    pass_seconds=run.seconds)


@collector.paused
def compile_inference(model, args, kwargs, config):
    """``model``'s forward compiled for the example micro-batch under ``config``."""
    c = config
    run = _Passes(c.show_progress)
    tensor_locations.check_settings(c.locations, c.io_tiles)
    target = with_io_tiles(c.target, c.io_tiles)

    def trace(stack_traces):
        with float_statistics_forward(model, c.precision):
            return capture_inference(model, args, kwargs, stack_traces=stack_traces)
    run.stage("Tracing")
    capture = trace(floating_point_checks(c.precision))                               # 1
    overlap = _check_overlap(capture, c.placement, c.io_tiles)
    run.done("trace")
    run.stage("Lowering")
    graph = _lower_model(capture, "inference_forward", lambda: trace(True))          # 2
    program = run.done("lower", _program("inference", {"inference_forward": graph},
                                         capture, overlap, c))
    program = run.done("place stages", place(                                          # 4
        program, graph, _placement(c.placement, capture, graph), capture.tied,
        training=False, auto_round=c.auto_round, hardware=c.hardware))
    run.stage("Tile mapping")
    program = run.done("map tiles", _map_tiles(program, target))                       # 8
    rounding = apply_precision(c.precision, [graph])                                   # 9
    program = run.done("precision", program)
    program, costs, memory, cycles, schedule = _plan(program, target, c, run)       # 10-14
    fn = compile_graph(graph)                                                          # 15
    run.done("generate code")
    return Compiled(capture=capture, program=program, target=target, memory=memory,
                    costs=costs, cycles=cycles, step_fn=fn, compile_seconds=run.close(),
                    schedule=schedule,
                    location_settings=c.locations, precision=c.precision, rounding=rounding,
                    pass_seconds=run.seconds)


@collector.paused
def rebuild_update(compiled, model, optimizer, config):
    """Re-traces only the optimizer update, for a new optimizer type or
    structure (steps 3, 6-15).  The step graph is kept, so the loss scaling
    must stay in it or out of it as compiled."""
    c = config
    program = compiled.program
    _, plan = update_plan(optimizer, program.accumulation, c.running_mean, c.auto_loss_scaling)
    check_loss_scaling(compiled, plan)
    shards = sharded_state(model, optimizer, compiled.capture, compiled.location_settings,
                           program.total_replicas, plan)
    unit_scale = program.accumulation * program.total_replicas == 1 and not plan.loss_scaling
    update = build_update(model, optimizer, compiled.capture, plan, shards, unit_scale)
    numeric, numeric_shards = numeric_update(model, optimizer, compiled.capture, plan,
                                             shards, update, unit_scale)
    graphs = [update.graph] + ([numeric.graph] if numeric is not update else [])
    for g in graphs:
        if c.auto_loss_scaling:
            add_scale_update(g, model, c.auto_loss_scaling)
        g.rounding = compiled.rounding
        g.streams = program.graphs["training_step"].streams
        g.floating_point_checks = floating_point_checks(compiled.precision)
    program.graphs["optimizer_update"] = update.graph
    program.sharded_state = set(shards)
    if (compiled.precision or {}).get("partials") == "half":
        apply_precision({"partials": "half"}, graphs)
    step = program.graphs["training_step"]
    place_update(update.graph, input_ipus(step), input_stages(step))
    program = _map_tiles(program, compiled.target)
    (compiled.program, compiled.costs, compiled.memory, compiled.cycles,
     compiled.schedule) = _plan(program, compiled.target, c, _Passes(), warn=False)
    compiled.shards = numeric_shards
    compiled.update_fn = compile_graph(numeric.graph)
    compiled.optimizer_kind, compiled.group_of, compiled.flags = (plan.kind, numeric.group_of,
                                                                  numeric.flags)
    compiled.max_grad_norm = plan.max_grad_norm
    compiled.plan, compiled.slots, compiled.layouts = plan, numeric.slots, numeric.layouts
    return compiled


def estimate_with_branches(compiled, taken):
    """The cycle estimate of one call with each conditional paying the
    branches the device took (``taken``: op name -> [then, else] counts)
    instead of the longer one."""
    costs = {name: [with_branches_taken(op, c, taken, compiled.target)
                    for op, c in zip(graph.ops, compiled.costs[name])]
             for name, graph in compiled.program.graphs.items()}
    return estimate(compiled.program, costs, compiled.target)[0]


# -- the steps ----------------------------------------------------------------------------
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


def _bytes(shapes_dtypes):
    return sum(int(np.prod(s)) * torch.empty((), dtype=d).element_size()
               for s, d in shapes_dtypes)


def _output_bytes(capture, c):
    """Bytes one call streams back to the host, as the output mode asks."""
    di, ga, rf = c.device_iterations, c.accumulation, c.replicas
    copies = {"All": di * ga * rf,
              "EveryN": (di // max(c.output_return_period, 1)) * ga * rf}.get(c.output_mode, rf)
    return sum(_micro_output_bytes(capture)) * copies


def _micro_output_bytes(capture):
    """Bytes of each of the model's tensor outputs for one micro-batch."""
    node = next(n for n in capture.graph.graph.nodes if n.op == "output")
    leaves = pytree.tree_leaves(node.args[0])[:capture.n_tensor_outputs]
    return [v.meta["val"].numel() * v.meta["val"].element_size()
            if hasattr(v, "meta") and "val" in v.meta else 0 for v in leaves]


def _program(kind, graphs, capture, overlap, c, **fields):
    """The program around the lowered graphs, its host streams counted."""
    di, ga, rf = c.device_iterations, c.accumulation, c.replicas
    in_bytes = _bytes((t.shape, t.dtype) for t in capture.example_inputs) * ga * rf * di
    program = Program(kind, graphs, None, rf, di, ga, in_bytes, _output_bytes(capture, c),
                      synthetic_data=c.synthetic, processes=c.processes,
                      sync_pattern=c.sync_pattern, **fields)
    program.in_streams, program.out_streams = _host_streams(capture, program, overlap)
    return program


def _host_streams(capture, program, overlap):
    """(inputs, outputs): the host streams of one call as ``(OverlapMode
    value, copies, bytes)``.

    Poplar streams every input of every micro-batch of every replica as its
    own host copy, and the outputs once per device iteration (all outputs
    together, an overlapped output on its own)."""
    di, ga, rf = program.device_iterations, program.accumulation, program.replicas
    in_modes, out_modes = overlap
    streams = [(in_modes.get(i, "no_overlap"), di * ga * rf,
                _bytes([(t.shape, t.dtype)]) * di * ga * rf)
               for i, t in enumerate(capture.example_inputs)]
    micro = _micro_output_bytes(capture)
    share = [program.out_bytes * m // max(sum(micro), 1) for m in micro]
    plain = program.out_bytes - sum(share[k] for k in out_modes)
    outputs = [("no_overlap", di, plain)] if plain else []
    outputs += [(mode, di, share[k]) for k, mode in out_modes.items()]
    return streams, outputs


def _check_overlap(capture, spec, io_tiles):
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


def _placement(spec, capture, graph):
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


def _map_tiles(program, target):
    """Every tensor of the program's graphs on tiles (``passes.tile_mapping``,
    an in-place rewrite setting ``Tensor.mapping``); the device variables
    are recorded in ``program.variables``.  Gradients of sharded optimizer
    state are accumulated whole, so they map at full size."""
    variables = {}
    graphs = program.graphs
    cursor = None
    for name, graph in graphs.items():
        full = {}
        if name == "optimizer_update":
            numel = {t.name: t.numel for t in graphs["training_step"].inputs
                     if t.role == "param"}
            for t in graph.inputs:
                param = t.name.split("/", 1)[-1]
                if t.role == "accumulator" and param in program.sharded_state:
                    full[t.name] = numel[param] * t.nbytes // max(t.numel, 1)
        cursor = map_graph(graph, target, cursor, variables, input_ipus(graph), full)
    program.variables = variables
    return program


def _plan(program, target, c, run, warn=True):
    """Costs per op, tensor locations, the control program, the memory
    report of every IPU (checked) and the cycle estimate (steps 10-14).
    Returns (program, costs, memory of IPU 0 with ``.ipus`` = all, cycles,
    schedule).  ``c.amp``: the available memory proportion, or {IPU index:
    proportion} (setAvailableMemoryProportion per IPU; 0.6 where unset)."""
    costs = op_costs(program, target, c.amp)                                            # 10
    run.done("op costs")
    run.stage("Memory planning")
    program.locations = tensor_locations.place(                                          # 11
        program.variables, c.locations or {}, program.total_replicas, program.sharded_state,
        accumulating=program.accumulation > 1)
    program = run.done("locate", program)
    program = run.done("control program", build_main(program))                         # 12
    shared = {}
    reports = [plan_memory(program, program.variables, target, costs, ipu, program.locations,
                           shared) for ipu in range(program.n_ipus)]                     # 13
    for report in reports:
        check_fits(report, target, c.allow_oom, program.n_ipus, warn_tight=warn)
    memory = reports[0]
    memory.ipus = reports
    run.done("memory")
    cycles, schedule = estimate(program, costs, target)                                  # 14
    run.done("estimate")
    return program, costs, memory, cycles, schedule
