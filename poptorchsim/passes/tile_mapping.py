"""Tile mapping: where every tensor of a graph lives on the tile array.

A mapping spreads a tensor linearly, in grains, over ``n_tiles`` consecutive
tiles starting at ``start`` (wrapping round).  Element-wise and view results
take their input's mapping, so their work happens where the data already is;
other results are spread fresh, each starting where the previous one ended so
small tensors do not all pile onto tile 0.  A host scalar's result that no
device op reads (``passes/host_scalars.py``) is not on the tiles: it maps
no bytes.
"""
from dataclasses import dataclass

import numpy as np

from ..ir.graph import subgraph_inputs
from ..ir.interfaces import TileMap
from .host_scalars import device_reads


@dataclass(frozen=True)
class TileMapping:
    start: int
    n_tiles: int
    nbytes: int
    grain: int
    ipu: int = 0

    def _used(self):
        """Bytes on each of the ``n_tiles`` tiles in use, in order (read-only;
        computed once: the memory passes read it for every op)."""
        used = self.__dict__.get("_used_bytes")
        if used is None:
            n_grains = -(-self.nbytes // self.grain)
            base, extra = divmod(n_grains, self.n_tiles)
            pos = np.arange(self.n_tiles)
            used = (base + (pos < extra)).astype(np.int64) * self.grain
            last = (extra - 1) if extra else self.n_tiles - 1
            used[last] -= n_grains * self.grain - self.nbytes
            used.setflags(write=False)
            self.__dict__["_used_bytes"] = used
        return used

    def bytes_per_tile(self, tiles):
        """Bytes on each tile, an array of length ``tiles`` (read-only); sums to
        ``nbytes``."""
        kept = self.__dict__.setdefault("_per_tile", {})
        out = kept.get(tiles)
        if out is None:
            out = np.zeros(tiles, dtype=np.int64)
            if self.nbytes:
                out[(self.start + np.arange(self.n_tiles)) % tiles] = self._used()
            out.setflags(write=False)
            kept[tiles] = out
        return out

    def max_bytes(self):
        return int(self._used().max()) if self.nbytes else 0


# the type checker holds TileMapping to what the IR declares of it
_CHECKED: type[TileMap] = TileMapping

_INHERITS = ("view", "elementwise", "transcendental", "random")


def map_graph(graph, target, cursor=None, variables=None, input_ipu=None, full_bytes=None,
              bound=None):
    """In-place rewrite: gives every tensor of ``graph`` a ``mapping``
    (``Tensor.mapping``) on the tile array of the IPU that computes it;
    returns the next start tile of each IPU.

    ``variables`` (name -> Tensor) holds device variables mapped by earlier
    graphs: an input of the same name shares that tensor's mapping, and new
    always-live inputs are added to it.  ``input_ipu`` names the IPU of each
    input (default 0); op results live on ``op.ipu``.  ``full_bytes`` (name ->
    bytes) maps an input that the graph reads as one replica's shard at the
    size of the whole variable it is cut from.  ``bound``: for a loop body or
    a branch, the enclosing graph's tensors its inputs stand for (they share
    their mappings); its ops run where the loop or conditional does.
    """
    variables = {} if variables is None else variables
    cursor = {} if cursor is None else cursor
    input_ipu = input_ipu or {}

    full_bytes = full_bytes or {}

    def spread(t, ipu):
        grain = target.grain_bytes
        nbytes = full_bytes.get(t.name, t.nbytes)
        n_grains = -(-nbytes // grain) if nbytes else 1
        n = max(1, min(target.tiles, n_grains))
        start = cursor.get(ipu, 0)
        t.mapping = TileMapping(start % target.tiles, n, nbytes, grain, ipu)
        cursor[ipu] = (start + n) % target.tiles

    for t, outer in zip(graph.inputs, bound or ()):
        t.mapping = outer.mapping
    for t in graph.inputs[len(bound or ()):]:
        if t.name in variables:
            t.mapping = variables[t.name].mapping
            continue
        spread(t, input_ipu.get(t.name, 0))
        if t.role != "activation":
            variables[t.name] = t
    const_ipu: dict = {}
    for op in graph.ops:
        for t in op.input_tensors():
            if t.role == "const":
                const_ipu.setdefault(t.id, op.ipu)
    for t in graph.tensors:
        if t.role == "const":      # constants stay on the tiles: always live
            spread(t, const_ipu.get(t.id, 0))
            variables[f"{graph.name}/{t.name}"] = t
    on_tiles = device_reads(graph)
    for op in graph.ops:
        ins = [t for t in op.input_tensors() if t.nbytes]
        for out in op.outputs:
            if out is None:
                continue
            if op.host_scalar and out.id not in on_tiles:      # stays on the host
                out.mapping = TileMapping(cursor.get(op.ipu, 0) % target.tiles, 1, 0,
                                          target.grain_bytes, op.ipu)
                continue
            like = next((t for t in ins if t.nbytes == out.nbytes
                         and t.mapping.ipu == op.ipu), None)
            if op.cost_class in _INHERITS and like is not None:
                m = like.mapping
                out.mapping = TileMapping(m.start, m.n_tiles, out.nbytes, m.grain, m.ipu)
            else:
                spread(out, op.ipu)
        for name, sub in (op.subgraphs or {}).items():
            for inner in sub.ops:
                inner.ipu, inner.stage = op.ipu, op.stage
            map_graph(sub, target, cursor, variables, None, None, subgraph_inputs(op, name))
    return cursor
