"""compile: the pass lists, as data, from a module to a ``Compiled``.

``TRAINING`` and ``INFERENCE`` list the passes of a compile in order, and
``REBUILD_UPDATE`` those that rebuild only the optimizer update (a new
optimizer type or structure).  Every pass is ``run(program, compilation)
-> program`` with its contracts (``passes/manager.py`` runs the list):

==  ======================  ====================================================
 1  trace                   ``capture.trace``: the module (and its loss,
                            backward) as one ATen fx graph
 2  lower                   ``passes.lower``: fx graph -> IR ``Graph``
 3  optimizer update        ``passes.update``: the update rules traced and
                            lowered over the trainable parameters
 4  place stages            ``passes.placement``: stage and IPU of every op
 5  recompute               ``passes.recompute``: ops run again in backward
 6  watch gradients         ``passes.precision``: fp16 underflow watch,
                            automatic loss scaling's statistics and update
 7  place update            ``passes.pipeline.place_update``
 8  map tiles               ``passes.tile_mapping``: every tensor on tiles
 9  precision               ``passes.precision.apply``: half partials,
                            stochastic rounding, floating-point checks
10  op costs                ``estimate.cost``: cycles and temporary bytes per op
11  locate                  ``passes.locations``: Streaming Memory, sharding
12  control program         ``passes.program.build_main``: ``Program.main``
13  memory                  ``passes.memory``: every IPU's tiles, checked
14  estimate                ``estimate.program_cost``: a walk over ``main``
15  generate code           ``machine.codegen``: one Python function per graph
==  ======================  ====================================================

The passes drive both wings: the estimate (``estimate/``) charges the
program and the host execution (``machine/``) generates its code; neither
wing imports passes/.  The engine (``machine.engine``) then runs a call by
walking the same ``Program.main`` that the estimate charged and ``getIR()``
prints.
"""
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch

from ..capture.trace import Capture
from ..capture.update_rules import UpdatePlan
from ..estimate.cost import with_branches_taken
from ..estimate.program_cost import estimate, op_costs
from ..estimate.schedule import Schedule
from ..estimate.targets import Target, with_io_tiles
from ..ir.graph import Program
from ..machine.codegen import compile_graph
from ..machine.gradient_watch import GradientWatch
from ..machine.rounding import Rounding
from . import locations as tensor_locations
from . import recompute
from .compiled import Compiled
from .contracts import (
    CODE_MADE,
    COSTED,
    ESTIMATED,
    LOCATED,
    LOWERED,
    MAIN_BUILT,
    MAPPED,
    MEMORY_PLANNED,
    PLACED,
    RECOMPUTE_PLANNED,
    TRACED,
    UPDATE_BUILT,
    UPDATE_PLACED,
)
from .front import check_overlap, count_streams, lower_model_graph, placement_of, trace_model
from .manager import Pass, PassManager
from .memory import MemoryReport, check_fits, plan_memory
from .pipeline import input_ipus, input_stages, place_update
from .placement import place
from .precision import add_scale_update, floating_point_checks, watch_gradients
from .precision import apply as apply_precision
from .program import build_main
from .tile_mapping import map_graph
from .update import (
    UpdateGraph,
    build_update,
    check_loss_scaling,
    numeric_update,
    sharded_state,
    update_plan,
)


