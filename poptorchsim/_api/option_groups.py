"""The parts ``poptorchsim.Options`` is built from.

``_OptionsDict`` holds option values, read as attributes and frozen on
demand; the sub-option groups (``Options.Training``, ``.Distributed``,
``.TensorLocations`` with its ``TensorLocationSettings``, ``.Precision``,
``.Jit``, ``._Popart``) are ``_OptionsDict``s with PopTorch's setters.
``options.py`` builds ``Options`` from them and re-exports them
(``poptorch.options.TensorLocationSettings``); nothing here imports it.
"""
import copy
import enum
import os

from .. import enums
from ..runtime.settings import popart_options

FROZEN_MESSAGE = "Can't modify frozen Options"


class _OptionsDict:
    """Values held in ``_values`` and read as attributes, frozen on demand."""

    def __init__(self, **defaults):
        object.__setattr__(self, "_values", dict(defaults))
        object.__setattr__(self, "_frozen", False)

    # -- freezing -----------------------------------------------------------
    def _children(self):
        return [v for v in vars(self).values() if isinstance(v, _OptionsDict)]

    def _freeze(self):
        object.__setattr__(self, "_frozen", True)
        for child in self._children():
            child._freeze()

    def _unfreeze(self):
        object.__setattr__(self, "_frozen", False)
        for child in self._children():
            child._unfreeze()

    def _check_not_frozen(self):
        if self._frozen:
            raise AttributeError(
                f"{FROZEN_MESSAGE}: trainingModel, inferenceModel and DataLoader freeze "
                "the Options they are given. Set options before wrapping, or change a "
                "copy (options.clone() is unfrozen) and wrap the model again; a wrapped "
                "model's own options are model.options, also frozen.")

    def __setattr__(self, name, value):
        self._check_not_frozen()
        object.__setattr__(self, name, value)

    # -- values ---------------------------------------------------------------
    def set(self, **kwargs):
        self._check_not_frozen()
        for key, value in kwargs.items():
            assert key in self._values, (
                f"Invalid option {key}, valid options are {sorted(self._values)}")
            expected = type(self._values[key])
            if not isinstance(value, expected) and not (
                    expected is float and isinstance(value, int)):
                raise AssertionError(
                    f"Unexpected type {type(value)} for option {key}. "
                    f"Expected {expected}")
            self._values[key] = value
        return self

    def createOrSet(self, **kwargs):
        self._check_not_frozen()
        self._values.update(kwargs)
        return self

    def exists(self, option):
        return option in self._values

    def deleteIfExists(self, option):
        self._check_not_frozen()
        self._values.pop(option, None)

    def checkIsFrozen(self, option=None):
        """Raises ``AttributeError`` if these options are frozen (PopTorch's
        check before every change; ``option``: the attribute about to be set,
        which PopTorch lets through when it is ``_is_frozen``)."""
        if option != "_is_frozen":
            self._check_not_frozen()

    def update(self, other):
        """Merges these values into the dict ``other`` and returns it;
        ``AssertionError`` if they share a key (PopTorch's backend merge)."""
        assert not set(self._values).intersection(other), (
            "Can't merge dictionaries, they have some keys in common")
        other.update(self._values)
        return other

    def __call__(self, option):
        """``opts("device_iterations")``: the value of an option, by name."""
        return getattr(self, option)

    def toDict(self):
        out = dict(self._values)
        for name, child in vars(self).items():
            if isinstance(child, _OptionsDict):
                out[name.strip("_")] = child.toDict()
        return out

    def __getattr__(self, name):
        values = object.__getattribute__(self, "_values")
        if name in values:
            return values[name]
        raise AttributeError(f"Invalid attribute {name}.{self._did_you_mean(name)}")

    def _did_you_mean(self, name):
        """" Did you mean X?" for the closest setter or option name, if any."""
        import difflib
        known = [n for n in dir(type(self)) if not n.startswith("_")]
        known += list(object.__getattribute__(self, "_values"))
        close = difflib.get_close_matches(name, known, n=1, cutoff=0.75)
        return f" Did you mean {close[0]}?" if close else ""

    def __deepcopy__(self, memo):
        clone = self.__class__.__new__(self.__class__)
        for key, value in vars(self).items():
            object.__setattr__(clone, key, copy.deepcopy(value, memo))
        clone._unfreeze()
        return clone

    def __getstate__(self):
        return vars(self).copy()

    def __setstate__(self, state):
        for key, value in state.items():
            object.__setattr__(self, key, value)

    def __repr__(self):
        parts = [f"{k}={v!r}" for k, v in self._values.items()]
        parts += [f"{k.strip('_')}={v!r}" for k, v in vars(self).items()
                  if isinstance(v, _OptionsDict)]
        return f"{type(self).__name__}({', '.join(parts)})"


