"""Stochastic rounding of fp32 results to fp16, and the fp32 computation of
an op whose fp16 results round stochastically (``docs/precision.md``)."""
import random

import torch
from torch.utils import _pytree as pytree

HALF = torch.float16
_MIN_EXP = -14          # smallest normal fp16 exponent; below it the spacing is fixed
_DROPPED = 1 << 13      # fp32 carries 13 mantissa bits below fp16's (normal values)
_SMALLEST_NORMAL = 2.0 ** _MIN_EXP
_NAN = 0x7FC00000       # fp32's quiet NaN: the largest |x| bits rounded (no carry into the sign)
_EXACT_FROM = 1 << 16   # a larger tensor mostly of fp16 values rounds the others only
_ROW = 64               # (by rows of this many values)
_BLOCK = 1 << 18        # values rounded at a time: each block's temporaries stay in
                        # cache (2**18 measured fastest against 2**16 .. 2**21)
_POOL = 1 << 22         # random integers drawn once per seed, read in windows


class RandomBits:
    """Uniform integers in [0, 2**13), one per value stochastic rounding
    rounds: windows into ``_POOL`` integers drawn once from ``seed``, each
    window starting at an offset drawn from ``seed`` (a block of values
    reads one window).  Each integer is uniform, so each rounding is
    unbiased; a window costs no arithmetic, where drawing the integers took
    half of the rounding's time (the IPU's tiles draw theirs in hardware)."""

    def __init__(self, seed):
        self.seed = int(seed)
        self.offsets = random.Random(self.seed)
        self._pool = None

    def take(self, n):
        """``n`` (at most ``_POOL``) integers, int32."""
        if self._pool is None:
            g = torch.Generator().manual_seed(self.seed)
            self._pool = torch.randint(0, _DROPPED, (_POOL,), dtype=torch.int32, generator=g)
        start = self.offsets.randrange(_POOL - n + 1)
        return self._pool[start:start + n]


def stochastic_round(x, bits):
    """``x`` (fp32) rounded stochastically to fp16: to ``lo`` or ``hi`` (the
    fp16 neighbours of x) with P(hi) = (x - lo) / (hi - lo).  Exact fp16
    values, infinities and NaNs are kept; values past fp16's largest finite
    (65504) may round to infinity, as a cast does.  ``bits``: a
    ``RandomBits``.

    One random integer r in [0, 2**13) per value, added to the bits of |x|
    (an fp32 carries 13 mantissa bits below an fp16's), then those 13 bits
    cleared: |x| rounds up with probability equal to the dropped fraction,
    which gives the same P(hi) for either sign.  fp16's subnormals (|x| <
    2**-14, spaced 2**-24 apart) are first moved into [2**-14, 2**-13),
    whose fp16 spacing is the same 2**-24, by adding 2**-14, and moved back
    after.  Probabilities are resolved to 2**-13 (exactly for fp16's normal
    range).  A large tensor mostly of values fp16 holds exactly (an
    embedding's gradient, mostly zeros; a sum with such a gradient) rounds
    only its rows (64 values in memory order) holding other values."""
    x = x.float().contiguous()
    if x.numel() < _EXACT_FROM or not _mostly_exact(x):
        return _dense(x, bits)
    flat = x.view(-1)
    out = flat.to(HALF)                 # rows of values fp16 holds kept as they are
    body = flat.numel() - flat.numel() % _ROW
    rows, kept = flat[:body].view(-1, _ROW), out[:body].view(-1, _ROW)
    inexact = kept.float().sub_(rows).abs_().amax(dim=1).nonzero().squeeze(1)  # NaNs too
    kept[inexact] = _dense(rows[inexact], bits)
    if body < flat.numel():
        out[body:] = _dense(flat[body:], bits)
    return out.view(x.shape)


def _dense(x, bits):
    """``stochastic_round`` of every value of ``x`` (fp32, contiguous)."""
    if x.numel() > _BLOCK:         # block by block: each block's temporaries stay in cache
        flat, out = x.view(-1), torch.empty(x.shape, dtype=HALF)
        for part, into in zip(flat.split(_BLOCK), out.view(-1).split(_BLOCK)):
            into.copy_(_round_block(part, bits))
        return out
    return _round_block(x, bits)


def _round_block(x, bits):
    """``stochastic_round`` of a dense fp32 block, in place on its temporaries."""
    r = bits.take(x.numel()).view(x.shape)
    a = x.abs()
    # 2**-14 for subnormals, else 0 (a comparison written as floats: bool tensors are slow)
    shift = torch.lt(a, _SMALLEST_NORMAL, out=torch.empty_like(a)).mul_(_SMALLEST_NORMAL)
    # a NaN's bits lowered to the quiet NaN's, so that adding r cannot carry into the sign
    a.add_(shift).view(torch.int32).clamp_(max=_NAN).add_(r).bitwise_and_(-_DROPPED)
    return torch.copysign(a.sub_(shift), x, out=a).to(HALF)


