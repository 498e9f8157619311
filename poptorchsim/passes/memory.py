"""Liveness and memory per tile, and the out-of-memory check.

Always-live memory holds the device variables (weights, buffers, optimizer
state, gradient accumulators, hyperparameters, constants), the input stream
buffers, the runtime code, and the control code and vertex state of every
op on the tiles it uses (identical ops share theirs: ``Code``).
Not-always-live memory holds each graph's intermediate tensors from the op
that makes them to their last use, plus each op's temporary operand buffers;
graphs run one after another, so the program's peak is the largest graph
peak.  All of it is arrays over tiles.
"""
import logging
from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from ..errors import OutOfMemoryError
from .liveness import Temps, buffer_roots, buffer_walk, live_usage

VERTEX_STATE_BYTES = 48        # per op, per tile it runs on
# How far the fullest tile's bytes may be from Poplar's: the median error of
# the max-tile memory over Poplar's own IPU Model figures for its convolution
# layers (12%) and fully connected layers (11%), from ``python -m poptorchsim
# validate`` (poptorchsim/validation).  A program whose fullest tile is within
# this share of the tile's memory fits by the estimate but may not on the IPU.
MAX_TILE_UNCERTAINTY = 0.12


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
    not_always_live_without_recomputation: Optional[np.ndarray] = None
    # every IPU's report, on IPU 0's (passes/compile.py sets it)
    ipus: list = field(default_factory=list)
    # The parts of ``always_live`` besides the variables (``Code``): vertex
    # state (``VERTEX_STATE_BYTES`` per distinct op on each tile it runs on),
    # the target's runtime code on every tile and the control code per tile;
    # variable -> role ("param", "input", ...).
    vertex_state: Optional[np.ndarray] = None
    code_bytes_per_tile: int = 0
    control_code: Optional[np.ndarray] = None
    # Tiles where an AMP vertex (a convolution's or matmul's plan) runs:
    # their data sits in the interleaved region, above the target's
    # ``interleaved_start`` (``including_gaps``).
    interleaved: Optional[np.ndarray] = None
    interleaved_start: int = 0
    roles: dict = field(default_factory=dict)

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
    def including_gaps(self):
        """Bytes per tile as PopVision's "including gaps" counts them: on a
        tile where an AMP vertex runs, the data above the interleaved
        region's start (the non-interleaved region below holds code and
        vertex state; the rest of it is a gap)."""
        return self.with_gaps(self.total)

    def with_gaps(self, total):
        """``total`` (bytes per tile) counted as ``including_gaps`` counts
        this report's own."""
        if self.interleaved is None or not self.interleaved_start:
            return total
        gapped = np.maximum(total, self.interleaved_start + total - self.code)
        return np.where(self.interleaved, gapped, total)

    @property
    def code(self):
        """Bytes per tile of code and vertex state: the runtime, the control
        code and the vertex state."""
        return (self.code_bytes_per_tile
                + (0 if self.vertex_state is None else self.vertex_state)
                + (0 if self.control_code is None else self.control_code))

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
        worst = max(self.graphs.items(), key=lambda kv: kv[1][0].max(axis=0)[tile]
                    if len(kv[1][0]) else -1, default=None)
        if worst is not None and len(worst[1][0]):
            name, (usage, live, buffers) = worst
            k = int(usage.peak_op[tile]) if hasattr(usage, "peak_op") \
                else int(np.argmax(usage[:, tile]))
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
        totals: dict = {}
        for _, dtype, nbytes in self.tensors():
            totals[dtype] = totals.get(dtype, 0) + nbytes
        return dict(sorted(totals.items(), key=lambda kv: (-kv[1], kv[0])))


def dtype_name(dtype):
    """``torch.float16`` -> "float16"."""
    return str(dtype).replace("torch.", "")


def _used_tiles(op, tiles):
    """The tiles ``op`` runs on: those its results live on (none for a host
    scalar: the host computes it, ``passes/host_scalars.py``)."""
    used = np.zeros(tiles, dtype=bool)
    if op.host_scalar:
        return used
    for t in op.outputs:
        if t is not None and op.cost_class != "view":
            used |= t.mapping.bytes_per_tile(tiles) > 0
    return used


