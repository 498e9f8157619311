"""Cycles of the vertices a convolution plan runs on one tile, as Poplar's
cycle estimators give them (poplibs ``lib/poplin/PerformanceEstimation.hpp``,
``lib/popops`` reductions and casts): the AMP vertices ``ConvPartialnx1`` and
``ConvPartial1x1Out``, the vertical and horizontal MACs, the reduction of
partial sums and the cast of float partials.  Vectorised over candidate
partitions (NumPy); ``conv_plan`` calls them."""
import numpy as np

from .conv_params import cdiv

WORKERS = 6


def amp_units(c):
    """(conv units, MACs per unit per pass) of the AMP vertex for ``c``'s
    types on Mk2: fp16 with fp16 partials 16 units, with float partials 8
    (``getFp16InFp32OutConvUnitsPerTile``), fp32 16 units of 8 weights."""
    if c.in_bytes == 2:
        return (16 if c.partial_bytes == 2 else 8), 16
    return 16, 8


def _worker_entries(n, cols):
    """(entries per worker, positions per entry) when ``n`` output positions
    of rows ``cols`` wide are dealt to the six workers in row segments."""
    per_worker = np.maximum(1, cdiv(n, WORKERS))
    entries = cdiv(per_worker, np.maximum(cols, 1)) + (per_worker % np.maximum(cols, 1) > 0)
    entries = np.minimum(entries, per_worker)
    size = np.ceil(per_worker / entries)
    return entries, size


def amp_cycles(c, gt, n, cols_t, it, ot, kpos_outer, kw, coeff, units):
    """Cycles of one AMP vertex on a tile (ConvPartialnx1, or
    ConvPartial1x1Out for a 1x1 kernel): ``gt`` conv groups, ``it`` input
    and ``ot`` output channel groups, ``n`` output positions in rows of
    ``cols_t``, ``kpos_outer`` x ``kw`` kernel passes
    (PerformanceEstimation.hpp: getConvPartialnx1SupervisorCycleEstimate,
    getConvPartial1x1SupervisorCycleEstimate); ``units`` conv units."""
    half_in = c.in_bytes == 2
    core = 4 if half_in else 8
    if c.kh == 1 and c.kw == 1 and c.rows == 1:
        return _amp_1x1(c, gt, n, it, ot, units, coeff)
    entries, size = _worker_entries(n, cols_t)
    if half_in:
        f = np.where(size >= 3, 34 + (size - 3) * core, np.where(size == 2, 33, 29))
    else:
        f = np.where(size >= 3, 45 + (size - 3) * core, np.where(size == 2, 44, 33))
    worker = 17 + entries * (f - 6)
    per_pass = WORKERS * worker
    weight_load = units * 32 / coeff
    innermost = weight_load + 15 + 3
    inner = kpos_outer * (14 + kw * (12 + (innermost + per_pass)))
    zero_vw = 2
    zero = WORKERS * ot * gt * (np.ceil(np.ceil(n * units / WORKERS) / zero_vw) + 5)
    return (103 + 36 + 54 + gt * (17 * ot + 6 * (ot - 1) + 1) + 6 * (gt - 1) + 1
            + gt * (16 + it * (14 + ot * (14 + inner))) + zero)


def _amp_1x1(c, gt, n, it, ot, units, coeff):
    """ConvPartial1x1Out: a 1x1 kernel over a flattened field, one work-list
    entry of about n/6 positions per worker
    (getConvPartial1x1SupervisorCycleEstimate, the Mk2 paths)."""
    size = np.maximum(1, np.ceil(n / WORKERS))
    loads = units * 32 / coeff
    if c.in_bytes == 2:
        retention = 10

        def worker(z):
            first = 2 if z else 4
            return np.where(size >= 3, (38 if z else 40) + (size - 3) * 4,
                            np.where(size == 2, 40 + first, 31 + first)) - retention
    else:
        retention = 0

        def worker(z):
            return 46 + (2 + 8 * size) * z + (size - 3).clip(0) * 8
    inner0, inner1 = WORKERS * worker(0), WORKERS * worker(1)
    r2 = 2 if retention else 0
    return (50 + WORKERS * (retention + r2 * (it * gt - 1))
            + gt * (12 + (it - 1) * (16 + ot * (19 + 6 + loads + inner0))
                    + 11 + ot * (19 + 7 + loads + inner1)))


def vmac_cycles(c, gt, n, kh, kw):
    """ConvPartialVerticalMac (fp16, one channel per group, four groups per
    vertex): per output position and kernel row a dot product of the kernel
    row (getConvPartialVerticalMacSupervisorCycleEstimate)."""
    per_worker = np.ceil(n / WORKERS)
    dot = 5 + 2 * (kw - 1)
    worker = 6 + per_worker * kh * (15 + dot)
    zero = 4 + n
    reduction = 10 + 19 * np.ceil(n / WORKERS) / 4
    return 100 + gt * (zero + 32 + 24 + WORKERS * worker + reduction)


def hmac_cycles(c, gt, n, it_chans, ot_chans, kpos):
    """ConvPartialHorizontalMac: per output position and output channel a
    dot product over the tile's input channels
    (getConvPartialHorizontalMacSupervisorCycleEstimate)."""
    if c.in_bytes == 2:
        dot = np.where(it_chans % 4 == 0, 7 + it_chans / 4, 7 + it_chans)
    else:
        dot = np.where(it_chans % 2 == 0, 7 + it_chans / 2, 7 + it_chans)
    per_worker = np.ceil(n / WORKERS)
    worker = 16 + kpos * (16 + per_worker * (19 + 7 + ot_chans * dot))
    return 58 + gt * (23 + 15 + 10 + WORKERS * worker)


def reduce_cycles(outputs, depth, partial_bytes):
    """Reducing ``depth`` partial sums of ``outputs`` elements on a tile
    (popops ReduceAdd, multi-input: getReduceCycleEstimate)."""
    acc = 4 if partial_bytes == 4 else 8
    cpl = acc / min(acc, 2 if partial_bytes == 4 else 4) + 1
    loops = np.ceil(outputs / acc / WORKERS)
    return WORKERS * (32 + (cpl * depth + 7) * loops)


def cast_cycles(n):
    """Float partials to a half result (estimateCastCycles)."""
    n6 = np.ceil(n / WORKERS)
    return WORKERS * (np.ceil(n6 / 2) + 26)
