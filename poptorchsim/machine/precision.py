"""fp16 arithmetic as the IPU does it: stochastic rounding and half partials.

Both are off by default; the engine then runs every op through its ATen
kernel unchanged, so fp16 results equal PyTorch's CPU fp16 bit for bit.

* **Stochastic rounding** (``Precision.enableStochasticRounding(True)``):
  an op whose result is fp16 is computed in fp32 (its fp16 operands and any
  fp16 dtype argument widened) and the fp32 result is rounded to one of the
  two fp16 values around it, up with probability (x - lo) / (hi - lo).  The
  expected value of the rounding is x: updates below half an ulp move
  weights in expectation.  The random bits come from one source per
  compiled executable's random streams (``streams.Streams``), seeded from
  ``Options.randomSeed`` (and the process id of a distributed run) and
  keyed by micro-batch, replica and op: the same seed gives the same
  results, whether the micro-batches run one after another or batched;
  replicas read different bits, as the IPU's per-tile generators do.
* **Half partials** (``Precision.setPartialsType(torch.half)``): matmuls
  and convolutions with fp16 operands accumulate their reduction in fp16.
  Model: the reduction is cut into chunks of ``PARTIALS_CHUNK`` (16, an AMP
  unit's fp16 input width); each chunk's products are summed in fp32 (the
  AMP's adder tree; fp16 products are exact in fp32) and added to a running
  partial sum that is rounded to fp16 (to nearest) after every chunk.  Float
  partials (the default) are PyTorch's CPU fp16 matmul: fp32 accumulation,
  one rounding at the end.
"""
import functools
import math

import torch

from .half_partials import (  # noqa: F401 - re-exported
    HALF_PARTIALS,
    PARTIALS_CHUNK,
    SLICE_CHUNKS,
    half_partials_kernel,
    half_partials_mm,
    mark_partials,
    uses_half_partials,
)
from .rounding import (  # noqa: F401 - re-exported
    HALF,
    Rounding,
    has_half,
    stochastic_round,
    widen_all,
    with_stochastic_rounding,
)

aten = torch.ops.aten


# fp16 kernels PyTorch's CPU build runs far slower than the same op in fp32
# (measured: pow 6.7x, tanh 2.7x, convolution_backward 96x; on a CPU with
# AVX2 but no native fp16 arithmetic (AVX-512 FP16, AMX), where oneDNN has no
# fp16 convolution or GEMM, the forward convolution falls back to slow_conv2d
# and the matmuls to a reference GEMM: ResNet-18's fp16 step took 5x its
# fp32 one, GPT-2's 9x; benchmarks/host_speed.py): computed in fp32 and
# rounded to nearest fp16, which is what they compute in fp16 (pow, tanh:
# the same values) or closer to it (convolutions and matmuls: one rounding
# of an fp32 accumulation, which is what the IPU's float partials compute;
# half partials have their own kernels, machine/half_partials.py)
SLOW_IN_HALF = {aten.pow.Tensor_Scalar, aten.pow.Tensor_Tensor, aten.pow.Scalar,
                aten.tanh.default, aten.convolution.default,
                aten.convolution_backward.default, aten.mm.default, aten.addmm.default,
                aten.bmm.default, aten.baddbmm.default}


# reductions to the index of an fp16 value, 3x slower in fp16 than on the
# same values widened to fp32 (which are the same values: the same index,
# ties to the first alike)
INDEX_OF_HALF = {aten.argmax.default, aten.argmin.default}


# fp16 kernels whose result is the fp32 kernel's rounded to nearest fp16, bit
# for bit, on PyTorch's CPU (they compute in fp32 and round once; checked
# value by value in tests/unit/test_fp16_kernels_unit.py; sigmoid_backward,
# for one, rounds its intermediate products and is not here): the gradient
# watch runs them natively in the micro-batches it does not count
ROUNDS_LIKE_FP32 = {
    aten.add.Tensor, aten.sub.Tensor, aten.mul.Tensor, aten.mul.Scalar, aten.div.Tensor,
    aten.div.Scalar, aten.neg.default, aten.where.self, aten.threshold_backward.default,
    aten.tanh_backward.default, aten.clone.default,
    aten.cat.default, aten._to_copy.default}


