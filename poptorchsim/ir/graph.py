"""The IPU graph IR: tensors, ops, graphs and the program that runs them.

A ``Graph`` is a static, single-assignment list of ``Op``s over ``Tensor``s.
Every op names its ATen overload (the numerics) and its cost class (the
machine's work).  A ``Program`` is the control program around graphs, as
Poplar builds it: repeat loops for device iterations and gradient
accumulation, host streams, calls of graphs on a replica, cross-replica
reductions.

An op may hold sub-graphs (``Op.subgraphs``): a loop its body, a
conditional its two branches.  A sub-graph's inputs are the op's tensor
arguments in order, its outputs become the op's results.

Text forms come from ``ir.printer``, which registers its formatters in
``FORMATTERS`` (the printer imports this module, never the reverse).
"""
import math
from dataclasses import dataclass, field
from typing import Any, Iterable, Iterator, Optional

import torch

from .interfaces import (
    GradientWatchState,
    RandomStreams,
    RecomputePlan,
    StochasticRounding,
    TileMap,
)
from .kinds import CostClass, Counter, Phased, ProgramKind, Role

FORMATTERS: dict = {}    # "graph" / "program" -> function(obj) -> str (ir.printer)

# Roles a tensor plays; the first group is always live on the device.
ROLES = tuple(Role)


@dataclass(eq=False)
class Tensor:
    id: int
    name: str
    shape: tuple
    dtype: torch.dtype
    role: Role = Role.ACTIVATION
    producer: Optional["Op"] = None
    value: Optional[torch.Tensor] = None     # constants only
    mapping: Optional[TileMap] = None     # its place on the tiles (passes/tile_mapping.py)

    def __post_init__(self) -> None:
        self.role = Role(self.role)

    @property
    def numel(self) -> int:
        return int(math.prod(self.shape))

    @property
    def nbytes(self) -> int:
        return self.numel * _itemsize(self.dtype)

    def __repr__(self) -> str:
        return f"%{self.name}"


def _itemsize(dtype: torch.dtype) -> int:
    size = _ITEMSIZE.get(dtype)
    if size is None:
        size = _ITEMSIZE[dtype] = torch.empty((), dtype=dtype).element_size()
    return size


_ITEMSIZE: dict[torch.dtype, int] = {}      # dtype -> bytes of one element


@dataclass(eq=False)
class Op:
    id: int
    name: str
    target: Any                      # an ATen OpOverload
    args: tuple                      # pytree of Tensors and constants
    kwargs: dict
    outputs: list                    # Tensors (None where the op returns none)
    cost_class: Optional[CostClass]  # None only while lowering refuses the op
    multi_output: bool = False
    available_memory: Optional[float] = None   # set_available_memory on this op
    block: Optional[tuple] = None     # (user_id, ipu_id) the forward op was traced in
    stage: int = 0                    # pipeline stage (forward numbering)
    ipu: int = 0                      # the IPU it runs on
    backward: bool = False            # part of the backward pass
    inplace: bool = False             # writes its first argument (engine runs it in place)
    traced_layout: Optional[tuple] = None   # (shape, stride, offset) of arg 0 in the trace
    subgraphs: Optional[dict] = None  # name -> Graph: a loop's "body", a conditional's
    attrs: dict = field(default_factory=dict)   # "then" and "else"; e.g. {"count": 10}
    source: str = ""                  # the model's line that made it (traced with stack traces)
    # scalar arithmetic the host does (torch.optim's Python floats: bias
    # corrections, lr / bias_correction, the step count): the engine runs it,
    # the machine charges it no cycles and no tile memory
    # (passes/host_scalars.py)
    host_scalar: bool = False
    # set by passes (each declared here, none added later):
    role: str = ""                    # what the op does for the program ("gradient unscale",
                                      # "loss scaling", "loss scale update", ...; lower.mark_role)
    recompute: bool = False           # run again before its stage's backward (passes/recompute.py)
    watched: bool = False             # fp16 backward op the gradient watch counts (loss_scaling)
    partials: str = "float"           # "half": fp16 partials of a matmul or conv (precision)
    plan: str = ""                    # a conv's or matmul's Poplar-style plan, per pass
                                      # (estimate/conv_plan.py; set with the op costs)
    rule_copy: int = -1               # the parameter whose copy of the optimizer's rule
                                      # made it (passes/update_copies.py; -1: none): the
                                      # code generator compiles each distinct copy once
    # input_tensors' answer for the args and kwargs objects it was found in
    _inputs: Optional[tuple] = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.cost_class is not None:
            self.cost_class = CostClass(self.cost_class)

    def input_tensors(self) -> tuple["Tensor", ...]:
        """The Tensors among the op's arguments, in order.  Passes read it
        many times: it is kept while ``args`` and ``kwargs`` are the same
        objects (a pass that rewrites an op's arguments assigns new ones)."""
        cached = self._inputs
        if cached is not None and cached[0] is self.args and cached[1] is self.kwargs:
            return cached[2]
        found: list[Tensor] = []
        _collect(self.args, found)
        _collect(self.kwargs, found)
        self._inputs = (self.args, self.kwargs, tuple(found))
        return self._inputs[2]


