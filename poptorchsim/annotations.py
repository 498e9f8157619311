"""PopTorch's multi-IPU face: blocks, stages and execution strategies.

Annotations say which *block* the ops of a model belong to::

    poptorch.BeginBlock(model.layer2, "L2", ipu_id=1)    # forward pre-hook
    with poptorch.Block("head", ipu_id=1): ...           # scope
    @poptorch.BlockFunction("decoder", ipu_id=1)         # decorator

While a model is traced they call ``capture.blocks.enter_block``, which tags
every fx node created afterwards with ``(user_id, ipu_id)``; when the model
runs on the CPU they do nothing.

An execution strategy (``PipelinedExecution``, the default, or
``ShardedExecution``) groups blocks into *stages*.  The compiler hands it
the blocks in the order the model entered them and gets back each block's
stage and IPU (``strategy.assign(blocks)``), following PopTorch's rules:

* no arguments (``AutoStage.SameAsIpu``): stage = the block's ``ipu_id``;
* ``AutoStage.AutoIncrement``: each new block starts the next stage (from 1:
  stage 0 holds the ops before the first block), except that, when
  pipelining, consecutive blocks on one IPU share a stage;
* explicit stages (``"A"``, ``["A", "B"]`` or ``Stage("A", "B").ipu(1)``):
  stage = position in the argument list;
* IPU = ``Stage.ipu()`` if set, else the block's ``ipu_id``, else the stage.

Phased execution (``SerialPhasedExecution``, ``ParallelPhasedExecution``)
groups stages into *phases* (``Phase``): the stages of a phase run at the same
time, each on its own IPU, and the phases run one after the other.  Stage ids
are dense, in phase order, then stage order within the phase.
"""
import functools

import torch
import torch.utils._pytree as _pytree

from . import enums
from .capture import blocks as _blocks
from .errors import Error, createPoptorchError

BlockId = str


# ---------------------------------------------------------------------------
# Block ids
# ---------------------------------------------------------------------------
def _check_ids(user_id, ipu_id):
    assert user_id is None or isinstance(user_id, str) or (
        isinstance(user_id, int) and not isinstance(user_id, bool) and user_id >= 0), (
            f"user_id must be either a string or a non-negative integer (got {user_id!r})")
    assert ipu_id is None or (
        isinstance(ipu_id, int) and not isinstance(ipu_id, bool) and ipu_id >= 0), (
            f"ipu_id must be either None or a non-negative integer (got {ipu_id!r})")


def _block_id(user_id):
    """``user_id`` as a string, or the next automatic id ("0", "1", ...)."""
    if user_id is not None:
        return str(user_id)
    user_id = str(Block._next_auto_id)
    Block._next_auto_id += 1
    return user_id


# ---------------------------------------------------------------------------
# Annotations
# ---------------------------------------------------------------------------
class Block:
    """Ops run inside ``with Block(user_id, ipu_id):`` belong to that block.

    Blocks with the same ``user_id`` are one block; ``ipu_id`` is an index in
    the multi-IPU device the model uses.  A block created without a
    ``user_id`` is given the next automatic id, "0", "1", ... in the order the
    blocks are created; ``Block.useAutoId()`` (called at the start of
    ``forward``) starts the count again, so every trace names them alike.
    Leaving the scope restores the block that was active before it.
    """

    _next_auto_id = 0

    @staticmethod
    def useAutoId():
        """Restarts automatic block ids at "0"."""
        Block._next_auto_id = 0

    @staticmethod
    def start(user_id=None, ipu_id=None):
        """Ops traced from now on belong to this block (no scope to leave)."""
        _check_ids(user_id, ipu_id)
        _blocks.enter_block(_block_id(user_id), ipu_id)

    def __init__(self, user_id=None, ipu_id=None):
        _check_ids(user_id, ipu_id)
        self.user_id = _block_id(user_id)
        self.ipu_id = ipu_id
        self._previous = []          # a stack, so one Block can be re-entered
        self._inputs = ()            # tensors entering the block, where known

    def __enter__(self):
        self._previous.append(_blocks.current_block())
        _blocks.enter_block(self.user_id, self.ipu_id, self._inputs)
        return self

    def __exit__(self, exc_type, exc, tb):
        _blocks.leave_block(self._previous.pop())
        return False

    def __repr__(self):
        return f"Block(user_id={self.user_id!r}, ipu_id={self.ipu_id!r})"


class _BlockHook:
    """The forward pre-hook ``BeginBlock`` registers: enters the block each
    time the module is called.  Later modules stay in it until another
    block begins."""

    def __init__(self, user_id, ipu_id):
        self.user_id = user_id
        self.ipu_id = ipu_id

    def __call__(self, module, args, kwargs=None):
        _blocks.enter_block(self.user_id, self.ipu_id, _tensors(args, kwargs))

    def __repr__(self):
        return f"BeginBlock(user_id={self.user_id}, ipu_id={self.ipu_id})"