class _TrainingOptions(_OptionsDict):
    """``Options.Training``: gradient accumulation and its reduction."""

    def __init__(self):
        super().__init__(
            gradient_accumulation=1,
            accumulation_and_replication_reduction_type=enums.ReductionType.Mean,
            meanAccumulationAndReplicationReductionStrategy=(
                enums.MeanReductionStrategy.Post),
            auto_loss_scaling=False,
        )

    def gradientAccumulation(self, gradient_accumulation):
        """Micro-batches whose gradients are reduced into one weight update."""
        _check_positive_int("gradient_accumulation", gradient_accumulation)
        self.set(gradient_accumulation=gradient_accumulation)
        return self

    def accumulationAndReplicationReductionType(self, reduction_type):
        if reduction_type not in (enums.ReductionType.Sum, enums.ReductionType.Mean):
            raise ValueError("Reduction type must be poptorch.ReductionType.Sum or "
                             "poptorch.ReductionType.Mean")
        self._check_not_frozen()
        self._values["accumulation_and_replication_reduction_type"] = reduction_type
        return self

    def setMeanAccumulationAndReplicationReductionStrategy(self, mean_reduction_strategy):
        if not isinstance(mean_reduction_strategy, enums.MeanReductionStrategy):
            raise ValueError("Expected a poptorch.MeanReductionStrategy")
        self._check_not_frozen()
        self._values["meanAccumulationAndReplicationReductionStrategy"] = (
            mean_reduction_strategy)
        return self

    def setAutomaticLossScaling(self, enabled):
        self.set(auto_loss_scaling=bool(enabled))
        return self

    def setConvolutionDithering(self, enabled):
        """Lays convolutions with different parameters out from different
        tiles, for tile balance.  Recorded (``convolution_dithering``): the
        simulated tile mapping does not model dithering; ``MultiConv``'s
        ``enableConvDithering`` is the per-convolution form."""
        if not isinstance(enabled, bool):
            raise AssertionError(f"Unexpected type {type(enabled)} for option "
                                 "convolution_dithering. Expected <class 'bool'>")
        return self.createOrSet(convolution_dithering=enabled)


class _DistributedOptions(_OptionsDict):
    """``Options.Distributed``: process rank and count, read from the environment."""

    def __init__(self):
        super().__init__(num_distributed_processes=1, distributed_process_id=0)
        self.setEnvVarNames("OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK")

    def setEnvVarNames(self, var_num_processes, var_process_id):
        self.configureProcessId(int(os.environ.get(var_process_id, "0")),
                                int(os.environ.get(var_num_processes, "1")))
        return self

    def configureProcessId(self, process_id, num_processes):
        self.set(distributed_process_id=process_id,
                 num_distributed_processes=num_processes)
        return self

    def disable(self):
        return self.configureProcessId(0, 1)

    @property
    def processId(self):
        return self.distributed_process_id

    @property
    def numProcesses(self):
        return self.num_distributed_processes


