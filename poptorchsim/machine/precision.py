"""fp16 arithmetic as the IPU does it: stochastic rounding and half partials.

Both are off by default; the engine then runs every op through its ATen
kernel unchanged, so fp16 results equal PyTorch's CPU fp16 bit for bit.

* **Stochastic rounding** (``Precision.enableStochasticRounding(True)``):
  an op whose result is fp16 is computed in fp32 (its fp16 operands and any
  fp16 dtype argument widened) and the fp32 result is rounded to one of the
  two fp16 values around it, up with probability (x - lo) / (hi - lo).  The
  expected value of the rounding is x: updates below half an ulp move
  weights in expectation.  The random bits come from one ``torch.Generator``
  per compiled executable, seeded from ``Options.randomSeed`` (and the
  process id of a distributed run): the same seed gives the same results;
  replicas run one after the other and draw different bits, as the IPU's
  per-tile generators do.
* **Half partials** (``Precision.setPartialsType(torch.half)``): matmuls
  and convolutions with fp16 operands accumulate their reduction in fp16.
  Model: the reduction is cut into chunks of ``PARTIALS_CHUNK`` (16, an AMP
  unit's fp16 input width); each chunk's products are summed in fp32 (the
  AMP's adder tree; fp16 products are exact in fp32) and added to a running
  partial sum that is rounded to fp16 (to nearest) after every chunk.  Float
  partials (the default) are PyTorch's CPU fp16 matmul: fp32 accumulation,
  one rounding at the end.
"""
import math

import torch
from torch.utils import _pytree as pytree

aten = torch.ops.aten
HALF = torch.float16
PARTIALS_CHUNK = 16
_MIN_EXP = -14          # smallest normal fp16 exponent; below it the spacing is fixed
_MANTISSA = 10


_DROPPED = 1 << 13      # fp32 carries 13 mantissa bits below fp16's (normal values)
_SMALLEST_NORMAL = 2.0 ** _MIN_EXP
_SPARSE_FROM = 1 << 16  # a larger tensor mostly of zeros rounds its non-zeros only
_BLOCK = 1 << 16        # values rounded at a time


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
    return (words.view(torch.int16)[:n] & (_DROPPED - 1)).to(torch.int32).view(shape)


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


# -- half partials -----------------------------------------------------------------

def _accumulate_half(pieces):
    """Sum of fp32 ``pieces`` (an iterator of chunk sums) with the running
    partial sum rounded to fp16 after each chunk (the fp16 sum and the fp32
    chunk added in fp32: type promotion widens the fp16 one exactly)."""
    acc = None
    for p in pieces:
        acc = p.to(HALF) if acc is None else torch.add(acc, p).to(HALF)
    return acc


def _chunks(k):
    return [slice(i, min(i + PARTIALS_CHUNK, k)) for i in range(0, k, PARTIALS_CHUNK)]


_PRODUCTS_LIMIT = 1 << 24       # fp32 chunk products computed by one matmul call, at most
_FEW_CHUNKS = 4


