"""PopTorch's execution strategies: how blocks become stages, phases and IPUs.

``Options.setExecutionStrategy`` takes one of them (``PipelinedExecution``,
the default, or ``ShardedExecution``; phased execution with
``SerialPhasedExecution`` or ``ParallelPhasedExecution``).  A strategy
groups blocks into *stages*: automatically (``AutoStage``) or as given
(``"A"``, ``["A", "B"]`` or ``Stage("A", "B").ipu(1)``).  The compiler hands
it the blocks in the order the model entered them and gets back each
block's stage and IPU (``strategy.assign(blocks, default=...)``); the
numbering, PopTorch's rules, is ``passes/stages.py``, which the strategies
call with what the user gave them.

Phased execution groups stages into *phases* (``Phase``): the stages of a
phase run at the same time, each on its own IPU, and the phases run one
after the other.  Stage ids are dense, in phase order, then stage order
within the phase.

The user imports these from ``poptorchsim`` (``poptorchsim.annotations``
re-exports them too).
"""
from .. import enums
from ..passes import stages as _stage_rules


# ---------------------------------------------------------------------------
# Stages and strategies
# ---------------------------------------------------------------------------
class Stage:
    """One or more blocks that run as one stage, on one IPU."""

    def __init__(self, *block_ids):
        assert all(isinstance(b, str) for b in block_ids), (
            f"Block IDs are supposed to be strings but got {block_ids}")
        self._blocks = block_ids
        self._stage_id = -1
        self._phase_id = -1
        self._ipu = None

    @property
    def blocks(self):
        """The ids of the blocks this stage is made of."""
        return self._blocks

    def ipu(self, ipu):
        """Runs this stage on IPU ``ipu`` (overrides the blocks' ``ipu_id``)."""
        assert isinstance(ipu, int) and not isinstance(ipu, bool) and ipu >= 0, (
            f"Stage.ipu() expects a non-negative integer (got {ipu!r})")
        self._ipu = ipu
        return self

    def __repr__(self):
        blocks = ", ".join(repr(b) for b in self._blocks)
        ipu = "" if self._ipu is None else f".ipu({self._ipu})"
        return f"Stage({blocks}){ipu}"


class _IExecutionStrategy:
    """Base of the execution strategies ``Options.setExecutionStrategy`` takes."""

    execution_mode = None      # PopTorch's backend ``execution_mode``

    def backendOptions(self):
        return {}

    @property
    def is_pipelined(self):
        return False

    @property
    def is_sharded(self):
        return False

    @property
    def is_phased(self):
        return False


class _StagedExecution(_IExecutionStrategy):
    """Shared by pipelined and sharded execution: the same arguments, the
    same stage and IPU assignment."""

    def __init__(self, *args):
        self._auto_stage = enums.AutoStage.SameAsIpu
        self._stages = []
        self._block_map = {}
        if len(args) == 1 and isinstance(args[0], enums.AutoStage):
            self._auto_stage = enums.AutoStage(args[0])
            return
        for stage_id, arg in enumerate(args):
            if isinstance(arg, Stage):
                stage = arg
            elif isinstance(arg, str):
                stage = Stage(arg)
            elif isinstance(arg, (list, tuple)):
                stage = Stage(*arg)
            else:
                raise AssertionError(
                    f"{type(self).__name__} takes a single poptorch.AutoStage, or "
                    "stages given as block ids, lists of block ids or "
                    f"poptorch.Stage objects (got {arg!r})")
            stage._stage_id = stage_id
            for block in stage.blocks:
                assert block not in self._block_map, (
                    f"{block} associated with more than one stage")
                self._block_map[block] = stage
            self._stages.append(stage)

    # -- user side ----------------------------------------------------------------
    def stage(self, block_id):
        """The ``Stage`` block ``block_id`` belongs to, to edit (``.ipu(n)``)."""
        assert block_id in self._block_map, f"Unknown block {block_id}"
        return self._block_map[block_id]

    @property
    def stages(self):
        """The explicit stages, in stage-id order (empty when automatic)."""
        return list(self._stages)

    @property
    def auto_stage(self):
        """The ``AutoStage`` rule in use, or None when stages are explicit."""
        return None if self._block_map else self._auto_stage

    # -- compiler side ------------------------------------------------------------
    def spec(self):
        """What the compiler needs, as plain data (``passes.stages.StagedSpec``)."""
        return _stage_rules.StagedSpec(
            tuple((block, stage._stage_id, stage._ipu)
                  for block, stage in self._block_map.items()),
            auto_increment=self._auto_stage != enums.AutoStage.SameAsIpu,
            pipelined=self.is_pipelined)

    def assign(self, blocks, default=False):
        """``{user_id: (stage_id, ipu)}`` for ``blocks``, the ``(user_id,
        ipu_id)`` pairs in the order the model entered them
        (``passes.stages.assign_staged``).  ``default``: the model runs ops
        before its first block (PopTorch's default block, key ``None``)."""
        return self.spec().assign(blocks, default)

    def __repr__(self):
        if self._block_map:
            args = ", ".join(repr(s) for s in self._stages)
        elif self._auto_stage != enums.AutoStage.SameAsIpu:
            args = f"poptorch.AutoStage.{self._auto_stage.name}"
        else:
            args = ""
        return f"{type(self).__name__}({args})"


