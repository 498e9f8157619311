"""A Poplar-style plan for one convolution pass or matrix product.

Poplar's convolution planner (poplibs ``lib/poplin/ConvPlan.cpp``,
``ConvModel.cpp``, ``ConvVertexType.cpp``, ``PerformanceEstimation.hpp``;
our notes in docs/cost_model.md) partitions a convolution over the tiles:
conv groups, the output field, input-channel groups and output-channel
groups, each split some number of ways, the product at most the tiles.  On
each tile one vertex computes its part: an AMP vertex (``ConvPartialnx1`` /
``ConvPartial1x1Out``) where the channels fill the AMP unit's channel groups,
a vertical MAC (``ConvPartialVerticalMac``, depthwise) or horizontal MAC
(``ConvPartialHorizontalMac``, few channels per group) where they do not.
The planner costs each candidate by its worst tile: the exchange of
operands (what a tile holds but was not already given), the vertex's
cycles, the reduction of partial sums when input channels are split, and a
cast of float partials to a half result; then it keeps the fastest plan
whose temporary bytes per tile (operands, halo, partials) fit the
available-memory proportion, splitting output channels serially when none
fits.

Backward passes are planned as their own convolutions (``Conv.input_grad``,
``Conv.weight_grad``), and a matrix product ``[G][M][K] x [G][K][N]`` is the
convolution of batch M, one field position, K input and N output channels,
which the planner may also swap (``Conv.matmul``).

Vectorised over the candidate partitions (NumPy); plans are cached by the
problem, so a network's repeated layers are planned once.
"""
import functools
from dataclasses import dataclass, replace

import numpy as np


# Split values tried for each partitioned dimension: enough to reach every
# tile count within a few percent (Poplar's popsolver tries every integer).
_SPLITS = np.array(sorted({1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 14, 16, 20, 23, 24, 28, 32, 40, 46,
                           48, 56, 64, 80, 92, 96, 112, 128, 160, 184, 192, 224, 256, 320, 368,
                           384, 448, 512, 640, 736, 768, 1024, 1280, 1472}))
WORKERS = 6