def _collect(x: Any, found: list[Tensor]) -> None:
    """The Tensors in ``x`` (nested lists, tuples and dicts), in order."""
    if isinstance(x, dict):
        x = x.values()
    elif not isinstance(x, (list, tuple)):
        if isinstance(x, Tensor):
            found.append(x)
        return
    for y in x:
        if isinstance(y, Tensor):
            found.append(y)
        elif isinstance(y, (list, tuple, dict)):
            _collect(y, found)


def subgraph_inputs(op: Op, name: str) -> list[Tensor]:
    """The tensors of the enclosing graph that sub-graph ``name`` of ``op``
    receives as its inputs, in order: a loop's carried values then the
    tensors its body reads (``args = (carried, read)``); a conditional's
    branch the tensors it reads (``args = (condition, then_reads,
    else_reads)``)."""
    if name == "body":
        return list(op.args[0]) + list(op.args[1])
    return list(op.args[1] if name == "then" else op.args[2])


def all_ops(graph: "Graph") -> Iterator[Op]:
    """The ops of ``graph`` and of every sub-graph they hold, depth first."""
    for op in graph.ops:
        yield op
        for sub in (op.subgraphs or {}).values():
            yield from all_ops(sub)


@dataclass(eq=False)
class Graph:
    name: str
    inputs: list = field(default_factory=list)     # Tensors, in call order
    ops: list = field(default_factory=list)
    outputs: list = field(default_factory=list)    # Tensors
    tensors: list = field(default_factory=list)
    # which model inputs (counted among the "input" tensors) forward() mutates;
    # their new values follow the model's own outputs
    input_writes: list = field(default_factory=list)
    # set by passes (each declared here, none added later):
    outputs_overwrite_inputs: bool = False   # variables updated in place (the optimizer update)
    stash_depth: Optional[dict] = None       # stage -> activations stashed (pipelined training)
    recompute: Optional[RecomputePlan] = None    # passes/recompute.py's plan
    statistics_outputs: int = 0              # trailing outputs: automatic loss scaling's statistics
    watch: Optional[GradientWatchState] = None      # fp16 gradients (machine.gradient_watch)
    rounding: Optional[StochasticRounding] = None   # stochastic rounding (machine.rounding)
    streams: Optional[RandomStreams] = None          # random numbers (machine.streams)
    floating_point_checks: bool = False      # enableFloatingPointExceptions

    def new_tensor(self, name: str, shape: Iterable[int], dtype: torch.dtype,
                   role: str = Role.ACTIVATION, producer: Optional[Op] = None,
                   value: Optional[torch.Tensor] = None) -> Tensor:
        t = Tensor(len(self.tensors), name, tuple(int(s) for s in shape), dtype, Role(role),
                   producer, value)
        self.tensors.append(t)
        return t

    def __str__(self) -> str:
        return FORMATTERS["graph"](self)


# -- the control program ---------------------------------------------------------
@dataclass(eq=False)
class Step:
    """Base class of program steps."""


@dataclass(eq=False)
class Sequence(Step):
    steps: list


