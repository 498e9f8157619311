"""Tile mapping: where every tensor of a graph lives on the tile array.

A mapping spreads a tensor linearly, in grains, over ``n_tiles`` consecutive
tiles starting at ``start`` (wrapping round).  Element-wise and view results
take their input's mapping, so their work happens where the data already is;
other results are spread fresh, each starting where the previous one ended so
small tensors do not all pile onto tile 0.
"""
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class TileMapping:
    start: int
    n_tiles: int
    nbytes: int
    grain: int

    def _used(self):
        """Bytes on each of the ``n_tiles`` tiles in use, in order."""
        n_grains = -(-self.nbytes // self.grain)
        base, extra = divmod(n_grains, self.n_tiles)
        pos = np.arange(self.n_tiles)
        per = (base + (pos < extra)).astype(np.int64) * self.grain
        last = (extra - 1) if extra else self.n_tiles - 1
        per[last] -= n_grains * self.grain - self.nbytes
        return per

    def bytes_per_tile(self, tiles):
        """Bytes on each tile, an array of length ``tiles``; sums to ``nbytes``."""
        out = np.zeros(tiles, dtype=np.int64)
        if self.nbytes:
            out[(self.start + np.arange(self.n_tiles)) % tiles] = self._used()
        return out

    def max_bytes(self):
        return int(self._used().max()) if self.nbytes else 0


_INHERITS = ("view", "elementwise", "transcendental", "random")


def map_graph(graph, target, cursor=0, variables=None):
    """Give every tensor of ``graph`` a ``mapping``; returns the next start tile.

    ``variables`` (name -> Tensor) holds device variables mapped by earlier
    graphs: an input of the same name shares that tensor's mapping, and new
    always-live inputs are added to it.
    """
    variables = {} if variables is None else variables
    def spread(t):
        nonlocal cursor
        grain = target.grain_bytes
        n_grains = -(-t.nbytes // grain) if t.nbytes else 1
        n = max(1, min(target.tiles, n_grains))
        t.mapping = TileMapping(cursor % target.tiles, n, t.nbytes, grain)
        cursor = (cursor + n) % target.tiles

    for t in graph.inputs:
        if t.name in variables:
            t.mapping = variables[t.name].mapping
            continue
        spread(t)
        if t.role != "activation":
            variables[t.name] = t
    for t in graph.tensors:
        if t.role == "const":
            spread(t)
    for op in graph.ops:
        ins = [t for t in op.input_tensors() if t.nbytes]
        for out in op.outputs:
            if out is None:
                continue
            like = next((t for t in ins if t.nbytes == out.nbytes), None)
            if op.cost_class in _INHERITS and like is not None:
                m = like.mapping
                out.mapping = TileMapping(m.start, m.n_tiles, out.nbytes, m.grain)
            else:
                spread(out)
    return cursor