@dataclass
class Compilation:
    """One compile: what the passes are given beside the program (the
    model, its optimizer, the example micro-batch, the resolved
    ``runtime.settings.config.CompileConfig``) and what they make beside it (the
    trace, the update graphs, the op costs, the memory reports, the cycle
    estimate, the generated code), from which ``Compiled`` is built."""
    model: torch.nn.Module
    config: Any                           # runtime.settings.config.CompileConfig
    args: tuple = ()
    kwargs: dict = field(default_factory=dict)
    optimizer: Optional[torch.optim.Optimizer] = None
    traces: Optional[dict] = None         # the optimizer's traced update rules, kept
    estimate_only: bool = False           # no numerics, no code (the planner)
    target: Optional[Target] = None       # the config's target with its IO tiles
    # made by the passes
    capture: Optional[Capture] = None
    overlap: tuple = ({}, {})             # overlapped (inputs, outputs)
    plan: Optional[UpdatePlan] = None
    in_optimizer: set = field(default_factory=set)
    shards: dict = field(default_factory=dict)
    unit_scale: bool = False
    update: Optional[UpdateGraph] = None        # the update the estimate charges
    numeric: Optional[UpdateGraph] = None       # the update the engine runs
    numeric_shards: dict = field(default_factory=dict)
    rounding: Optional[Rounding] = None           # stochastic rounding
    watch: Optional[GradientWatch] = None         # the fp16 gradient watch
    costs: dict = field(default_factory=dict)   # graph name -> [OpCost] per op
    memory: Optional[MemoryReport] = None
    cycles: dict = field(default_factory=dict)   # the breakdown of one call
    schedule: Optional[Schedule] = None
    step_fn: Optional[Callable] = None
    update_fn: Optional[Callable] = None
    compiled: Optional[Compiled] = None   # the compile an update is rebuilt in
    pass_seconds: dict = field(default_factory=dict)
    warn: bool = True                     # warn when the fullest tile only just fits

    def numeric_graphs(self):
        """The update graphs the engine runs beside the one the estimate
        charges (LAMB's whole-weight numerics), if any."""
        n, u = self.numeric, self.update
        return [n.graph] if n is not None and u is not None and n is not u else []


# -- the passes ---------------------------------------------------------------------------
def trace(program: Program, c: Compilation) -> Program:
    """1: the model (with its loss and backward in training) as one ATen fx
    graph; the overlapped inputs and outputs, PopTorch's rules checked."""
    cfg = c.config
    tensor_locations.check_settings(cfg.locations, cfg.io_tiles)
    if program.kind == "training":
        _, c.plan = update_plan(c.optimizer, cfg.accumulation, cfg.running_mean,
                                cfg.auto_loss_scaling)
        by_id = {id(p): n for n, p in c.model.named_parameters()}
        assert c.optimizer is not None, "a training compile has an optimizer"
        c.in_optimizer = {by_id[id(p)] for g in c.optimizer.param_groups for p in g["params"]
                          if id(p) in by_id}
    if c.capture is None:
        c.capture = trace_model(c, floating_point_checks(cfg.precision))
    c.overlap = check_overlap(c.capture, cfg.placement, cfg.io_tiles)
    return program


def lower_model(program: Program, c: Compilation) -> Program:
    """2: the traced graph lowered to the IR (``passes.lower``); the host
    streams of one call counted."""
    name = program.model_graph
    program.graphs[name] = lower_model_graph(c.capture, name, lambda: trace_model(c, True))
    count_streams(program, c)
    return program


def optimizer_update(program: Program, c: Compilation) -> Program:
    """3: the optimizer's update rules traced and lowered over the trainable
    parameters (with the whole-weight numerics LAMB needs, unless the
    compile only estimates)."""
    cfg = c.config
    c.shards = sharded_state(c.model, c.optimizer, c.capture, cfg.locations,
                             cfg.total_replicas, c.plan)
    assert c.plan is not None, "trace plans the update"
    c.unit_scale = cfg.accumulation * cfg.total_replicas == 1 and not c.plan.loss_scaling
    c.update = build_update(c.model, c.optimizer, c.capture, c.plan, c.shards, c.unit_scale,
                            c.traces)
    c.numeric, c.numeric_shards = (c.update, c.shards) if c.estimate_only else numeric_update(
        c.model, c.optimizer, c.capture, c.plan, c.shards, c.update, c.unit_scale)
    program.graphs["optimizer_update"] = c.update.graph
    program.sharded_state = set(c.shards)
    return program


def place_stages(program: Program, c: Compilation) -> Program:
    """4: every op's pipeline stage and IPU (``passes.placement``)."""
    cfg = c.config
    graph = program.graphs[program.model_graph]
    assert c.capture is not None, "TRACED"
    return place(program, graph, placement_of(cfg.placement, c.capture, graph), c.capture.tied,
                 training=program.kind == "training", auto_round=cfg.auto_round,
                 hardware=cfg.hardware)