def in_fp32(kernel, out_dtypes):
    """``kernel`` computed on fp16 operands widened to fp32, its results
    rounded to nearest in the dtypes the trace gave them."""
    def run(*args, **kwargs):
        if not has_half((args, kwargs)):
            return kernel(*args, **kwargs)
        wide = kernel(*widen_all(args), **{k: widen_all(v) for k, v in kwargs.items()})
        if isinstance(wide, torch.Tensor):
            return wide.to(out_dtypes[0]) if out_dtypes[0] is not None else wide
        return type(wide)(w.to(d) if isinstance(w, torch.Tensor) and d is not None else w
                          for w, d in zip(wide, out_dtypes))
    return run


def host_kernel(op, kernel, rounding=None, into=False, traced=False, wide=False):
    """The host function the engine calls for ``op``: ``kernel``, or its
    half-partials form, or (with stochastic ``rounding``) ``kernel``
    computed in fp32 with its fp16 results rounded stochastically.
    ``into``: ``kernel`` is the out-of-place kernel of an op the engine
    runs in place (its result is written into its first operand).
    ``traced``: the op's graph was traced with its run-time dtypes (which
    results are fp16 is read from the IR); ``wide``: its fp16 operands may
    come in fp32 and its fp16 results go in fp32 (``takes_wide``)."""
    if uses_half_partials(op) and half_partials_kernel(op.target) is not None:
        return half_partials_kernel(op.target)
    dtypes = [t.dtype if t is not None else None for t in op.outputs]
    if rounding is not None and rounds_stochastically(op):
        return with_stochastic_rounding(kernel, dtypes, rounding, into, op.id, traced, wide)
    if (op.target in SLOW_IN_HALF and HALF in dtypes) or op.target in INDEX_OF_HALF:
        return in_fp32(kernel, dtypes)
    return kernel


# ops whose result holds only values of their operands (or zeros and ones):
# with fp16 operands every value is already an fp16 one, which rounding,
# stochastic or not, keeps
_EXACT_IN_HALF = {
    "clone", "copy", "_to_copy", "cat", "stack", "contiguous", "repeat", "flip", "roll",
    "constant_pad_nd", "slice_scatter", "select_scatter", "slice_backward",
    "select_backward", "tril", "triu", "zeros", "ones", "empty", "zeros_like", "ones_like",
    "empty_like", "new_zeros", "new_ones", "new_empty", "embedding", "index_select",
    "gather", "index", "relu", "threshold_backward", "neg", "abs", "bernoulli", "maximum",
    "minimum", "amax", "amin"}
_EXACT_OVERLOADS = {"aten::where.self", "aten::max.dim", "aten::min.dim"}


def exact_in_half(op):
    """Does ``op`` give values of its fp16 operands only (every floating-point
    operand fp16), so that rounding its fp16 result changes nothing?"""
    if not _moves_values(op.target):
        return False
    return all(t.dtype == HALF for t in op.input_tensors() if t.dtype.is_floating_point)


@functools.lru_cache(maxsize=None)
def _moves_values(target):
    """Is ``target`` an op that only moves values (``_EXACT_IN_HALF``)?"""
    schema = getattr(target, "_schema", None)
    packet = getattr(target, "overloadpacket", None)
    if schema is None or packet is None:
        return False
    name = f"{schema.name}.{schema.overload_name}" if schema.overload_name else schema.name
    return packet.__name__ in _EXACT_IN_HALF or name in _EXACT_OVERLOADS


def rounds_stochastically(op):
    """May the engine round ``op``'s results stochastically (when on)?  Ops
    computing a floating-point result; views, ops writing an operand in
    place (copies into buffers) and ops that only move fp16 values
    (``exact_in_half``) are left alone."""
    return (op.cost_class not in ("view", "host") and not op.inplace and not op.subgraphs
            and any(t is not None and t.dtype.is_floating_point for t in op.outputs)
            and not exact_in_half(op))


# view ops whose result reads its operand's bytes as another dtype
_RETYPING_VIEWS = {"view_as_real", "view_as_complex"}