def _chunk_products(a32, b32):
    """The products of ``a32 @ b32`` chunk by chunk of the reduction, in
    order: one batched matmul computes many chunks at once (beyond
    ``_FEW_CHUNKS``; the reduction
    cut into [..., chunks, M, 16] @ [..., chunks, 16, N]; a last short
    chunk padded with zeros, which add nothing), as many as keep its result
    under ``_PRODUCTS_LIMIT`` values."""
    k = a32.shape[-1]
    n = -(-k // PARTIALS_CHUNK)
    if n <= _FEW_CHUNKS:            # one call per chunk costs less than the reshaping
        for s in _chunks(k):
            yield torch.matmul(a32[..., s], b32[..., s, :])
        return
    pad = n * PARTIALS_CHUNK - k
    if pad:
        a32 = torch.nn.functional.pad(a32, (0, pad))
        b32 = torch.nn.functional.pad(b32, (0, 0, 0, pad))
    m, cols = a32.shape[-2], b32.shape[-1]
    lead = torch.broadcast_shapes(a32.shape[:-2], b32.shape[:-2])
    per = max(1, _PRODUCTS_LIMIT // max(1, m * cols * math.prod(lead)))
    a4 = a32.unflatten(-1, (n, PARTIALS_CHUNK)).movedim(-2, -3)       # [..., n, M, 16]
    b4 = b32.unflatten(-2, (n, PARTIALS_CHUNK))                        # [..., n, 16, N]
    for start in range(0, n, per):
        block = torch.matmul(a4[..., start:start + per, :, :], b4[..., start:start + per, :, :])
        yield from block.unbind(-3)


SLICE_CHUNKS = 16      # chunks one tile accumulates in order (a slice of 256 products)


def _slice_partials(a32, b32):
    """The fp16 partial sums of the slices of the reduction (``SLICE_CHUNKS``
    chunks each; a last, shorter slice as many as it has), in order along
    the reduction, as [..., g, M, N] groups: each slice's running fp16 sum,
    the chunk products of a group's slices computed by one batched matmul
    (groups of a power of two of slices, as many as keep the products
    under ``_PRODUCTS_LIMIT`` values)."""
    width = SLICE_CHUNKS * PARTIALS_CHUNK
    k, m, cols = a32.shape[-1], a32.shape[-2], b32.shape[-1]
    full = k // width
    lead = math.prod(torch.broadcast_shapes(a32.shape[:-2], b32.shape[:-2]))
    fits = max(1, _PRODUCTS_LIMIT // max(1, m * cols * lead * SLICE_CHUNKS))
    per = 1 << (fits.bit_length() - 1)
    for start in range(0, full, per):
        g = min(per, full - start)
        lo, hi = start * width, (start + g) * width
        a = a32[..., lo:hi].unflatten(-1, (g * SLICE_CHUNKS, PARTIALS_CHUNK)).movedim(-2, -3)
        b = b32[..., lo:hi, :].unflatten(-2, (g * SLICE_CHUNKS, PARTIALS_CHUNK))
        products = torch.matmul(a, b).unflatten(-3, (g, SLICE_CHUNKS))    # [..., g, c, M, N]
        yield _accumulate_half(products.unbind(-3))
    if full * width < k:
        tail = _accumulate_half(_chunk_products(a32[..., full * width:],
                                                b32[..., full * width:, :]))
        yield tail.unsqueeze(-3)


def _tree_sum_half(partials):
    """fp16 partial sums (an iterator of [..., g, M, N] groups, in order)
    added pairwise, each sum rounded to fp16: a balanced binary tree over
    the slices, built as they come (two sums of the same height are added
    at once), the few left at the end added from the last.  A group's
    aligned power-of-two blocks are added level by level, all pairs of a
    level at once: the same tree."""
    stack = []                      # (height, fp16 partial sum)
    for group in partials:
        start, g = 0, group.shape[-3]
        while start < g:
            size = 1 << ((g - start).bit_length() - 1)
            block = group.narrow(-3, start, size)
            while block.shape[-3] > 1:          # fp16 + fp16: the fp32 sum rounded once
                block = block[..., 0::2, :, :] + block[..., 1::2, :, :]
            p, height = block.squeeze(-3), size.bit_length() - 1
            while stack and stack[-1][0] == height:
                p = stack.pop()[1] + p
                height += 1
            stack.append((height, p))
            start += size
    acc = stack.pop()[1]
    while stack:
        acc = stack.pop()[1] + acc
    return acc


def half_partials_mm(a, b):
    """``a @ b`` (fp16, 2-D or batched) with fp16 partial sums: a reduction
    of at most ``SLICE_CHUNKS`` chunks as one running sum; a longer one cut
    into slices of that many chunks (one tile's share of a reduction spread
    over tiles), each slice's running sum in fp16, the slices' sums added
    pairwise in fp16 (the cross-tile reduction)."""
    a32, b32 = a.float(), b.float()
    chunks = -(-a.shape[-1] // PARTIALS_CHUNK)
    if chunks <= SLICE_CHUNKS:
        return _accumulate_half(_chunk_products(a32, b32))
    return _tree_sum_half(_slice_partials(a32, b32))


def _mm(a, b):
    return half_partials_mm(a, b)


def _addmm(bias, a, b, *, beta=1, alpha=1):
    prod = half_partials_mm(a, b).float()
    return (beta * bias.float() + alpha * prod).to(HALF)


def _baddbmm(bias, a, b, *, beta=1, alpha=1):
    return _addmm(bias, a, b, beta=beta, alpha=alpha)


def _convolution(x, w, bias, stride, padding, dilation, transposed, output_padding, groups):
    """A convolution with fp16 partials: the reduction over input channels
    (times the kernel window) in chunks of channels whose window products
    fill one chunk of the AMP's reduction."""
    if transposed or groups != 1:               # see docs/precision.md
        return aten.convolution.default(x, w, bias, stride, padding, dilation, transposed,
                                        output_padding, groups)
    c_in = w.shape[1]
    window = max(1, w[0, 0].numel())
    per = max(1, PARTIALS_CHUNK // window)      # channels per chunk of the reduction
    x32, w32 = x.float(), w.float()
    out = _accumulate_half(
        aten.convolution.default(x32[:, i:i + per], w32[:, i:i + per], None, stride, padding,
                                 dilation, False, output_padding, 1)
        for i in range(0, c_in, per))
    if bias is not None:
        shape = [1, -1] + [1] * (out.dim() - 2)
        out = (out.float() + bias.float().view(shape)).to(HALF)
    return out


HALF_PARTIALS = {
    aten.mm.default: _mm,
    aten.bmm.default: _mm,
    aten.addmm.default: _addmm,
    aten.baddbmm.default: _baddbmm,
    aten.convolution.default: _convolution,
}


def half_partials_kernel(target):
    """The host function computing ``target`` with fp16 partials, or None."""
    return HALF_PARTIALS.get(target)


def uses_half_partials(op):
    """Does ``op`` (an IR op) run with fp16 partials?"""
    return op.partials == "half"


def mark_partials(graph, partials):
    """In-place rewrite: marks the matmuls and convolutions of ``graph`` (and its sub-graphs)
    whose operands are fp16 with ``partials`` (``Op.partials``)."""
    for op in graph.ops:
        if op.cost_class in ("matmul", "conv") and any(
                t.dtype == HALF for t in op.input_tensors()):
            op.partials = partials
        for sub in (op.subgraphs or {}).values():
            mark_partials(sub, partials)


# fp16 kernels PyTorch's CPU build runs far slower than the same op in fp32
# (measured: pow 6.7x, tanh 2.7x, convolution_backward 96x; benchmarks/
# host_speed.py): computed in fp32 and rounded to nearest fp16, which is
# what they compute in fp16 (pow, tanh: the same values) or closer to it
# (convolution_backward: one rounding, where the fp16 kernel rounds partial
# sums)
SLOW_IN_HALF = {aten.pow.Tensor_Scalar, aten.pow.Tensor_Tensor, aten.pow.Scalar,
                aten.tanh.default, aten.convolution_backward.default}


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
        if not _has_half((args, kwargs)):
            return kernel(*args, **kwargs)
        wide = kernel(*_widen_all(args), **{k: _widen_all(v) for k, v in kwargs.items()})
        if isinstance(wide, torch.Tensor):
            return wide.to(out_dtypes[0]) if out_dtypes[0] is not None else wide
        return type(wide)(w.to(d) if isinstance(w, torch.Tensor) and d is not None else w
                          for w, d in zip(wide, out_dtypes))
    return run


def host_kernel(op, kernel, rounding=None, into=False):
    """The host function the engine calls for ``op``: ``kernel``, or its
    half-partials form, or (with stochastic ``rounding``) ``kernel``
    computed in fp32 with its fp16 results rounded stochastically.
    ``into``: ``kernel`` is the out-of-place kernel of an op the engine
    runs in place (its result is written into its first operand)."""
    if uses_half_partials(op) and half_partials_kernel(op.target) is not None:
        return half_partials_kernel(op.target)
    dtypes = [t.dtype if t is not None else None for t in op.outputs]
    if rounding is not None and rounds_stochastically(op):
        return with_stochastic_rounding(kernel, dtypes, rounding, into)
    if op.target in SLOW_IN_HALF and HALF in dtypes:
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
    schema = getattr(op.target, "_schema", None)
    packet = getattr(op.target, "overloadpacket", None)
    if schema is None or packet is None:
        return False
    name = f"{schema.name}.{schema.overload_name}" if schema.overload_name else schema.name
    if packet.__name__ not in _EXACT_IN_HALF and name not in _EXACT_OVERLOADS:
        return False
    return all(t.dtype == HALF for t in op.input_tensors() if t.dtype.is_floating_point)


def rounds_stochastically(op):
    """May the engine round ``op``'s results stochastically (when on)?  Ops
    computing a floating-point result; views, ops writing an operand in
    place (copies into buffers) and ops that only move fp16 values
    (``exact_in_half``) are left alone."""
    return (op.cost_class not in ("view", "host") and not op.inplace and not op.subgraphs
            and any(t is not None and t.dtype.is_floating_point for t in op.outputs)
            and not exact_in_half(op))


# -- fp16 gradients: what underflowed and overflowed ----------------------------------

# |x| boundaries of what rounding to nearest fp16 does to an fp32 value x:
# 0 | underflows to zero (|x| <= 2**-25, ties to even) | fp16 | overflows to
# infinity (|x| >= 65520, a tie rounding to the even infinity) | inf, NaN
_UNDERFLOW, _OVERFLOW = 2.0 ** -25, 65520.0
_BOUNDS = torch.tensor([0.0, _UNDERFLOW,
                        float(torch.nextafter(torch.tensor(_OVERFLOW), torch.tensor(0.0))),
                        torch.finfo(torch.float32).max])


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
    micro-batch (of its first replica) of a call that ``reset`` starts;
    ``skip`` leaves a call uncounted (the runtime counts about one
    micro-batch in 16: the counting costs about one fp32 step).  An op
    with half partials runs its own kernel and is compared with the fp32
    one, value by value."""

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

    def wrap(self, op, kernel, reference, rounding=None):
        """The host function of watched ``op``: ``reference`` (its plain
        kernel) on widened operands, rounded to fp16 (stochastically with
        ``rounding``), counted into this watch.  ``kernel``: what the engine
        would run otherwise; an op with half partials keeps it."""
        dtypes = [t.dtype if t is not None else None for t in op.outputs]
        stochastic = rounding is not None and rounds_stochastically(op)
        exact = uses_half_partials(op) and half_partials_kernel(op.target) is not None

        def narrow(w, dtype):
            if not isinstance(w, torch.Tensor) or dtype is None or w.dtype == dtype:
                return w
            if dtype != HALF:
                return w.to(dtype)
            return rounding.round(w) if stochastic else w.to(HALF)

        def counted(args, kwargs, out, wide):
            outs = [out] if isinstance(out, torch.Tensor) else list(out)
            wides = [wide] if isinstance(wide, torch.Tensor) else list(wide)
            for o, w in zip(outs, wides):
                if isinstance(o, torch.Tensor) and o.dtype == HALF and isinstance(w, torch.Tensor):
                    if exact or stochastic:
                        self._count_values(op.name, o, w)
                    else:
                        self._count_rounded(op.name, o, w)
            return out

        single = len(dtypes) == 1
        to_half = single and dtypes[0] == HALF and not stochastic
        # between counted micro-batches, a kernel giving the same values
        # as the rounded fp32 one runs as is (natively, or already in fp32)
        same = not stochastic and not exact and (
            op.target in ROUNDS_LIKE_FP32 or (op.target in SLOW_IN_HALF and HALF in dtypes))

        def run(*args, **kwargs):
            if (same or exact) and not self.counting:   # half partials: the reference
                return kernel(*args, **kwargs)          # only serves the counting
            wide = reference(*[a.float() if isinstance(a, torch.Tensor) and a.dtype == HALF
                               else _widen_all(a) for a in args],
                             **({k: _widen_all(v) for k, v in kwargs.items()} if kwargs else {}))
            if exact:
                out = kernel(*args, **kwargs)
            elif to_half and isinstance(wide, torch.Tensor):
                out = wide.to(HALF)
            elif single and isinstance(wide, torch.Tensor):
                out = narrow(wide, dtypes[0])
            else:
                out = type(wide)(narrow(w, d) for w, d in zip(wide, dtypes))
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

    def _count_rounded(self, name, out, wide):
        """``out`` is ``wide`` (fp32) rounded to nearest fp16: a value
        underflowed where ``out`` is zero and ``wide`` is not, so two counts
        of non-zeros and the range of ``out`` (finite: nothing overflowed)
        say it all for most results; an op that lost values adds its summed
        magnitude, one with infinities or NaNs the value-by-value classes."""
        n = wide.numel()
        if n == 0:
            return
        lo, hi = torch.aminmax(out.detach())
        nz_wide, nz_out, lo, hi = torch.stack([torch.count_nonzero(wide).double(),
                                               torch.count_nonzero(out).double(),
                                               lo.double(), hi.double()]).tolist()
        if not (math.isfinite(lo) and math.isfinite(hi)):   # infinities, NaNs, overflow
            flat = wide.detach().float().abs().reshape(-1).contiguous()
            classes = torch.bucketize(flat, _BOUNDS)
            c = torch.bincount(classes, minlength=5).tolist()
            m = torch.bincount(classes, weights=flat, minlength=5).tolist()
            self._add(name, n, c[0], c[1], c[3], c[3] + c[4], m[0] + m[1] + m[2] + m[3], m[1])
            return
        zeros, under = n - int(nz_wide), int(nz_wide - nz_out)
        size = lost = 0.0           # an op's magnitude matters only beside what it lost
        if under:
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
        stats = self.statistics if self.statistics is not None else \
            torch.zeros(2, dtype=torch.int64)
        return [stats.to(torch.int32), self.factor,
                torch.tensor(self.loss_scaling, dtype=torch.float32), self.counter]

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
            state.step_extra[0] = torch.tensor(new, dtype=torch.float32)
        state.grad_scale = state.grad_scale * (old / new)
        if getattr(state, "combined_scale", None) is not None:
            state.combined_scale = [c * (old / new) for c in state.combined_scale]
