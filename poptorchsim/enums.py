"""PopTorch's enumerations, with PopTorch's names and values."""
import enum


class OutputMode(enum.IntEnum):
    """Which micro-batches' outputs a call returns to the host."""
    Final = 0
    EveryN = 1
    All = 2
    Sum = 3
    Default = 4


# Older PopTorch releases called it AnchorMode.
AnchorMode = OutputMode


class DataLoaderMode(enum.IntEnum):
    Sync = 0
    Async = 1
    AsyncRebatched = 2


class SharingStrategy(enum.IntEnum):
    SharedMemory = 0
    FileSystem = 1
    Fork = 2
    ForkServer = 3


class ConnectionType(enum.IntEnum):
    Always = 0
    OnDemand = 1
    Never = 2


class ReductionType(enum.IntEnum):
    Sum = 0
    Mean = 1
    NoReduction = 2


class MeanReductionStrategy(enum.IntEnum):
    Running = 0
    Post = 1
    PostAndLoss = 2


class SyncPattern(enum.IntEnum):
    Full = 0
    SinglePipeline = 1
    ReplicaAndLadder = 2


class MatMulSerializationMode(enum.Enum):
    InputChannels = "input_channels"
    ReducingDim = "reducing_dim"
    OutputChannels = "output_channels"
    Disabled = "none"


class Liveness(enum.IntEnum):
    AlwaysLive = 0
    OffChipAfterFwd = 1
    OffChipAfterFwdNoOverlap = 2
    OffChipAfterEachPhase = 3


class AutoStage(enum.IntEnum):
    SameAsIpu = 0
    AutoIncrement = 1


class CommGroupType(enum.IntEnum):
    All = 0
    Consecutive = 1
    Orthogonal = 2
    NoGrouping = 3


class VariableRetrievalMode(enum.IntEnum):
    OnePerGroup = 0
    AllReplicas = 2


class OverlapMode(enum.Enum):
    """How far ahead an input (output) marked by ``set_overlap_for_input``
    (``set_overlap_for_output``) streams through the IO tiles while the
    compute tiles work: not at all, one gradient-accumulation step ahead, or
    across device iterations too."""
    NoOverlap = "no_overlap"
    OverlapAccumulationLoop = "overlap_accumulation_loop"
    OverlapDeviceIterationLoop = "overlap_device_iteration_loop"


class MultiConvPlanType(enum.IntEnum):
    """How a ``MultiConv``'s convolutions are planned: in one compute set
    (each on its share of the tiles) or one after another."""
    Parallel = 0
    Serial = 1


class HalfFloatCastingBehavior(enum.IntEnum):
    """(deprecated) Only used for tracing.

    HalfUpCastToFloat is now the only supported option: ops with fp16 and
    fp32 operands compute in fp32, as PyTorch does."""
    FloatDowncastToHalf = 0
    HalfUpcastToFloat = 1
    Default = 2


class RandomStreams(enum.Enum):
    """Where random ops draw from on the host (``Options.randomStreams``;
    poptorchsim's own).  ``PerMicroBatch`` (the default): a counter-based
    stream per replica, micro-batch and op, as the IPU seeds its generators
    from ``randomSeed``; the numbers do not depend on the order micro-batches
    run in, so programs with dropout batch them.  ``Eager``: PyTorch's
    global generator, drawn in eager order (the same dropout masks as plain
    PyTorch under the same ``torch.manual_seed``; micro-batches then run
    one after another).  The environment variable
    ``POPTORCHSIM_RANDOM_STREAMS=eager`` chooses ``Eager`` for an
    unchanged program."""
    PerMicroBatch = "counter"
    Eager = "eager"
