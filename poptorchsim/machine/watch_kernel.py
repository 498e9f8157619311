"""The gradient watch's counts of one fp16 result in one pass, compiled by numba.

``GradientWatch._count_rounded`` needs, for a result rounded to fp16
(``out``) from its fp32 value (``wide``): how many values each holds that
are not zero, whether ``out`` holds an infinity or a NaN, and, where values
underflowed, the summed magnitude of ``wide`` and of the values ``out``
lost.  As PyTorch operations that is four to six passes and a read back:
about 300 us for a GPT-2 MLP gradient on a 2-core machine, 50 us here.  A
counted call of GPT-2's fp16 step counts about 300 results; the PyTorch
form cost it about two fp32 micro-batches.  Here it is one loop over both, compiled once
(``cache=True``).  The counts are the same integers; the magnitudes are
fp32 sums as PyTorch's, in another order (they differ in the last bits;
they only weigh what was lost against the whole:
``GradientWatch._lost_share``).

Used where numba is installed and not switched off (``sr_kernel.available``),
for contiguous CPU tensors of an fp32 ``wide`` and an fp16 ``out`` (or its
values held in fp32: ``codegen.py``'s wide values); otherwise the PyTorch
form runs (``gradient_watch.py``)."""
import numpy as np
import torch

from . import sr_kernel

try:
    from numba import njit
except ImportError:
    njit = None


_I = np.int32


def _counts(wide_bits, wide, out_bits, magnitude, infinity, res):
    """``out_bits``: the fp16 result's bits (int16; ``magnitude`` 0x7FFF,
    ``infinity`` 0x7C00) or the bits of its values held in fp32 (int32;
    0x7FFFFFFF, 0x7F800000).  Every intermediate is cast back to int32, as
    in ``sr_kernel._segment``: numba computes int32 arithmetic in int64, and
    the mixed widths keep the loop from vectorizing (3x slower)."""
    nz_wide = nz_out = bad = _I(0)
    size = lost = np.float32(0.0)
    for k in range(wide.size):
        b = _I(_I(out_bits[k]) & magnitude)
        zero = _I(b == _I(0))
        nz_wide = _I(nz_wide + _I(_I(wide_bits[k] & _I(0x7FFFFFFF)) != _I(0)))
        nz_out = _I(nz_out + _I(1) - zero)
        bad = _I(bad + _I(b >= infinity))
        a = abs(wide[k])
        size += a
        lost += a * np.float32(zero)
    res[0], res[1], res[2], res[3], res[4] = nz_wide, nz_out, bad, size, lost


if njit is not None:
    # reassociation only: the sums vectorize (as PyTorch's own fp32 sums do), and
    # NaNs and infinities keep their meaning
    _compiled = njit(cache=True, nogil=True, boundscheck=False, fastmath={"reassoc"})(_counts)


def counts(out, wide):
    """(values ``wide`` holds that are not zero, those ``out`` holds, does
    ``out`` hold an infinity or a NaN, summed |wide|, summed |wide| where
    ``out`` is zero), or None where the compiled form does not apply."""
    if njit is None or not sr_kernel.available() or wide.dtype != torch.float32 \
            or out.dtype not in (torch.float16, torch.float32) \
            or wide.device.type != "cpu" or out.device.type != "cpu" \
            or out.shape != wide.shape or wide.numel() >= 2 ** 31:
        return None
    w = wide.detach().contiguous().numpy().reshape(-1)
    o = out.detach().contiguous().numpy().reshape(-1)
    res = np.zeros(5, dtype=np.float64)
    if out.dtype == torch.float16:
        _compiled(w.view(np.int32), w, o.view(np.int16), _I(0x7FFF), _I(0x7C00), res)
    else:
        _compiled(w.view(np.int32), w, o.view(np.int32), _I(0x7FFFFFFF), _I(0x7F800000), res)
    return int(res[0]), int(res[1]), bool(res[2]), float(res[3]), float(res[4])
