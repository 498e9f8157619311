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
* ``AutoStage.AutoIncrement``: each new block starts the next stage, except
  that, when pipelining, consecutive blocks on one IPU share a stage;
* explicit stages (``"A"``, ``["A", "B"]`` or ``Stage("A", "B").ipu(1)``):
  stage = position in the argument list;
* IPU = ``Stage.ipu()`` if set, else the block's ``ipu_id``, else the stage.
"""
import functools

import torch
import torch.utils._pytree as _pytree

from . import enums
from .capture import blocks as _blocks
from .errors import createPoptorchError

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
    def assign(self, blocks):
        """``{user_id: (stage_id, ipu)}`` for ``blocks``, the ``(user_id,
        ipu_id)`` pairs in the order the model entered them.

        A block id seen twice keeps its first entry."""
        entered = {}
        for user_id, ipu_id in blocks:
            entered.setdefault(user_id, ipu_id)
        if self._block_map:
            return self._assign_explicit(entered)
        if self._auto_stage == enums.AutoStage.SameAsIpu:
            return self._assign_same_as_ipu(entered)
        return self._assign_auto_increment(entered)

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
        out = {}
        stage, last_ipu = -1, None
        for user_id, ipu_id in entered.items():
            # Pipelining: consecutive blocks on one IPU are one stage.
            same_ipu = ipu_id is not None and ipu_id == last_ipu
            if not (self.is_pipelined and same_ipu):
                stage += 1
            last_ipu = _first_set(ipu_id, stage)
            out[user_id] = (stage, last_ipu)
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
