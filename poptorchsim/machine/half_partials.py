"""fp16 partial sums of matmuls and convolutions (``Precision.setPartialsType(torch.half)``):
the model of ``docs/precision.md``, computed with batched fp32 kernels."""
import math

import torch

aten = torch.ops.aten
HALF = torch.float16
PARTIALS_CHUNK = 16

def _accumulate_half(pieces):
    """Sum of fp32 ``pieces`` (an iterator of chunk sums) with the running
    partial sum rounded to fp16 after each chunk (the fp16 sum added into the
    fp32 chunk, widened exactly, then copied back into the fp16 sum: the
    rounding to nearest of a cast).  The pieces are overwritten."""
    acc = None
    for p in pieces:                # in place: no fresh memory for each chunk
        acc = p.to(HALF) if acc is None else acc.copy_(p.add_(acc))
    return acc


def _chunks(k):
    return [slice(i, min(i + PARTIALS_CHUNK, k)) for i in range(0, k, PARTIALS_CHUNK)]


_PRODUCTS_LIMIT = 1 << 24       # fp32 chunk products computed by one matmul call, at most
_FEW_CHUNKS = 4


def _chunk_products(a32, b32):
    """The products of ``a32 @ b32`` chunk by chunk of the reduction, in
    order.  Beyond ``_FEW_CHUNKS`` chunks, one batched matmul computes many
    at once (the reduction cut into [..., chunks, M, 16] @ [..., chunks, 16,
    N]; a last short chunk padded with zeros, which add nothing), as many as
    keep its result under ``_PRODUCTS_LIMIT`` values."""
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


_CACHED = 1 << 18       # chunk products of a block of rows kept in cache, at most
_MIN_ROWS = 256         # rows of a block, at least


def _running_sum(a32, b32):
    """``_accumulate_half`` of ``_chunk_products(a32, b32)``; a reduction of
    a few chunks with many rows (a tied embedding's gradient, 30522 x 20 x
    64) block by block of rows: a block's chunk products (at most
    ``_CACHED`` values) are added while they are in cache, where all rows'
    products went to memory and back (1.5x slower; with more chunks or
    fewer rows, the calls a block makes cost more than the cache saves)."""
    m, cols = a32.shape[-2], b32.shape[-1]
    chunks = -(-a32.shape[-1] // PARTIALS_CHUNK)
    lead = torch.broadcast_shapes(a32.shape[:-2], b32.shape[:-2])
    rows = max(1, _CACHED // max(1, chunks * cols * math.prod(lead)))
    if chunks > _FEW_CHUNKS or rows < _MIN_ROWS or rows * 2 > m:
        return _accumulate_half(_chunk_products(a32, b32))
    out = torch.empty(lead + (m, cols), dtype=HALF)
    for r in range(0, m, rows):
        out[..., r:r + rows, :] = _accumulate_half(_chunk_products(a32[..., r:r + rows, :], b32))
    return out


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
    body = full * width
    for start in range(0, full, per):
        g = min(per, full - start)
        lo, hi = start * width, (start + g) * width
        a = a32[..., lo:hi].unflatten(-1, (g * SLICE_CHUNKS, PARTIALS_CHUNK)).movedim(-2, -3)
        b = b32[..., lo:hi, :].unflatten(-2, (g * SLICE_CHUNKS, PARTIALS_CHUNK))
        products = torch.matmul(a, b).unflatten(-3, (g, SLICE_CHUNKS))    # [..., g, c, M, N]
        yield _accumulate_half(products.unbind(-3))
    if body < k:
        yield _running_sum(a32[..., body:], b32[..., body:, :]).unsqueeze(-3)


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
        return _running_sum(a32, b32)
    return _tree_sum_half(_slice_partials(a32, b32))


def _mm(a, b):
    return half_partials_mm(a, b)


def _addmm(bias, a, b, *, beta=1, alpha=1):
    prod = half_partials_mm(a, b).float()
    if alpha != 1:
        prod = prod.mul_(alpha)
    bias = bias.float() if beta == 1 else beta * bias.float()
    return prod.add_(bias).to(HALF)


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
