"""Stochastic rounding of fp32 results to fp16, and the fp32 computation of
an op whose fp16 results round stochastically (``docs/precision.md``)."""
import random
from typing import Any

import torch
from torch.utils import _pytree as pytree

from ..ir.interfaces import StochasticRounding
from . import vmap_rules
from .streams import DROPPED, MASK32, POOL, Streams, Window, Windows, draw_pool, key_ints

HALF = torch.float16
_MIN_EXP = -14          # smallest normal fp16 exponent; below it the spacing is fixed
_DROPPED = DROPPED      # fp32 carries 13 mantissa bits below fp16's (normal values)
_SMALLEST_NORMAL = 2.0 ** _MIN_EXP
_SIGN = -(1 << 31)     # fp32's sign bit, as an int32
_NAN = 0x7FC00000       # fp32's quiet NaN: the largest |x| bits rounded (no carry into the sign)
_EXACT_FROM = 1 << 16   # a larger tensor mostly of fp16 values rounds the others only
_ROW = 64               # (by rows of this many values)
_BLOCK = 1 << 18        # values rounded at a time: each block's temporaries stay in
                        # cache (2**18 measured fastest against 2**16 .. 2**21)


class RandomBits:
    """A source of stochastic rounding's bits outside an executable (its
    streams give an executable's, ``streams.Streams.window``): windows
    into a pool of ``POOL`` uniform integers in [0, 2**13) drawn once from
    ``seed``, each window starting at an offset drawn from ``seed`` in
    order.  Each integer is uniform, so each rounding is unbiased; a window
    costs no arithmetic (the IPU's tiles draw their bits in hardware)."""

    def __init__(self, seed):
        self.seed = int(seed)
        self.offsets = random.Random(self.seed)
        self._pool = None

    def window(self, device=None):
        if self._pool is None:
            self._pool = draw_pool(self.seed)
        return Window(self._pool, self.offsets.randrange(POOL))


def stochastic_round(x, bits, wide=False):
    """``x`` (fp32) rounded stochastically to fp16: to ``lo`` or ``hi`` (the
    fp16 neighbours of x) with P(hi) = (x - lo) / (hi - lo).  Exact fp16
    values, infinities and NaNs are kept; values past fp16's largest finite
    (65504) may round to infinity, as a cast does.  ``bits``: the
    ``streams.Window`` of this result (value ``j`` of ``x`` in memory order
    reads its bit ``j``), or a ``RandomBits``.

    One random integer r in [0, 2**13) per value, added to the bits of |x|
    (an fp32 carries 13 mantissa bits below an fp16's), then those 13 bits
    cleared: |x| rounds up with probability equal to the dropped fraction,
    which gives the same P(hi) for either sign.  fp16's subnormals (|x| <
    2**-14, spaced 2**-24 apart) are first moved into [2**-14, 2**-13),
    whose fp16 spacing is the same 2**-24, by adding 2**-14, and moved back
    after.  Probabilities are resolved to 2**-13 (exactly for fp16's normal
    range).  A large tensor mostly of values fp16 holds exactly (an
    embedding's gradient, mostly zeros; a sum with such a gradient) rounds
    only its rows (64 values in memory order) holding other values; the
    values it rounds read the same bits as in a full rounding, so the
    result does not depend on the shortcut.

    ``wide``: the fp16 values returned in fp32 (``.float()`` of the fp16
    result, bit for bit; the compiled kernel writes them so at once), for
    ops that compute in fp32 anyway (``codegen.py``'s wide values)."""
    if wide and not (x.device.type == "cpu" and isinstance(bits, (Window, Windows))
                     and _compiled()):
        return stochastic_round(x, bits).float()
    if hasattr(bits, "window"):
        bits = bits.window(x.device)
    x = x.float().contiguous()
    if x.device.type == "cpu" and isinstance(bits, (Window, Windows)) and _compiled():
        # one compiled pass (sr_kernel.py): every value, the same bits, the same result
        if isinstance(bits, Windows):
            return sr_kernel.round_rows(x, bits.pool, bits.first, bits.n, wide)
        return sr_kernel.round_rows(x, bits.pool, [bits.start], x.numel(), wide)
    if x.device.type != "cpu" and isinstance(bits, (Window, Windows)) and _on_gpu(x.device):
        # one Triton kernel (sr_triton.py): no launch per pass, no count read back
        if isinstance(bits, Windows):
            return sr_triton.round_rows(x, bits.pool, bits.starts, bits.n)
        return sr_triton.round_rows(x, bits.pool, bits.start)
    if x.device.type != "cpu" or x.numel() < _EXACT_FROM or not _mostly_exact(x):
        return _dense(x, bits)          # (on a GPU: no count read back, no blocks)
    flat = x.view(-1)
    out = flat.to(HALF)                 # rows of values fp16 holds kept as they are
    body = flat.numel() - flat.numel() % _ROW
    rows, kept = flat[:body].view(-1, _ROW), out[:body].view(-1, _ROW)
    inexact = kept.float().sub_(rows).abs_().amax(dim=1).nonzero().squeeze(1)  # NaNs too
    positions = (inexact[:, None] * _ROW + torch.arange(_ROW, device=x.device)).view(-1)
    kept[inexact] = _round_block(rows[inexact], bits.at(positions).view(-1, _ROW))
    if body < flat.numel():
        out[body:] = _round_block(flat[body:], bits.range(body, flat.numel() - body))
    return out.view(x.shape)