class LegacyBeginBlockFn:
    """What ``BeginBlock`` returns for a plain callable: enters the block,
    then calls it."""

    def __init__(self, layer_to_call, user_id=None, ipu_id=None):
        _check_ids(user_id, ipu_id)
        self._layer_to_call = layer_to_call
        self.user_id = _block_id(user_id)
        self.ipu_id = ipu_id
        functools.update_wrapper(self, layer_to_call, updated=())

    def __call__(self, *args, **kwargs):
        _blocks.enter_block(self.user_id, self.ipu_id, _tensors(args, kwargs))
        return self._layer_to_call(*args, **kwargs)

    def __repr__(self):
        return (f"BeginBlock({self._layer_to_call!r}, user_id={self.user_id}, "
                f"ipu_id={self.ipu_id})")


def _tensors(args, kwargs=None):
    """The tensors entering a block: the capture side hooks their gradients so
    that backward ops land in the block of their forward ops."""
    leaves = _pytree.tree_leaves((args, kwargs or {}))
    return tuple(t for t in leaves if isinstance(t, torch.Tensor))


def _block_hooks(module):
    return [key for key, hook in module._forward_pre_hooks.items()
            if isinstance(hook, _BlockHook)]


def BeginBlock(layer_to_call, user_id=None, ipu_id=None):
    """Puts ``layer_to_call`` (and everything called after it, until another
    block begins) in block ``user_id`` on IPU ``ipu_id``.

    Returns the same module, now carrying a forward pre-hook.  A plain
    callable is wrapped instead (``LegacyBeginBlockFn``)."""
    if not isinstance(layer_to_call, torch.nn.Module):
        if callable(layer_to_call):
            return LegacyBeginBlockFn(layer_to_call, user_id, ipu_id)
        raise createPoptorchError(
            "module is not an instance of torch.nn.Module or function.")
    if _block_hooks(layer_to_call):
        raise createPoptorchError("module has already been assigned to a block.")
    _check_ids(user_id, ipu_id)
    layer_to_call.register_forward_pre_hook(_BlockHook(_block_id(user_id), ipu_id),
                                            with_kwargs=True)
    return layer_to_call


def BlockFunction(user_id=None, ipu_id=None):
    """Decorator: every call of the function runs inside ``Block(user_id,
    ipu_id)``.  Without a ``user_id`` the block's automatic id is taken when
    ``BlockFunction`` is called, so each call lands in the same block."""
    _check_ids(user_id, ipu_id)
    user_id = _block_id(user_id)

    def decorator(func):
        @functools.wraps(func)
        def wrapper(*args, **kwargs):
            block = Block(user_id, ipu_id)
            block._inputs = _tensors(args, kwargs)
            with block:
                return func(*args, **kwargs)
        return wrapper

    return decorator


def removeBlocks(module):
    """Removes the ``BeginBlock`` hooks of ``module`` and all its submodules."""
    assert isinstance(module, torch.nn.Module), (
        f"removeBlocks expects a torch.nn.Module (got {type(module)})")
    for m in module.modules():
        for key in _block_hooks(m):
            del m._forward_pre_hooks[key]
            m._forward_pre_hooks_with_kwargs.pop(key, None)


def recomputationCheckpoint(*tensors):
    """Identity that marks ``tensors`` as checkpoints: with recomputation on,
    they are kept between forward and backward instead of being recomputed.

    One tensor gives one tensor back, several a tuple; a single list or tuple
    gives the same kind of sequence back."""
    if len(tensors) == 1 and isinstance(tensors[0], (list, tuple)):
        return type(tensors[0])(_checkpoint_all(tensors[0]))
    out = _checkpoint_all(tensors)
    return out[0] if len(out) == 1 else tuple(out)


