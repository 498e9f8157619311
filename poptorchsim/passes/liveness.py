"""Liveness of a graph's intermediate tensors, per tile.

Which activations share a buffer (views alias their input; element-wise
results reuse a dying input of the same size), when each buffer is live
(from the op that makes it to its last use, stashed in a pipeline, dead
between forward and backward when recomputed), and the bytes that are live
on each tile after each op: a sweep over the ops, each buffer's bytes added
where its liveness begins and taken away after it ends.  ``memory.py``
builds the memory report from it.
"""
from typing import Sequence

import numpy as np

from . import recompute


def graph_liveness_profile(graph, tiles):
    """Live (not-always-live) bytes summed over tiles after each op of ``graph``."""
    usage = live_usage(graph, tiles, 0)[0]
    return usage.sum(axis=1).astype(np.int64) if len(usage) else np.zeros(0, np.int64)


_INPLACE = ("elementwise", "transcendental")


def buffer_roots(graph):
    """Which activations share a buffer: view results alias their input, and
    an element-wise result reuses an input buffer of the same size whose
    contents all die at that op (in place).  Returns ``find(tensor) -> root``."""
    parent: dict = {}

    def find(t):
        root = t
        while root.id in parent:
            root = parent[root.id]
        while t.id in parent and parent[t.id] is not root:     # shorten the path
            parent[t.id], t = root, parent[t.id]
        return root

    last = {}
    for k, op in enumerate(graph.ops):
        for t in op.input_tensors():
            last[t.id] = k
    for t in graph.outputs:
        last[t.id] = len(graph.ops)
    buffer_last: dict = {}            # root id -> last use of anything stored there

    def join(out, r):
        parent[out.id] = r
        buffer_last[r.id] = max(buffer_last.get(r.id, -1), last.get(out.id, -1))

    outputs = {t.id for t in graph.outputs}
    for k, op in enumerate(graph.ops):
        ins = op.input_tensors()
        for out in op.outputs:
            if out is None:
                continue
            buffer_last.setdefault(out.id, last.get(out.id, -1))
            if (op.cost_class == "view" or op.inplace) and ins:
                join(out, find(ins[0]))
            elif op.cost_class in _INPLACE and out.id not in outputs:
                for t in ins:
                    r = find(t)
                    if (r.role == "activation" and r.nbytes == out.nbytes
                            and buffer_last.get(r.id, last.get(r.id, -1)) == k):
                        join(out, r)
                        break
    return find


class Liveness:
    """Which buffers are live at each op: the rows of an (ops x buffers)
    boolean matrix, kept as each buffer's interval (``start`` to ``end``,
    less the ops strictly between ``lo`` and ``hi`` where recomputation frees
    it) and, in phased execution with activations off chip, the phases that
    touch it.  ``live[k]`` is row ``k``; ``np.asarray(live)`` the matrix."""

    def __init__(self, n_ops, start, end, lo, hi, op_phase=None, allowed=None):
        self.n_ops = n_ops
        self.start, self.end, self.lo, self.hi = start, end, lo, hi
        self.op_phase = op_phase          # per op: its phase's column of ``allowed``
        self.allowed = allowed            # buffers x phases: the phases touching each

    @property
    def shape(self):
        return (self.n_ops, len(self.start))

    def __len__(self):
        return self.n_ops

    def __getitem__(self, k):
        if not isinstance(k, (int, np.integer)):
            return np.asarray(self)[k]
        if k < 0:
            k += self.n_ops
        if not 0 <= k < self.n_ops:
            raise IndexError(f"op {k} of {self.n_ops}")
        row = (self.start <= k) & (k <= self.end) & ~((k > self.lo) & (k < self.hi))
        if self.allowed is not None:
            row &= self.allowed[:, self.op_phase[k]]
        return row

    def __array__(self, dtype=None, copy=None):
        steps = np.arange(self.n_ops)[:, None]
        live = (steps >= self.start[None, :]) & (steps <= self.end[None, :])
        live &= ~((steps > self.lo[None, :]) & (steps < self.hi[None, :]))
        if self.allowed is not None:
            live &= self.allowed[:, self.op_phase].T
        return live if dtype is None else live.astype(dtype)

    def intervals(self):
        """(buffer, first op, last op) of every run of ops a buffer is live at."""
        start, end, lo, hi = self.start, self.end, self.lo, self.hi
        n = np.arange(len(start))
        # [start, end] less (lo, hi): [start, min(end, lo)] and [max(start, hi), end]
        a1, b1 = start, np.minimum(end, lo)
        a2, b2 = np.maximum(start, hi), end
        keep1, keep2 = a1 <= b1, a2 <= b2
        runs = (np.concatenate([n[keep1], n[keep2]]), np.concatenate([a1[keep1], a2[keep2]]),
                np.concatenate([b1[keep1], b2[keep2]]))
        if self.allowed is None:
            return runs
        # only at the ops of the phases that touch the buffer
        pieces: tuple[list, list, list] = ([], [], [])
        for i, a, b in zip(*runs):
            mask = self.allowed[i, self.op_phase[a:b + 1]]
            edges = np.flatnonzero(np.diff(np.concatenate([[False], mask, [False]])))
            for s, e in zip(edges[::2], edges[1::2]):
                pieces[0].append(i)
                pieces[1].append(a + s)
                pieces[2].append(a + e - 1)
        return tuple(np.asarray(p, dtype=np.int64) for p in pieces)


