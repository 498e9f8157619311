"""What the IR needs of the objects passes of higher layers leave on it.

A tensor's place on the tiles and a graph's recomputation plan are made by
passes (``passes/tile_mapping.py``, ``passes/recompute.py``) and read by
the memory plan, the estimate and the engine.  The IR declares them here as
protocols, so ``ir/graph.py`` names no class of a higher layer: any object
with these members will do, and the type checker checks the ones the
passes make against them."""
from typing import Any, Protocol


class TileMap(Protocol):
    """A tensor spread linearly, in grains, over ``n_tiles`` consecutive
    tiles from ``start`` on IPU ``ipu`` (``passes.tile_mapping.TileMapping``)."""

    @property
    def start(self) -> int: ...

    @property
    def n_tiles(self) -> int: ...

    @property
    def nbytes(self) -> int: ...

    @property
    def grain(self) -> int: ...

    @property
    def ipu(self) -> int: ...

    def bytes_per_tile(self, tiles: int) -> Any:
        """Bytes on each of ``tiles`` tiles (a NumPy array)."""
        ...

    def max_bytes(self) -> int: ...


class RecomputePlan(Protocol):
    """Which ops of a graph run again before its backward pass, and where
    (``passes.recompute.Recomputation``)."""

    mode: int
    ops: frozenset
    segment: dict
    checkpoints: int

    @property
    def name(self) -> str: ...

    def __bool__(self) -> bool: ...
