"""Liveness and memory per tile, and the out-of-memory check.

Always-live memory holds the device variables (weights, buffers, optimizer
state, gradient accumulators, hyperparameters, constants), the input stream
buffers, control code and the vertex state of every op on the tiles it uses.
Not-always-live memory holds each graph's intermediate tensors from the op
that makes them to their last use, plus each op's temporary operand buffers;
graphs run one after another, so the program's peak is the largest graph
peak.  All of it is arrays over tiles.
"""
import logging
from dataclasses import dataclass, field

import numpy as np

from ..errors import OutOfMemoryError
from . import recompute

VERTEX_STATE_BYTES = 48        # per op, per tile it runs on


@dataclass
class MemoryReport:
    """Memory per tile of one IPU."""
    capacity: int
    always_live: np.ndarray              # bytes per tile
    not_always_live: np.ndarray          # peak bytes per tile
    by_tensor: dict = field(default_factory=dict)   # variable -> bytes per tile
    graphs: dict = field(default_factory=dict)      # name -> (usage, live, buffers)
    ipu: int = 0
    # Tensor locations: variable -> bytes per tile kept off this IPU's tiles
    # by replicated tensor sharding or Streaming Memory, and the bytes each
    # replica keeps in Streaming Memory.
    saved: dict = field(default_factory=dict)
    streaming_bytes: int = 0
    dtypes: dict = field(default_factory=dict)      # variable -> dtype name ("float16")
    # Recomputation (passes/recompute.py): PopART's RecomputationType name,
    # the recomputed ops of the training step, and the not-always-live peak
    # per tile the same program would have without recomputing them.
    recomputation: str = "None"
    recomputed_ops: list = field(default_factory=list)
    not_always_live_without_recomputation: np.ndarray = None
    # every IPU's report, on IPU 0's (runtime/compiler.py sets it)
    ipus: list = field(default_factory=list)

    @property
    def saved_per_tile(self):
        """On-chip bytes per tile that tensor locations save."""
        return (sum(self.saved.values()) if self.saved
                else np.zeros(len(self.always_live), dtype=np.int64))

    @property
    def recomputation_saved_per_tile(self):
        """Not-always-live peak bytes per tile that recomputation saves."""
        if self.not_always_live_without_recomputation is None:
            return np.zeros(len(self.not_always_live), dtype=np.int64)
        return self.not_always_live_without_recomputation - self.not_always_live

    @property
    def total(self):
        return self.always_live + self.not_always_live

    @property
    def peak_tile(self):
        return int(np.argmax(self.total))

    def largest_on(self, tile, n=5):
        """(bytes, name) of the largest tensors on ``tile`` at its fullest moment:
        the always-live variables, and the buffers live at the peak op of the
        graph that fills the tile most."""
        return [(b, name) for name, _, b in self.tensors_on(tile, n)]

    def tensors_on(self, tile, n=5):
        """``largest_on`` with each tensor's dtype: (name, dtype name, bytes)."""
        found = [(int(v[tile]), k, self.dtypes.get(k, "")) for k, v in self.by_tensor.items()
                 if v[tile]]
        worst = max(self.graphs.items(), key=lambda kv: kv[1][0][:, tile].max()
                    if len(kv[1][0]) else -1, default=None)
        if worst is not None and len(worst[1][0]):
            name, (usage, live, buffers) = worst
            k = int(np.argmax(usage[:, tile]))
            for alive, t in zip(live[k], buffers):
                nbytes = int(t.mapping.bytes_per_tile(len(self.total))[tile]) if alive else 0
                if nbytes:
                    found.append((nbytes, f"{name}/{t.name}", dtype_name(t.dtype)))
        return [(k, d, b) for b, k, d in sorted(found, key=lambda f: (-f[0], f[1]))[:n]]

    def tensors(self):
        """The always-live variables on this IPU: (name, dtype name, bytes
        over all tiles), largest first."""
        rows = [(k, self.dtypes.get(k, ""), int(v.sum())) for k, v in self.by_tensor.items()]
        return sorted(rows, key=lambda r: (-r[2], r[0]))

    def bytes_by_dtype(self):
        """Always-live variable bytes over all tiles per dtype name, largest
        first (code and vertex state are not tensors and are left out)."""
        totals = {}
        for _, dtype, nbytes in self.tensors():
            totals[dtype] = totals.get(dtype, 0) + nbytes
        return dict(sorted(totals.items(), key=lambda kv: (-kv[1], kv[0])))