def _usage(live, buffers, scale, tiles, temps):
    """Bytes live on each tile at each op (ops x tiles, float64): the sum of
    the live buffers' bytes, swept over the ops (a buffer added where a run
    of its liveness begins, taken away after it ends) in time linear in the
    ops and the buffers' tiles, plus ``temps`` (an (ops x tiles) array, 0 or
    a ``Temps``).  Bytes are whole numbers, so the sum is exact whatever
    the order; temporary bytes may hold fractions, and are added after it,
    each element once, as ``sum + temps`` would."""
    delta = np.zeros((live.n_ops + 1, tiles))
    _add_buffers(live, buffers, scale, tiles, delta)
    if not isinstance(temps, Temps):
        _running_sum(delta)
        usage = delta[:live.n_ops]
        usage += temps
        return usage
    if temps.loads and temps.whole():
        temps.sweep(delta)            # whole numbers: in the sweep, still exact
        _running_sum(delta)
        return delta[:live.n_ops]
    _running_sum(delta)
    usage = delta[:live.n_ops]
    if temps.loads:
        usage += temps.dense()
    else:                             # the rows that are not zero (x + 0 is x)
        for k, row in temps.rows.items():
            usage[k] += row
    return usage


def _add_buffers(live, buffers, scale, tiles, delta):
    """Each live buffer's bytes into ``delta`` (rows of changes per op):
    added at the op where a run of its liveness begins, taken away after
    the op where it ends."""
    rows = {}
    for i, a, b in zip(*live.intervals()):
        i = int(i)
        if i not in rows:
            rows[i] = _placed(buffers[i].mapping, tiles, scale[i])
        for lo, hi, values in rows[i]:
            delta[a][lo:hi] += values
            delta[b + 1][lo:hi] -= values


class _SparseRows(dict):
    """The rows of an (n x tiles) array of zeros, held where written."""

    def __init__(self, tiles):
        super().__init__()
        self.tiles = tiles

    def __missing__(self, k):
        row = self[k] = np.zeros(self.tiles)
        return row