class PipelinedExecution(_StagedExecution):
    """Pipelines the model's stages over IPUs: the default strategy.

    >>> PipelinedExecution()                         # stage = each block's ipu_id
    >>> PipelinedExecution(AutoStage.AutoIncrement)  # a new stage per new block
    >>> PipelinedExecution("A", ["B", "C"], Stage("D").ipu(3))
    """

    execution_mode = 0

    def backendOptions(self):
        return {"execution_mode": 0}

    @property
    def is_pipelined(self):
        return True


class ShardedExecution(_StagedExecution):
    """Runs the stages one after the other, one IPU active at a time.

    Takes the same arguments as ``PipelinedExecution``."""

    execution_mode = 1

    def backendOptions(self):
        return {"execution_mode": 1}

    @property
    def is_sharded(self):
        return True


# ---------------------------------------------------------------------------
# Phased execution
# ---------------------------------------------------------------------------
class Phase:
    """An execution phase: stages that run at the same time, each on its own IPU.

    >>> Phase(Stage("A").ipu(0), Stage("B").ipu(1))   # two stages
    >>> Phase("A", "B")                                # one stage of two blocks
    >>> Phase([Stage("A"), Stage("B")]).ipus(0, 2)     # a list works too
    """

    def __init__(self, *arg):
        if len(arg) == 1 and isinstance(arg[0], (list, tuple)):
            arg = tuple(arg[0])
        if all(isinstance(elt, Stage) for elt in arg):
            self.stages = list(arg)
        else:
            assert all(isinstance(elt, str) for elt in arg), (
                "All arguments must either be block IDs (strings) or Stages: "
                + str([type(elt) for elt in arg]))
            self.stages = [Stage(*arg)]

    def stage(self, idx):
        """The ``idx``-th ``Stage`` of this phase."""
        return self.stages[idx]

    def ipus(self, *ipus):
        """Runs the phase's stages on ``ipus``, one IPU per stage, in order."""
        assert len(ipus) == len(self.stages), (
            f"Phase contains {len(self.stages)} stages but you provided "
            f"{len(ipus)} ipus")
        for stage, ipu in zip(self.stages, ipus):
            stage.ipu(ipu)
        return self

    def __repr__(self):
        return f"Phase({', '.join(repr(s) for s in self.stages)})"