def _mostly_exact(x, stride=61):
    """Does fp16 hold at least three quarters of ``x``'s values exactly?
    Judged from every ``stride``-th value (the answer only picks the faster
    of two ways of rounding, which round alike: fp16 values kept, the
    others to a neighbour)."""
    sample = x.view(-1)[::stride]
    exact = torch.eq(sample.to(HALF).float(), sample)
    return int(torch.count_nonzero(exact)) * 4 >= sample.numel() * 3


class Rounding:
    """The random state of stochastic rounding for one executable."""

    def __init__(self, seed=None, process_id=0):
        if seed is None:                        # no randomSeed: torch's global RNG decides
            seed = int(torch.randint(0, 2 ** 62, (1,)).item())
        self.seed = (int(seed) * 1_000_003 + int(process_id)) % (2 ** 63)
        self.bits = RandomBits(self.seed)

    def __getstate__(self):
        return {"seed": self.seed, "offsets": self.bits.offsets.getstate()}

    def __setstate__(self, state):
        self.seed = state["seed"]
        self.bits = RandomBits(self.seed)
        if "offsets" in state:          # (a state saved before the pool: starts afresh)
            self.bits.offsets.setstate(state["offsets"])

    def round(self, x):
        return stochastic_round(x, self.bits)


def _widen_all(x):
    """``_widen`` over the arguments of an op (tensors, dtypes, lists and
    tuples of them, scalars), without pytree's generality."""
    if isinstance(x, torch.Tensor):
        return x.float() if x.dtype == HALF else x
    if isinstance(x, (list, tuple)):
        return type(x)(_widen_all(y) for y in x)
    return torch.float32 if x is HALF else x


def _dtypes_of(x, out):
    """Appends to ``out`` the dtypes of the tensors in ``x`` and the dtype
    arguments (lists, tuples and dicts of them searched), without pytree's
    generality."""
    if isinstance(x, torch.Tensor):
        out.append(x.dtype)
    elif isinstance(x, torch.dtype):
        out.append(x)
    elif isinstance(x, (list, tuple)):
        for y in x:
            _dtypes_of(y, out)
    elif isinstance(x, dict):
        for y in x.values():
            _dtypes_of(y, out)
    return out


def _has_half(tree):
    return HALF in _dtypes_of(tree, [])


def _meta(x):
    return torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device="meta") \
        if isinstance(x, torch.Tensor) else x


def with_stochastic_rounding(kernel, out_dtypes, rounding, into=False):
    """``kernel`` computed in fp32, its fp16 results rounded stochastically.

    Which results are fp16 is read from the kernel itself (on meta tensors,
    once per operand dtypes): graphs traced dtype-blind (the optimizer
    update) meet fp16 weights only at run time.  ``out_dtypes`` (the traced
    dtypes) serve where the kernel has no meta form.  ``into``: the op's
    result is written into its first operand (the engine's in-place plan)."""
    seen = {}

    def dtypes(key, args, kwargs):
        if key not in seen:
            try:
                out = kernel(*pytree.tree_map(_meta, args), **pytree.tree_map(_meta, kwargs))
                seen[key] = [out.dtype] if isinstance(out, torch.Tensor) else \
                    [o.dtype if isinstance(o, torch.Tensor) else None for o in out]
            except Exception:  # noqa: BLE001 - no meta kernel: the traced dtypes
                seen[key] = list(out_dtypes)
        return seen[key]

    def exact(args, kwargs):
        result = kernel(*args, **kwargs)
        return args[0].copy_(result) if into else result

    def run(*args, **kwargs):
        key = tuple(_dtypes_of(kwargs, _dtypes_of(args, [])))
        if HALF not in key and HALF not in out_dtypes:
            return exact(args, kwargs)
        want = dtypes(key, args, kwargs)
        if HALF not in want:
            return exact(args, kwargs)
        wide = kernel(*_widen_all(args), **{k: _widen_all(v) for k, v in kwargs.items()})
        if isinstance(wide, torch.Tensor):
            result = rounding.round(wide) if want[0] == HALF else wide.to(want[0])
            return args[0].copy_(result) if into else result
        return type(wide)(rounding.round(r) if d == HALF and isinstance(r, torch.Tensor)
                          else r for r, d in zip(wide, want))
    return run
