"""Stage and IPU of every block: the numbering behind the execution strategies.

The face's strategies (``PipelinedExecution``, ``ShardedExecution``,
``SerialPhasedExecution``, ``ParallelPhasedExecution``) hold what the user
said; their ``assign(blocks, default=...)`` and ``check`` hand it here as
plain data and get back ``{user_id: (stage_id, ipu)}``, following
PopTorch's rules:

* ``assign_staged`` (pipelined and sharded execution):

  - no arguments (``AutoStage.SameAsIpu``): stage = the block's ``ipu_id``;
  - ``AutoStage.AutoIncrement``: each new block starts the next stage (from
    1: stage 0 holds the ops before the first block), except that, when
    pipelining, consecutive blocks on one IPU share a stage;
  - explicit stages: stage = position in the strategy's argument list;
  - IPU = ``Stage.ipu()`` if set, else the block's ``ipu_id``, else the stage.

* ``assign_phased`` (phased execution): stage ids are dense, in phase order,
  then stage order within the phase; IPU = ``Stage.ipu()`` if set, else the
  block's ``ipu_id``, else the layout of PopTorch's documentation.
* ``check_phases``: PopTorch's compile-time rules for phases.

``blocks`` is always the ``(user_id, ipu_id)`` pairs in the order the model
entered them; a block id seen twice keeps its first entry.  Block id
``None`` is PopTorch's default block: the ops before the first block.
"""
from dataclasses import dataclass

from ..errors import Error

# Liveness settings that only serial phases support (``poptorch.Liveness`` names)
SERIAL_ONLY_LIVENESS = ("OffChipAfterEachPhase", "OffChipAfterFwdNoOverlap")


def first_set(*values):
    """The first value that is not None."""
    return next(v for v in values if v is not None)


def entered_blocks(blocks):
    """``{user_id: ipu_id}`` in the order the blocks were first entered."""
    entered: dict = {}
    for user_id, ipu_id in blocks:
        entered.setdefault(user_id, ipu_id)
    return entered


# ---------------------------------------------------------------------------
# Pipelined and sharded execution
# ---------------------------------------------------------------------------
def assign_staged(blocks, explicit=None, auto_increment=False, pipelined=False,
                  default=False):
    """``{user_id: (stage_id, ipu)}`` for pipelined or sharded execution.

    ``explicit``: ``{block id: (stage id, Stage.ipu() or None)}`` for the
    stages the strategy was given, in the order given (empty: automatic
    stages); ``auto_increment``: ``AutoStage.AutoIncrement`` rather than
    ``SameAsIpu``; ``pipelined``: pipelined rather than sharded execution.

    ``default``: the model runs ops before its first block; they form
    PopTorch's default block, key ``None``, on IPU 0 in stage 0 (the stage
    and IPU PopTorch's compiler starts with).  With ``AutoIncrement``
    PopTorch numbers blocks from stage 1, after that default stage;
    pipelining merges the default stage with a first block on IPU 0."""
    entered = entered_blocks(blocks)
    if explicit:
        out = _assign_explicit(entered, explicit)
    elif not auto_increment:
        out = _assign_same_as_ipu(entered)
    else:
        return _assign_auto_increment({None: 0, **entered} if default else entered,
                                      pipelined)
    return {None: (0, 0), **out} if default else out


def _assign_explicit(entered, explicit):
    out = {}
    for user_id, ipu_id in entered.items():
        assert user_id in explicit, (
            f"Unknown Block '{user_id}' list of expected Blocks: "
            f"{list(explicit)}")
        stage_id, stage_ipu = explicit[user_id]
        out[user_id] = (stage_id, first_set(stage_ipu, ipu_id, stage_id))
    return out


def _assign_same_as_ipu(entered):
    out = {}
    for user_id, ipu_id in entered.items():
        assert ipu_id is not None, (
            "poptorch.AutoStage.SameAsIpu was selected but no IPU was "
            f"specified for block {user_id}")
        out[user_id] = (ipu_id, ipu_id)
    return out


def _assign_auto_increment(entered, pipelined):
    """PopTorch numbers blocks 1, 2, ... in the order the model enters
    them (stage 0 is the default block's, key ``None``); a block with no
    ``ipu_id`` runs on the IPU of that number.  When pipelining,
    consecutive blocks on one IPU are one stage (PopTorch starts a stage
    at each change of IPU), with the first one's number."""
    out = {}
    stage, number, last_ipu = None, 0, None
    for user_id, ipu_id in entered.items():
        if user_id is not None:
            number += 1
        ipu = first_set(ipu_id, 0 if user_id is None else number)
        if stage is None or not (pipelined and ipu == last_ipu):
            stage = 0 if user_id is None else number
        last_ipu = ipu
        out[user_id] = (stage, ipu)
    return out


# ---------------------------------------------------------------------------
# Phased execution
# ---------------------------------------------------------------------------
def default_phased_ipu(phase, index, serial):
    """The IPU of the ``index``-th stage of phase ``phase`` when neither the
    stage nor its blocks name one: serial phases put the k-th stage of every
    phase on IPU k; parallel phases put it on IPU ``2k + phase % 2`` (phase
    0 on IPUs 0, 2, ...; phase 1 on 1, 3, ...)."""
    return index if serial else 2 * index + phase % 2