def _checkpoint_all(tensors):
    from .capture.annotations import annotate
    out = []
    for t in tensors:
        if not isinstance(t, torch.Tensor):
            raise ValueError("All inputs must be tensors")
        annotate(t, "recomputation_checkpoint", True)
        out.append(t)
    return out


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
    def assign(self, blocks, default=False):
        """``{user_id: (stage_id, ipu)}`` for ``blocks``, the ``(user_id,
        ipu_id)`` pairs in the order the model entered them.

        A block id seen twice keeps its first entry.  ``default``: the model
        runs ops before its first block; they form PopTorch's default block,
        key ``None``, on IPU 0 in stage 0 (the stage and IPU PopTorch's
        compiler starts with).  With ``AutoStage.AutoIncrement`` PopTorch
        numbers blocks from stage 1, after that default stage; pipelining
        merges the default stage with a first block on IPU 0."""
        entered = {}
        for user_id, ipu_id in blocks:
            entered.setdefault(user_id, ipu_id)
        if self._block_map:
            out = self._assign_explicit(entered)
        elif self._auto_stage == enums.AutoStage.SameAsIpu:
            out = self._assign_same_as_ipu(entered)
        else:
            return self._assign_auto_increment({None: 0, **entered} if default else entered)
        return {None: (0, 0), **out} if default else out

    def _assign_explicit(self, entered):
        out = {}
        for user_id, ipu_id in entered.items():
            assert user_id in self._block_map, (
                f"Unknown Block '{user_id}' list of expected Blocks: "
                f"{list(self._block_map)}")
            stage = self._block_map[user_id]
            out[user_id] = (stage._stage_id, _first_set(stage._ipu, ipu_id,
                                                        stage._stage_id))
        return out

    @staticmethod
    def _assign_same_as_ipu(entered):
        out = {}
        for user_id, ipu_id in entered.items():
            assert ipu_id is not None, (
                "poptorch.AutoStage.SameAsIpu was selected but no IPU was "
                f"specified for block {user_id}")
            out[user_id] = (ipu_id, ipu_id)
        return out

    def _assign_auto_increment(self, entered):
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
            ipu = _first_set(ipu_id, 0 if user_id is None else number)
            if stage is None or not (self.is_pipelined and ipu == last_ipu):
                stage = 0 if user_id is None else number
            last_ipu = ipu
            out[user_id] = (stage, ipu)
        return out

    def __repr__(self):
        if self._block_map:
            args = ", ".join(repr(s) for s in self._stages)
        elif self._auto_stage != enums.AutoStage.SameAsIpu:
            args = f"poptorch.AutoStage.{self._auto_stage.name}"
        else:
            args = ""
        return f"{type(self).__name__}({args})"


def _first_set(*values):
    return next(v for v in values if v is not None)


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
        ipu_id)`` pairs in the order the model entered them.

        A block id seen twice keeps its first entry.  IPU = ``Stage.ipu()``
        (or ``Phase.ipus()``) if set, else the block's ``ipu_id``, else the
        layout PopTorch's documentation describes: serial phases put the k-th
        stage of every phase on IPU k; parallel phases put it on IPU
        ``2k + phase % 2`` (phase 0 on IPUs 0, 2, ...; phase 1 on 1, 3, ...).

        ``default``: the model runs ops before its first block; they form
        PopTorch's default block, key ``None``, in phase 0 on IPU 0 (the
        stage of phase 0 on IPU 0 where there is one).
        """
        entered = {}
        for user_id, ipu_id in blocks:
            entered.setdefault(user_id, ipu_id)
        out = {}
        for user_id, ipu_id in entered.items():
            assert user_id in self._block_map, (
                f"Unknown Block '{user_id}' list of expected Blocks: "
                f"{list(self._block_map)}")
            stage_id = self._block_map[user_id]
            phase, index = self._position[stage_id]
            out[user_id] = (stage_id, _first_set(self._stages[stage_id]._ipu, ipu_id,
                                                 self._default_ipu(phase, index)))
        if default:
            phase_of = self.phase_of_stage()
            on_ipu0 = sorted(s for s, ipu in out.values() if ipu == 0 and phase_of[s] == 0)
            out = {None: (on_ipu0[0] if on_ipu0 else 0, 0), **out}
        return out

    def _default_ipu(self, phase, index):
        return index if self.serial else 2 * index + phase % 2

    def phase_of_stage(self):
        """The phase index of every stage id."""
        return [phase for phase, _ in self._position]

    def check(self, stage_of_block):
        """PopTorch's compile-time rules for phases; ``stage_of_block`` is what
        ``assign`` returned.  Raises ``poptorch.Error``."""
        liveness = self.tensors_liveness
        if not self.serial and liveness in (enums.Liveness.OffChipAfterEachPhase,
                                            enums.Liveness.OffChipAfterFwdNoOverlap):
            raise Error(
                "This is only supported for serial phase execution: "
                f"poptorch.Liveness.{liveness.name} was set on a "
                f"{type(self).__name__}. Use poptorch.SerialPhasedExecution, or "
                "Liveness.AlwaysLive / Liveness.OffChipAfterFwd "
                "(sendTensorsOffChipAfterFwd()) with parallel phases.")
        if self.serial:
            return
        phase_of = self.phase_of_stage()
        for user_id, (stage_id, ipu) in stage_of_block.items():
            phase = phase_of[stage_id]
            if phase % 2 == ipu % 2:
                continue
            n = len(self._phases[phase].stages)
            fix = ", ".join(str(2 * k + phase % 2) for k in range(n))
            parity = "even" if phase % 2 == 0 else "odd"
            raise Error(
                "When phases are executed in parallel: even phases must run on even "
                f"IPUs and odd phases on odd IPUs. Block '{user_id}' (stage {stage_id}) "
                f"is in phase {phase} but runs on IPU {ipu}. Put phase {phase}'s "
                f"stages on {parity} IPUs, for example "
                f"strategy.phase({phase}).ipus({fix}), or give its blocks {parity} "
                "ipu_ids.")

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