def plan_recomputation(program: Program, c: Compilation) -> Program:
    """5: the forward ops the backward runs again (``passes.recompute``)."""
    mode = recompute.default_mode(c.config.recomputation,
                                  program.pipelined and program.n_ipus > 1)
    recompute.plan(program.graphs["training_step"], mode, program.pipelined)
    return program


def watch(program: Program, c: Compilation) -> Program:
    """6: the fp16 gradient watch and automatic loss scaling's statistics
    and loss-scale update."""
    als = c.config.auto_loss_scaling
    c.watch = watch_gradients(program, c.model, als)
    for g in c.numeric_graphs():
        if als:
            add_scale_update(g, c.model, als)
    return program


def place_optimizer_update(program: Program, c: Compilation) -> Program:
    """7: every update op on the IPU (and stage) of its parameter."""
    step = program.graphs["training_step"]
    place_update(program.graphs["optimizer_update"], input_ipus(step), input_stages(step))
    return program


def map_tiles(program: Program, c: Compilation) -> Program:
    """8: every tensor of the program's graphs on tiles (``passes.tile_mapping``,
    an in-place rewrite setting ``Tensor.mapping``); the device variables
    are recorded in ``program.variables``.  Gradients of sharded optimizer
    state are accumulated whole, so they map at full size."""
    variables: dict = {}
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
        cursor = map_graph(graph, c.target, cursor, variables, input_ipus(graph), full)
    program.variables = variables
    return program


def precision(program: Program, c: Compilation) -> Program:
    """9: half partials, stochastic rounding, the random streams and the
    floating-point checks on every graph the engine runs."""
    c.rounding = apply_precision(c.config.precision,
                                 list(program.graphs.values()) + c.numeric_graphs())
    return program


def cost_ops(program: Program, c: Compilation) -> Program:
    """10: every op's cycles and temporary bytes (``estimate.cost``);
    ``config.amp``: the available memory proportion, or {IPU index:
    proportion} (setAvailableMemoryProportion per IPU; 0.6 where unset)."""
    c.costs = op_costs(program, c.target, c.config.amp)
    return program


def locate(program: Program, c: Compilation) -> Program:
    """11: where every device variable lives: on chip, in Streaming Memory,
    sharded across the replicas (``passes.locations``)."""
    program.locations = tensor_locations.place(
        program.variables, c.config.locations or {}, program.total_replicas,
        program.sharded_state, accumulating=program.accumulation > 1)
    return program


def control_program(program: Program, c: Compilation) -> Program:
    """12: ``Program.main``, the control program of one call."""
    return build_main(program)


def plan_memory_of_ipus(program: Program, c: Compilation) -> Program:
    """13: the memory report of every IPU, each checked to fit (IPU 0's
    report holds them all as ``.ipus``)."""
    shared: dict = {}
    reports = [plan_memory(program, program.variables, c.target, c.costs, ipu,
                           program.locations, shared) for ipu in range(program.n_ipus)]
    for report in reports:
        check_fits(report, c.target, c.config.allow_oom, program.n_ipus, warn_tight=c.warn)
    c.memory = reports[0]
    c.memory.ipus = reports
    return program


def estimate_cycles(program: Program, c: Compilation) -> Program:
    """14: the cycles of one call, a walk over ``Program.main``."""
    c.cycles, c.schedule = estimate(program, c.costs, c.target)
    return program


def generate_code(program: Program, c: Compilation) -> Program:
    """15: one Python function per graph the engine runs (a graph whose
    function an earlier compile made keeps it)."""
    if c.step_fn is None:
        c.step_fn = compile_graph(program.graphs[program.model_graph])
    if program.kind == "training" and c.update_fn is None:
        assert c.numeric is not None, "UPDATE_BUILT"
        c.update_fn = compile_graph(c.numeric.graph)
    return program