def cdiv(a, b):
    return -(-a // b)


@dataclass(frozen=True)
class Conv:
    """One convolution pass as Poplar plans it (all per conv group).

    ``rows`` x ``cols``: the output field (batch x output rows, output
    columns); ``in_rows`` x ``in_cols``: the input field a tile reads for the
    whole output (padding included); ``kh`` x ``kw`` the kernel positions
    each output sums over; ``stride``."""
    groups: int
    cin: int
    cout: int
    rows: int
    cols: int
    kh: int = 1
    kw: int = 1
    stride: int = 1
    in_rows: int = 0
    in_cols: int = 0
    in_bytes: int = 2          # operand element
    partial_bytes: int = 4     # partial sums: float unless half partials
    out_bytes: int = 2
    pass_name: str = "fwd"     # fwd, bwd, wu, matmul
    swap: bool = False         # operands swapped (swapOperands)
    expand: bool = False       # kernel folded into the input channels (expandDims)
    # elements per group of the tensors a rearrangement copies, where they
    # are not what the shapes say (0): the input without its padding, the
    # weight update's real operands rather than their expanded views
    in_elems: int = 0
    w_elems: int = 0

    @property
    def macs(self):
        return self.groups * self.cin * self.cout * self.rows * self.cols * self.kh * self.kw

    @staticmethod
    def forward(groups, batch, cin, cout, h, w, kh, kw, stride, pad_h, pad_w, item, partial):
        ho = (h + 2 * pad_h - kh) // stride + 1
        wo = (w + 2 * pad_w - kw) // stride + 1
        return Conv(groups, cin, cout, batch * ho, wo, kh, kw, stride,
                    batch * (h + 2 * pad_h), w + 2 * pad_w, item, partial, item,
                    "fwd", in_elems=cin * batch * h * w).flattened()

    def flattened(self):
        """A 1x1 kernel at stride 1 sums over no neighbours: Poplar folds the
        batch and the field into one dimension (``flattenDims``)."""
        if self.kh == 1 and self.kw == 1 and self.stride == 1 and self.rows > 1:
            n = self.rows * self.cols
            return replace(self, rows=1, cols=n, in_rows=1, in_cols=n)
        return self

    def expanded(self, both):
        """Poplar's ``expandDims``: the kernel's columns (``both``: all its
        positions) folded into the input channels, the input becoming the
        output's field (an im2col); a few input channels then fill the AMP
        unit."""
        if both:
            n = self.rows * self.cols
            return replace(self, cin=self.cin * self.kh * self.kw, rows=1, cols=n, kh=1, kw=1,
                           stride=1, in_rows=1, in_cols=n, expand=True, in_elems=0)
        return replace(self, cin=self.cin * self.kw, kw=1, in_cols=self.cols,
                       in_rows=(self.rows - 1) * self.stride + self.kh, expand=True,
                       in_elems=0)

    def input_grad(self, batch, h, w):
        """The input gradient: a convolution of the output gradient (input
        dilated by the stride, padded by the kernel less one) with the
        flipped, transposed weights; the vertex's work lists skip the
        dilation's and the padding's zeros, so each input position sums over
        about kh/stride x kw/stride positions, and never more than the
        output has."""
        s = self.stride
        # positions of the kernel that only meet the padding are never
        # visited: at most the output's extent per dimension
        kh = min(cdiv(self.kh, s), max(1, self.rows // batch))
        kw = min(cdiv(self.kw, s), self.cols)
        return Conv(self.groups, self.cout, self.cin, batch * h, w, kh, kw, 1, self.rows + (self.kh - 1) * batch,
                    self.cols + self.kw - 1, self.in_bytes, self.partial_bytes, self.out_bytes,
                    "bwd", in_elems=self.cout * self.rows * self.cols).flattened()

    def weight_grad(self):
        """The weight update's gradient: batch and input channels swap, the
        output field is the kernel, the reduction runs over the batch and the
        output field.  Poplar expands the field into the input channels
        (``expandDims``), making it a matrix product per group:
        [kh.kw.cin] x [batch.ho.wo] x [cout]."""
        return Conv(self.groups, self.rows * self.cols, self.cout, 1, self.kh * self.kw * self.cin,
                    in_rows=1, in_cols=self.kh * self.kw * self.cin, in_bytes=self.in_bytes,
                    partial_bytes=self.partial_bytes, out_bytes=self.out_bytes, pass_name="wu",
                    in_elems=self.in_elems or self.cin * self.rows * self.cols,
                    w_elems=self.cout * self.rows * self.cols)

    @staticmethod
    def matmul(groups, m, k, n, item, partial):
        return Conv(groups, k, n, 1, m, in_rows=1, in_cols=m, in_bytes=item,
                    partial_bytes=partial, out_bytes=item, pass_name="matmul")

    def swapped(self):
        """A matrix product with its operands swapped (C^T = B^T A^T)."""
        return replace(self, cout=self.cols, cols=self.cout, in_cols=self.cout, swap=not self.swap,
                       in_elems=self.w_elems, w_elems=self.in_elems)


@dataclass(frozen=True)
class Plan:
    """The chosen partition and vertex, and what it costs on the worst tile."""
    vertex: str
    splits: tuple          # (conv groups, field, input channels, output channels)
    serial: int            # output channels done in this many serial pieces
    tiles: int
    compute: float         # cycles: vertices (conv, reduction, cast)
    exchange: float        # cycles: operands, partials
    supersteps: int        # compute sets, each one sync
    temp_bytes: float      # per used tile, as the planner bounds it (all operands touched)
    live_bytes: float = 0.0    # per used tile, allocated: received operands and partials
    swapped: bool = False
    expanded: str = ""     # the kernel's "columns" or "all" positions folded into channels
    rearranged: str = ""   # the operands it copies into its layout ("input, weights")
    units: int = 0         # AMP conv units the vertex runs

    def describe(self):
        g, f, i, o = self.splits
        text = (f"{self.vertex} on {self.tiles} tiles: groups/{g} field/{f} in/{i} out/{o}"
                + (f", {self.serial} serial" if self.serial > 1 else "")
                + (", operands swapped" if self.swapped else "")
                + (f", kernel {self.expanded} expanded" if self.expanded else "")
                + (f", {self.units} conv units" if self.units else "")
                + (f", {self.rearranged} rearranged" if self.rearranged else ""))
        return text


def _amp_units(c):
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


def _amp(c, gt, n, cols_t, it, ot, kpos_outer, kw, coeff, units):
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


def _vmac(c, gt, n, kh, kw):
    """ConvPartialVerticalMac (fp16, one channel per group, four groups per
    vertex): per output position and kernel row a dot product of the kernel
    row (getConvPartialVerticalMacSupervisorCycleEstimate)."""
    per_worker = np.ceil(n / WORKERS)
    dot = 5 + 2 * (kw - 1)
    worker = 6 + per_worker * kh * (15 + dot)
    zero = 4 + n
    reduction = 10 + 19 * np.ceil(n / WORKERS) / 4
    return 100 + gt * (zero + 32 + 24 + WORKERS * worker + reduction)


def _hmac(c, gt, n, it_chans, ot_chans, kpos):
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


def _reduce_cycles(outputs, depth, partial_bytes):
    """Reducing ``depth`` partial sums of ``outputs`` elements on a tile
    (popops ReduceAdd, multi-input: getReduceCycleEstimate)."""
    acc = 4 if partial_bytes == 4 else 8
    cpl = acc / min(acc, 2 if partial_bytes == 4 else 4) + 1
    loops = np.ceil(outputs / acc / WORKERS)
    return WORKERS * (32 + (cpl * depth + 7) * loops)


def _cast_cycles(n):
    """Float partials to a half result (estimateCastCycles)."""
    n6 = np.ceil(n / WORKERS)
    return WORKERS * (np.ceil(n6 / 2) + 26)


def _exchange(nbytes, rate=4.0):
    return np.ceil(nbytes / rate)


def _rearranged(c, name, icpg, ocpg, cout):
    """(input, weights, output): which of them a plan rearranges
    (addTransformCycleEstimate's flags): a weight-update pass, an expanded
    kernel, operands swapped other than the pass expects (matrix products
    and weight updates expect them swapped), or channels padded to the
    vertex's groups."""
    wu, mm = c.pass_name == "wu", c.pass_name == "matmul"
    amp = name == "AMP"
    pad_in = amp and c.cin % icpg != 0
    pad_out = amp and cout % ocpg != 0
    operands_swap = c.swap != mm
    return (wu or c.expand or operands_swap or pad_in,
            wu or c.expand or operands_swap or pad_in or pad_out,
            (c.swap != (wu or mm)) or pad_out)


def _transforms(c, name, icpg, ocpg, weights_per_unit, cout, used, memcpy=8):
    """(copy cycles, exchange cycles, compute sets, temporary bytes) per
    tile of rearranging the operands and the output into the layouts the
    plan's vertices need (``_rearranged``; addTransformCycleEstimate), and of
    regrouping an AMP output whose channel groups are not the next layer's.
    Memory is copied at ``memcpy`` bytes a cycle (``getMemcpyBytesPerCycle``)
    less a 5/4 factor (5/3 where the channels do not fill a 64-bit word),
    exchanged at 4 bytes a cycle."""
    re_in, re_w, re_out = _rearranged(c, name, icpg, ocpg, cout)
    regroup_out = name == "AMP" and c.pass_name != "matmul" and ocpg != weights_per_unit
    grain = 2 if c.in_bytes == 4 else 4
    copy = exchange = steps = 0.0
    temp = 0.0
    if re_in or re_w:
        elems = c.groups * (re_in * (c.in_elems or c.cin * (c.in_rows or c.rows)
                                      * (c.in_cols or c.cols))
                            + re_w * (c.w_elems or c.cin * cout * c.kh * c.kw))
        nbytes = np.ceil(elems / used) * c.in_bytes
        factor = 4 if (c.cin * cout) % grain == 0 else 3
        copy = copy + np.ceil(nbytes * 5 / (min(memcpy, c.in_bytes) * factor))
        exchange = exchange + np.ceil(nbytes / 4)
        steps = steps + 1
        temp = np.maximum(temp, 2 * nbytes)
    if re_out or regroup_out:
        nbytes = np.ceil(c.groups * cout * c.rows * c.cols / used) * c.out_bytes
        factor = 4 if cout % grain == 0 else 3
        rate = min(memcpy, c.out_bytes) if re_out else min(memcpy, ocpg * c.out_bytes)
        copy = copy + np.ceil(nbytes * 5 / (rate * factor))
        if re_out:
            exchange = exchange + np.ceil(nbytes / 4)
            steps = steps + 1
        temp = np.maximum(temp, 2 * nbytes)
    return copy, exchange, steps, temp


def _candidates(c, tiles):
    """Every (conv-group, field, input-channel, output-channel) split whose
    product fits the tiles, as four integer arrays."""
    def useful(limit):
        s = _SPLITS[_SPLITS <= max(1, limit)]
        return s
    g = useful(c.groups)
    f = useful(c.rows * c.cols)
    i = useful(cdiv(c.cin, 2))
    o = useful(cdiv(c.cout, 4))
    grid = np.stack(np.meshgrid(g, f, i, o, indexing="ij"), -1).reshape(-1, 4)
    grid = grid[np.prod(grid, axis=1) <= tiles]
    return grid[:, 0], grid[:, 1], grid[:, 2], grid[:, 3]


def _evaluate(c, tiles, limit, serial, sync, coeff, memcpy):
    """The best plan of ``c`` (output channels in ``serial`` pieces) for
    each vertex type, as a list of (cycles, temp, Plan)."""
    out = []
    cout = cdiv(c.cout, serial)
    gs, fs, is_, os_ = _candidates(replace(c, cout=cout), tiles)
    # the field split cuts rows first, then columns
    rows_t = cdiv(c.rows, np.minimum(fs, c.rows))
    cols_t = cdiv(c.cols, np.maximum(1, cdiv(fs, c.rows)))
    n = rows_t * cols_t
    gt = cdiv(c.groups, gs)
    in_rows_t = np.minimum(c.in_rows or c.rows, (rows_t - 1) * c.stride + c.kh)
    in_cols_t = np.minimum(c.in_cols or c.cols, (cols_t - 1) * c.stride + c.kw)
    in_pos_t = in_rows_t * in_cols_t
    used = gs * fs * is_ * os_

    vertices = []
    units, weights_per_unit = _amp_units(c)
    depthwise = c.cin == 1 and c.cout == 1 and c.groups > 1
    for icpg in ((16, 8, 4) if c.in_bytes == 2 else (8, 4, 2)):
        if icpg > weights_per_unit or (icpg < weights_per_unit and c.cin >= weights_per_unit):
            continue
        vertices.append(("AMP", icpg, units))
        if units == 16 and c.in_bytes == 2:
            # Mk2 also offers half the conv units (a candidate of
            # getConvVertexTypeCandidates when there are 16)
            vertices.append(("AMP", icpg, 8))
    if depthwise and c.in_bytes == 2:
        vertices.append(("VMAC", 1, 1))
    if not vertices or c.cin < 16 or depthwise:
        vertices.append(("HMAC", 0, 1))

    for name, icpg, ocpg in vertices:
        if name == "AMP":
            cin_g = cdiv(c.cin, icpg)
            it = cdiv(cin_g, is_)
            ot = cdiv(cdiv(cout, ocpg), os_)
            cin_t, cout_t = it * icpg, ot * ocpg
            fh = max(1, weights_per_unit // icpg) if icpg < weights_per_unit else 1
            kpos_outer = cdiv(c.kh, fh)
            compute = _amp(c, gt, n, cols_t, it, ot, kpos_outer, c.kw, coeff, ocpg)
        elif name == "VMAC":
            gt4 = cdiv(gt, 4)
            cin_t = cout_t = np.ones_like(gt)
            compute = _vmac(c, gt4, n, c.kh, c.kw)
        else:
            cin_t = cdiv(c.cin, is_)
            cout_t = cdiv(cout, os_)
            compute = _hmac(c, gt, n, cin_t, cout_t, c.kh * c.kw)
        inputs = gt * cin_t * in_pos_t
        weights = gt * cin_t * cout_t * c.kh * c.kw
        outputs = gt * cout_t * n
        moved_in = inputs - np.floor(inputs / os_)
        moved_w = weights - np.floor(weights / fs)
        in_rate = np.where(os_ % 2 == 0, 8.0, 4.0)
        # the planner charges the partials' first exchange whatever the
        # depth (addExchangeCycleEstimates' reduceFirstStage); with no
        # reduction they stay on their tile, and the run does not pay it
        out_x = _exchange(outputs * c.partial_bytes)
        exchange = (_exchange(moved_in * c.in_bytes, 1) / in_rate
                    + _exchange(moved_w * c.in_bytes) + out_x)
        steps = np.ones_like(gt) * 2          # exchange + conv compute set
        depth = is_
        reduced = np.ceil(outputs / depth)
        red = np.where(depth > 1, _reduce_cycles(reduced, depth, c.partial_bytes)
                       + _cast_cycles(reduced) * (c.partial_bytes != c.out_bytes), 0.0)
        red_x = np.where(depth > 1, _exchange(reduced * (depth - 1) * c.partial_bytes), 0.0)
        cast = np.where(depth == 1, _cast_cycles(outputs) * (c.partial_bytes != c.out_bytes), 0.0)
        steps = steps + (depth > 1) + ((depth == 1) & (c.partial_bytes != c.out_bytes))
        temp = (c.in_bytes * (inputs + weights) + c.partial_bytes * outputs
                + np.where(depth > 1, reduced * c.partial_bytes, 0.0))
        live = (c.in_bytes * (moved_in + moved_w) + c.partial_bytes * outputs
                + np.where(depth > 1, reduced * c.partial_bytes, 0.0))
        t_copy, t_exchange, t_steps, t_temp = _transforms(c, name, icpg, ocpg, weights_per_unit,
                                                          cout, used, memcpy)
        rearranged = ", ".join(what for what, flag in zip(
            ("input", "weights", "output"), _rearranged(c, name, icpg, ocpg, cout)) if flag)
        compute = compute + t_copy
        exchange = exchange + t_exchange
        steps = steps + t_steps
        temp = np.maximum(temp, t_temp)
        cycles = serial * (compute + red + cast + exchange + red_x + steps * sync)
        fits = temp <= limit
        # the fastest plan that fits, else the one needing the least memory
        for mask, keys in ((fits, (temp, cycles)), (np.ones_like(fits), (cycles, temp))):
            if mask.any():
                idx = np.flatnonzero(mask)
                best = idx[np.lexsort((keys[0][idx], keys[1][idx]))[0]]
                out.append((bool(mask[best] and fits[best]), float(cycles[best]), float(temp[best]),
                            Plan(name, (int(gs[best]), int(fs[best]), int(is_[best]),
                                        int(os_[best])), serial, int(used[best]),
                                 float(serial * (compute[best] + red[best] + cast[best])),
                                 float(serial * (exchange[best] + red_x[best]
                                                 - (depth[best] == 1) * out_x[best])),
                                 int(serial * steps[best]), float(temp[best]),
                                 float(live[best]), rearranged=rearranged,
                                 units=ocpg if name == "AMP" else 0)))
                break
    return out


@functools.lru_cache(maxsize=4096)
def plan(c, tiles, limit_bytes, sync, coeff=8, memcpy=8):
    """The fastest plan of ``c`` on ``tiles`` tiles (each compute set paying
    ``sync`` cycles, AMP weights loaded at ``coeff`` bytes per cycle,
    operands rearranged at ``memcpy`` bytes per cycle) whose temporary bytes
    per tile fit ``limit_bytes`` (output channels split serially until one
    fits; the least-memory plan if none does)."""
    fallback = None
    for serial in (1, 2, 4, 8, 16, 32):
        if serial > 1 and cdiv(c.cout, serial) < 4:
            break
        options = _evaluate(c, tiles, limit_bytes, serial, sync, coeff, memcpy)
        if c.kh * c.kw > 1:
            for both in (False, True):
                e = c.expanded(both)
                options += [(f, cy, t, replace(p, expanded="all" if both else "columns"))
                            for f, cy, t, p in _evaluate(e, tiles, limit_bytes, serial, sync,
                                                         coeff, memcpy)]
        if c.pass_name in ("matmul", "wu"):
            options += [(f, cy, t, replace(p, swapped=True))
                        for f, cy, t, p in _evaluate(c.swapped(), tiles, limit_bytes, serial,
                                                     sync, coeff, memcpy)]
        fitting = [o for o in options if o[0]]
        if fitting:
            return min(fitting, key=lambda o: (o[1], o[2]))[3]
        least = min(options, key=lambda o: (o[2], o[1]))
        if fallback is None or least[2] < fallback[2]:
            fallback = least
    return fallback[3]