class TensorLocationSettings(_OptionsDict):
    """Where one kind of tensor lives: on chip or in Streaming Memory, and
    whether it is sharded across replicas (replicated tensor sharding).

    >>> opts = Options()
    >>> opts.TensorLocations.setOptimizerLocation(
    ...     TensorLocationSettings().useOnChipStorage(False)
    ...     .useReplicatedTensorSharding(True))       # doctest: +ELLIPSIS
    _TensorLocationOptions(...)

    Settings left unset keep Poplar's defaults: on chip, no sharding, at least
    2 elements to go off chip and 8192 to be sharded.
    """

    def __init__(self, **default_values):
        super().__init__(**default_values)

    def minElementsForOffChip(self, min_elements):
        """Tensors with fewer elements stay on chip."""
        assert isinstance(min_elements, int)
        return self.createOrSet(minElementsForOffChip=min_elements)

    def minElementsForReplicatedTensorSharding(self, min_elements):
        """Only tensors with at least this many elements are sharded."""
        assert isinstance(min_elements, int)
        return self.createOrSet(minElementsForReplicatedTensorSharding=min_elements)

    def useOnChipStorage(self, use=True):
        """True: In-Processor Memory; False: Streaming Memory; None: unset."""
        if use is None:
            self.deleteIfExists("onChip")
            return self
        assert isinstance(use, bool)
        return self.createOrSet(onChip=int(use))

    def useReplicatedTensorSharding(self, use=True):
        """Shard the tensor across replicas (weights and optimizer state)."""
        assert isinstance(use, bool)
        return self.createOrSet(useReplicatedTensorSharding=int(use))

    def useIOTilesToLoad(self, use=True):
        """Stream these variables from Streaming Memory through the IO tiles
        (``TensorLocations.numIOTiles``): the transfer overlaps compute, then
        crosses the exchange to the compute tiles."""
        assert isinstance(use, bool)
        return self.createOrSet(useIOTilesToLoad=int(use))

    def useIOTilesToStore(self, use=True):
        """Stream these variables to Streaming Memory through the IO tiles
        (see ``useIOTilesToLoad``)."""
        assert isinstance(use, bool)
        return self.createOrSet(useIOTilesToStore=int(use))


class _TensorLocationOptions(_OptionsDict):
    """``Options.TensorLocations``: ``TensorLocationSettings`` per kind of tensor."""

    def __init__(self):
        super().__init__(num_io_tiles=0)

    def numIOTiles(self, num_tiles):
        assert isinstance(num_tiles, int) and 32 <= num_tiles <= 192 and num_tiles % 2 == 0, (
            "numIOTiles must be an even number between 32 and 192.")
        return self.set(num_io_tiles=num_tiles)

    def _location(self, key, location):
        assert isinstance(location, TensorLocationSettings), (
            f"{key} expects a poptorch.TensorLocationSettings (got {type(location)})")
        return self.createOrSet(**{key: dict(location._values)})

    def setActivationLocation(self, location):
        """Activations (used with phased execution)."""
        return self._location("location_activation", location)

    def setWeightLocation(self, location):
        """The model's weights."""
        return self._location("location_weight", location)

    def setOptimizerLocation(self, location):
        """The optimizer's state (momentum, Adam's moments)."""
        return self._location("location_optimizer", location)

    def setAccumulatorLocation(self, location):
        """The gradient accumulators (with gradient accumulation)."""
        return self._location("location_accumulator", location)

    def settings(self):
        """``{"weight": {...}, "optimizer": {...}, ...}``: what was set."""
        return {k[len("location_"):]: dict(v) for k, v in self._values.items()
                if k.startswith("location_")}