def rebuild_optimizer_update(program: Program, c: Compilation) -> Program:
    """3, 6 and 9 for a new optimizer of a compiled program: the update
    traced again; the step graph is kept, so the loss scaling must stay in
    it or out of it as compiled."""
    cfg, compiled = c.config, c.compiled
    assert compiled is not None, "rebuilt in a compiled program"
    _, c.plan = update_plan(c.optimizer, program.accumulation, cfg.running_mean,
                            cfg.auto_loss_scaling)
    check_loss_scaling(compiled, c.plan)
    c.shards = sharded_state(c.model, c.optimizer, c.capture, compiled.location_settings,
                             program.total_replicas, c.plan)
    c.unit_scale = (program.accumulation * program.total_replicas == 1
                    and not c.plan.loss_scaling)
    c.update = build_update(c.model, c.optimizer, c.capture, c.plan, c.shards, c.unit_scale)
    c.numeric, c.numeric_shards = numeric_update(c.model, c.optimizer, c.capture, c.plan,
                                                 c.shards, c.update, c.unit_scale)
    graphs = [c.update.graph] + c.numeric_graphs()
    for g in graphs:
        if cfg.auto_loss_scaling:
            add_scale_update(g, c.model, cfg.auto_loss_scaling)
        g.rounding = compiled.rounding
        g.streams = program.graphs["training_step"].streams
        g.floating_point_checks = floating_point_checks(compiled.precision)
    program.graphs["optimizer_update"] = c.update.graph
    program.sharded_state = set(c.shards)
    if (compiled.precision or {}).get("partials") == "half":
        apply_precision({"partials": "half"}, graphs)
    return program


# -- the pass lists -----------------------------------------------------------------------
_TRACE = Pass("trace", trace, ensures=(TRACED,), shows="Tracing")
_LOWER = Pass("lower", lower_model, (TRACED,), (LOWERED,), shows="Lowering")
_PLACE = Pass("place stages", place_stages, (LOWERED,), (PLACED,))
_MAP = Pass("map tiles", map_tiles, (PLACED,), (MAPPED,), shows="Tile mapping")
_PRECISION = Pass("precision", precision, (MAPPED,))
_TAIL = (
    Pass("op costs", cost_ops, (MAPPED,), (COSTED,)),
    Pass("locate", locate, (MAPPED,), (LOCATED,), shows="Memory planning"),
    Pass("control program", control_program, (PLACED, LOCATED), (MAIN_BUILT,)),
    Pass("memory", plan_memory_of_ipus, (COSTED, LOCATED), (MEMORY_PLANNED,)),
    Pass("estimate", estimate_cycles, (COSTED, MAIN_BUILT), (ESTIMATED,)),
    Pass("generate code", generate_code, (LOWERED,), (CODE_MADE,)),
)

#: the training compile
TRAINING = (
    _TRACE, _LOWER,
    Pass("optimizer update", optimizer_update, (LOWERED,), (UPDATE_BUILT,)),
    _PLACE,
    Pass("recompute", plan_recomputation, (PLACED,), (RECOMPUTE_PLANNED,)),
    Pass("watch gradients", watch, (PLACED, UPDATE_BUILT)),
    Pass("place update", place_optimizer_update, (PLACED, UPDATE_BUILT), (UPDATE_PLACED,)),
    _MAP, _PRECISION, *_TAIL,
)

#: the inference compile
INFERENCE = (_TRACE, _LOWER, _PLACE, _MAP, _PRECISION, *_TAIL)

#: a compiled training program's optimizer update rebuilt for a new optimizer
REBUILD_UPDATE = (
    Pass("optimizer update", rebuild_optimizer_update, (PLACED,), (UPDATE_BUILT,)),
    Pass("place update", place_optimizer_update, (PLACED, UPDATE_BUILT), (UPDATE_PLACED,)),
    _MAP, *_TAIL,
)

ESTIMATE_ONLY = "estimate"     # the last pass of a compile that only estimates


def _until(passes, last):
    names = [p.name for p in passes]
    return passes[:names.index(last) + 1]