def _compiled():
    """Is stochastic rounding's compiled kernel here (numba: ``sr_kernel.py``)?
    Imported at the first rounding, not with the package."""
    global sr_kernel
    if sr_kernel is None:
        from . import sr_kernel as kernel
        sr_kernel = kernel
    return sr_kernel.available()


sr_kernel: Any = None   # the module, once imported (``_compiled``)


def _on_gpu(device):
    """Is stochastic rounding's Triton kernel here for ``device``
    (``sr_triton.py``)?  Imported at the first rounding on a GPU."""
    global sr_triton
    if sr_triton is None:
        from . import sr_triton as kernel
        sr_triton = kernel
    return sr_triton.available(device)


sr_triton: Any = None   # the module, once imported (``_on_gpu``)


def _dense(x, bits):
    """``stochastic_round`` of every value of ``x`` (fp32, contiguous)."""
    if x.numel() > _BLOCK and x.device.type == "cpu":   # block by block: in cache
        out = torch.empty(x.shape, dtype=HALF, device=x.device)
        for k, (part, into) in enumerate(zip(x.view(-1).split(_BLOCK),
                                             out.view(-1).split(_BLOCK))):
            _round_block(part, bits.range(k * _BLOCK, part.numel()), into)
        return out
    return _round_block(x, bits.range(0, x.numel()).view(x.shape))


def _round_block(x, r, out=None):
    """``stochastic_round`` of a dense fp32 block with its bits ``r``, in
    place on its temporaries (into the fp16 ``out`` when given).  The sign
    is set aside as bits and put back as bits (``copysign`` costs as much
    as four of these passes)."""
    r = r.view(x.shape)
    sign = torch.bitwise_and(x.view(torch.int32), _SIGN)
    a = x.abs()
    # 1 for subnormals, else 0 (a comparison written as floats: bool tensors are slow)
    small = torch.lt(a, _SMALLEST_NORMAL, out=torch.empty_like(a))
    bits = a.add_(small, alpha=_SMALLEST_NORMAL).view(torch.int32)
    # a NaN's bits lowered to the quiet NaN's, so that adding r cannot carry into the sign
    bits.clamp_(max=_NAN).add_(r).bitwise_and_(-_DROPPED)
    a.sub_(small, alpha=_SMALLEST_NORMAL).view(torch.int32).bitwise_or_(sign)
    if out is None:
        return a.to(HALF)
    return out.copy_(a)


