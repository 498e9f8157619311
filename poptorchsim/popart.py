"""PopART's Python names that PopTorch programs use, for ``import popart``
where no PopART is installed.

PopTorch programs import ``popart`` for its enums only, and pass them to
PopTorch as ints: ``opts._Popart.set("autoRecomputation",
int(popart.RecomputationType.Standard))``,
``opts.enableSyntheticData(int(popart.SyntheticDataMode.RandomNormal))``.
The enums here have PopART's Python names (its pybind11 module,
``python/popart/popart_core/popart.cpp``) and PopART's values (the C++
enums in ``willow/include/popart/*.hpp``); where the two names differ
(C++ ``RecomputationType::None`` is Python's ``NoRecompute``) the Python one
is used.  They are ``IntEnum``s, so ``int(member)`` gives PopART's value and
the member itself can be passed where PopTorch takes the int.

PopART's own graph-building and session API (``Builder``,
``TrainingSession``, ``DeviceManager``, ...) is not simulated: those names
exist, so ``isinstance(x, popart.DeviceInfo)`` works, but creating one raises
``PopartApiNotSimulatedError``.
"""
import enum

from .errors import Error

VERSION = (3, 4, 0)          # the PopART release whose names and values these are


class PopartApiNotSimulatedError(Error, NotImplementedError):
    """A PopART graph or session object was created: poptorchsim simulates
    PopTorch, whose programs only need PopART's enums."""


class _PopartEnum(enum.IntEnum):
    """An enum printed as PopART's pybind11 enums print: ``Type.Member``."""

    def __str__(self):
        return f"{type(self).__name__}.{self.name}"


def _enum(name, members, doc):
    cls = _PopartEnum(name, members, module=__name__)
    cls.__doc__ = doc
    return cls


# -- session options (willow/include/popart/sessionoptions.hpp) --------------------------
RecomputationType = _enum("RecomputationType", [
    ("NoRecompute", 0), ("Standard", 1), ("NormOnly", 2), ("Pipeline", 3),
    ("RecomputeAll", 4)], "SessionOptions.autoRecomputation.")
MergeVarUpdateType = _enum("MergeVarUpdateType", [
    ("Off", 0), ("All", 1), ("AutoLoose", 2), ("AutoTight", 3)],
    "SessionOptions.mergeVarUpdate (C++ None is Python's Off).")
VirtualGraphMode = _enum("VirtualGraphMode", [
    ("Off", 0), ("Manual", 1), ("Auto", 2), ("ExecutionPhases", 3)],
    "SessionOptions.virtualGraphMode.")
SyntheticDataMode = _enum("SyntheticDataMode", [
    ("Off", 0), ("Zeros", 1), ("RandomNormal", 2), ("RandomUniform", 3)],
    "SessionOptions.syntheticDataMode.")
AccumulateOuterFragmentSchedule = _enum("AccumulateOuterFragmentSchedule", [
    ("Scheduler", 0), ("Serial", 1), ("OverlapCycleOptimized", 2),
    ("OverlapMemoryOptimized", 3)], "accumulateOuterFragmentSettings.schedule.")
SubgraphCopyingStrategy = _enum("SubgraphCopyingStrategy", [
    ("OnEnterAndExit", 0), ("JustInTime", 1)], "SessionOptions.subgraphCopyingStrategy.")
BatchSerializationBatchSchedule = _enum("BatchSerializationBatchSchedule", [
    ("Scheduler", 0), ("Isomorphic", 1), ("OverlapOnIo", 2), ("OverlapOnCompute", 3)],
    "batchSerializationSettings.batchSchedule.")
BatchSerializationMethod = _enum("BatchSerializationMethod", [
    ("UnrollDynamic", 0), ("UnrollStatic", 1), ("Loop", 2)],
    "batchSerializationSettings.method.")
BatchSerializationTransformContext = _enum("BatchSerializationTransformContext", [
    ("Fwd", 0), ("Bwd", 1), ("Forward", 0), ("Backward", 1)],
    "batchSerializationSettings.transformContext (Forward and Backward are aliases).")
ExecutionPhaseSchedule = _enum("ExecutionPhaseSchedule", [
    ("Interleaving", 0), ("Batch", 1), ("BatchClusteredIO", 2)],
    "executionPhaseSettings.schedule.")