def _usage_peak(live, buffers, scale, tiles, temps, block=256):
    """``(usage.max(axis=0), usage.argmax(axis=0))`` of ``_usage``'s matrix,
    the same numbers, without holding it: the sweep's changes are kept only
    at the ops where buffers begin and end, and the running sum is taken
    ``block`` rows at a time.  Where temporary bytes are kept by op, only
    the ops where the sum changes or an op adds some are visited: between
    them every op's row is the running sum, so the first op of such a run
    stands for it (the first op at a tile's peak is the one found)."""
    n_ops = live.n_ops
    peak, at = np.zeros(tiles), np.zeros(tiles, dtype=np.int64)
    if n_ops == 0:
        return peak, at
    # each buffer's bytes added to the running sum where a run of its liveness
    # begins and taken away after it ends, tile slice by tile slice: whole numbers,
    # so the sums are exact and the same as _usage's rows of changes give
    changes: dict = {}                # op -> [(slices of a buffer's bytes, +1 or -1)]
    placed: dict = {}
    for i, a, b in zip(*live.intervals()):
        i = int(i)
        if i not in placed:
            placed[i] = _placed(buffers[i].mapping, tiles, scale[i])
        changes.setdefault(int(a), []).append((placed[i], 1))
        changes.setdefault(int(b) + 1, []).append((placed[i], -1))
    delta = _SparseRows(tiles)        # rows of changes of the variables loaded (temps.sweep)
    extra = temps                     # per op: what _usage adds after the running sum
    if isinstance(temps, Temps):
        if temps.loads and temps.whole():
            temps.sweep(delta)
            extra = {}
        elif temps.loads:
            extra = temps.dense()
        else:
            extra = temps.rows
    elif isinstance(temps, (int, float)):
        extra = {}
    visited: Sequence[int] = range(n_ops)
    if isinstance(extra, dict):
        visited = sorted(k for k in set(changes) | set(delta) | set(extra) if k < n_ops)
    rows = extra.get if isinstance(extra, dict) else extra.__getitem__
    current = np.zeros(tiles)
    chunk = np.empty((min(block, 2 * len(visited) + 1), tiles))
    ops: list = []                    # the op each row of chunk is
    peak[:] = -np.inf

    def reduce():
        part = chunk[:len(ops)]
        high, where = part.max(axis=0), part.argmax(axis=0)
        better = high > peak
        peak[better], at[better] = high[better], np.asarray(ops)[where[better]]
        ops.clear()

    # With no temporary bytes below zero, a row that cannot top the last row
    # taken is left out: a run of the running sum after an op (at most that
    # op's row, which adds its temporary bytes to it) and an op where buffers
    # only end.  Neither can hold a tile's peak before the row taken does.
    falls_short = isinstance(extra, dict) and all((r >= 0).all() for r in extra.values())
    taken = False                     # a row is in (or was in) chunk
    covered = 0                       # the ops before it are accounted for
    for k in visited:
        if k > covered and not (falls_short and taken):   # ops covered..k-1: the sum
            chunk[len(ops)] = current
            ops.append(covered)
            taken = True
            if len(ops) == len(chunk):
                reduce()
        rising = False
        for slices, sign in changes.get(k, ()):
            for lo, hi, values in slices:
                if sign > 0:
                    current[lo:hi] += values
                    rising = True
                else:
                    current[lo:hi] -= values
        change = delta.get(k)
        if change is not None:
            np.add(current, change, out=current)
            rising = True
        row = rows(k)
        covered = k + 1
        if row is None and not rising and falls_short and taken:
            continue
        if row is None:
            chunk[len(ops)] = current
        else:
            np.add(current, row, out=chunk[len(ops)])
        ops.append(k)
        taken = True
        if len(ops) == len(chunk):
            reduce()
    if covered < n_ops and not (falls_short and taken):
        chunk[len(ops)] = current
        ops.append(covered)
    if ops:
        reduce()
    return peak, at


def _running_sum(rows):
    """``np.cumsum(rows, axis=0)`` in place, a row at a time: the same sums
    in the same order, several times faster than numpy's walk down each
    column of a C-ordered array."""
    for k in range(1, len(rows)):
        np.add(rows[k - 1], rows[k], out=rows[k])


class Temps:
    """A graph's temporary bytes per tile on one IPU (ops x tiles), kept as
    the rows of ops that have any and the off-chip variables the graph loads
    (``loads``: (bytes per tile, phase or None), at every op or at the ops of
    that phase, ``op_phase``)."""

    def __init__(self, n_ops, tiles, op_phase=None):
        self.n_ops, self.tiles, self.op_phase = n_ops, tiles, op_phase
        self.rows, self.loads = {}, []

    def add(self, k, temp):
        """Row ``k`` plus ``temp`` (bytes per tile, or 0)."""
        if isinstance(temp, (int, float)) and temp == 0:
            return
        if k not in self.rows:
            self.rows[k] = np.zeros(self.tiles)
        self.rows[k] += temp

    def whole(self):
        """Every row holds whole numbers of bytes."""
        return all(np.array_equal(row, np.floor(row)) for row in self.rows.values())

    def dense(self):
        temps = np.zeros((self.n_ops, self.tiles))
        for k, row in self.rows.items():
            temps[k] = row
        if self.n_ops:
            add_loaded(temps, self.loads, self.op_phase)
        return temps

    def sweep(self, delta):
        """Into ``delta`` (the sweep's changes per op): each row at its op,
        each load over its ops.  Whole numbers only (exact in any order)."""
        for k, row in self.rows.items():
            delta[k] += row
            delta[k + 1] -= row
        totals: dict = {}
        for nbytes, phase in self.loads:
            totals[phase] = totals[phase] + nbytes if phase in totals else nbytes.copy()
        for phase, nbytes in totals.items():
            if phase is None:
                delta[0] += nbytes
                continue
            mask = np.asarray(self.op_phase) == phase
            edges = np.flatnonzero(np.diff(np.concatenate([[False], mask, [False]])))
            for a, b in zip(edges[::2], edges[1::2]):
                delta[a] += nbytes
                delta[b] -= nbytes


