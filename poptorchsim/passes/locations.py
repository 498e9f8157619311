"""Tensor locations: which device variables live in Streaming Memory and
which are sharded across replicas (replicated tensor sharding, RTS).

``place`` reads the user's ``TensorLocationSettings`` per kind of tensor
(weights, optimizer state, gradient accumulators) and decides for every
variable, as PopART does: a tensor goes off chip when its kind asks for it
and it has at least ``minElementsForOffChip`` elements; it is sharded when
its kind asks for RTS, there is more than one replica and it has at least
``minElementsForReplicatedTensorSharding`` elements.

A sharded tensor holds ``ceil(n / R)`` elements per replica (padded so the
shards are equal).  Sharded optimizer state means the gradient is
reduce-scattered instead of all-reduced, each replica updates its shard, and
the new weights are all-gathered.  Off-chip tensors are loaded from and
stored to Streaming Memory around the graph that uses them.
"""
import logging
from dataclasses import dataclass

from ..errors import Error

# PopART's defaults for TensorLocationSettings.
MIN_ELEMENTS_OFF_CHIP = 2
MIN_ELEMENTS_RTS = 8192

KIND_OF_ROLE = {"param": "weight", "state": "optimizer", "accumulator": "accumulator"}


@dataclass(frozen=True)
class Location:
    """Where one device variable lives."""
    kind: str              # weight, optimizer, accumulator
    numel: int
    itemsize: int
    off_chip: bool = False
    shards: int = 1        # > 1: replicated tensor sharding over this many replicas
    io_tiles: bool = False  # streamed through the IO tiles (useIOTilesToLoad/Store)

    @property
    def sharded(self):
        return self.shards > 1

    @property
    def nbytes(self):
        return self.numel * self.itemsize

    @property
    def shard_numel(self):
        return -(-self.numel // self.shards)

    @property
    def replica_bytes(self):
        """Bytes each replica holds (on chip, or moves to and from Streaming Memory)."""
        return self.shard_numel * self.itemsize

    @property
    def on_chip_bytes(self):
        return 0 if self.off_chip else self.replica_bytes

    @property
    def saved_bytes(self):
        """On-chip bytes saved on each replica against the default placement."""
        return self.nbytes - self.on_chip_bytes


def _setting(settings, kind, key, default):
    return settings.get(kind, {}).get(key, default)


def wants_off_chip(settings, kind, numel):
    on_chip = _setting(settings, kind, "onChip", 1)
    return not on_chip and numel >= _setting(settings, kind, "minElementsForOffChip",
                                             MIN_ELEMENTS_OFF_CHIP)


def wants_sharding(settings, kind, numel, replicas):
    return (replicas > 1 and bool(_setting(settings, kind, "useReplicatedTensorSharding", 0))
            and numel >= _setting(settings, kind, "minElementsForReplicatedTensorSharding",
                                  MIN_ELEMENTS_RTS))


def sharded_parameters(settings, numels, replicas):
    """Names (of ``numels``: name -> elements) whose optimizer state is sharded."""
    return {n for n, k in numels.items()
            if wants_sharding(settings, "optimizer", k, replicas)}


def place(variables, settings, replicas, sharded_state=(), accumulating=True):
    """``{name: Location}`` for the device variables that are off chip or
    sharded.  ``variables``: name -> IR Tensor (with ``role``), ``sharded_state``:
    parameter names whose optimizer state was traced as shards."""
    out = {}
    for name, t in variables.items():
        kind = KIND_OF_ROLE.get(t.role)
        if kind is None or (kind == "accumulator" and not accumulating):
            continue
        itemsize = t.nbytes // max(t.numel, 1)
        param = name.split("/", 1)[1] if "/" in name else name
        # state and accumulators have their parameter's size (sharded state
        # was traced as one shard)
        numel = variables[param].numel if param in variables and t.numel > 1 else t.numel
        if kind == "optimizer" and param in sharded_state and t.numel > 1:
            shards = replicas
        elif kind == "weight" and wants_sharding(settings, kind, numel, replicas):
            shards = replicas
        else:
            shards = 1
        off = wants_off_chip(settings, kind, numel)
        if off or shards > 1:
            io = off and bool(_setting(settings, kind, "useIOTilesToLoad", 0)
                              or _setting(settings, kind, "useIOTilesToStore", 0))
            out[name] = Location(kind, numel, itemsize, off, shards, io)
    return out


def check_settings(settings, io_tiles=0):
    """PopART's checks of the TensorLocations settings before compiling:
    IO tiles asked for must be allocated; activations only move off chip
    with phased execution (a warning)."""
    for kind, setting in settings.items():
        # as in PopART, the IO tile set only concerns variables in Streaming
        # Memory: on chip (the default) the setting has nothing to move
        if setting.get("onChip", 1):
            continue
        for key in ("useIOTilesToLoad", "useIOTilesToStore"):
            if setting.get(key) and not io_tiles:
                raise Error(f"TensorLocations {kind} location asks {key}(True), but no IO "
                            "tiles are allocated: allocate them with poptorch.Options()."
                            "TensorLocations.numIOTiles(n) (32 or more), or drop "
                            f"{key}.")
    if settings.get("activation", {}).get("onChip", 1) == 0:
        logging.getLogger("poptorchsim").warning(
            "TensorLocations.setActivationLocation(useOnChipStorage(False)) only moves "
            "activations with phased execution (SerialPhasedExecution or "
            "ParallelPhasedExecution); activations stay on chip.")
