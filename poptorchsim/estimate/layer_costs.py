"""Pooling, reductions and embedding lookups at Poplar's vertex rates.

Each function returns (compute cycles, exchange cycles, supersteps) of the
worst tile for one op, from the vertex cycle estimators Poplar's IPU Model
reports (our notes: docs/cost_model.md):

* max pooling and its gradient (popnn ``getPoolingCycles``, the
  ``MaxPooling`` and ``MaxPoolingGrad`` vertices): channels in groups of 16,
  the output rows and channel groups spread over the tiles, each worker
  running its rows kernel position by kernel position;
* reductions (popops ``reduce``): a reduction on each tile of the partials
  it holds, then stages across tiles, each reducing up to 64 sources (two
  stages from 77 sources, ``ReductionPlan``), every stage an exchange of
  float partials, a ``ReduceAdd`` compute set and a sync;
* embedding gathers and scatter-adds (popops ``multiSlice`` and
  ``multiUpdateAdd``, planned by ``embedding::plan``): the table split over
  its rows, its row width and the lookups; each tile's ``MultiSlice``
  vertices (six workers) visit every index sent to it, its one
  ``MultiUpdateAdd`` vertex (one worker) every index too; split lookups add
  a reduction of float partials.
"""
import numpy as np

from .conv_params import cdiv
from .conv_vertices import WORKERS

_SPLITS = np.array([1, 2, 4, 8, 16, 23, 32, 46, 64, 92, 128, 184, 256, 368, 512, 736, 1024, 1472])


def pool_cycles(batch, channels, in_h, in_w, out_h, out_w, kernel, item, backward, tiles):
    """Max pooling of a [batch, channels, in_h, in_w] input to [.., out_h,
    out_w] over ``kernel`` = (kh, kw) positions: (compute, exchange,
    supersteps)."""
    vw = 8 // item
    cpg = 16 if channels % 16 == 0 else vw
    groups = cdiv(channels, cpg)
    pieces = groups * batch * out_h                # (channel group, output row) pairs
    used = min(tiles, pieces)
    per_tile = cdiv(pieces, used)
    cols = cdiv(out_w, max(1, min(out_w, tiles // used)))   # rows split further by columns
    # the six workers share the tile's output positions, row segment by row segment
    per_worker = cdiv(per_tile * cols, WORKERS)
    segments = cdiv(per_worker, cols)
    n = max(min(per_worker, cols) - 1, 0)
    d = cpg // vw
    rpt = 7 + 5 * n if backward else 4 + 3 * n
    per_piece = 13 + kernel[0] * kernel[1] * (20 + 1 + d * (2 + rpt + 1) + 1 + 3) + 2
    worker = 17 + 2 + 6 + 2 + 2 + 2 + (10 if backward else 0) + 3 + 2 + 4 + 1 + \
        segments * per_piece
    compute = 7 + WORKERS * worker + 6
    stride = max(1, cdiv(in_h, out_h))
    in_rows = per_tile * stride + max(kernel[0] - stride, 0)
    in_bytes = in_rows * min(in_w, cols * stride + kernel[1]) * cpg * item
    out_bytes = per_tile * cols * cpg * item
    moved = (2 * in_bytes + out_bytes) if backward else in_bytes
    steps = 3 if backward else 1                   # gradient copy, scale mask, MaxPoolingGrad
    return compute, moved / 4, steps


def _reduce_vertex(outputs, depth, partial_bytes=4):
    """ReduceAdd with ``depth`` partials per output (multi-input)."""
    acc = 4 if partial_bytes == 4 else 8
    cpl = acc / min(acc, 2 if partial_bytes == 4 else 4) + 1
    loops = max(1, cdiv(int(outputs), acc * WORKERS))
    return WORKERS * (32 + (cpl * depth + 7) * loops)


def reduce_cycles(numel, outputs, source_tiles, item, tiles):
    """Reducing ``numel`` elements spread over ``source_tiles`` tiles to
    ``outputs``: (compute, exchange, supersteps)."""
    outputs = max(int(outputs), 1)
    factor = max(1, numel // outputs)
    local = max(1, cdiv(numel, max(source_tiles, 1)))
    local_outputs = min(outputs, local)
    on_tile = max(1, local // local_outputs)
    compute = _reduce_vertex(local_outputs, on_tile, item)
    exchange, steps = 0.0, 1
    sources = min(source_tiles, max(1, cdiv(factor, on_tile)))
    stages = [] if sources <= 1 else ([int(np.ceil(np.sqrt(sources)))] * 2
                                      if sources >= 77 else [sources])
    remaining = outputs
    for depth in stages:
        per_tile = cdiv(remaining * depth, min(tiles, remaining * depth))
        per_tile_out = max(1, per_tile // depth)
        exchange += per_tile * 4 / 4
        compute += _reduce_vertex(per_tile_out, depth)
        steps += 1
    if item != 4 and stages:
        compute += WORKERS * (cdiv(cdiv(outputs, min(tiles, outputs)), 2 * WORKERS) + 26)
    return compute, exchange, steps


def embedding_cycles(rows, width, lookups, item, update, tiles):
    """``multiSlice`` (or, ``update``, ``multiUpdateAdd``) of ``lookups`` rows
    of a [rows, width] table: (compute, exchange, supersteps), from the plan
    ``embedding::plan`` chooses by its memory objective."""
    vw = 8 // item
    grain = max(1, 4 // item)
    e, d, lk = np.meshgrid(_SPLITS, _SPLITS, _SPLITS, indexing="ij")
    e, d, lk = e.ravel(), d.ravel(), lk.ravel()
    ok = (e * d * lk <= tiles) & (e <= cdiv(width, grain)) & (d <= max(1, rows // 2)) & \
        (lk <= lookups)
    e, d, lk = e[ok], d[ok], lk[ok]
    region = np.ceil(width / e)
    per_rows = np.ceil(rows / d)
    offsets = np.ceil(lookups / lk)
    base = per_rows * region * item
    out = offsets * region * item
    idx = np.maximum(offsets, 32) * 4
    temp = np.where(lk > 1, per_rows * region * 4 * 2, 0.0) if update else out
    objective = 10 * (base + out + idx + 4 * (lk + 2 * d)) + temp
    best = int(np.argmin(objective))
    region, offs, rows_t, split = float(region[best]), float(offsets[best]), \
        float(per_rows[best]), int(lk[best])
    if not update:
        worker = 16 + cdiv(int(offs), WORKERS) * (19 + 3 * np.ceil(region / vw))
        compute = WORKERS * worker
        exchange = offs * 4 / 4 + offs * region * item / 4
        return float(compute), float(exchange), 2
    worker = 3 + (14 if item == 4 else 15) + offs * ((11 if item == 4 else 12)
                                                    + 3 * (region / grain - 1))
    compute = WORKERS * worker
    exchange = offs * 4 / 4 + offs * region * item / 4
    steps = 2
    if split > 1:
        red_c, red_x, red_s = reduce_cycles(rows_t * region * split, rows_t * region, split,
                                            4, tiles)
        compute += red_c
        exchange += red_x
        steps += red_s
    return float(compute), float(exchange), steps