def _placed(mapping, tiles, scale):
    """``mapping``'s bytes per tile times ``scale`` as (first tile, end tile,
    values) slices (two where it wraps round the tile array)."""
    if not mapping.nbytes:
        return []
    values = mapping._used() * scale
    start, n = mapping.start % tiles, mapping.n_tiles
    if n > tiles:                      # more tiles than the array: as bytes_per_tile does
        return [(0, tiles, mapping.bytes_per_tile(tiles) * scale)]
    if start + n <= tiles:
        return [(start, start + n, values)]
    cut = tiles - start
    return [(start, tiles, values[:cut]), (0, n - cut, values[cut:])]


class Usage:
    """``live_usage``'s (ops x tiles) bytes, kept small: the peak of every
    tile and the op where it is reached are stored, the matrix itself is
    computed again (the same sweep, so the same numbers) when read with
    ``np.asarray(usage)`` or indexing.  A memory report keeps one per graph
    and IPU, and the dense matrices of a large model's graphs would hold
    gigabytes (48 GPT-2 layers: 18,000 ops x 1,472 tiles x 8 bytes per IPU)."""

    def __init__(self, sweep, peak, peak_op, shape):
        self._sweep = sweep             # _usage's arguments (picklable: the cache stores it)
        self.peak, self.peak_op, self.shape = peak, peak_op, shape

    def __len__(self):
        return self.shape[0]

    def __array__(self, dtype=None, copy=None):
        dense = _usage(*self._sweep)
        return dense if dtype is None else dense.astype(dtype)

    def __getitem__(self, k):
        return np.asarray(self)[k]

    def max(self, axis=None):
        if axis == 0:
            return self.peak.copy()
        return np.asarray(self).max(axis=axis)


def buffer_walk(graph, find):
    """Per op of ``graph``: (the buffers its results begin, as (IPU, root)
    pairs, and the buffers (root ids) it reads), for ``live_usage``, which
    walks it once per IPU.  A result begins a buffer where it is an
    activation with bytes whose root is one too (not a view of a variable),
    and not a variable's new value written in place."""
    skip = {t.id for t in graph.outputs} if graph.outputs_overwrite_inputs else set()
    walk = []
    for op in graph.ops:
        made = []
        for t in op.outputs:
            if t is not None and t.role == "activation" and t.nbytes and t.id not in skip:
                r = find(t)
                if r.role == "activation":
                    made.append((t.mapping.ipu, r))
        walk.append((made, [find(t).id for t in op.input_tensors()]))
    return walk