def _mostly_exact(x, samples=4096):
    """Does fp16 hold at least three quarters of ``x``'s values exactly?
    Judged from about ``samples`` values evenly strided (the answer only
    picks the faster of two ways of rounding, which round alike: fp16
    values kept, the others to a neighbour)."""
    sample = x.view(-1)[::max(61, x.numel() // samples | 1)]
    exact = torch.eq(sample.to(HALF).float(), sample)
    return int(torch.count_nonzero(exact)) * 4 >= sample.numel() * 3


class Rounding:
    """Stochastic rounding of one executable: its bits come from the
    executable's random streams (``streams.Streams``), one window per
    rounded result, keyed by the micro-batch and the op."""

    def __init__(self, streams):
        self.streams = streams

    def round(self, x, stream=0, wide=False):
        """``x`` rounded from result ``stream``'s window; ``wide``: the fp16
        values returned in fp32 (``stochastic_round``)."""
        if self.streams.batched:        # a batched call: each row its own window
            return vmap_rules.apply(_RoundRows, x, self.streams.key, stream,
                                    self.streams.pool(x.device), wide)
        return stochastic_round(x, self.streams.window(stream, x.device), wide)


class _RoundRows(torch.autograd.Function):
    """``stochastic_round`` of ``x`` from result ``stream``'s window under
    ``key`` in ``pool``; under ``vmap`` (micro-batches run as one call,
    ``key`` one row per micro-batch), the rows rounded at once, each from
    its own window (``Windows``): the values the serial order gives them."""

    @staticmethod
    def forward(x, key, stream, pool, wide=False):
        return stochastic_round(x, Window(pool, Streams.window_start(key_ints(key), stream)),
                                wide)

    @staticmethod
    def setup_context(ctx, inputs, output):
        pass

    @staticmethod
    def vmap(info, in_dims, x, key, stream, pool, wide=False):
        x_dim, key_dim = in_dims[0], in_dims[1]
        rows = info.batch_size
        x = x if x_dim == 0 else x.movedim(x_dim, 0) if x_dim is not None \
            else x.expand((rows,) + x.shape)
        if _compiled() and x.device.type == "cpu":
            # the CPU's compiled path with nothing between: the rows' starts from
            # the keys' words in one compiled loop, the rows rounded in another
            # (what ``stochastic_round`` does with these ``Windows``, without the
            # ~100 us of Python a rounding otherwise costs: GPT-2's fp16 step
            # rounds about 600 results a call, most of them small); the words
            # are read once per call (its keys are one tensor, never written)
            kept = _WORDS[0]        # (one tuple, replaced whole: safe across threads)
            if kept is None or kept[0] is not key or kept[1] != (key_dim, rows):
                words = key if key_dim == 0 else key.movedim(key_dim, 0) \
                    if key_dim is not None else key.expand((rows,) + key.shape)
                kept = _WORDS[0] = (key, (key_dim, rows), sr_kernel.key_words(words.numpy()))
            starts = sr_kernel.starts_of_words(kept[2], stream)
            return sr_kernel.round_rows(x, pool, starts, x.numel() // rows, wide), 0
        keys = (key.movedim(key_dim, 0).tolist() if key_dim is not None
                else [key.tolist()] * rows)
        if _compiled():                 # one compiled loop (sr_kernel.py), the same starts
            starts = sr_kernel.window_starts(keys, stream)
        else:
            starts = [Streams.window_start((k0 & MASK32, k1 & MASK32), stream)
                      for k0, k1 in keys]
        n = x[0].numel()
        return stochastic_round(x, Windows(pool, starts, n), wide), 0


_WORDS: list = [None]     # [(the keys of a batched call, their layout, their words)]


def result_stream(stream, j):
    """The stream of result ``j`` of the op whose id is ``stream``."""
    return int(stream) * 8 + j


def widen_all(x):
    """``_widen`` over the arguments of an op (tensors, dtypes, lists and
    tuples of them, scalars), without pytree's generality."""
    if isinstance(x, torch.Tensor):
        return x.float() if x.dtype == HALF else x
    if isinstance(x, (list, tuple)):
        return type(x)(widen_all(y) for y in x)
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


def has_half(tree):
    return HALF in _dtypes_of(tree, [])


def _meta(x):
    return torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device="meta") \
        if isinstance(x, torch.Tensor) else x


def with_stochastic_rounding(kernel, out_dtypes, rounding, into=False, stream=0,
                             traced=False, wide=False):
    """``kernel`` computed in fp32, its fp16 results rounded stochastically.

    Which results are fp16: with ``traced`` (a graph traced with its
    run-time dtypes: the step), ``out_dtypes``, the traced dtypes, as
    ``getIR()`` shows them (a layer norm's fp16 mean and inverse standard
    deviation, as PopART's); otherwise read from the kernel itself (on meta
    tensors, once per operand dtypes): graphs traced dtype-blind (the
    optimizer update) meet fp16 weights only at run time; ``out_dtypes``
    serve where the kernel has no meta form.  ``into``: the op's result is
    written into its first operand (the engine's in-place plan).
    ``stream``: the op's id; result ``j`` reads stream ``result_stream(stream, j)``.
    ``wide``: fp16 operands may come in fp32 and fp16 results are returned
    in fp32 (``codegen.py``'s wide values; needs ``traced``)."""
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

    half_out = HALF in out_dtypes

    def run(*args, **kwargs):
        if traced:                  # the traced dtypes decide: no operand is read
            if not half_out:
                return exact(args, kwargs)
            want = out_dtypes
        else:
            key = tuple(_dtypes_of(kwargs, _dtypes_of(args, [])))
            if HALF not in key and not half_out:
                return exact(args, kwargs)
            want = dtypes(key, args, kwargs)
            if HALF not in want:
                return exact(args, kwargs)
        full = kernel(*widen_all(args), **{k: widen_all(v) for k, v in kwargs.items()})
        if isinstance(full, torch.Tensor):
            result = rounding.round(full, result_stream(stream, 0), wide) if want[0] == HALF \
                else full.to(want[0])
            return args[0].copy_(result) if into else result
        return type(full)(rounding.round(r, result_stream(stream, j), wide)
                          if d == HALF and isinstance(r, torch.Tensor) else r
                          for j, (r, d) in enumerate(zip(full, want)))
    return run


# the IR's protocol (ir/interfaces.py), held to by the type checker
_CHECKED: type[StochasticRounding] = Rounding