class _PrecisionOptions(_OptionsDict):
    """``Options.Precision``: fp16 arithmetic (docs/precision.md)."""

    def __init__(self, popart=None):
        super().__init__(enable_floating_point_exceptions=False,
                         enable_stochastic_rounding=False, partials_type="float",
                         running_statistics_always_float=False)
        # the PopART session options these setters also write, as PopTorch's do
        object.__setattr__(self, "_popart_options", popart)

    def _popart_set(self, name, value):
        """The PopART option PopTorch's setter writes (``Options.toDict()``)."""
        if self._popart_options is not None:
            self._popart_options.options[name] = value

    def halfFloatCasting(self, half_float_casting):  # deprecated, as PopTorch
        """Deprecated in PopTorch, and a no-op there: ops mixing fp16 and fp32
        operands always compute in fp32 (``HalfUpcastToFloat``)."""
        import logging
        logging.getLogger("poptorchsim").warning(
            "[Deprecated] Do not call options.Precision.halfFloatCasting(): "
            "HalfUpcastToFloat is now the only supported option and matches PyTorch's "
            "behaviour so you don't need to explicitly set it.")
        return self

    def runningStatisticsAlwaysFloat(self, value):
        """Batch-norm running mean and variance kept in float32 in an fp16
        model (PopTorch's behaviour before 3.1; see docs/precision.md)."""
        if not isinstance(value, bool):
            raise ValueError("runningStatisticsAlwaysFloat needs to be set to a bool")
        return self.set(running_statistics_always_float=value)

    def enableFloatingPointExceptions(self, enabled):
        """Raise ``poptorch.Error`` at the first op that divides by zero,
        overflows or is invalid (NaN), instead of computing inf or NaN
        (docs/precision.md)."""
        assert isinstance(enabled, bool), \
            "enableFloatingPointExceptions needs to be set to a bool"
        self._popart_set("enableFloatingPointChecks", enabled)
        return self.set(enable_floating_point_exceptions=enabled)

    def enableStochasticRounding(self, enabled):
        self._popart_set("enableStochasticRounding", bool(enabled))
        return self.set(enable_stochastic_rounding=bool(enabled))

    def setPartialsType(self, dtype):
        import torch
        if dtype not in (torch.float, torch.half):
            raise ValueError("Partials type must be torch.float or torch.half")
        kind = "float" if dtype == torch.float else "half"
        self._popart_set("partialsTypeMatMuls", kind)
        self._popart_set("convolutionOptions", {"partialsType": kind})
        return self.set(partials_type=kind)


class _JitOptions(_OptionsDict):
    def __init__(self):
        super().__init__()

    def traceModel(self, trace_model):
        if trace_model:
            raise ValueError("options.Jit.traceModel(True) is no longer supported")
        return self


class _PopartOptions(_OptionsDict):
    """``Options._Popart``: PopART's session options, stored as given (a
    PopART enum member, ``popart.RecomputationType.Standard``, as its int).

    The simulator reads the ones it models (``runtime/settings/popart_options.py``'s
    ``MODELLED``: ``autoRecomputation``, ``syntheticDataMode``,
    ``automaticLossScalingSettings.*``, ...); setting any other logs once
    per option name that the simulation ignores it.  Its values live in
    ``options`` (PopTorch's layout), not in ``_values``."""

    def __init__(self):
        super().__init__()
        object.__setattr__(self, "options", {
            "instrumentWithHardwareCycleCounter": False,
            "rearrangeAnchorsOnHost": False})

    def set(self, key, value):
        self._check_not_frozen()
        if isinstance(value, enum.IntEnum):
            value = int(value)      # PopART's enums are ints to PopTorch
        self.options[key] = value
        popart_options.note_unmodelled(key)
        return self

    def setEngineOptions(self, engine_options):
        return self.set("engineOptions", dict(engine_options))

    def setPatterns(self, patterns, level=2):
        """Overrides PopART's default patterns: ``{name: enabled}``, and
        ``level`` (``popart::PatternsLevel``); stored under PopTorch's keys."""
        assert isinstance(level, int)
        assert isinstance(patterns, dict)
        self.set("patterns_level", level)
        return self.set("patterns", dict(patterns))

    def toDict(self):
        return dict(self.options)

    def __repr__(self):
        body = ", ".join(f"{k}={v!r}" for k, v in self.options.items())
        return f"{type(self).__name__}({body})"


def _check_positive_int(name, value):
    if isinstance(value, bool) or not isinstance(value, int):
        raise AssertionError(
            f"Unexpected type {type(value)} for option {name}. Expected <class 'int'>")
    if value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value}")
