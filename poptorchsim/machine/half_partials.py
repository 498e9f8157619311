"""fp16 partial sums of matmuls and convolutions (``Precision.setPartialsType(torch.half)``):
the model of ``docs/precision.md``, computed with batched fp32 kernels."""
import functools

import torch

from . import vmap_rules

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


SLICE_CHUNKS = 16       # chunks one tile accumulates in order (a slice of 256 products)
_SUMS_LIMIT = 1 << 21   # running fp16 sums of one group of slices, at most
_BLOCK = 1 << 19        # running sums of one block of the result, at most (with scratch: 5 MB)
_FEW_CHUNKS = 4         # a reduction this short runs on its operands as laid out
# On a GPU the blocks are for memory, not cache.  With the CPU's, ViT-B/16's first MLP
# product for 128 images (25,216 x 768 x 3,072) is 3 slices x 149 blocks x 16 chunks
# of a product and three element-wise passes: about 27,000 launches, where these
# blocks make 3 x 2 x 16, about 370 (a step took 50 s on an H200).
# The blocks only cut the result; each value's sums are the same.
_GPU_SUMS_LIMIT = 1 << 26
_GPU_BLOCK = 1 << 26    # 256 MB of fp32 products, twice with the scratch


def _limits(device):
    """(``_BLOCK``, ``_SUMS_LIMIT``) for tensors on ``device``."""
    if device.type == "cpu":
        return _BLOCK, _SUMS_LIMIT
    return _GPU_BLOCK, _GPU_SUMS_LIMIT


def _chunk_operands(a32, b32, slices):
    """``a32`` [B, M, K] and ``b32`` [B, K, N] (K = slices x chunks x 16)
    chunk by chunk: [chunks, B x slices, M, 16] and [chunks, B x slices,
    16, N], contiguous for a matrix product (whose kernel sums a chunk's
    products in order whatever their layout, and runs faster on contiguous
    operands), as laid out for a matrix-vector one."""
    batch, m, k = a32.shape
    n = b32.shape[-1]
    chunks = k // (slices * PARTIALS_CHUNK)
    a = a32.reshape(batch, m, slices, chunks, PARTIALS_CHUNK).permute(3, 0, 2, 1, 4)
    b = b32.reshape(batch, slices, chunks, PARTIALS_CHUNK, n).permute(2, 0, 1, 3, 4)
    a = a.reshape(chunks, batch * slices, m, PARTIALS_CHUNK)
    b = b.reshape(chunks, batch * slices, PARTIALS_CHUNK, n)
    if m == 1 or n == 1:    # a matrix-vector product sums in an order its operands' layout sets
        return a, b
    return a.contiguous(), b.contiguous()


