"""``poptorchsim.Options``: PopTorch's option object, its setters and checks.

Every setter validates at once, returns ``self`` so calls chain, and raises
the exception PopTorch raises, with PopTorch's text.  ``trainingModel``,
``inferenceModel`` and ``DataLoader`` freeze the object they are given; the
executor keeps its own frozen clone.

The sub-option groups (``Options.Training``, ``.Precision``, ...) and the
values mechanism they share are ``_api/option_groups.py``, re-exported here
under PopTorch's names (``poptorch.options.TensorLocationSettings``).
``Options.loadFromFile`` reads PopTorch's option files (``_load_file``).
"""
import copy
import json
import os

from . import enums
from ._api import session_options
from ._api.graph_ops import Attribute  # noqa: F401 - poptorch.options.Attribute
from ._api.option_extras import _CompilerOptions
from ._api.option_groups import (  # noqa: F401 - poptorch.options.<name>, as PopTorch has them
    FROZEN_MESSAGE,
    TensorLocationSettings,
    _check_positive_int,
    _DistributedOptions,
    _JitOptions,
    _OptionsDict,
    _PopartOptions,
    _PrecisionOptions,
    _TensorLocationOptions,
    _TrainingOptions,
)
from ._api.strategies import (  # noqa: F401 - poptorch.options.<name>, as PopTorch has them
    ParallelPhasedExecution,
    Phase,
    PipelinedExecution,
    SerialPhasedExecution,
    ShardedExecution,
    Stage,
    _IExecutionStrategy,
)
from .errors import Error

BlockId = str  # poptorch.options.BlockId: a block's user_id


class ConfigFileError(Exception):
    """A line of an ``Options.loadFromFile`` file that does not parse
    (``poptorch.options.ConfigFileError``, as PopTorch names it)."""


class Options(_CompilerOptions, _OptionsDict):
    """PopTorch's ``poptorch.Options``.

    >>> opts = Options().deviceIterations(50).replicationFactor(2)
    >>> opts.device_iterations, opts.replication_factor
    (50, 2)
    """

    def __init__(self):
        super().__init__(
            replication_factor=1,
            input_group_size=1,
            input_cgt=enums.CommGroupType.Consecutive,
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
        object.__setattr__(self, "_popart", _PopartOptions())
        object.__setattr__(self, "_precision", _PrecisionOptions(self._popart))
        object.__setattr__(self, "_tensor_locations", _TensorLocationOptions())
        object.__setattr__(self, "_jit", _JitOptions())
        # PopTorch's default strategy, as PopTorch's Options holds it
        object.__setattr__(self, "_execution_strategy", PipelinedExecution())
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
        return self._execution_strategy

    # -- misc -------------------------------------------------------------------
    def randomSeed(self, random_seed):
        """Seeds the host (``torch.manual_seed``) and the device RNG."""
        assert isinstance(random_seed, int), "Random seed must be an integer"
        import torch
        torch.manual_seed(random_seed)
        return self.createOrSet(random_seed=random_seed)

    def randomStreams(self, mode):
        """poptorchsim's own: where random ops (dropout, ``torch.rand`` ...)
        draw on the host.  ``RandomStreams.PerMicroBatch`` (the default):
        counter-based streams keyed by ``randomSeed``, replica, micro-batch
        and op, the same numbers however the micro-batches are scheduled;
        ``RandomStreams.Eager``: PyTorch's generator in eager order, which
        matches plain PyTorch's dropout bit for bit (micro-batches then run
        one after another).  ``docs/precision.md``."""
        if isinstance(mode, str):
            mode = enums.RandomStreams(mode)
        if not isinstance(mode, enums.RandomStreams):
            raise ValueError(f"randomStreams: {mode!r} is not a poptorchsim.RandomStreams "
                             "(PerMicroBatch or Eager)")
        return self.createOrSet(random_streams=mode.value)

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
        from .estimate.targets import target_named
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
        others' compute (with replication).  See ``estimate/program_cost.py``
        ``_host_seconds``; with one IPU and one replica they all cost the
        same, as on the device."""
        assert isinstance(sync_pattern, enums.SyncPattern), (
            "sync_pattern must be an instance of poptorch.SyncPattern")
        return self.set(sync_pattern=sync_pattern.value)

    def maxRepeatLogs(self, max_lines):
        """How many lines a repetitive log call site prints before it says
        "...repeated messages suppressed..." (default 4; ``None``: all).
        PopTorch limits three call sites this way, all warnings of its
        dispatcher's type coercion (``logging::warn(log_repeat, ...)``);
        every other line, its Python warnings among them, always prints.
        poptorchsim has no such site, so the setting is checked and kept
        (``max_repeat_logs``) and changes no output."""
        if max_lines is not None and (isinstance(max_lines, bool)
                                      or not isinstance(max_lines, int) or max_lines < 0):
            raise ValueError(f"maxRepeatLogs expects None or an integer >= 0, got "
                             f"{max_lines!r}")
        return self.set(max_repeat_logs=(1 << 64) - 1 if max_lines is None else max_lines)

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
        _load_file(self, filepath)
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
        ``runtime/executables/cache.py`` for what the key covers); None turns it off."""
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

    # -- observing (runtime/executor/observe.py) ------------------------------------------------
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

    def toDict(self):
        """Every option in one flat dictionary, as PopTorch's backend takes it
        (``_api/session_options.py``); an output mode must be picked first."""
        return session_options.to_dict(self)

    def _backend_dict(self, output_mode):
        """``toDict()`` with ``OutputMode.Default`` resolved to ``output_mode``,
        as a wrapped model's options are when it compiles."""
        return session_options.to_dict(self, output_mode)

    def clone(self):
        """An unfrozen deep copy."""
        return copy.deepcopy(self)


def _string_to_enum(value):
    """``"ConnectionType.OnDemand"`` -> ``enums.ConnectionType.OnDemand``;
    any other string is returned as it is."""
    enum_type, _, member = value.partition(".")
    enum_class = getattr(enums, enum_type, None)
    if enum_class is None or "." in member or not hasattr(enum_class, "__members__"):
        return value
    return enum_class.__members__.get(member, value)


# -- Options.loadFromFile ------------------------------------------------------------
# One option call a line, PopTorch's file format: each line is what would
# follow ``options.`` in Python (``deviceIterations(4)``); blank lines and lines
# starting with ``#`` are skipped, and an inline ``# comment`` is Python's own.
# The lines run in order, so a later file overrides only the options it sets.
# A line that does not parse raises ``ConfigFileError`` naming the line and the
# file, as PopTorch's ``_options_config.py`` does.

# Python 3.10+ says "'(' was never closed" where the Python PopTorch was
# written for said "unexpected EOF while parsing"; PopTorch's text is kept.
_EOF_DETAILS = ("was never closed", "unexpected EOF")


def _load_file(options, filepath):
    import poptorchsim
    commands = []
    with open(filepath) as f:
        filename = os.path.basename(f.name)
        for line in f:
            stripped = line.strip()
            if not stripped or stripped.startswith("#"):
                continue
            commands.append("options." + stripped)
    code = "\n".join(commands)
    try:
        compiled = compile(code, filename, "exec")
    except SyntaxError as err:
        detail = err.args[0]
        if any(s in detail for s in _EOF_DETAILS):
            detail = "unexpected EOF while parsing"
        line = (err.text or "").rstrip("\n")
        raise ConfigFileError(
            f"{type(err).__name__} at line {err.lineno} of {filename}: {detail}\n"
            f"> {line}") from None
    exec(compiled, {}, {"poptorch": poptorchsim, "options": options})  # noqa: S102 - the user's own file
