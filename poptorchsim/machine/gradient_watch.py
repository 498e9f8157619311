"""What the fp16 gradients of a training call lost: the gradient watch."""
import math

import torch
from torch._C import _functorch as _ft

from ..ir.interfaces import GradientWatchState
from . import watch_kernel
from .half_partials import half_partials_kernel, uses_half_partials
from .precision import ROUNDS_LIKE_FP32, SLOW_IN_HALF, rounds_stochastically
from .rounding import HALF, result_stream, widen_all

# |x| boundaries of what rounding to nearest fp16 does to an fp32 value x:
# 0 | underflows to zero (|x| <= 2**-25, ties to even) | fp16 | overflows to
# infinity (|x| >= 65520, a tie rounding to the even infinity) | inf, NaN
_UNDERFLOW, _OVERFLOW = 2.0 ** -25, 65520.0
_BOUNDS = torch.tensor([0.0, _UNDERFLOW,
                        float(torch.nextafter(torch.tensor(_OVERFLOW), torch.tensor(0.0))),
                        torch.finfo(torch.float32).max])


def _row_zero(t):
    """The first micro-batch's values of ``t``: in a batched call (the
    engine's ``torch.func.vmap`` over micro-batches), row 0 of its batched
    dimension, a plain tensor (the values the serial order gives it)."""
    while isinstance(t, torch.Tensor) and _ft.is_batchedtensor(t):
        t = _ft.get_unwrapped(t).select(_ft.maybe_get_bdim(t), 0)
    return t


