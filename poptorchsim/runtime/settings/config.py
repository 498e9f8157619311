"""``CompileConfig``: every option that shapes a program, resolved once.

``CompileConfig.from_options(options, training)`` reads a PopTorch
``Options`` (and its sub-objects) through their public accessors and
returns a frozen record.  The compiler, the executable cache key and the
runtime read this record; nothing below the face reads the options object's
private storage.
"""
from dataclasses import dataclass, field, fields

from ... import enums
from ...estimate.targets import default_target, hardware_ipus
from ...passes.precision import auto_loss_scaling
from ...passes.precision import settings as precision_settings
from .engine_options import allow_out_of_memory
from .popart_options import recomputation_type, synthetic_data_mode


def _proportions(options):
    """setAvailableMemoryProportion as the compiler takes it: one value, or
    {IPU index: value} when the IPUs were given different ones."""
    given = {int(k[3:]): v for k, v in options.available_memory_proportion.items()
             if k.startswith("IPU") and k[3:].isdigit()}
    if len(set(given.values())) > 1:
        return given
    return given.get(0, 0.6)


def _placement_spec(strategy):
    """The execution strategy the face holds, handed down as plain data."""
    return strategy.spec() if strategy is not None else None


def output_mode(options, training):
    """The output mode a model runs with: ``Default`` is ``Final`` in
    training and ``All`` in inference, as in PopTorch."""
    mode = enums.OutputMode(options.output_mode)
    if mode == enums.OutputMode.Default:
        mode = enums.OutputMode.Final if training else enums.OutputMode.All
    return mode


@dataclass(frozen=True)
class CompileConfig:
    """What the compiler is told, beside the model, its optimizer and the
    example inputs.  Fields marked ``key=False`` do not shape the program
    (they stay out of the executable cache key)."""
    training: bool
    device_iterations: int = 1
    accumulation: int = 1             # gradient accumulation (1 in inference)
    replicas: int = 1                 # replicas of this process (replicationFactor)
    processes: int = 1                # host processes sharing the replicas
    target: object = field(default_factory=default_target)   # estimate.targets.Target
    amp: object = 0.6                 # available memory proportion, or {IPU: proportion}
    allow_oom: bool = False           # Poplar's debug.allowOutOfMemory
    synthetic: bool = False           # enableSyntheticData: no host streams
    placement: object = None          # passes.stages StagedSpec / PhasedSpec: the execution
                                      # strategy as data (None: PopTorch's default)
    auto_round: bool = False          # autoRoundNumIPUs
    # IPUs reported as hardware (POPTORCHSIM_IPU_HARDWARE), None without, or with the
    # IPU Model or an offline target. Not in the cache key: it shapes no program, it
    # only decides whether one may run; every program obtained, compiled, cached or
    # loaded from an exported file, is checked against it (executables/cache.py)
    hardware: object = field(default=None, metadata={"key": False})
    locations: dict = field(default_factory=dict)   # TensorLocations settings per kind
    io_tiles: int = 0
    precision: dict = None            # passes.precision.settings
    recomputation: object = None      # PopART's autoRecomputation (None: unset)
    sync_pattern: str = "Full"        # SyncPattern name
    running_mean: bool = False        # MeanReductionStrategy.Running over accumulation
    auto_loss_scaling: object = None  # passes.loss_scaling.Settings, or None
    output_mode: str = "All"          # OutputMode name, Default resolved
    output_return_period: int = 1
    show_progress: bool = field(default=True, metadata={"key": False})

    @classmethod
    def from_options(cls, options, training):
        """The configuration ``options`` give a training or inference model."""
        o = options
        t = o.Training
        ga = t.gradient_accumulation if training else 1
        running = training and (
            t.accumulation_and_replication_reduction_type == enums.ReductionType.Mean
            and t.meanAccumulationAndReplicationReductionStrategy
            == enums.MeanReductionStrategy.Running)
        return cls(
            training=training, device_iterations=o.device_iterations, accumulation=ga,
            replicas=o.replication_factor,
            processes=o.Distributed.numProcesses,
            target=default_target(getattr(o, "ipu_model_version", None)),
            amp=_proportions(o), allow_oom=allow_out_of_memory(o),
            synthetic=bool(getattr(o, "synthetic_data", False)) or synthetic_data_mode(o),
            placement=_placement_spec(getattr(o, "execution_strategy", None)),
            auto_round=bool(o.auto_round_num_ipus), hardware=_hardware(o),
            locations=o.TensorLocations.settings(),
            io_tiles=o.TensorLocations.num_io_tiles, precision=precision_settings(o),
            recomputation=recomputation_type(o),
            sync_pattern=enums.SyncPattern(int(o.sync_pattern)).name,
            running_mean=running,
            auto_loss_scaling=auto_loss_scaling(o) if training else None,
            output_mode=output_mode(o, training).name,
            output_return_period=o.output_return_period,
            show_progress=bool(o.show_compilation_progress_bar))

    def key(self):
        """What of the configuration shapes the program (the cache key's part)."""
        return {f.name: getattr(self, f.name) for f in fields(self)
                if f.metadata.get("key", True)}

    @property
    def total_replicas(self):
        return self.replicas * self.processes


def _hardware(options):
    """The IPUs a program's models compile for as hardware: the switch's
    (``estimate.targets.hardware_ipus``), unless the options ask for the
    IPU Model (``useIpuModel(True)``) or an offline target (connection type
    ``Never``), which take any count as PopTorch's do."""
    if getattr(options, "use_model", False) or \
            options.connection_type == enums.ConnectionType.Never.value:
        return None
    return hardware_ipus()