# -- the compile paths --------------------------------------------------------------------
def compile_training(model, optimizer, args, kwargs, config, capture=None, traces=None,
                     estimate_only=False):
    """``model`` and ``optimizer`` compiled for the example micro-batch
    ``args``/``kwargs`` under ``config`` (a ``runtime.settings.config.CompileConfig``).

    The planner (``runtime.planning.planner``) compiles one model under many
    configurations: ``capture``, an earlier compile's trace of the same
    model, micro-batch and loss scaling, skips tracing; ``traces`` (a dict
    kept between compiles) keeps the optimizer's traced update rules;
    ``estimate_only`` stops after the estimate (no numerics, no code)."""
    c = Compilation(model, config, args, kwargs, optimizer, traces, estimate_only,
                    with_io_tiles(config.target, config.io_tiles), capture=capture,
                    warn=not estimate_only)
    passes = _until(TRAINING, ESTIMATE_ONLY) if estimate_only else TRAINING
    return _compiled(c, _run(passes, empty_program("training", config), c))


def compile_inference(model, args, kwargs, config):
    """``model``'s forward compiled for the example micro-batch under ``config``."""
    c = Compilation(model, config, args, kwargs,
                    target=with_io_tiles(config.target, config.io_tiles))
    return _compiled(c, _run(INFERENCE, empty_program("inference", config), c))


def rebuild_update(compiled, model, optimizer, config):
    """Re-traces only the optimizer update of ``compiled`` (``REBUILD_UPDATE``),
    for a new optimizer type or structure; ``compiled`` is updated."""
    c = Compilation(model, config, optimizer=optimizer, target=compiled.target,
                    capture=compiled.capture, step_fn=compiled.step_fn, compiled=compiled,
                    warn=False)
    program = PassManager(REBUILD_UPDATE).run(compiled.program, c)
    assert c.plan is not None and c.numeric is not None, "UPDATE_BUILT"
    compiled.program, compiled.costs, compiled.memory = program, c.costs, c.memory
    compiled.cycles, compiled.schedule = c.cycles, c.schedule
    compiled.shards = c.numeric_shards
    compiled.update_fn = c.update_fn
    compiled.optimizer_kind, compiled.group_of, compiled.flags = (
        c.plan.kind, c.numeric.group_of, c.numeric.flags)
    compiled.max_grad_norm = c.plan.max_grad_norm
    compiled.plan, compiled.slots, compiled.layouts = c.plan, c.numeric.slots, c.numeric.layouts
    return compiled


def estimate_with_branches(compiled, taken):
    """The cycle estimate of one call with each conditional paying the
    branches the device took (``taken``: op name -> [then, else] counts)
    instead of the longer one."""
    costs = {name: [with_branches_taken(op, c, taken, compiled.target)
                    for op, c in zip(graph.ops, compiled.costs[name])]
             for name, graph in compiled.program.graphs.items()}
    return estimate(compiled.program, costs, compiled.target)[0]


def _run(passes, program, c):
    """``passes`` run on ``program``; the seconds each took kept on ``c``."""
    manager = PassManager(passes, show=c.config.show_progress)
    program = manager.run(program, c)
    c.pass_seconds = manager.seconds
    return program


def empty_program(kind, cfg):
    """The program before its first pass: no graphs yet, the call's loop
    and replica counts as the config says."""
    return Program(kind, {}, None, cfg.replicas, cfg.device_iterations, cfg.accumulation,
                   synthetic_data=cfg.synthetic, processes=cfg.processes,
                   sync_pattern=cfg.sync_pattern)


def _compiled(c, program):
    """The ``Compiled`` of a finished compile."""
    training = {}
    if c.numeric is not None:
        n = c.numeric
        training = dict(update_fn=c.update_fn, optimizer_kind=c.plan.kind, group_of=n.group_of,
                        flags=n.flags, max_grad_norm=c.plan.max_grad_norm,
                        shards=c.numeric_shards, plan=c.plan, slots=n.slots,
                        layouts=n.layouts, watch=c.watch,
                        auto_loss_scaling=c.config.auto_loss_scaling)
    return Compiled(capture=c.capture, program=program, target=c.target, memory=c.memory,
                    costs=c.costs, cycles=c.cycles, step_fn=c.step_fn,
                    compile_seconds=sum(c.pass_seconds.values()), schedule=c.schedule,
                    location_settings=c.config.locations, precision=c.config.precision,
                    rounding=c.rounding, pass_seconds=c.pass_seconds, **training)