def takes_wide(op):
    """Can ``op`` take its fp16 operands in fp32 (the fp16 values exactly:
    *wide values*, ``codegen.py``), in a graph traced with its run-time
    dtypes whose fp16 results round stochastically?  Ops computed in fp32
    anyway with an fp16 result (rounded stochastically: ``host_kernel``'s
    ``wide``), views, and ops that only move fp16 values (``exact_in_half``,
    scalars fp16 holds: their results are then fp16 values in fp32).  The
    others (random ops, half partials, loops, in-place writes, fp32
    results, views that read bytes as another dtype) take fp16."""
    if op.inplace or op.subgraphs or op.cost_class in ("random", "host", "custom"):
        return False
    if op.target in (aten.as_strided.default, aten.as_strided_.default):
        return False
    if op.cost_class == "view":
        packet = getattr(op.target, "overloadpacket", None)
        return getattr(packet, "__name__", "") not in _RETYPING_VIEWS and not _names_dtype(op)
    if uses_half_partials(op) and half_partials_kernel(op.target) is not None:
        return False
    if rounds_stochastically(op):
        return any(t is not None and t.dtype == HALF for t in op.outputs)
    return exact_in_half(op) and _scalars_in_half(op)


def _leaves(x):
    """The leaves of an op's arguments (nested lists, tuples and dicts), as
    ``pytree.tree_leaves`` gives them, without pytree's per-node lookups."""
    if isinstance(x, (list, tuple)):
        for y in x:
            yield from _leaves(y)
    elif isinstance(x, dict):
        for y in x.values():
            yield from _leaves(y)
    else:
        yield x


def _names_dtype(op):
    """Does one of ``op``'s arguments name a dtype?"""
    return any(isinstance(a, torch.dtype) for a in _leaves((op.args, op.kwargs)))


def _scalars_in_half(op):
    """Are ``op``'s float arguments values fp16 holds (a threshold, a pad
    value)?  An fp16 op reads a scalar as fp16; in fp32 another value would
    compare or pad differently."""
    floats = [a for a in _leaves((op.args, op.kwargs)) if isinstance(a, float)]
    return all(math.isnan(a) or float(torch.tensor(a, dtype=HALF)) == a for a in floats)


class LossScale:
    """The loss scale of a training program with automatic loss scaling:
    the update factor, its counter, and the statistics of the current
    update period (summed over micro-batches, replicas and processes).

    After each weight update, the new factor the update graph computed
    becomes the scale of the next step: the step's loss-scaling input and
    the scale by which the update divides the gradients (``grad_scale``,
    and SGD's combined-variant scale into the velocity)."""

    def __init__(self, loss_scaling, factor=1.0, period=1):
        self.loss_scaling = float(loss_scaling)
        self.factor = torch.tensor(float(factor), dtype=torch.float32)
        self.counter = torch.tensor(0.0, dtype=torch.float32)
        self.period = int(period)
        self.statistics = None
        self.history = []               # the final loss scale after each update of a call

    @property
    def final(self):
        return self.loss_scaling * float(self.factor)

    def add(self, statistics):
        s = statistics.to(torch.int64)
        self.statistics = s if self.statistics is None else self.statistics + s

    def update_inputs(self):
        """The loss-scale update op's inputs: statistics, factor, loss scaling, counter."""
        device = self.factor.device         # the host device (host_device.py)
        stats = self.statistics if self.statistics is not None else \
            torch.zeros(2, dtype=torch.int64, device=device)
        return [stats.to(torch.int32), self.factor,
                torch.tensor(self.loss_scaling, dtype=torch.float32, device=device),
                self.counter]

    def apply(self, state, new_factor):
        """The update graph's new factor takes effect for the next step; the
        statistics start again when an update period ends."""
        old = self.final
        if (int(self.counter) + 1) % self.period == 0:
            self.statistics = None
        self.factor = new_factor.detach().float().reshape(())
        self.counter = self.counter + 1
        self.history.append(self.final)
        self.set_scale(state, old)

    def set_scale(self, state, old):
        """``state``'s loss-scale tensors moved from scale ``old`` to ``final``."""
        new = self.final
        if getattr(state, "step_extra", None):
            state.step_extra[0] = torch.tensor(new, dtype=torch.float32,
                                               device=state.step_extra[0].device)
        state.grad_scale = state.grad_scale * (old / new)
        if getattr(state, "combined_scale", None) is not None:
            state.combined_scale = [c * (old / new) for c in state.combined_scale]