def live_usage(graph, tiles, temps, ipu=0, op_phase=None, recomputing=True, find=None,
               keep_small=False, walk=None):
    """(usage, live, buffers): bytes live on each tile at each op (ops x tiles),
    which buffers are live at each op (a ``Liveness``: ops x buffers), and the
    buffers.

    Each buffer lives from the op that first writes it to the last use of any
    tensor stored in it.  Outputs of a graph that overwrites its variables
    (the optimizer update, in place as on the IPU) cost nothing extra.
    ``op_phase`` (phased execution with activations sent off chip): the phase
    of every op; a buffer then occupies the tiles only in the phases that
    write or read it, and waits in Streaming Memory in between.
    ``recomputing=False``: as if the graph's recomputed ops kept their
    results (to measure what recomputation saves).  ``find``: the graph's
    ``buffer_roots``, where the caller has it, and ``walk`` its
    ``buffer_walk``.  ``keep_small``: the usage as a ``Usage`` (its per-tile
    peak kept, the matrix computed on demand)."""
    n_ops = len(graph.ops)
    if n_ops == 0:
        return np.zeros((0, tiles)), np.zeros((0, 0), dtype=bool), []
    find = find or buffer_roots(graph)
    first: dict = {}
    last: dict = {}
    buffers: dict = {}
    for k, (made, read) in enumerate(walk or buffer_walk(graph, find)):
        for t_ipu, r in made:
            if t_ipu == ipu:
                buffers[r.id] = r
                first.setdefault(r.id, k)
                last[r.id] = max(last.get(r.id, k), k)
        for i in read:
            if i in buffers:
                last[i] = k
    for t in graph.outputs:
        r = find(t)
        if r.id in buffers:
            last[r.id] = n_ops - 1
    ids = list(buffers)
    # Recomputation: a recomputed buffer is dead between its forward use and
    # the recompute point; a tensor a recomputed op reads lives until then.
    gap_lo, gap_hi, recomputed, extend = recompute.gaps(graph if recomputing else None,
                                                        find, ids)
    for i, k in extend.items():
        last[i] = max(last[i], k)
    # Pipelined training keeps ("stashes") a stage's activations that its
    # backward reads for every micro-batch in flight: 2(N-1-s)+1 of them.
    stash = graph.stash_depth
    scale = np.ones(len(ids))
    if stash:
        producer_stage = {}
        for op in graph.ops:
            for t in op.outputs:
                if t is not None and not op.backward:
                    producer_stage[find(t).id] = op.stage
        read_by_backward = {find(t).id for op in graph.ops if op.backward
                            for t in op.input_tensors()} | set(extend)
        for n, i in enumerate(ids):
            if i in producer_stage and i in read_by_backward and not recomputed[n]:
                scale[n] = stash.get(producer_stage[i], 1)
    start = np.array([first[i] for i in ids], dtype=np.int64)
    end = np.array([last[i] for i in ids], dtype=np.int64)
    phase_column = allowed = None
    if op_phase is not None and ids:
        op_phase = np.asarray(op_phase)
        phases, phase_column = np.unique(op_phase, return_inverse=True)
        column = {int(p): c for c, p in enumerate(phases)}
        allowed = np.zeros((len(ids), len(phases)), dtype=bool)
        index = {i: n for n, i in enumerate(ids)}
        for k, op in enumerate(graph.ops):
            c = column[int(op_phase[k])]
            for t in list(op.input_tensors()) + [o for o in op.outputs if o is not None]:
                row = index.get(find(t).id)
                if row is not None:
                    allowed[row, c] = True
    live = Liveness(n_ops, start, end, gap_lo, gap_hi, phase_column, allowed)
    order = [buffers[i] for i in ids]
    if keep_small:
        peak, at = _usage_peak(live, order, scale, tiles, temps)
        return (Usage((live, order, scale, tiles, temps), peak, at, (n_ops, tiles)),
                live, order)
    return _usage(live, order, scale, tiles, temps), live, order


def add_loaded(temps, loads, op_phase):
    """``temps`` (ops x tiles) plus the bytes per tile of each variable in
    ``loads`` ((bytes per tile, phase or None), in order) at every op, or at
    the ops of its phase.  Rows of whole numbers take each phase's sum at
    once (exact, so the same as adding one by one); a row holding a fraction
    (a matmul's temporary share) takes them one by one, in order."""
    if not loads:
        return
    fraction = (temps != np.floor(temps)).any(axis=1)
    whole = ~fraction
    every = not fraction.any()
    totals: dict = {}
    for nbytes, phase in loads:
        totals[phase] = totals[phase] + nbytes if phase in totals else nbytes.copy()
    for phase, nbytes in totals.items():
        if phase is None and every:
            temps += nbytes
            continue
        rows = whole if phase is None else whole & (op_phase == phase)
        temps[rows] += nbytes
    if not every:
        rows = np.flatnonzero(fraction)
        part = temps[rows]
        for nbytes, phase in loads:
            if phase is None:
                part += nbytes
            else:
                part[op_phase[rows] == phase] += nbytes
        temps[rows] = part