@dataclass(eq=False)
class Repeat(Step):
    count: int
    body: Step
    counter: Counter

    def __post_init__(self) -> None:
        self.counter = Counter(self.counter)


@dataclass(eq=False)
class HostToDevice(Step):
    """Streams the next device iteration's micro-batches from the host.
    ``streams``: (overlap mode, copies, bytes) per input stream, per
    execution of the step (on average over the call)."""
    nbytes: int
    streams: list = field(default_factory=list)


@dataclass(eq=False)
class DeviceToHost(Step):
    """Streams outputs to the host, as the output mode asks (``streams`` as
    ``HostToDevice``'s)."""
    nbytes: int
    mode: str
    streams: list = field(default_factory=list)


@dataclass(eq=False)
class Call(Step):
    """Runs a graph once on every replica."""
    graph: Graph
    replicas: int


@dataclass(eq=False)
class AllReduce(Step):
    """Sums the gradient accumulators across replicas."""
    nbytes: int
    replicas: int


@dataclass(eq=False)
class ReduceScatter(Step):
    """Sums gradients across replicas; each replica keeps only its shard."""
    nbytes: int
    replicas: int


@dataclass(eq=False)
class AllGather(Step):
    """Rebuilds whole tensors from every replica's shard."""
    nbytes: int
    replicas: int


@dataclass(eq=False)
class _Remote(Step):
    names: list
    nbytes: int                       # per replica
    io_tiles: bool = False            # through the IO tiles (overlaps compute)
    transfers: Optional[int] = None   # separate copies (default: one per variable)
    phased: bool = False              # phased execution's traffic (per phase)

    def __post_init__(self) -> None:
        if self.transfers is None:
            self.transfers = len(self.names)


@dataclass(eq=False)
class RemoteLoad(_Remote):
    """Loads variables from Streaming Memory onto the tiles (per replica)."""


@dataclass(eq=False)
class RemoteStore(_Remote):
    """Stores variables back to Streaming Memory (per replica)."""


@dataclass(eq=False)
class Program:
    kind: ProgramKind
    graphs: dict                      # name -> Graph
    main: Optional[Step] = None       # the control program (passes/program.build_main)
    replicas: int = 1
    device_iterations: int = 1
    accumulation: int = 1
    in_bytes: int = 0                 # streamed host -> device per call
    out_bytes: int = 0                # streamed device -> host per call
    grad_bytes: int = 0               # gradients reduced per weight update
    synthetic_data: bool = False      # no host streams (Options.enableSyntheticData)
    sync_pattern: str = "Full"        # Options.syncPattern: its enums.SyncPattern name
    n_stages: int = 1                 # forward pipeline stages
    n_ipus: int = 1                   # IPUs per replica
    ipu_of_stage: list = field(default_factory=lambda: [0])
    pipelined: bool = False
    stage_map: str = ""
    in_streams: list = field(default_factory=list)    # (overlap mode, copies, bytes) per call
    out_streams: list = field(default_factory=list)
    processes: int = 1                # host processes sharing the replicas
    variables: dict = field(default_factory=dict)   # device variable name -> Tensor (tile mapping)
    locations: dict = field(default_factory=dict)   # variable -> passes.locations.Location
    sharded_state: set = field(default_factory=set)  # params whose optimizer state is sharded
    phased: Phased = Phased.NONE      # phased execution
    phase_of_stage: Optional[list] = None       # phase of each stage (phased execution)
    activations_off_chip: bool = False   # phased: activations wait in Streaming Memory

    def __post_init__(self) -> None:
        self.kind = ProgramKind(self.kind)
        self.phased = Phased(self.phased)

    @property
    def model_graph(self) -> str:
        """The name of the graph that runs the model (once per micro-batch)."""
        return "training_step" if self.kind == "training" else "inference_forward"

    @property
    def total_replicas(self) -> int:
        """Replicas in all processes together."""
        return self.replicas * self.processes

    def __str__(self) -> str:
        return FORMATTERS["program"](self)


# the closed set of control steps: the engine and the estimate have one rule each
STEP_KINDS = (Sequence, Repeat, Call, HostToDevice, DeviceToHost, AllReduce, ReduceScatter,
              AllGather, RemoteLoad, RemoteStore)
