"""What the IR needs of the objects higher layers leave on it.

A tensor's place on the tiles and a graph's recomputation plan are made by
passes (``passes/tile_mapping.py``, ``passes/recompute.py``) and read by
the memory plan, the estimate and the engine.  A graph's random streams,
stochastic-rounding state and fp16 gradient watch are the host execution's
(``machine/streams.py``, ``machine/rounding.py``,
``machine/gradient_watch.py``), attached by the precision pass and read by
the generated code and the engine.  The IR declares them here as
protocols, so ``ir/graph.py`` names no class of a higher layer: any object
with these members will do, and the type checker checks the classes that
make them against them (each module's ``_CHECKED``)."""
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


class RandomStreams(Protocol):
    """The counter-based random streams a graph's random ops and stochastic
    rounding draw from (``machine.streams.Streams``): ``set`` puts the key of
    one micro-batch (or update) of the current call in force."""

    seed: int
    mode: str
    calls: int
    key: Any
    batched: bool

    def key_of(self, kind: str, *where: int) -> Any: ...

    def set(self, kind: str, *where: int) -> None: ...


class StochasticRounding(Protocol):
    """fp16 results rounded stochastically, from the graph's streams
    (``machine.rounding.Rounding``)."""

    streams: Any

    def round(self, x: Any, stream: int = 0, wide: bool = False) -> Any: ...


class GradientWatchState(Protocol):
    """The count of fp16 backward values lost to underflow or overflow
    (``machine.gradient_watch.GradientWatch``)."""

    counting: bool

    def reset(self) -> None: ...
