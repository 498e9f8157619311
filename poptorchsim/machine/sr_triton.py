"""Stochastic rounding of a CUDA tensor in one pass, a Triton kernel.

``rounding.stochastic_round`` written as PyTorch operations launches about
ten kernels per rounded result (the sign, the magnitude, the subnormal
shift, the bits added, the bits cleared, the sign put back, the cast), and
its shortcut for results mostly of fp16 values reads a count back to the
host: on a GPU, where an fp16 program with stochastic rounding rounds every
fp16 result it makes, those launches and waits made a GPT-2 step 7x eager
fp16 (``benchmarks/gpu_check.py`` on an H200).  This is the same rounding
(``rounding._round_block``, step for step in fp32 and int32) as one kernel,
every value reading its bit of its window of the pool as the PyTorch form
does, so the values are the same bit for bit (``tests/test_precision.py``
checks it against the PyTorch form in Triton's interpreter, on the CPU).

It is used where Triton is installed (PyTorch's CUDA wheels bring it) and
the tensor is on a CUDA device.  ``POPTORCHSIM_TRITON=0`` turns it off.
"""
import os

import torch

from .streams import DROPPED, POOL

try:
    import triton
    import triton.language as tl
except ImportError:             # the PyTorch form runs (rounding.py)
    triton = None

_SMALLEST_NORMAL = 2.0 ** -14   # fp16's (rounding._SMALLEST_NORMAL)
_NAN = 0x7FC00000               # fp32's quiet NaN (rounding._NAN)
_BLOCK = 1024                   # values per program


def available(device):
    """Can the kernel round a tensor on ``device`` here?  On CUDA with
    Triton (and on the CPU in Triton's interpreter, ``TRITON_INTERPRET=1``,
    which is how the tests check it without a GPU)."""
    if triton is None or os.environ.get("POPTORCHSIM_TRITON", "1") == "0":
        return False
    return device.type == "cuda" or (device.type == "cpu" and
                                     os.environ.get("TRITON_INTERPRET", "0") == "1")


if triton is not None:
    @triton.jit
    def _round_kernel(x_ptr, pool_ptr, starts_ptr, out_ptr, total, n, start0,
                      ROWS: tl.constexpr, POOL_SIZE: tl.constexpr, KEEP: tl.constexpr,
                      SMALL: tl.constexpr, NAN: tl.constexpr, BLOCK: tl.constexpr):
        idx = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = idx < total
        if ROWS:        # stacked results (a batched call): row i reads window starts[i]
            row = idx // n
            start = tl.load(starts_ptr + row, mask=mask, other=0)
            j = idx - row * n
        else:
            start = start0
            j = idx
        r = tl.load(pool_ptr + (start + j) % POOL_SIZE, mask=mask, other=0).to(tl.int32)
        x = tl.load(x_ptr + idx, mask=mask, other=0.0)
        sign = (x.to(tl.int32, bitcast=True) >> 31) << 31
        a = tl.abs(x)
        small = a < SMALL
        bits = tl.where(small, a + SMALL, a).to(tl.int32, bitcast=True)
        bits = (tl.minimum(bits, NAN) + r) & KEEP
        v = bits.to(tl.float32, bitcast=True)
        v = tl.where(small, v - SMALL, v)
        v = (v.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True)
        tl.store(out_ptr + idx, v.to(tl.float16), mask=mask)


def round_rows(x, pool, starts, n=None):
    """``x`` (fp32) rounded stochastically to fp16, on its device: value
    ``k`` of row ``i`` (rows of ``n`` values in memory order) reads bit
    ``k`` of the window at ``starts[i]`` of ``pool`` (int16, ``POOL``
    values; ``starts`` an int64 tensor on the device).  ``starts`` one int:
    all of ``x`` is one row, from that window (no ``n``)."""
    flat = x.float().contiguous().view(-1)
    out = torch.empty(flat.numel(), dtype=torch.float16, device=flat.device)
    total = flat.numel()
    if total:
        rows = isinstance(starts, torch.Tensor)
        _round_kernel[(triton.cdiv(total, _BLOCK),)](
            flat, pool, starts if rows else flat, out, total, int(n) if rows else total,
            0 if rows else int(starts), ROWS=rows, POOL_SIZE=POOL, KEEP=-DROPPED,
            SMALL=_SMALLEST_NORMAL, NAN=_NAN, BLOCK=_BLOCK)
    return out.view(x.shape)