def assign_phased(blocks, stage_of_block, stage_ipus, positions, serial, default=False):
    """``{user_id: (stage_id, ipu)}`` for phased execution.

    ``stage_of_block``: ``{block id: stage id}``, in the order the strategy
    was given its blocks; ``stage_ipus``: each stage's ``Stage.ipu()`` (or
    None); ``positions``: each stage's ``(phase index, index in the
    phase)``; ``serial``: serial rather than parallel phases.

    ``default``: the model runs ops before its first block; they form
    PopTorch's default block, key ``None``, in phase 0 on IPU 0 (the stage
    of phase 0 on IPU 0 where there is one)."""
    out = {}
    for user_id, ipu_id in entered_blocks(blocks).items():
        assert user_id in stage_of_block, (
            f"Unknown Block '{user_id}' list of expected Blocks: "
            f"{list(stage_of_block)}")
        stage_id = stage_of_block[user_id]
        phase, index = positions[stage_id]
        out[user_id] = (stage_id, first_set(stage_ipus[stage_id], ipu_id,
                                            default_phased_ipu(phase, index, serial)))
    if default:
        phase_of = [phase for phase, _ in positions]
        on_ipu0 = sorted(s for s, ipu in out.values() if ipu == 0 and phase_of[s] == 0)
        out = {None: (on_ipu0[0] if on_ipu0 else 0, 0), **out}
    return out


def check_phases(stage_of_block, positions, stages_per_phase, serial, liveness,
                 strategy_name):
    """PopTorch's compile-time rules for phases.  ``stage_of_block`` is what
    ``assign_phased`` returned; ``stages_per_phase``: how many stages each
    phase has; ``liveness``: the name of the activations' ``poptorch.Liveness``;
    ``strategy_name``: the strategy's class name, for the message.  Raises
    ``poptorch.Error``."""
    if not serial and liveness in SERIAL_ONLY_LIVENESS:
        raise Error(
            "This is only supported for serial phase execution: "
            f"poptorch.Liveness.{liveness} was set on a "
            f"{strategy_name}. Use poptorch.SerialPhasedExecution, or "
            "Liveness.AlwaysLive / Liveness.OffChipAfterFwd "
            "(sendTensorsOffChipAfterFwd()) with parallel phases.")
    if serial:
        return
    phase_of = [phase for phase, _ in positions]
    for user_id, (stage_id, ipu) in stage_of_block.items():
        phase = phase_of[stage_id]
        if phase % 2 == ipu % 2:
            continue
        n = stages_per_phase[phase]
        fix = ", ".join(str(2 * k + phase % 2) for k in range(n))
        parity = "even" if phase % 2 == 0 else "odd"
        raise Error(
            "When phases are executed in parallel: even phases must run on even "
            f"IPUs and odd phases on odd IPUs. Block '{user_id}' (stage {stage_id}) "
            f"is in phase {phase} but runs on IPU {ipu}. Put phase {phase}'s "
            f"stages on {parity} IPUs, for example "
            f"strategy.phase({phase}).ipus({fix}), or give its blocks {parity} "
            "ipu_ids.")


# ---------------------------------------------------------------------------
# A strategy as data: what the face hands the compiler
# ---------------------------------------------------------------------------
@dataclass(frozen=True)
class StagedSpec:
    """Pipelined or sharded execution, as plain data (``strategy.spec()``).
    ``explicit``: ``((block id, stage id, Stage.ipu() or None), ...)`` for
    stages the user gave; empty for automatic stages."""
    explicit: tuple = ()
    auto_increment: bool = False
    pipelined: bool = True
    phased = False

    def assign(self, blocks, default=False):
        explicit = {b: (s, ipu) for b, s, ipu in self.explicit}
        return assign_staged(blocks, explicit, auto_increment=self.auto_increment,
                             pipelined=self.pipelined, default=default)


@dataclass(frozen=True)
class PhasedSpec:
    """Serial or parallel phased execution, as plain data (``strategy.spec()``).
    ``stage_of_block``: ``((block id, stage id), ...)`` in the order given;
    ``stage_ipus``: each stage's ``Stage.ipu()`` or None; ``positions``: each
    stage's ``(phase, index in the phase)``."""
    stage_of_block: tuple
    stage_ipus: tuple
    positions: tuple
    stages_per_phase: tuple
    serial: bool
    liveness: str = "AlwaysLive"      # poptorch.Liveness name of the activations
    strategy_name: str = ""
    pipelined = False
    phased = True

    def assign(self, blocks, default=False):
        return assign_phased(blocks, dict(self.stage_of_block), list(self.stage_ipus),
                             list(self.positions), self.serial, default=default)

    def phase_of_stage(self):
        return [phase for phase, _ in self.positions]

    def check(self, stage_of_block):
        check_phases(stage_of_block, list(self.positions), list(self.stages_per_phase),
                     self.serial, self.liveness, self.strategy_name)

    @property
    def activations_off_chip(self):
        return self.liveness != "AlwaysLive"