class Code:
    """Code and vertex state per tile, as ops are added: each op leaves
    ``VERTEX_STATE_BYTES`` of vertex state and ``per_step`` bytes of control
    code per compute set (its syncs, ``cost.sync / sync``) on the tiles it
    runs on.  Identical ops share both, as PopART's outlining makes repeated
    layers one Poplar function and a loop's body is held once: an op whose
    kind, shapes and tiles were seen before adds nothing."""

    def __init__(self, tiles, per_step, sync):
        self.control = np.zeros(tiles, dtype=np.int64)
        self.state = np.zeros(tiles, dtype=np.int64)
        self.tiles, self.per_step, self.sync = tiles, per_step, sync
        self.seen = set()
        self.occupied: dict = {}        # mapping -> (its tiles, their bits), None if none
        self.names: dict = {}           # target -> its name

    def _tiles(self, op):
        """(the tiles ``op`` runs on, their bits), None where none: a result's
        mapping's are kept (results share their input's mapping, so the same
        few are asked for again and again)."""
        outs = op.outputs
        if len(outs) == 1 and outs[0] is not None and not op.host_scalar \
                and op.cost_class != "view":
            mapping = outs[0].mapping
            if mapping not in self.occupied:
                used = mapping.bytes_per_tile(self.tiles) > 0
                self.occupied[mapping] = (used, np.packbits(used).tobytes()) \
                    if used.any() else None
            return self.occupied[mapping]
        used = _used_tiles(op, self.tiles)
        return (used, np.packbits(used).tobytes()) if used.any() else None

    def add(self, op, cost, control=True):
        """``control=False``: vertex state only (a loop or conditional, whose
        sub-graphs' ops hold the control code)."""
        tiles = self._tiles(op)
        if tiles is None:
            return
        used, bits = tiles
        name = self.names.get(op.target)
        if name is None:
            name = self.names[op.target] = str(op.target)
        key = (name, op.cost_class,
               tuple([(t.shape, t.dtype) for t in op.input_tensors()]),
               tuple([(t.shape, t.dtype) for t in op.outputs if t is not None]),
               bits)
        if key in self.seen:
            return
        self.seen.add(key)
        self.state += used * VERTEX_STATE_BYTES
        if control and self.per_step and self.sync and cost.sync:
            self.control += used * int(round(cost.sync / self.sync)) * self.per_step


def _op_memory(op, cost, tiles, ipu, code):
    """Temporary bytes per tile of one op: its own temporary buffers, plus
    the peak of the sub-graphs it holds; its vertex state and control code
    go to ``code`` (a loop's body once, not per iteration)."""
    temp = cost.temp_bytes
    if cost.parts:
        temp = temp + _subgraph_memory(op, cost, tiles, ipu, code)
    code.add(op, cost, control=not cost.parts)
    return temp


