"""The closed sets of names the IR uses, as enums.

Each is a ``StrEnum``: a member equals its string (``Role.PARAM == "param"``),
so code comparing with the names keeps working, while the IR's records turn
what they are given into members when built (an unknown name is a
``ValueError`` there, not a silent typo) and the verifier checks them after
every pass."""
from enum import StrEnum


class ProgramKind(StrEnum):
    """``Program.kind``."""
    TRAINING = "training"
    INFERENCE = "inference"


class Role(StrEnum):
    """``Tensor.role``: what a tensor is to the program."""
    PARAM = "param"                 # a trained weight (or a frozen one)
    BUFFER = "buffer"               # a module buffer (running statistics, ...)
    STATE = "state"                 # optimizer state, step counts, loss-scale state
    HYPER = "hyper"                 # a hyperparameter the host streams
    ACCUMULATOR = "accumulator"     # a gradient accumulator
    CONST = "const"                 # a constant compiled into the program
    INPUT = "input"                 # a micro-batch input
    ACTIVATION = "activation"       # an op's result


# always live on the tiles (variables and constants); the others come and go
ALWAYS_LIVE_ROLES = (Role.PARAM, Role.BUFFER, Role.STATE, Role.HYPER, Role.ACCUMULATOR,
                     Role.CONST)


class CostClass(StrEnum):
    """``Op.cost_class``: which cost rule charges an op (``ir/ops.py`` sorts
    the ATen ops into them)."""
    VIEW = "view"
    COPY = "copy"
    GATHER = "gather"
    CREATION = "creation"
    RANDOM = "random"
    MATMUL = "matmul"
    CONV = "conv"
    ELEMENTWISE = "elementwise"
    TRANSCENDENTAL = "transcendental"
    REDUCTION = "reduction"
    NORM = "norm"
    SOFTMAX = "softmax"
    POOL = "pool"
    LOSS = "loss"
    SORT = "sort"
    RNN = "rnn"
    HOST = "host"                   # runs on the host (print, host calls)
    CUSTOM = "custom"               # a custom op (its own cost and memory)
    LOOP = "loop"                   # poptorch.for_loop: a sub-graph run N times
    COND = "cond"                   # poptorch.cond: one of two sub-graphs


class Counter(StrEnum):
    """``Repeat.counter``: which loop of a call a ``Repeat`` is."""
    DEVICE_ITERATION = "device_iteration"
    ACCUMULATION = "accumulation"
    CALL = "call"                   # the estimate's stand-in for a call outside any loop


class Phased(StrEnum):
    """``Program.phased``: phased execution, or none."""
    NONE = ""
    SERIAL = "serial"
    PARALLEL = "parallel"