ExecutionPhaseIOSchedule = _enum("ExecutionPhaseIOSchedule", [
    ("Preload", 0), ("OnDemand", 1)], "executionPhaseSettings.*IOSchedule.")
MeanReductionStrategy = _enum("MeanReductionStrategy", [
    ("Running", 0), ("Post", 1)], "SessionOptions.meanAccumulationAndReplicationReductionStrategy.")
GradientTensorTrackingMethod = _enum("GradientTensorTrackingMethod", [
    ("AllNonViewChangingGradientTensors", 0), ("ConvAndMatmulGradients", 1),
    ("GradientsOfUserSpecifiedTensors", 2)],
    "automaticLossScalingSettings.gradientTensorTrackingMethod.")
AutodiffStitchStrategy = _enum("AutodiffStitchStrategy", [
    ("RecomputeMinimal", 0), ("RecomputeAllNonInputs", 1), ("AddFwdOutputs", 2),
    ("SafeAddFwdOutputs", 3)], "autodiffSettings.stitchStrategy.")
IrSerializationFormat = _enum("IrSerializationFormat", [("JSON", 0)],
                              "Format of a serialised IR.")
Instrumentation = _enum("Instrumentation", [("Outer", 0), ("Inner", 1)],
                        "SessionOptions.hardwareInstrumentations.")

# -- tensors and ops (tensorlocation.hpp, op.hpp, patterns.hpp, ...) ----------------------
TensorStorage = _enum("TensorStorage", [("OnChip", 0), ("OffChip", 1)],
                      "Where a tensor is stored.")
ReplicatedTensorSharding = _enum("ReplicatedTensorSharding", [("Off", 0), ("On", 1)],
                                 "Whether a tensor is sharded over replicas.")
TileSet = _enum("TileSet", [("Compute", 0), ("IO", 1)], "Compute or IO tiles.")
ExchangeStrategy = _enum("ExchangeStrategy", [
    ("JustInTime", 0), ("OverlapInnerLoop", 1), ("OverlapLoops", 2), ("OverlapStep", 3)],
    "How host exchanges overlap with compute.")
ReplicatedStreamMode = _enum("ReplicatedStreamMode", [("Broadcast", 0), ("Replicate", 1)],
                             "How an input stream feeds the replicas.")
ReductionType = _enum("ReductionType", [("Sum", 0), ("Mean", 1), ("NoReduction", 2)],
                      "Reduction of a loss or of replicated gradients.")
ScatterReduction = _enum("ScatterReduction", [
    ("Sum", 0), ("Max", 1), ("Min", 2), ("Mul", 3), ("NoReduction", 4)],
    "Reduction of scatterreduce (C++ None is Python's NoReduction).")
RecomputeType = _enum("RecomputeType", [
    ("Undefined", 0), ("Checkpoint", 1), ("Recompute", 2), ("Recomputed", 3)],
    "Recomputation of one op.")
PatternsLevel = _enum("PatternsLevel", [
    ("NoPatterns", 0), ("Minimal", 1), ("Default", 2), ("All", 3)],
    "Which PopART patterns run (Options._Popart.setPatterns's level).")
InitType = _enum("InitType", [("NoInit", 0), ("Zero", 1)], "Init op's initial value.")
TensorRemapType = _enum("TensorRemapType", [("FwdBwdReverse", 0), ("FwdBwd", 1), ("Fwd", 2)],
                        "Tensor remapping.")
AnchorReturnTypeId = _enum("AnchorReturnTypeId", [
    ("Final", 0), ("EveryN", 1), ("All", 2), ("Sum", 3)],
    "Which micro-batches an anchor returns (PopTorch's OutputMode).")

# -- optimizers (optimizer.hpp, sgd.hpp, adam.hpp, adaptive.hpp) --------------------------
WeightDecayMode = _enum("WeightDecayMode", [("Decay", 0), ("L2Regularization", 1)],
                        "Weight decay or L2 regularisation.")
SGDAccumulatorAndMomentum = _enum("SGDAccumulatorAndMomentum", [
    ("Combined", 0), ("Separate", 1)], "SGD's accumulator and momentum tensors.")