def _subgraph_memory(op, cost, tiles, ipu, code):
    """Temporary bytes per tile of a loop's body or a conditional's
    branches: while it runs, the op holds the peak of a sub-graph's own live
    activations (its inputs and results belong to the enclosing graph);
    every op of every sub-graph keeps its vertex state and code (both
    branches of a conditional are on the tiles)."""
    temp = np.zeros(tiles)
    for name, sub in op.subgraphs.items():
        parts = cost.parts[name]
        temps = np.zeros((len(sub.ops), tiles))
        for k, (inner, c) in enumerate(zip(sub.ops, parts)):
            temps[k] += _op_memory(inner, c, tiles, ipu, code)
        usage = live_usage(sub, tiles, temps, ipu)[0]
        if len(usage):
            temp = np.maximum(temp, usage.max(axis=0))
    return temp


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
    code = Code(tiles, target.control_code_bytes_per_step, target.sync_cycles)
    for v in by_tensor.values():
        always += v
    interleaved = np.zeros(tiles, dtype=bool)
    peak = np.zeros(tiles, dtype=np.int64)
    plain = peak.copy()               # the peak without recomputation
    recomputation, recomputed_ops = "None", []
    graphs = {}
    for graph in program.graphs.values():
        op_phase = (np.array([phased[op.stage] for op in graph.ops], dtype=np.int64)
                    if phased else None)
        temps = Temps(len(graph.ops), tiles, op_phase)
        for k, (op, cost) in enumerate(zip(graph.ops, costs[graph.name])):
            if op.ipu != ipu:
                continue
            temps.add(k, _op_memory(op, cost, tiles, ipu, code))
            if cost.plan:
                interleaved |= np.asarray(cost.temp_bytes) > 0
        # off-chip variables this graph loads
        temps.loads = [loaded[t.name] for t in graph.inputs if t.name in loaded]
        offload = phased and program.activations_off_chip
        if graph.name not in shared:
            roots = buffer_roots(graph)
            shared[graph.name] = (roots, buffer_walk(graph, roots))
        find, walk = shared[graph.name]
        usage, live, buffers = live_usage(graph, tiles, temps, ipu,
                                           op_phase if offload else None, find=find,
                                           keep_small=True, walk=walk)
        graphs[graph.name] = (usage, live, buffers)
        rec = graph.recompute
        if rec is not None and rec.mode:
            recomputation = rec.name
            recomputed_ops += [op.name for op in graph.ops if op in rec.ops]
        if rec and len(usage):
            without = live_usage(graph, tiles, temps, ipu, op_phase if offload else None,
                                  recomputing=False, find=find, keep_small=True,
                                  walk=walk)[0]
            plain = np.maximum(plain, without.max(axis=0).astype(np.int64))
        elif len(usage):
            plain = np.maximum(plain, usage.max(axis=0).astype(np.int64))
        if len(usage):
            peak = np.maximum(peak, usage.max(axis=0).astype(np.int64))
    vertex_state = code.state
    always += code.state + code.control
    return MemoryReport(target.bytes_per_tile, always, peak, by_tensor, graphs, ipu,
                        saved, streaming,
                        {name: dtype_name(variables[name].dtype) for name in by_tensor},
                        recomputation=recomputation, recomputed_ops=recomputed_ops,
                        not_always_live_without_recomputation=(
                            plain if recomputed_ops else None),
                        vertex_state=vertex_state,
                        code_bytes_per_tile=target.code_bytes_per_tile,
                        control_code=code.control,
                        interleaved=interleaved, interleaved_start=target.interleaved_start,
                        roles={name: variables[name].role for name in by_tensor})


def variable_phases(program):
    """Phased execution: the phase of every device variable, from the first
    op that reads it (optimizer state and accumulators follow their
    parameter)."""
    phase_of_stage = program.phase_of_stage
    phases: dict = {}
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


def _warn_if_tight(report, target, n_ipus):
    """A warning where the fullest tile fits, but by less than the
    estimate's own uncertainty of it (``MAX_TILE_UNCERTAINTY``)."""
    total = report.total
    peak = float(total.max()) if total.size else 0.0
    if peak <= (1 - MAX_TILE_UNCERTAINTY) * report.capacity:
        return
    tile = int(np.argmax(total))
    where = f"IPU {report.ipu}, tile {tile}" if n_ipus > 1 else f"tile {tile}"
    logging.getLogger("poptorchsim").warning(
        "The fullest tile (%s) holds %d of its %d bytes (%.1f%%): the program fits by the "
        "estimate, but within its uncertainty of the fullest tile (its max-tile memory is a "
        "median %d%% off Poplar's own figures per layer), so it may not fit on %s. Leave "
        "more headroom before relying on it: a lower availableMemoryProportion, a smaller "
        "micro-batch, or more IPUs.", where, peak, report.capacity,
        100 * peak / report.capacity, round(100 * MAX_TILE_UNCERTAINTY), target.name)


def check_fits(report, target, allow_out_of_memory=False, n_ipus=1, warn_tight=True):
    """Raises Poplar's out-of-memory error, or with ``allow_out_of_memory``
    (Poplar's ``debug.allowOutOfMemory``) logs it and lets compilation finish
    so the report can show where memory runs out."""
    total = report.total
    if total.max() <= report.capacity:
        if warn_tight:          # the planner compares configurations without it
            _warn_if_tight(report, target, n_ipus)
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
        f"of {target.tiles} tiles of {ipu_name} overflow "
        f"(always-live {int(report.always_live[tile])} B, "
        f"not-always-live {int(report.not_always_live[tile])} B on tile {tile}). "
        f"Largest tensors there: {largest}. Reduce the micro-batch size or the model, "
        "or split the model over more IPUs.")
    if not allow_out_of_memory:
        raise error
    logging.getLogger("poptorchsim").warning(
        "%s (continuing: debug.allowOutOfMemory is set; the program would not load on "
        "a real IPU)", error)
