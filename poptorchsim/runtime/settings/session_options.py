"""PopTorch's backend's parse of an options dictionary (``Options.toDict()``,
``_api/session_options.py``): each option goes to the option of its name
and kind, or is an error; at debug level each one set is logged, as
PopTorch's backend logs it (``poptorch.Options set <name> to value
<value>``).  ``poptorch_core._validateOptions`` runs it, and so does every
compile: an unknown option fails the compile, as in PopTorch."""
import logging

from ...errors import Error

_log = logging.getLogger("poptorchsim")

# The session options PopTorch's backend knows, by the kind of value each takes
# (popart_compiler/source/SessionOptions.cpp: its poptorch options and the
# PopART SessionOptions fields it registers)
_BOOL = """auto_round_num_ipus use_model serial_phases_execution separate_backward_phase
    broadcast_buffers enableExplicitIR enableInplaceAmbiguityChecking
    enableLoadAndOffloadRNGState batchSerializationSettings.concatOnVirtualGraphChange
    batchSerializationSettings.concatOnExecutionPhaseChange
    batchSerializationSettings.concatOnPipelineStageChange strictOpVersions opxAliasChecking
    opxModifyChecking dotOpNames exportPoplarComputationGraph exportPoplarVertexGraph
    separateCallOpPdfs enableOutlining enableOutliningCopyCostPruning rearrangeAnchorsOnHost
    rearrangeStreamsOnHost enablePrefetchDatastreams enableNonStableSoftmax
    enableReplicatedGraphs enableGradientAccumulation instrumentWithHardwareCycleCounter
    enablePipelining disableGradAccumulationTensorStreams disableOptimizerStateTensorStreams
    compileEngine constantWeights enableEngineCaching enableMergeExchange
    enableFloatingPointChecks enableStochasticRounding ensureFp32LossScaleTensor
    explicitRecomputation enableExplicitMainLoops useHostCopyOps aliasZeroCopy delayVarUpdates
    enableFullyConnectedPass enableSerializedMatmuls enableStableNorm decomposeGradSum
    enableDistributedReplicatedGraphs groupHostSync automaticLossScalingSettings.enabled
    enableSupportedDataTypeCasting groupNormStridedChannelGrouping
    scheduleNonWeightUpdateGradientConsumersEarly
    replicatedCollectivesSettings.prepareScheduleForMergingCollectives
    replicatedCollectivesSettings.mergeAllReduceCollectives"""
_UINT64 = """device_iterations num_distributed_processes distributed_process_id ipu_version
    ipu_id gradient_accumulation output_return_period replication_factor input_group_size
    input_cgt execution_mode tensors_liveness output_mode connection_type
    accumulateOuterFragmentSettings.schedule max_repeat_logs
    accumulation_and_replication_reduction_type sync_pattern random_seed
    autodiffSettings.stitchStrategy batchSerializationSettings.transformContext
    batchSerializationSettings.method batchSerializationSettings.batchSchedule
    autoRecomputation mergeVarUpdate virtualGraphMode syntheticDataMode
    subgraphCopyingStrategy accumulationAndReplicationReductionType
    meanAccumulationAndReplicationReductionStrategy
    automaticLossScalingSettings.gradientTensorTrackingMethod executionPhaseSettings.phases
    executionPhaseSettings.stages batchSerializationSettings.factor firstDotOp finalDotOp
    numIOTiles mergeVarUpdateMemThreshold looseThresholdAtPeak accumulationFactor
    swapLimitScheduler globalReplicationFactor globalReplicaOffset defaultBufferingDepth
    defaultPrefetchBufferingDepth compilationProgressTotal
    transitiveClosureOptimizationThreshold automaticLossScalingSettings.updatePeriod"""
_DOUBLE = """outlineSequenceBreakCost outlineThreshold timeLimitScheduler
    automaticLossScalingSettings.thresholdUpperCountProportion
    automaticLossScalingSettings.binEdgeLocation"""
_STRING = """log_dir saveInitializersToFile logDir model_name cachePath partialsTypeMatMuls
    customCodeletCompileFlags serializedPoprithmsShiftGraphsDir kahnTieBreaker"""
_CONTAINER = """accumulateOuterFragmentSettings.excludedVirtualGraphs dotChecks
    hardwareInstrumentations customCodelets engineOptions reportOptions convolutionOptions
    matmulOptions lstmOptions gclOptions updatableNamedBuffers ipuof_configs"""

KINDS = {**dict.fromkeys(_BOOL.split(), "bool"), **dict.fromkeys(_UINT64.split(), "uint64"),
         **dict.fromkeys(_DOUBLE.split(), "floating point"),
         **dict.fromkeys(_STRING.split(), "string"),
         **dict.fromkeys(_CONTAINER.split(), "container")}
_LOCATIONS = ("location_activation", "location_weight", "location_optimizer",
              "location_accumulator")


def _text(value):
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def parse(opts, log=None):
    """PopTorch's backend's parse of an options dictionary (``to_dict``):
    raises ``Error`` for an unknown option or a value of a type no option
    takes; logs each option set at debug level on ``log``."""
    log = log or _log
    debug = log.isEnabledFor(logging.DEBUG)

    def set_(name, kind, shown):
        if KINDS.get(name) != kind:
            label = {"container": "set / vector"}.get(kind, kind)
            raise Error(f"Unknown {label} option {name}")
        if debug:
            log.debug("poptorch.Options set %s to value %s", name, shown)

    for name, value in opts.items():
        if name in ("patterns_level", "anchored_tensors", "compilation_progress_bar_fn"):
            continue
        if isinstance(value, bool):
            set_(name, "bool", _text(value))
        elif isinstance(value, float):
            set_(name, "floating point", _text(value))
        elif isinstance(value, int):
            set_(name, "uint64", value)
        elif isinstance(value, str):
            set_(name, "string", value)
        elif isinstance(value, (list, tuple, set)):
            for v in value:
                if KINDS.get(name) != "container":
                    raise Error(f"Unknown set / vector option {name}")
                if debug:
                    log.debug("poptorch.Options added %s to %s", v, name)
        elif isinstance(value, dict):
            if name == "available_memory_proportion":
                continue
            if name == "patterns":
                if "patterns_level" not in opts:
                    raise Error("PopART option 'patterns' should not be set without first "
                                "setting 'patterns_level'.")
                continue
            if name.startswith("location_"):
                if name not in _LOCATIONS:
                    raise Error(f"Unknown tensor location {name}")
                continue
            for k, v in value.items():
                if KINDS.get(name) != "container":
                    raise Error(f"Unknown map option {name}")
                if debug:
                    log.debug("poptorch.Options set %s[%s] to %s", name, k, _text(v))
        else:
            raise Error(f"Unknown value type {type(value).__name__} for option {name}")