def _spans(length, other, block):
    """Equal spans of ``length`` holding about ``block // other`` each (16 at least)."""
    size = min(length, max(16, block // other))
    size = -(-length // -(-length // size))
    return [slice(i, min(i + size, length)) for i in range(0, length, size)]


def _few_chunks(a32, b32):
    """The running fp16 sum of a reduction of at most ``_FEW_CHUNKS``
    chunks ([B, M, K] @ [B, K, N], the last chunk as long as it is): each
    chunk's products added as they come, block by block of the result's
    longer side, so that a block's products stay in cache through its
    chunks (written whole, the tied MLM decoder's 20 x 30522 logits of 16
    micro-batches went through memory a dozen times: 3x slower), on the
    operands as they are laid out (a tied embedding's gradient, 30522 x 20
    x 64, or its logits: no copy of a large operand)."""
    k, m, n = a32.shape[-1], a32.shape[-2], b32.shape[-1]

    def run(a, b):
        return _accumulate_half(
            torch.bmm(a[..., i:i + PARTIALS_CHUNK], b[..., i:i + PARTIALS_CHUNK, :])
            for i in range(0, k, PARTIALS_CHUNK))
    chunks = -(-k // PARTIALS_CHUNK)
    block = _limits(a32.device)[0]
    if chunks * m * n * a32.shape[0] <= block:
        return run(a32, b32)
    out = torch.empty(a32.shape[0], m, n, dtype=HALF, device=a32.device)
    if m > n:
        for rows in _spans(m, chunks * n * a32.shape[0], block):
            out[:, rows] = run(a32[:, rows], b32)
    else:
        for cols in _spans(n, chunks * m * a32.shape[0], block):
            out[:, :, cols] = run(a32, b32[..., cols])
    return out


def _running_sums(a32, b32, slices):
    """The running fp16 sums of ``slices`` slices of the reduction of
    ``a32 @ b32`` ([B, M, K] @ [B, K, N], K = slices x chunks x 16, padded
    with zeros, which add nothing), as [B, slices, M, N]: all slices at
    once, block by block of the result, chunk by chunk.  A chunk's products
    are summed in fp32 by one batched matmul into a scratch block; the fp16
    sums, widened exactly, are added to it and the result rounded to fp16.
    A block (``_BLOCK`` values) stays in cache through all its chunks, where
    writing every chunk's products for the whole result to memory first
    made the reduction memory-bound (2-3x slower).  The blocks cut the
    longer side of the result, so that the larger operand is read once.  A
    small product (all its chunks' products within a block) computes them
    by one batched matmul and adds them: half the calls, which cost more
    than its values (a matrix-vector product keeps to blocks, which keep
    its operands' layout)."""
    a, b = _chunk_operands(a32, b32, slices)
    chunks, sums, m, _ = a.shape
    n = b.shape[-1]
    block = _limits(a32.device)[0]
    if m > 1 and n > 1 and chunks * sums * m * n <= block:   # all fit in cache: one matmul
        products = torch.bmm(a.flatten(0, 1), b.flatten(0, 1)).unflatten(0, (chunks, sums))
        return _accumulate_half(products.unbind(0)).view(a32.shape[0], slices, m, n)
    acc = torch.empty(sums, m, n, dtype=HALF, device=a32.device)
    if m >= n:
        blocks = [(rows, slice(None)) for rows in _spans(m, sums * n, block)]
    else:
        blocks = [(slice(None), cols) for cols in _spans(n, sums * m, block)]
    first = acc[:, blocks[0][0], blocks[0][1]]
    total = torch.empty(first.numel(), device=a32.device)
    scratch = torch.empty(first.numel(), device=a32.device)
    for rows, cols in blocks:
        part = acc[:, rows, cols]
        block = total[:part.numel()].view(part.shape)
        fresh = scratch[:part.numel()].view(part.shape)
        part.copy_(torch.bmm(a[0][:, rows], b[0][..., cols], out=block))
        for j in range(1, chunks):
            torch.bmm(a[j][:, rows], b[j][..., cols], out=fresh)   # the chunk's fp32 sum
            part.copy_(block.copy_(part).add_(fresh))               # + the fp16 sum, rounded
    return acc.view(a32.shape[0], slices, m, n)


def _slice_partials(a32, b32):
    """The fp16 partial sums of the slices of the reduction (``SLICE_CHUNKS``
    chunks each; a last, shorter slice as many as it has), in order along
    the reduction, as [B, g, M, N] groups of slices (a power of two of
    them, as many as keep their sums under ``_SUMS_LIMIT`` values)."""
    width = SLICE_CHUNKS * PARTIALS_CHUNK
    batch, m, k = a32.shape
    n = b32.shape[-1]
    full = k // width
    fits = max(1, _limits(a32.device)[1] // max(1, m * n * batch))
    per = 1 << (fits.bit_length() - 1)
    for start in range(0, full, per):
        g = min(per, full - start)
        lo, hi = start * width, (start + g) * width
        yield _running_sums(a32[..., lo:hi], b32[..., lo:hi, :], g)
    rest = k - full * width
    if not rest:
        return
    tail_a, tail_b = a32[..., full * width:], b32[..., full * width:, :]
    if rest <= _FEW_CHUNKS * PARTIALS_CHUNK:
        yield _few_chunks(tail_a, tail_b).unsqueeze(1)
        return
    pad = -rest % PARTIALS_CHUNK                # the last slice, padded to whole chunks
    if pad:
        tail_a = torch.nn.functional.pad(tail_a, (0, pad))
        tail_b = torch.nn.functional.pad(tail_b, (0, 0, 0, pad))
    yield _running_sums(tail_a, tail_b, 1)


def _tree_sum_half(partials):
    """fp16 partial sums (an iterator of [..., g, M, N] groups, in order)
    added pairwise, each sum rounded to fp16: a balanced binary tree over
    the slices, built as they come (two sums of the same height are added
    at once), the few left at the end added from the last.  A group's
    aligned power-of-two blocks are added level by level, all pairs of a
    level at once: the same tree."""
    stack: list = []                      # (height, fp16 partial sum)
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
    lead = torch.broadcast_shapes(a.shape[:-2], b.shape[:-2])
    if a.shape[-1] == 0:                        # an empty reduction sums to zero
        return torch.zeros(lead + (a.shape[-2], b.shape[-1]), dtype=HALF, device=a.device)
    if b.dim() == 2 and a.dim() > 2:
        # one right operand for the whole batch (a weight; micro-batches folded into
        # the batch): the batch's rows as one matrix, each row's reduction the same
        # chunks and slices in the same order, and no copy of the operand per row
        # (the tied MLM decoder's gradient copied its 30522 x 64 weight 16 times)
        out = half_partials_mm(a.reshape(-1, a.shape[-1]), b)
        return out.view(a.shape[:-1] + out.shape[-1:])
    a32 = a.float().expand(lead + a.shape[-2:]).reshape((-1,) + a.shape[-2:])
    b32 = b.float().expand(lead + b.shape[-2:]).reshape((-1,) + b.shape[-2:])
    out = _tree_sum_half(_slice_partials(a32, b32))
    return out.view(lead + out.shape[-2:])


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


class _Batched(torch.autograd.Function):
    """``kernel(*args)``; under ``vmap`` (micro-batches run as one call),
    the kernel once on the whole batch: a matrix product's batch becomes a
    leading dimension of its operands (``fold``: each row's reduction is
    the one it has alone, the same partial sums in the same order), a
    convolution runs row by row.  The kernels write into buffers of their
    own, which vmap's batching rules cannot take."""

    @staticmethod
    def forward(kernel, fold, *args):
        return kernel(*args)

    @staticmethod
    def setup_context(ctx, inputs, output):
        pass

    @staticmethod
    def vmap(info, in_dims, kernel, fold, *args):
        dims = in_dims[2:]
        tensors = [(a, d) for a, d in zip(args, dims) if isinstance(a, torch.Tensor)]
        logical = max(a.dim() - (d is not None) for a, d in tensors)
        if fold:
            moved = []
            for a, d in zip(args, dims):
                if isinstance(a, torch.Tensor) and d is not None:
                    a = a.movedim(d, 0)
                    a = a.view((a.shape[0],) + (1,) * (logical - a.dim() + 1) + a.shape[1:])
                moved.append(a)
            return kernel(*moved), 0
        rows = [kernel(*[a.select(d, i) if isinstance(a, torch.Tensor) and d is not None
                         else a for a, d in zip(args, dims)])
                for i in range(info.batch_size)]
        return torch.stack(rows), 0


def _batchable(kernel, fold):
    def run(*args, **kwargs):
        return vmap_rules.apply(_Batched, functools.partial(kernel, **kwargs) if kwargs
                                else kernel, fold, *args)
    return run


HALF_PARTIALS = {
    aten.mm.default: _batchable(_mm, True),
    aten.bmm.default: _batchable(_mm, True),
    aten.addmm.default: _batchable(_addmm, True),
    aten.baddbmm.default: _batchable(_baddbmm, True),
    aten.convolution.default: _batchable(_convolution, False),
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