def dtype_name(dtype):
    """``torch.float16`` -> "float16"."""
    return str(dtype).replace("torch.", "")


def graph_liveness_profile(graph, tiles):
    """Live (not-always-live) bytes summed over tiles after each op of ``graph``."""
    usage = _live_usage(graph, tiles, 0)[0]
    return usage.sum(axis=1).astype(np.int64) if len(usage) else np.zeros(0, np.int64)


_INPLACE = ("elementwise", "transcendental")


def _buffers(graph):
    """Which activations share a buffer: view results alias their input, and
    an element-wise result reuses an input buffer of the same size whose
    contents all die at that op (in place).  Returns ``find(tensor) -> root``."""
    parent = {}

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
    buffer_last = {}            # root id -> last use of anything stored there

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
        pieces = ([], [], [])
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
    a ``_Temps``).  Bytes are whole numbers, so the sum is exact whatever
    the order; temporary bytes may hold fractions, and are added after it,
    each element once, as ``sum + temps`` would."""
    delta = np.zeros((live.n_ops + 1, tiles))
    rows = {}
    for i, a, b in zip(*live.intervals()):
        i = int(i)
        if i not in rows:
            rows[i] = _placed(buffers[i].mapping, tiles, scale[i])
        for lo, hi, values in rows[i]:
            delta[a, lo:hi] += values
            delta[b + 1, lo:hi] -= values
    if not isinstance(temps, _Temps):
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


def _running_sum(rows):
    """``np.cumsum(rows, axis=0)`` in place, a row at a time: the same sums
    in the same order, several times faster than numpy's walk down each
    column of a C-ordered array."""
    for k in range(1, len(rows)):
        np.add(rows[k - 1], rows[k], out=rows[k])


class _Temps:
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
            _add_loaded(temps, self.loads, self.op_phase)
        return temps

    def sweep(self, delta):
        """Into ``delta`` (the sweep's changes per op): each row at its op,
        each load over its ops.  Whole numbers only (exact in any order)."""
        for k, row in self.rows.items():
            delta[k] += row
            delta[k + 1] -= row
        totals = {}
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


def _live_usage(graph, tiles, temps, ipu=0, op_phase=None, recomputing=True, find=None):
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
    ``_buffers``, where the caller has it."""
    n_ops = len(graph.ops)
    if n_ops == 0:
        return np.zeros((0, tiles)), np.zeros((0, 0), dtype=bool), []
    find = find or _buffers(graph)
    overwrite = graph.outputs_overwrite_inputs
    skip = {t.id for t in graph.outputs} if overwrite else set()
    first, last, buffers = {}, {}, {}
    for k, op in enumerate(graph.ops):
        for t in op.outputs:
            if (t is not None and t.role == "activation" and t.nbytes and t.id not in skip
                    and t.mapping.ipu == ipu):
                r = find(t)
                if r.role != "activation":      # a view of a variable: no new memory
                    continue
                buffers[r.id] = r
                first.setdefault(r.id, k)
                last[r.id] = max(last.get(r.id, k), k)
        for t in op.input_tensors():
            r = find(t)
            if r.id in buffers:
                last[r.id] = k
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
                n = index.get(find(t).id)
                if n is not None:
                    allowed[n, c] = True
    live = Liveness(n_ops, start, end, gap_lo, gap_hi, phase_column, allowed)
    order = [buffers[i] for i in ids]
    return _usage(live, order, scale, tiles, temps), live, order


def _vertex_state(op, tiles):
    """Vertex state ``op`` leaves on the tiles its results live on (none
    for a host scalar: the host computes it, ``passes/host_scalars.py``)."""
    used = np.zeros(tiles, dtype=bool)
    if op.host_scalar:
        return used * VERTEX_STATE_BYTES
    for t in op.outputs:
        if t is not None and op.cost_class != "view":
            used |= t.mapping.bytes_per_tile(tiles) > 0
    return used * VERTEX_STATE_BYTES


def _op_memory(op, cost, tiles, ipu):
    """(temporary, always-live) bytes per tile of one op: its own temporary
    buffers and vertex state, plus those of the sub-graphs it holds."""
    temp, state = cost.temp_bytes, _vertex_state(op, tiles)
    if cost.parts:
        body, nested = _subgraph_memory(op, cost, tiles, ipu)
        temp, state = temp + body, state + nested
    return temp, state


def _subgraph_memory(op, cost, tiles, ipu):
    """(temporary, always-live) bytes per tile of a loop's body or a
    conditional's branches: while it runs, the op holds the peak of a
    sub-graph's own live activations (its inputs and results belong to the
    enclosing graph); every op of every sub-graph keeps its vertex state
    (both branches of a conditional are on the tiles)."""
    temp = np.zeros(tiles)
    state = np.zeros(tiles, dtype=np.int64)
    for name, sub in op.subgraphs.items():
        parts = cost.parts[name]
        temps = np.zeros((len(sub.ops), tiles))
        for k, (inner, c) in enumerate(zip(sub.ops, parts)):
            temp_k, state_k = _op_memory(inner, c, tiles, ipu)
            temps[k] += temp_k
            state += state_k
        usage = _live_usage(sub, tiles, temps, ipu)[0]
        if len(usage):
            temp = np.maximum(temp, usage.max(axis=0))
    return temp, state


def plan_memory(program, variables, target, costs, ipu=0, locations=None, shared=None):
    """The ``MemoryReport`` of ``program`` on IPU ``ipu``.

    ``variables``: name -> Tensor of every always-live device variable;
    ``costs``: graph name -> list of ``OpCost`` (for temporary buffers);
    ``locations``: name -> ``passes.locations.Location`` of the variables
    that are sharded across replicas or live in Streaming Memory.  A sharded
    variable keeps its share on chip; an off-chip one is loaded onto its
    tiles only while a graph that reads it runs.  ``shared``: a dict the
    reports of one program's IPUs share (which activations share a buffer
    is the same on every IPU).
    """
    shared = {} if shared is None else shared
    tiles = target.tiles
    locations = locations or {}
    phased = program.phase_of_stage if program.phased else None
    var_phase = variable_phases(program) if phased else {}
    by_tensor, saved, loaded, streaming = {}, {}, {}, 0
    for name, t in variables.items():
        if t.mapping.ipu != ipu:
            continue
        per_tile = t.mapping.bytes_per_tile(tiles)
        loc = locations.get(name)
        if name in var_phase and t.role != "hyper":
            # phased execution: on the tiles only while its phase runs
            share = per_tile * (loc.replica_bytes / max(t.mapping.nbytes, 1) if loc else 1)
            loaded[name] = (share.astype(np.int64), var_phase[name])
            saved[name] = (per_tile * (loc.nbytes / max(t.mapping.nbytes, 1)) if loc
                           else per_tile).astype(np.int64)
            streaming += loc.replica_bytes if loc else t.mapping.nbytes
            continue
        if loc is None:
            by_tensor[name] = per_tile
            continue
        # per-tile bytes of the full tensor and of one replica's share
        full = per_tile * (loc.nbytes / max(t.mapping.nbytes, 1))
        share = full * (loc.replica_bytes / max(loc.nbytes, 1))
        if loc.off_chip:
            loaded[name] = (share.astype(np.int64), None)
            streaming += loc.replica_bytes
        else:
            by_tensor[name] = share.astype(np.int64)
        saved[name] = (full - (0 if loc.off_chip else share)).astype(np.int64)
    always = np.full(tiles, target.code_bytes_per_tile, dtype=np.int64)
    for v in by_tensor.values():
        always += v
    peak = np.zeros(tiles, dtype=np.int64)
    plain = peak.copy()               # the peak without recomputation
    recomputation, recomputed_ops = "None", []
    graphs = {}
    for graph in program.graphs.values():
        op_phase = (np.array([phased[op.stage] for op in graph.ops], dtype=np.int64)
                    if phased else None)
        temps = _Temps(len(graph.ops), tiles, op_phase)
        for k, (op, cost) in enumerate(zip(graph.ops, costs[graph.name])):
            if op.ipu != ipu:
                continue
            temp_k, state_k = _op_memory(op, cost, tiles, ipu)
            temps.add(k, temp_k)
            always += state_k
        # off-chip variables this graph loads
        temps.loads = [loaded[t.name] for t in graph.inputs if t.name in loaded]
        offload = phased and program.activations_off_chip
        if graph.name not in shared:
            shared[graph.name] = _buffers(graph)
        find = shared[graph.name]
        usage, live, buffers = _live_usage(graph, tiles, temps, ipu,
                                           op_phase if offload else None, find=find)
        graphs[graph.name] = (usage, live, buffers)
        rec = graph.recompute
        if rec is not None and rec.mode:
            recomputation = rec.name
            recomputed_ops += [op.name for op in graph.ops if op in rec.ops]
        if rec and len(usage):
            without = _live_usage(graph, tiles, temps, ipu, op_phase if offload else None,
                                  recomputing=False, find=find)[0]
            plain = np.maximum(plain, without.max(axis=0).astype(np.int64))
        elif len(usage):
            plain = np.maximum(plain, usage.max(axis=0).astype(np.int64))
        if len(usage):
            peak = np.maximum(peak, usage.max(axis=0).astype(np.int64))
    return MemoryReport(target.bytes_per_tile, always, peak, by_tensor, graphs, ipu,
                        saved, streaming,
                        {name: dtype_name(variables[name].dtype) for name in by_tensor},
                        recomputation=recomputation, recomputed_ops=recomputed_ops,
                        not_always_live_without_recomputation=(
                            plain if recomputed_ops else None))


def _add_loaded(temps, loads, op_phase):
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
    totals = {}
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


def variable_phases(program):
    """Phased execution: the phase of every device variable, from the first
    op that reads it (optimizer state and accumulators follow their
    parameter)."""
    phase_of_stage = program.phase_of_stage
    phases = {}
    for graph in program.graphs.values():
        for op in graph.ops:
            for t in op.input_tensors():
                if t.role in ("param", "buffer", "state", "accumulator"):
                    phases.setdefault(t.name, phase_of_stage[op.stage])
    for name in list(phases):
        param = name.split("/", 1)[-1]
        if param in phases:
            phases[name] = phases[param]
    return phases


def check_fits(report, target, allow_out_of_memory=False, n_ipus=1):
    """Raises Poplar's out-of-memory error, or with ``allow_out_of_memory``
    (Poplar's ``debug.allowOutOfMemory``) logs it and lets compilation finish
    so the report can show where memory runs out."""
    total = report.total
    if total.max() <= report.capacity:
        return
    tile = int(np.argmax(total > report.capacity))
    largest = ", ".join(f"{name} ({nbytes} B)" for nbytes, name in report.largest_on(tile))
    over = int((total > report.capacity).sum())
    where = f" (IPU {report.ipu}, tile {tile})" if n_ipus > 1 else ""
    ipu_name = (f"IPU {report.ipu} ({target.name})" if n_ipus > 1
                else f"the {target.name} IPU")
    error = OutOfMemoryError(
        f"Out of memory on tile {report.ipu * target.tiles + tile}: {int(total[tile])} "
        f"bytes used but tiles only have {report.capacity} bytes of memory{where}. {over} "
        f"of {target.tiles} tiles of {ipu_name} overflow (always-live {int(report.always_live[tile])} B, "
        f"not-always-live {int(report.not_always_live[tile])} B on tile {tile}). "
        f"Largest tensors there: {largest}. Reduce the micro-batch size or the model, "
        "or split the model over more IPUs.")
    if not allow_out_of_memory:
        raise error
    logging.getLogger("poptorchsim").warning(
        "%s (continuing: debug.allowOutOfMemory is set; the program would not load on "
        "a real IPU)", error)