class GradientWatch:
    """Counts, in one call, the fp16 gradient values the backward pass
    lost (ops marked ``Op.watched``: every backward op with an fp16
    result, casts included): *underflowed*, zero in fp16 but not when the
    op is computed in fp32 from the same operands; *overflowed*, infinite
    in fp16 but finite in fp32; and *non-finite*, infinite or NaN in fp16.
    A value is counted where it is lost, not again downstream.  Per op, the
    share of its fp32 result's summed magnitude that underflowed (over the
    runs in which it lost values) says
    whether what was lost mattered (tiny values that underflow at any scale
    weigh nothing); ``worst_lost_share`` is the largest.

    A watched op runs once: its kernel on operands widened to fp32, the
    result rounded to fp16 (to nearest, or stochastically when that is on),
    as the IPU's fp16 units with float partials compute.  The statistics
    come from that fp32 result: what rounds to zero or to infinity is known
    from its magnitude (the range of the fp16 result and two counts of
    non-zeros for most results).  They are counted over the first
    micro-batch (of its first replica) of a call that ``reset`` starts (in
    a batched call, the first row of each batched result: ``_row_zero``);
    ``skip`` leaves a call uncounted (the runtime counts about one
    micro-batch in 16: the counting costs about one fp32 step).  An op
    with half partials runs its own kernel and is compared with the fp32
    one, value by value; an op whose kernel gives the rounded fp32 values
    (``ROUNDS_LIKE_FP32``, rounding to nearest) runs its kernel too; both
    make the fp32 result for the counted micro-batch alone."""

    def __init__(self):
        self.reset()

    def reset(self):
        """A new counted call: count again, from its first micro-batch."""
        self.counting = True
        self._first = None          # the first watched op of the call
        self.values = 0
        self.nonzero = 0            # values the fp32 reference makes non-zero
        self.underflowed = 0
        self.overflowed = 0
        self.nonfinite = 0
        # op name -> [values, underflowed, overflowed, |fp32| summed, |fp32| of the lost]
        self.per_op = {}

    def wrap(self, op, kernel, reference, rounding=None, wide=False):
        """The host function of watched ``op``: ``reference`` (its plain
        kernel) on widened operands, rounded to fp16 (stochastically with
        ``rounding``), counted into this watch.  ``kernel``: what the engine
        would run otherwise; an op with half partials keeps it.  ``wide``:
        its results rounded stochastically are returned in fp32
        (``precision.takes_wide``)."""
        dtypes = [t.dtype if t is not None else None for t in op.outputs]
        stochastic = rounding is not None and rounds_stochastically(op)
        exact = uses_half_partials(op) and half_partials_kernel(op.target) is not None

        def narrow(w, dtype, j=0):
            if not isinstance(w, torch.Tensor) or dtype is None or w.dtype == dtype:
                return w
            if dtype != HALF:
                return w.to(dtype)
            return rounding.round(w, result_stream(op.id, j), wide) if stochastic \
                else w.to(HALF)

        def counted(args, kwargs, out, wide):
            outs = [out] if isinstance(out, torch.Tensor) else list(out)
            wides = [wide] if isinstance(wide, torch.Tensor) else list(wide)
            for o, w, d in zip(outs, wides, dtypes):     # (an fp16 ``o`` may be in fp32)
                o, w = _row_zero(o), _row_zero(w)
                if isinstance(o, torch.Tensor) and d == HALF and isinstance(w, torch.Tensor):
                    if exact:       # fp16 partial sums: not a rounding of ``wide``
                        self._count_values(op.name, o, w)
                    else:
                        self._count_rounded(op.name, o, w, stochastic)
            return out

        single = len(dtypes) == 1
        to_half = single and dtypes[0] == HALF and not stochastic
        # a kernel giving the same values as the rounded fp32 one runs as
        # is (natively, or already in fp32; tests/unit/test_fp16_kernels_unit.py)
        same = not stochastic and not exact and (
            op.target in ROUNDS_LIKE_FP32 or (op.target in SLOW_IN_HALF and HALF in dtypes))

        def run(*args, **kwargs):
            if same or exact:
                # the kernel's results are the op's (half partials), or the
                # rounded fp32 ones (``same``): the fp32 reference only serves
                # the counting, of the counted row alone (in a batched call the
                # other micro-batches' would be made for nothing)
                out = kernel(*args, **kwargs)
                if not self.counting or not self._counts(op.name):
                    return out
                first = [_row_zero(a) for a in args]
                wide = reference(*[a.float() if isinstance(a, torch.Tensor) and a.dtype == HALF
                                   else widen_all(a) for a in first],
                                 **{k: widen_all(_row_zero(v)) for k, v in kwargs.items()})
                return counted(args, kwargs, out, wide)
            wide = reference(*[a.float() if isinstance(a, torch.Tensor) and a.dtype == HALF
                               else widen_all(a) for a in args],
                             **({k: widen_all(v) for k, v in kwargs.items()} if kwargs else {}))
            if to_half and isinstance(wide, torch.Tensor):
                out = wide.to(HALF)
            elif single and isinstance(wide, torch.Tensor):
                out = narrow(wide, dtypes[0])
            else:
                out = type(wide)(narrow(w, d, j) for j, (w, d) in enumerate(zip(wide, dtypes)))
            if self.counting and self._counts(op.name):
                return counted(args, kwargs, out, wide)
            return out
        return run

    def skip(self):
        """A call the watch does not count: the last counted call's numbers stay."""
        self.counting = False

    def _counts(self, name):
        """Is this run of op ``name`` counted?  The first micro-batch of a
        call is (its first watched op coming round again starts the next)."""
        if self._first is None:
            self._first = name
        elif name == self._first:
            self.counting = False
        return self.counting

    def _add(self, name, values, zeros, under, over, nonfinite, size, lost):
        row = self.per_op.setdefault(name, [0, 0, 0, 0.0, 0.0])
        row[0] += values
        row[1] += under
        row[2] += over
        row[3] += size
        row[4] += lost
        self.values += values
        self.nonzero += values - zeros
        self.underflowed += under
        self.overflowed += over
        self.nonfinite += nonfinite

    def _count_rounded(self, name, out, wide, stochastic=False):
        """``out`` is ``wide`` (fp32) rounded to fp16, to nearest or
        (``stochastic``) to a neighbour: either way zero stays zero and
        nothing else becomes zero unless it underflowed, so a value
        underflowed where ``out`` is zero and ``wide`` is not, and two counts
        of non-zeros and the range of ``out`` (finite: nothing overflowed)
        say it all for most results; an op that lost values adds its summed
        magnitude, one with infinities or NaNs the value-by-value classes
        (rounded stochastically, the values themselves: a value below the
        overflow bound may have rounded to infinity)."""
        n = wide.numel()
        if n == 0:
            return
        fast = watch_kernel.counts(out, wide)      # one compiled pass, where it applies
        if fast is not None:
            nz_wide, nz_out, nonfinite = fast[0], fast[1], fast[2]
        else:
            lo, hi = torch.aminmax(out.detach())
            nz_wide, nz_out, lo, hi = torch.stack([torch.count_nonzero(wide).double(),
                                                   torch.count_nonzero(out).double(),
                                                   lo.double(), hi.double()]).tolist()
            nonfinite = not (math.isfinite(lo) and math.isfinite(hi))
        if nonfinite:                                       # infinities, NaNs, overflow
            if stochastic:
                self._count_values(name, out, wide)
                return
            flat = wide.detach().float().abs().reshape(-1).contiguous()
            classes = torch.bucketize(flat, _BOUNDS.to(flat.device))
            c = torch.bincount(classes, minlength=5).tolist()
            m = torch.bincount(classes, weights=flat, minlength=5).tolist()
            self._add(name, n, c[0], c[1], c[3], c[3] + c[4], m[0] + m[1] + m[2] + m[3], m[1])
            return
        zeros, under = n - int(nz_wide), int(nz_wide - nz_out)
        size = lost = 0.0           # an op's magnitude matters only beside what it lost
        if under and fast is not None:
            size, lost = fast[3], fast[4]
        elif under:
            a = wide.detach().float().abs()
            size, lost = torch.stack([a.sum(), torch.where(out == 0, a, 0.0).sum()]).tolist()
        self._add(name, n, zeros, under, 0, 0, size, lost)

    def _count_values(self, name, out, wide):
        """``out`` (fp16) compared with ``wide`` (fp32) value by value."""
        finite = torch.isfinite(out)
        lost = (out == 0) & (wide != 0)
        size = wide.detach().float().abs().nan_to_num(posinf=0.0)
        zeros = int((wide == 0).sum())
        self._add(name, out.numel(), zeros, int(lost.sum()),
                  int((~finite & torch.isfinite(wide)).sum()), int((~finite).sum()),
                  float(size.sum()), float(size[lost].sum()))

    @staticmethod
    def _lost_share(row):
        return row[4] / row[3] if row[3] else 0.0

    @property
    def worst_lost_share(self):
        """The largest share of an op's (fp32) gradient magnitude that
        underflowed: 1.0 when an op's whole result became zero."""
        return max((self._lost_share(r) for r in self.per_op.values()), default=0.0)

    def summary(self, top=5):
        """A dict: totals, and the ``top`` ops that lost the largest share
        of their gradient's magnitude (or overflowed)."""
        worst = sorted(self.per_op.items(),
                       key=lambda kv: (-kv[1][2], -self._lost_share(kv[1]), -kv[1][1]))[:top]
        return {"values": self.values, "nonzero": self.nonzero,
                "underflowed": self.underflowed,
                "underflowed_magnitude": self.worst_lost_share,
                "overflowed": self.overflowed, "nonfinite": self.nonfinite,
                "ops": [{"op": n, "values": r[0], "underflowed": r[1], "overflowed": r[2],
                         "underflowed_magnitude": self._lost_share(r)}
                        for n, r in worst if r[1] or r[2]]}


# the IR's protocol (ir/interfaces.py), held to by the type checker
_CHECKED: type[GradientWatchState] = GradientWatch
