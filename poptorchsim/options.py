"""``poptorchsim.Options``: PopTorch's option object, its setters and checks.

Every setter validates at once, returns ``self`` so calls chain, and raises
the exception PopTorch raises, with PopTorch's text.  ``trainingModel``,
``inferenceModel`` and ``DataLoader`` freeze the object they are given; the
executor keeps its own frozen clone.
"""
import copy
import json
import os

from . import enums
from .errors import Error

FROZEN_MESSAGE = "Can't modify frozen Options"


class ConfigFileError(Exception):
    """A line of an ``Options.loadFromFile`` file that does not parse
    (``poptorch.options.ConfigFileError``, as PopTorch names it)."""


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

    def exists(self, key):
        return key in self._values

    def deleteIfExists(self, key):
        self._check_not_frozen()
        self._values.pop(key, None)

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

    def setMeanAccumulationAndReplicationReductionStrategy(self, strategy):
        if not isinstance(strategy, enums.MeanReductionStrategy):
            raise ValueError("Expected a poptorch.MeanReductionStrategy")
        self._check_not_frozen()
        self._values["meanAccumulationAndReplicationReductionStrategy"] = strategy
        return self

    def setAutomaticLossScaling(self, enabled):
        self.set(auto_loss_scaling=bool(enabled))
        return self


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

    def __init__(self):
        super().__init__()

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

    def __init__(self):
        super().__init__(enable_floating_point_exceptions=False,
                         enable_stochastic_rounding=False, partials_type="float",
                         running_statistics_always_float=False)

    def halfFloatCasting(self, half_float_casting):  # noqa: ARG002 - deprecated, as PopTorch
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
        return self.set(enable_floating_point_exceptions=enabled)

    def enableStochasticRounding(self, enabled):
        return self.set(enable_stochastic_rounding=bool(enabled))

    def setPartialsType(self, dtype):
        import torch
        if dtype not in (torch.float, torch.half):
            raise ValueError("Partials type must be torch.float or torch.half")
        return self.set(partials_type="float" if dtype == torch.float else "half")


class _JitOptions(_OptionsDict):
    def __init__(self):
        super().__init__()

    def traceModel(self, trace_model):
        if trace_model:
            raise ValueError("options.Jit.traceModel(True) is no longer supported")
        return self


class _PopartOptions(_OptionsDict):
    """``Options._Popart``: backend options, stored as given."""

    def __init__(self):
        super().__init__()
        object.__setattr__(self, "options", {
            "instrumentWithHardwareCycleCounter": False,
            "rearrangeAnchorsOnHost": False})

    def set(self, key, value):
        self._check_not_frozen()
        self.options[key] = value
        return self

    def setEngineOptions(self, engine_options):
        return self.set("engineOptions", dict(engine_options))

    def setPatterns(self, patterns, level=2):
        self.set("patterns", dict(patterns))
        return self.set("patternsLevel", level)

    def __repr__(self):
        body = ", ".join(f"{k}={v!r}" for k, v in self.options.items())
        return f"{type(self).__name__}({body})"


