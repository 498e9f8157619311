"""Stochastic rounding of fp32 results to fp16, and the fp32 computation of
an op whose fp16 results round stochastically (``docs/precision.md``)."""
import math

import torch
from torch.utils import _pytree as pytree

HALF = torch.float16
_MIN_EXP = -14          # smallest normal fp16 exponent; below it the spacing is fixed
_DROPPED = 1 << 13      # fp32 carries 13 mantissa bits below fp16's (normal values)
_SMALLEST_NORMAL = 2.0 ** _MIN_EXP
_SPARSE_FROM = 1 << 16  # a larger tensor mostly of zeros rounds its non-zeros only
_BLOCK = 1 << 18        # values rounded at a time (a multiple of 4: the random words
                        # drawn are the same whatever the block; 2**18 measured fastest
                        # against 2**16 .. 2**21, the per-op overhead against the cache)
_LOW_BITS = 0x1FFF1FFF1FFF1FFF   # the low 13 bits of each 16-bit quarter of a word


def stochastic_round(x, generator=None):
    """``x`` (fp32) rounded stochastically to fp16: to ``lo`` or ``hi`` (the
    fp16 neighbours of x) with P(hi) = (x - lo) / (hi - lo).  Exact fp16
    values, infinities and NaNs are kept; values past fp16's largest finite
    (65504) may round to infinity, as a cast does.

    One random integer r in [0, 2**13) per value, added to the bits of |x|
    (an fp32 carries 13 mantissa bits below an fp16's), then those 13 bits
    cleared: |x| rounds up with probability equal to the dropped fraction,
    which gives the same P(hi) for either sign.  fp16's subnormals (|x| <
    2**-14, spaced 2**-24 apart) are first moved into [2**-14, 2**-13),
    whose fp16 spacing is the same 2**-24, by adding 2**-14, and moved back
    after.  Probabilities are resolved to 2**-13 (exactly for fp16's normal
    range)."""
    x = x.float().contiguous()
    if x.numel() >= _SPARSE_FROM and _mostly_zeros(x):   # an embedding's gradient
            flat = x.view(-1)
            where = flat.nonzero().squeeze(1)
            out = flat.to(HALF)             # zeros (of either sign) exact
            out[where] = stochastic_round(flat[where], generator)
            return out.view(x.shape)
    if x.numel() > _BLOCK:         # block by block: each block's temporaries stay in cache
        flat, out = x.view(-1), torch.empty(x.shape, dtype=HALF)
        for part, into in zip(flat.split(_BLOCK), out.view(-1).split(_BLOCK)):
            into.copy_(_round_block(part, generator))
        return out
    return _round_block(x, generator)


def _round_block(x, generator):
    """``stochastic_round`` of a dense fp32 block, in place on its temporaries."""
    r = _random_bits(x.shape, generator)
    a = x.abs()
    # 2**-14 for subnormals, else 0 (a comparison written as floats: bool tensors are slow)
    shift = torch.lt(a, _SMALLEST_NORMAL, out=torch.empty_like(a)).mul_(_SMALLEST_NORMAL)
    bits = a.add_(shift).view(torch.int32)
    bits.add_(r).bitwise_and_(-_DROPPED)
    out = torch.copysign(a.sub_(shift), x, out=a)
    if x.numel() and torch.isnan(x.max()):      # a NaN's payload may carry into its sign
        out = torch.where(torch.isnan(x), x, out)
    return out.to(HALF)


def _mostly_zeros(x, stride=61):
    """Are at most a quarter of ``x``'s values non-zero?  Judged from every
    ``stride``-th value (the answer only picks the faster of two exact ways
    of rounding)."""
    sample = x.view(-1)[::stride]
    return int(torch.count_nonzero(sample)) <= sample.numel() // 4


def _random_bits(shape, generator):
    """Uniform integers in [0, 2**13) (int32), drawn four to a 64-bit word:
    the CPU generator's cost is per draw."""
    n = math.prod(shape)
    words = torch.empty((n + 3) // 4, dtype=torch.int64).random_(generator=generator)
    # each quarter masked to [0, 2**13) in place, on the words (no int16 temporary)
    return words.bitwise_and_(_LOW_BITS).view(torch.int16)[:n].to(torch.int32).view(shape)


class Rounding:
    """The random state of stochastic rounding for one executable."""

    def __init__(self, seed=None, process_id=0):
        if seed is None:                        # no randomSeed: torch's global RNG decides
            seed = int(torch.randint(0, 2 ** 62, (1,)).item())
        self.seed = (int(seed) * 1_000_003 + int(process_id)) % (2 ** 63)
        self.generator = torch.Generator().manual_seed(self.seed)

    def __getstate__(self):
        return {"seed": self.seed, "state": self.generator.get_state()}

    def __setstate__(self, state):
        self.seed = state["seed"]
        self.generator = torch.Generator().manual_seed(self.seed)
        self.generator.set_state(state["state"])

    def round(self, x):
        return stochastic_round(x, self.generator)


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
