"""Tile mapping: where every tensor of a graph lives on the tile array.

A mapping spreads a tensor linearly, in grains, over ``n_tiles`` consecutive
tiles starting at ``start`` (wrapping round).  Element-wise and view results
take their input's mapping, so their work happens where the data already is;
other results are spread fresh, each starting where the previous one ended so
small tensors do not all pile onto tile 0.  A host scalar's result that no
device op reads (``passes/host_scalars.py``) is not on the tiles: it maps
no bytes.
"""
import functools
from dataclasses import dataclass

import numpy as np

from ..ir.graph import subgraph_inputs
from ..ir.interfaces import TileMap
from .host_scalars import device_reads


@functools.lru_cache(maxsize=4096)
def _spread(n_tiles, nbytes, grain):
    """``nbytes`` in grains of ``grain`` bytes over ``n_tiles`` tiles, the
    first tiles taking one grain more, the last grain partly filled
    (read-only)."""
    n_grains = -(-nbytes // grain)
    base, extra = divmod(n_grains, n_tiles)
    used = (base + (np.arange(n_tiles) < extra)).astype(np.int64) * grain
    used[(extra - 1) if extra else n_tiles - 1] -= n_grains * grain - nbytes
    used.setflags(write=False)
    return used


@functools.lru_cache(maxsize=4096)
def _most(n_tiles, nbytes, grain):
    """The bytes on the fullest tile of ``_spread``."""
    return int(_spread(n_tiles, nbytes, grain).max()) if nbytes else 0


@dataclass(frozen=True)
class TileMapping:
    start: int
    n_tiles: int
    nbytes: int
    grain: int
    ipu: int = 0

    def _used(self):
        """Bytes on each of the ``n_tiles`` tiles in use, in order (read-only;
        the same array for every mapping of the same size and grain: the
        memory passes read it for every op, and a model's repeated layers
        have many such)."""
        return _spread(self.n_tiles, self.nbytes, self.grain)

    def bytes_per_tile(self, tiles):
        """Bytes on each tile, an array of length ``tiles`` (read-only); sums to
        ``nbytes``."""
        kept = self.__dict__.setdefault("_per_tile", {})
        out = kept.get(tiles)
        if out is None:
            out = np.zeros(tiles, dtype=np.int64)
            start, n = self.start % tiles, self.n_tiles
            if self.nbytes and n <= tiles:      # as slices (np.roll costs 7x more)
                head = min(n, tiles - start)
                out[start:start + head] = self._used()[:head]
                out[:n - head] = self._used()[head:]        # wrapping round the last tile
            elif self.nbytes:
                out[(start + np.arange(n)) % tiles] = self._used()
            out.setflags(write=False)
            kept[tiles] = out
        return out

    def max_bytes(self):
        return _most(self.n_tiles, self.nbytes, self.grain)


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