class Options(_OptionsDict):
    """PopTorch's ``poptorch.Options``.

    >>> opts = Options().deviceIterations(50).replicationFactor(2)
    >>> opts.device_iterations, opts.replication_factor
    (50, 2)
    """

    def __init__(self):
        super().__init__(
            replication_factor=1,
            input_group_size=1,
            device_iterations=1,
            log_dir=".",
            max_repeat_logs=4,
            auto_round_num_ipus=False,
            output_mode=enums.OutputMode.Default.value,
            output_return_period=1,
            connection_type=enums.ConnectionType.Always.value,
            sync_pattern=enums.SyncPattern.Full.value,
            available_memory_proportion={},
            broadcast_buffers=True,
            show_compilation_progress_bar=True,
            relax_optimizer_checks=False,
            anchored_tensors={},        # short name -> [long name, default mode?, mode, period]
        )
        object.__setattr__(self, "_training", _TrainingOptions())
        object.__setattr__(self, "_distributed", _DistributedOptions())
        object.__setattr__(self, "_precision", _PrecisionOptions())
        object.__setattr__(self, "_tensor_locations", _TensorLocationOptions())
        object.__setattr__(self, "_jit", _JitOptions())
        object.__setattr__(self, "_popart", _PopartOptions())
        object.__setattr__(self, "_execution_strategy", None)   # see execution_strategy
        object.__setattr__(self, "_module_namescope_enabled", True)
        cache_dir = os.environ.get("POPTORCH_CACHE_DIR", "")
        if cache_dir:
            self.enableExecutableCaching(cache_dir)
        defaults = os.environ.get("POPTORCH_DEFAULT_OPTIONS")
        if defaults:
            self.from_json(defaults)

    # -- sub-objects ---------------------------------------------------------
    @property
    def Training(self):
        return self._training

    @property
    def Distributed(self):
        return self._distributed

    @property
    def Precision(self):
        return self._precision

    @property
    def TensorLocations(self):
        return self._tensor_locations

    @property
    def Jit(self):
        return self._jit

    @property
    def _Popart(self):
        return self._popart

    # -- batching --------------------------------------------------------------
    def deviceIterations(self, device_iterations):
        """Iterations of the device-side loop per call; one weight update each."""
        _check_positive_int("device_iterations", device_iterations)
        return self.set(device_iterations=device_iterations)

    def replicationFactor(self, replication_factor):
        """Number of data-parallel replicas of the model."""
        _check_positive_int("replication_factor", replication_factor)
        return self.set(replication_factor=replication_factor)

    def outputMode(self, output_mode, output_return_period=None):
        """Which outputs come back to the host (``OutputMode``)."""
        assert isinstance(output_mode, enums.OutputMode), (
            "output_mode must be an instance of poptorch.OutputMode")
        if output_mode == enums.OutputMode.EveryN:
            assert isinstance(output_return_period, int) and \
                output_return_period > 0, (
                    "EveryN anchor must have output_return_period set to valid "
                    "positive integer")
        else:
            output_return_period = None
        return self.set(output_mode=output_mode.value,
                        output_return_period=output_return_period or 1)

    # PopTorch < 3 name
    anchorMode = outputMode

    def defaultOutputMode(self):
        return self.output_mode == enums.OutputMode.Default

    # -- multi-IPU ----------------------------------------------------------------
    def setExecutionStrategy(self, strategy):
        """How blocks become stages and IPUs: ``PipelinedExecution`` (the
        default) or ``ShardedExecution``."""
        from .annotations import _IExecutionStrategy
        assert isinstance(strategy, _IExecutionStrategy), (
            "strategy must be an instance of an execution strategy class, such as "
            f"poptorch.PipelinedExecution or poptorch.ShardedExecution (got {type(strategy)})")
        self._check_not_frozen()
        object.__setattr__(self, "_execution_strategy", strategy)
        return self

    @property
    def execution_strategy(self):
        """The strategy set by ``setExecutionStrategy``; ``PipelinedExecution()``
        (stage = each block's ``ipu_id``) until one is set."""
        strategy = vars(self).get("_execution_strategy")
        if strategy is None:
            from .annotations import PipelinedExecution
            strategy = PipelinedExecution()
            object.__setattr__(self, "_execution_strategy", strategy)
        return strategy

    # -- misc -------------------------------------------------------------------
    def randomSeed(self, random_seed):
        """Seeds the host (``torch.manual_seed``) and the device RNG."""
        assert isinstance(random_seed, int), "Random seed must be an integer"
        import torch
        torch.manual_seed(random_seed)
        return self.createOrSet(random_seed=random_seed)

    def useIpuModel(self, use_model):
        """Kept for PopTorch programs: poptorchsim always simulates."""
        return self.createOrSet(use_model=bool(use_model))

    def useIpuId(self, ipu_id):
        assert isinstance(ipu_id, int), "IPU id must be an integer"
        return self.createOrSet(ipu_id=ipu_id)

    def useOfflineIpuTarget(self, ipu_version=2):
        """Compile for ``ipu_version`` (1, 2 or 21) without running."""
        self.connectionType(enums.ConnectionType.Never)
        self.useIpuModelVersion(f"ipu{ipu_version}")
        return self.createOrSet(ipu_version=ipu_version)

    def useIpuModelVersion(self, version):
        """The simulated IPU: "ipu1"/"mk1", "ipu2"/"mk2", "ipu21"/"bow" or "test"
        (4 tiles).  Overrides POPTORCHSIM_IPU_MODEL_VERSION."""
        from .machine.targets import target_named
        target_named(version)
        return self.createOrSet(ipu_model_version=str(version))

    def connectionType(self, connection_type):
        assert isinstance(connection_type, enums.ConnectionType), (
            "connection_type must be an instance of poptorch.ConnectionType")
        return self.set(connection_type=connection_type.value)

    def syncPattern(self, sync_pattern):
        """How IPUs synchronise for host IO (``poptorch.SyncPattern``).

        ``Full`` (default): every host transfer syncs all IPUs, so the IO is
        paid while every IPU waits.  ``SinglePipeline``: each IPU of a
        replica talks to the host on its own, so the first stage's inputs
        and the last stage's outputs stream while the other IPUs compute (a
        replica on several IPUs).  ``ReplicaAndLadder``: replicas do their
        host IO without syncing each other, so one replica's IO overlaps the
        others' compute (with replication).  See ``runtime/compiler.py``
        ``_host_seconds``; with one IPU and one replica they all cost the
        same, as on the device."""
        assert isinstance(sync_pattern, enums.SyncPattern), (
            "sync_pattern must be an instance of poptorch.SyncPattern")
        return self.set(sync_pattern=sync_pattern.value)

    def maxRepeatLogs(self, max_lines):
        """A log line repeated back to back is shown at most ``max_lines``
        times, then dropped until a different line comes (default 4;
        ``None``: show all).  Applies to poptorchsim's logger from the moment
        a model wrapped with these options is created (``runtime/log_repeats.py``)."""
        if max_lines is not None and (isinstance(max_lines, bool)
                                      or not isinstance(max_lines, int) or max_lines < 0):
            raise ValueError(f"maxRepeatLogs expects None or an integer >= 0, got "
                             f"{max_lines!r}")
        from .runtime.log_repeats import UNLIMITED
        return self.set(max_repeat_logs=UNLIMITED if max_lines is None else max_lines)

    def disableModuleNamescope(self):
        """Op names without their module's name scope: with it (the default)
        an op traced inside ``self.layer1[0]`` is named ``layer1/0/<op>`` in
        the IR and ``getTensorNames()``, as PopTorch names it
        ``layer1/0/Conv``; disabled, just ``<op>``."""
        self._check_not_frozen()
        object.__setattr__(self, "_module_namescope_enabled", False)
        return self

    def loadFromFile(self, filepath):
        """Applies the options in ``filepath``: one call a line, written as
        after ``options.`` (``deviceIterations(4)``), ``#`` comments and
        blank lines skipped.  Options the file does not name keep their
        values, so a second file overrides only what it sets.  A line that
        does not parse raises ``poptorch.options.ConfigFileError``."""
        from ._options_config import parse_and_set_options
        parse_and_set_options(self, filepath)
        return self

    def autoRoundNumIPUs(self, auto_round_num_ipus=True):
        """Round a model's IPU count up to a power of two (the spare IPUs are
        reserved and idle) instead of failing."""
        return self.set(auto_round_num_ipus=bool(auto_round_num_ipus))

    def broadcastBuffers(self, broadcast_buffers=True):
        return self.set(broadcast_buffers=bool(broadcast_buffers))

    def logDir(self, log_dir):
        return self.set(log_dir=str(log_dir))

    def modelName(self, name):
        return self.createOrSet(model_name=str(name))

    def showCompilationProgressBar(self, show=True):
        return self.set(show_compilation_progress_bar=bool(show))

    def relaxOptimizerAttributesChecks(self, relax=True):
        """Attributes an optimizer gains after the model was wrapped (which the
        compiled update ignores) are logged at debug level instead of as
        warnings."""
        return self.set(relax_optimizer_checks=bool(relax))

    def enableExecutableCaching(self, path):
        """Keeps compiled executables in the folder ``path`` and loads them
        from there instead of compiling the same model again (see
        ``runtime/cache.py`` for what the key covers); None turns it off."""
        if path is not None and not isinstance(path, (str, os.PathLike)):
            raise Error(f"enableExecutableCaching expects a folder path (str) or None "
                        f"(got {type(path)})")
        self._Popart.set("enableEngineCaching", path is not None)
        if path is not None:
            self._Popart.set("cachePath", os.fspath(path))
        return self

    def enableSyntheticData(self, enabled):
        """No host IO: inputs stay on the device, so estimates leave out the
        host streams (PopTorch's synthetic data mode)."""
        return self.createOrSet(synthetic_data=bool(enabled))

    def enableProfiling(self, profile_dir=None):
        """Writes a simulation report (JSON, PNG plots, HTML) per model to
        ``<profile_dir>/<modelName>/`` when the model compiles, as Poplar's
        ``autoReport.all`` does."""
        engine = dict(self._Popart.options.get("engineOptions", {}))
        engine["autoReport.all"] = "true"
        engine["autoReport.directory"] = str(profile_dir or ".")
        self._Popart.setEngineOptions(engine)
        return self

    def setAvailableMemoryProportion(self, available_memory_proportion):
        for key, value in available_memory_proportion.items():
            assert key.startswith("IPU"), (
                "Keys for setAvailableMemoryProportion must be IPU ids of the "
                "form 'IPU0', 'IPU1', ...")
            if not 0.0 < float(value) <= 1.0:
                raise ValueError(
                    f"Available memory proportion for {key} must be in (0, 1], "
                    f"got {value}")
        self._check_not_frozen()
        self._values["available_memory_proportion"] = dict(
            available_memory_proportion)
        return self

    # -- observing (runtime/observe.py) ------------------------------------------------
    def anchorTensor(self, short_name, long_name, output_mode=None, output_return_period=1):
        """Returns the tensor ``long_name`` (a name from
        ``PoplarExecutor.getTensorNames()``, e.g. ``"Gradient___fc2.bias"``)
        after every call, read with ``getAnchoredTensor(short_name)``.
        ``output_mode``: which micro-batches' values come back (None: the
        model's output mode).  Returns None, as PopTorch's does."""
        self._check_not_frozen()
        assert isinstance(short_name, str) and isinstance(long_name, str), (
            "anchorTensor: short_name and long_name must be strings")
        assert output_mode is None or isinstance(output_mode, enums.OutputMode), (
            "output_mode must be an instance of poptorch.OutputMode")
        if output_mode == enums.OutputMode.EveryN:
            assert isinstance(output_return_period, int) and output_return_period > 0, (
                "EveryN anchor must have output_return_period set to valid positive "
                "integer")
        else:
            output_return_period = 1
        self.anchored_tensors[short_name] = [long_name, output_mode is None, output_mode,
                                             output_return_period]

    def logCycleCount(self, log_cycle_count):
        """``PoplarExecutor.cycleCount()`` returns the simulated cycles of the
        last call (logged at DEBUG level after each call)."""
        assert isinstance(log_cycle_count, bool), "logCycleCount expects a bool"
        self._Popart.set("instrumentWithHardwareCycleCounter", log_cycle_count)
        return self

    def updatableNamedBuffers(self, buffers):
        """The buffers ``PoplarExecutor.copyNamedBuffersToDevice()`` copies
        from the host model to the device (and no others)."""
        buffers = list(buffers) if isinstance(buffers, (list, tuple)) else buffers
        assert isinstance(buffers, list) and all(isinstance(b, str) for b in buffers), (
            "updatableNamedBuffers expects a list of buffer names (str)")
        self._Popart.set("updatableNamedBuffers", buffers)
        return self

    def from_json(self, string):
        """Applies ``{"deviceIterations": 2, "Training.gradientAccumulation": 4}``.

        A string value ``"EnumName.Member"`` naming a poptorch enum
        (``"ConnectionType.OnDemand"``) is that enum member, as in PopTorch;
        a list is the call's arguments (``{"_Popart.set": ["key", 1]}``)."""
        for key, value in json.loads(string).items():
            target = self
            *path, setter = key.split(".")
            for part in path:
                target = getattr(target, part)
            fn = getattr(target, setter, None)
            if fn is None or not callable(fn):
                raise Error(f"Unknown option {key} in POPTORCH_DEFAULT_OPTIONS")
            if isinstance(value, str) and "." in value:
                value = _string_to_enum(value)
            if isinstance(value, list):
                fn(*value)
            else:
                fn(value)
        return self

    def clone(self):
        """An unfrozen deep copy."""
        return copy.deepcopy(self)


def _check_positive_int(name, value):
    if isinstance(value, bool) or not isinstance(value, int):
        raise AssertionError(
            f"Unexpected type {type(value)} for option {name}. Expected <class 'int'>")
    if value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value}")


def _string_to_enum(value):
    """``"ConnectionType.OnDemand"`` -> ``enums.ConnectionType.OnDemand``;
    any other string is returned as it is."""
    enum_type, _, member = value.partition(".")
    enum_class = getattr(enums, enum_type, None)
    if enum_class is None or "." in member or not hasattr(enum_class, "__members__"):
        return value
    return enum_class.__members__.get(member, value)