class _IPhasedExecution(_IExecutionStrategy):
    """Shared by serial and parallel phased execution.

    Phases are given as ``Phase`` objects, lists of ``Stage`` objects, lists
    of block ids (one stage), a bare block id or a bare ``Stage``.  Stage ids
    are dense: phase order first, then stage order within the phase.
    """

    execution_mode = 2
    serial = None              # True for serial phases, False for parallel

    def __init__(self, *phases):
        assert phases, ("There is currently no AutoStage for PhasedExecution, "
                        "please explicitly specify the phases")
        # PopTorch's docstrings pass one list of Phase objects: take it too.
        if (len(phases) == 1 and isinstance(phases[0], (list, tuple)) and phases[0]
                and all(isinstance(p, Phase) for p in phases[0])):
            phases = tuple(phases[0])
        self._tensors_liveness = enums.Liveness.AlwaysLive
        self._separate_backward_phase = False
        self._phases = []
        self._stages = []          # stage id -> Stage
        self._position = []        # stage id -> (phase index, index in the phase)
        self._block_map = {}       # block id -> stage id
        for phase_id, arg in enumerate(phases):
            if isinstance(arg, Phase):
                phase = arg
            elif isinstance(arg, (list, tuple)):
                phase = Phase(*arg)
            elif isinstance(arg, (str, Stage)):
                phase = Phase(arg)
            else:
                raise AssertionError(
                    f"{type(self).__name__} takes phases given as poptorch.Phase "
                    "objects, lists of poptorch.Stage objects or lists of block ids "
                    f"(got {arg!r})")
            self._phases.append(phase)
            for index, stage in enumerate(phase.stages):
                stage_id = len(self._stages)
                stage._stage_id = stage_id
                stage._phase_id = phase_id
                for block in stage.blocks:
                    assert block not in self._block_map, (
                        f"{block} associated with more than one stage")
                    self._block_map[block] = stage_id
                self._stages.append(stage)
                self._position.append((phase_id, index))

    # -- user side ----------------------------------------------------------------
    def phase(self, phase):
        """The ``Phase`` at index ``phase``, to edit (``.ipus(...)``)."""
        assert isinstance(phase, int) and not isinstance(phase, bool) and phase >= 0, (
            "Phases are identified by positive integers")
        if phase >= len(self._phases):
            raise IndexError(f"Phase {phase} does not exist: this strategy has "
                             f"{len(self._phases)} phases")
        return self._phases[phase]

    def stage(self, block_id):
        """The ``Stage`` block ``block_id`` belongs to, to edit (``.ipu(n)``)."""
        assert block_id in self._block_map, f"Unknown block {block_id}"
        return self._stages[self._block_map[block_id]]

    def useSeparateBackwardPhase(self, use=True):
        """With ``True`` no phase is shared by the forward and backward passes:
        forward phases 0, 1, 2 are followed by backward phases 4, 5, 6 instead
        of 2, 3, 4 (the last forward phase also starting the backward pass)."""
        assert isinstance(use, bool), (
            f"useSeparateBackwardPhase expects a bool (got {use!r})")
        self._separate_backward_phase = use
        return self

    @property
    def phases(self):
        """The phases, in order."""
        return list(self._phases)

    @property
    def stages(self):
        """Every stage, in stage-id order."""
        return list(self._stages)

    @property
    def separate_backward_phase(self):
        return self._separate_backward_phase

    @property
    def tensors_liveness(self):
        """The ``poptorch.Liveness`` of the activations."""
        return enums.Liveness(self._tensors_liveness)

    @property
    def is_phased(self):
        return True

    def backendOptions(self):
        return {"execution_mode": 2,
                "separate_backward_phase": self._separate_backward_phase,
                "tensors_liveness": int(self._tensors_liveness),
                "serial_phases_execution": bool(self.serial)}

    # -- compiler side ------------------------------------------------------------
    def assign(self, blocks, default=False):
        """``{user_id: (stage_id, ipu)}`` for ``blocks``, the ``(user_id,
        ipu_id)`` pairs in the order the model entered them
        (``passes.stages.assign_phased``).  IPU = ``Stage.ipu()`` (or
        ``Phase.ipus()``) if set, else the block's ``ipu_id``, else the layout
        PopTorch's documentation describes: serial phases put the k-th stage of
        every phase on IPU k; parallel phases put it on IPU ``2k + phase % 2``.
        ``default``: the model runs ops before its first block (PopTorch's
        default block, key ``None``, in phase 0 on IPU 0)."""
        return self.spec().assign(blocks, default)

    def spec(self):
        """What the compiler needs, as plain data (``passes.stages.PhasedSpec``)."""
        return _stage_rules.PhasedSpec(
            tuple(self._block_map.items()), tuple(stage._ipu for stage in self._stages),
            tuple(self._position), tuple(len(phase.stages) for phase in self._phases),
            bool(self.serial), self.tensors_liveness.name, type(self).__name__)

    def phase_of_stage(self):
        """The phase index of every stage id."""
        return self.spec().phase_of_stage()

    def check(self, stage_of_block):
        """PopTorch's compile-time rules for phases; ``stage_of_block`` is what
        ``assign`` returned.  Raises ``poptorch.Error``."""
        self.spec().check(stage_of_block)

    def _repr_settings(self):
        return ".useSeparateBackwardPhase()" if self._separate_backward_phase else ""

    def __repr__(self):
        phases = ", ".join(repr(p) for p in self._phases)
        return f"{type(self).__name__}({phases}){self._repr_settings()}"