AdamMode = _enum("AdamMode", [
    ("Adam", 0), ("AdamNoBias", 1), ("AdaMax", 2), ("Lamb", 3), ("LambNoBias", 4)],
    "Adam's variant.")
AdaptiveMode = _enum("AdaptiveMode", [
    ("AdaGrad", 0), ("RMSProp", 1), ("CenteredRMSProp", 2), ("AdaDelta", 3)],
    "Adaptive optimizer's variant.")

# -- devices (devicemanager.hpp, variablesettings.hpp) -------------------------------------
SyncPattern = _enum("SyncPattern", [("Full", 0), ("SinglePipeline", 1),
                                    ("ReplicaAndLadder", 2)], "IPU sync pattern.")
DeviceType = _enum("DeviceType", [
    ("IpuModel", 0), ("Cpu", 1), ("Ipu", 2), ("OfflineIpu", 3), ("Sim", 4)],
    "Kind of device.")
DeviceConnectionType = _enum("DeviceConnectionType", [
    ("Always", 0), ("OnDemand", 1), ("Never", 2)], "When to attach to the device.")
DeviceSelectionCriterion = _enum("DeviceSelectionCriterion", [("First", 0), ("Random", 1)],
                                 "Which free device to pick.")
VariableRetrievalMode = _enum("VariableRetrievalMode", [
    ("OnePerGroup", 0), ("AllReduceReplicas", 1), ("AllReplicas", 2)],
    "Which replicas' copies of a variable are read back.")


def versionString():
    """The PopART release whose names and values this module carries."""
    return ".".join(map(str, VERSION)) + " (poptorchsim)"


def versionNumber():
    """``(major, minor, point)``, as PopART's ``versionNumber()``."""
    return VERSION


# -- PopART's own graph and session API: not simulated --------------------------------------
_GRAPH_API = (
    "Builder", "AiGraphcoreOpset1", "AiOnnxOpset11", "TrainingSession", "InferenceSession",
    "Session", "DeviceManager", "DeviceInfo", "DataFlow", "AnchorReturnType", "PyStepIO",
    "PyStepIOCallback", "StepIO", "SessionOptions", "TensorInfo", "TensorLocation",
    "TensorLocationSettings", "InputShapeInfo", "Patterns", "SGD", "ConstSGD", "Adam",
    "Adaptive", "ClipNormSettings", "OptimizerValue", "Ir", "Logger",
    "AutomaticLossScalingSettings", "BatchSerializationSettings",
    "AccumulateOuterFragmentSettings", "ExecutionPhaseSettings", "ReplicatedCollectivesSettings",
    "VariableSettings", "CommGroup", "DebugContext")


def _not_simulated(name):
    def refuse(cls, *args, **kwargs):
        raise PopartApiNotSimulatedError(
            f"popart.{name}: PopART's own graph-building and session API is not simulated "
            "by poptorchsim. PopTorch programs only need PopART's enums (popart."
            "RecomputationType, popart.SyntheticDataMode, ...), passed to "
            "poptorch.Options (opts._Popart.set(\"autoRecomputation\", "
            "int(popart.RecomputationType.Standard))); build the model with PyTorch and "
            "run it with poptorch.trainingModel / poptorch.inferenceModel instead.")
    return refuse


for _name in _GRAPH_API:
    globals()[_name] = type(_name, (), {
        "__new__": _not_simulated(_name), "__module__": __name__,
        "__doc__": f"PopART's {_name}: not simulated (creating one raises "
                   "PopartApiNotSimulatedError)."})


def getLogger(name="all"):
    """PopART's C++ logger: not simulated (poptorchsim logs to the Python
    logger "poptorchsim")."""
    return globals()["Logger"](name)      # one of _GRAPH_API's, made above


def __getattr__(name):
    raise AttributeError(
        f"module 'popart' (poptorchsim's stand-in, poptorchsim.popart) has no attribute "
        f"{name!r}: it holds PopART's enums that PopTorch programs pass to PopTorch "
        "(RecomputationType, SyntheticDataMode, ...), versionString(), and the names of "
        "PopART's graph API, which is not simulated.")


__all__ = [n for n in list(globals()) if not n.startswith("_") and n not in ("enum", "Error")]
