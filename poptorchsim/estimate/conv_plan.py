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

from .conv_params import Conv, cdiv  # noqa: F401 - Conv: the problem a plan is made for
from .conv_vertices import (
    amp_cycles,
    amp_units,
    cast_cycles,
    hmac_cycles,
    reduce_cycles,
    vmac_cycles,
)

# Split values tried for each partitioned dimension: enough to reach every
# tile count within a few percent (Poplar's popsolver tries every integer).
_SPLITS = np.array(sorted({1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 14, 16, 20, 23, 24, 28, 32, 40, 46,
                           48, 56, 64, 80, 92, 96, 112, 128, 160, 184, 192, 224, 256, 320, 368,
                           384, 448, 512, 640, 736, 768, 1024, 1280, 1472}))


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
    combined: int = 1      # conv groups combined into the channels
    out_flattened: bool = False    # output columns folded into the output channels

    def describe(self):
        g, f, i, o = self.splits
        text = (f"{self.vertex} on {self.tiles} tiles: groups/{g} field/{f} in/{i} out/{o}"
                + (f", {self.serial} serial" if self.serial > 1 else "")
                + (", operands swapped" if self.swapped else "")
                + (f", kernel {self.expanded} expanded" if self.expanded else "")
                + (f", {self.combined} groups combined" if self.combined > 1 else "")
                + (", output columns as channels" if self.out_flattened else "")
                + (f", {self.units} conv units" if self.units else "")
                + (f", {self.rearranged} rearranged" if self.rearranged else ""))
        return text


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
    combine = c.combine > 1
    return (wu or c.expand or operands_swap or combine or pad_in,
            wu or c.expand or c.out_flat or operands_swap or combine or pad_in or pad_out,
            (c.swap != (wu or mm)) or c.out_flat or combine or pad_out)


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
    # the grid of the four splits in lexicographic order, kept where the product
    # fits: built a split at a time, each step dropping the rows already over
    # (a product over the tiles stays over), never the whole grid (4 x 10^6 rows
    # for a batched matmul's many groups)
    grid = [useful(c.groups)]
    product = grid[0]
    for s in (useful(c.rows * c.cols), useful(cdiv(c.cin, 2)), useful(cdiv(c.cout, 4))):
        n = len(product)
        product = np.repeat(product, len(s)) * np.tile(s, n)
        keep = product <= tiles
        grid = [np.repeat(column, len(s))[keep] for column in grid] + [np.tile(s, n)[keep]]
        product = product[keep]
    return grid[0], grid[1], grid[2], grid[3]


def _evaluate(c, tiles, limit, serial, sync, coeff, memcpy):
    """The best plan of ``c`` (output channels in ``serial`` pieces) for
    each vertex type, as a list of (cycles, temp, Plan)."""
    out = []
    cout = cdiv(c.cout, serial)
    gs, fs, is_, os_ = _candidates(replace(c, cout=cout), tiles)
    # the field split cuts rows first, then columns, or columns first,
    # whichever leaves a tile the smaller input (the less halo)
    def field(rows_t, cols_t):
        in_rows_t = np.minimum(c.in_rows or c.rows, (rows_t - 1) * c.stride + c.kh)
        in_cols_t = np.minimum(c.in_cols or c.cols, (cols_t - 1) * c.stride + c.kw)
        return rows_t, cols_t, in_rows_t * in_cols_t
    rows, cols = max(c.rows, 1), max(c.cols, 1)      # an empty product still plans
    by_rows = field(cdiv(c.rows, np.minimum(fs, rows)), cdiv(c.cols, np.maximum(1, cdiv(fs, rows))))
    by_cols = field(cdiv(c.rows, np.maximum(1, cdiv(fs, cols))), cdiv(c.cols, np.minimum(fs, cols)))
    cols_first = by_cols[2] < by_rows[2]
    rows_t, cols_t, in_pos_t = (np.where(cols_first, b, a) for a, b in zip(by_rows, by_cols))
    n = rows_t * cols_t
    gt = cdiv(c.groups, gs)
    if c.pass_name == "bwd" and c.in_elems:
        # an input gradient's input is the output gradient padded by the
        # kernel less one: the padding is not stored, so a tile holds at most
        # its share of the real positions, each met by every kernel position
        real = c.in_elems // max(c.cin, 1)
        in_pos_t = np.minimum(in_pos_t, cdiv(real, fs) * c.kh * c.kw)
    used = gs * fs * is_ * os_

    vertices = []
    units, weights_per_unit = amp_units(c)
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
    # the horizontal MAC is a candidate for every convolution
    # (ConvVertexType.cpp getConvVertexHMACCandidates); a fully connected
    # pass is planned jointly with its other passes, whose channel grouping
    # must suit the AMP unit, so a matrix product takes it only when its
    # channels are too few for the AMP unit
    if c.pass_name != "matmul" or not vertices or c.cin < 16:
        vertices.append(("HMAC", 0, 1))

    for name, icpg, ocpg in vertices:
        if name == "AMP":
            cin_g = cdiv(c.cin, icpg)
            it = cdiv(cin_g, is_)
            ot = cdiv(cdiv(cout, ocpg), os_)
            cin_t, cout_t = it * icpg, ot * ocpg
            fh = max(1, weights_per_unit // icpg) if icpg < weights_per_unit else 1
            kpos_outer = cdiv(c.kh, fh)
            compute = amp_cycles(c, gt, n, cols_t, it, ot, kpos_outer, c.kw, coeff, ocpg)
        elif name == "VMAC":
            gt4 = cdiv(gt, 4)
            cin_t = cout_t = np.ones_like(gt)
            compute = vmac_cycles(c, gt4, n, c.kh, c.kw)
        else:
            cin_t = cdiv(c.cin, is_)
            cout_t = cdiv(cout, os_)
            compute = hmac_cycles(c, gt, n, cin_t, cout_t, c.kh * c.kw)
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
        red = np.where(depth > 1, reduce_cycles(reduced, depth, c.partial_bytes)
                       + cast_cycles(reduced) * (c.partial_bytes != c.out_bytes), 0.0)
        red_x = np.where(depth > 1, _exchange(reduced * (depth - 1) * c.partial_bytes), 0.0)
        cast = np.where(depth == 1, cast_cycles(outputs) * (c.partial_bytes != c.out_bytes), 0.0)
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
    fits; the least-memory plan if none does).  Kept per arguments (all
    frozen values): a model's repeated layers plan once."""
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
        if c.flat_batch:
            options += [(ok, cy, t, replace(p, out_flattened=True))
                        for ok, cy, t, p in _evaluate(c.out_flattened(), tiles, limit_bytes,
                                                      serial, sync, coeff, memcpy)]
        for f in c.combine_factors():
            options += [(ok, cy, t, replace(p, combined=f))
                        for ok, cy, t, p in _evaluate(c.combined(f), tiles, limit_bytes, serial,
                                                      sync, coeff, memcpy)]
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
    assert fallback is not None, "a layer has at least one plan"
    return fallback[3]