class SerialPhasedExecution(_IPhasedExecution):
    """All the phases run one after the other on the same group of IPUs
    (phase 0 on IPUs 0 & 1, then phase 1 on IPUs 0 & 1, ...).

    >>> strategy = SerialPhasedExecution(Phase(Stage("A"), Stage("A2")),
    ...                                  Phase(Stage("B"), Stage("B2")))
    >>> strategy.phase(0).ipus(0, 1)
    >>> strategy.phase(1).ipus(0, 1)
    """

    serial = True

    def setTensorsLiveness(self, liveness):
        """Where activations live between phases: see ``poptorch.Liveness``."""
        assert isinstance(liveness, enums.Liveness), (
            f"setTensorsLiveness expects a poptorch.Liveness (got {liveness!r})")
        self._tensors_liveness = liveness
        return self

    def _repr_settings(self):
        out = super()._repr_settings()
        if self.tensors_liveness != enums.Liveness.AlwaysLive:
            out += f".setTensorsLiveness(poptorch.Liveness.{self.tensors_liveness.name})"
        return out


class ParallelPhasedExecution(_IPhasedExecution):
    """Phases alternate between two groups of IPUs: even phases on even IPUs,
    odd phases on odd IPUs (phase 0 on IPUs 0 & 2, phase 1 on 1 & 3, ...), so
    one group loads the next phase while the other computes.

    >>> strategy = ParallelPhasedExecution(Phase(Stage("0"), Stage("1")),
    ...                                    Phase(Stage("2"), Stage("3")))
    >>> strategy.phase(0).ipus(0, 2)
    >>> strategy.phase(1).ipus(1, 3)
    """

    serial = False

    def sendTensorsOffChipAfterFwd(self, off_chip=True):
        """``True``: activations wait in Streaming Memory between the forward
        and backward passes (``Liveness.OffChipAfterFwd``); ``False``: they stay
        on chip (``Liveness.AlwaysLive``)."""
        assert isinstance(off_chip, bool), (
            f"sendTensorsOffChipAfterFwd expects a bool (got {off_chip!r})")
        self._tensors_liveness = (enums.Liveness.OffChipAfterFwd if off_chip
                                  else enums.Liveness.AlwaysLive)
        return self

    def _repr_settings(self):
        out = super()._repr_settings()
        liveness = self.tensors_liveness
        if liveness == enums.Liveness.OffChipAfterFwd:
            out += ".sendTensorsOffChipAfterFwd()"
        elif liveness != enums.Liveness.AlwaysLive:
            out += f" (tensors_liveness=poptorch.Liveness.{liveness.name})"
        return out
