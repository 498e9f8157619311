"""PopTorch's multi-IPU face: blocks, and the strategies that stage them.

Annotations say which *block* the ops of a model belong to::

    poptorch.BeginBlock(model.layer2, "L2", ipu_id=1)    # forward pre-hook
    with poptorch.Block("head", ipu_id=1): ...           # scope
    @poptorch.BlockFunction("decoder", ipu_id=1)         # decorator

While a model is traced they call ``capture.blocks.enter_block``, which tags
every fx node created afterwards with ``(user_id, ipu_id)``; when the model
runs on the CPU they do nothing.

An execution strategy (``PipelinedExecution``, the default,
``ShardedExecution``, ``SerialPhasedExecution``, ``ParallelPhasedExecution``)
groups blocks into stages (``Stage``) and phases (``Phase``): they are
``_api/strategies.py``, re-exported here; the stage numbering itself is
``passes/stages.py``.
"""
import functools

import torch

from ._api.strategies import (  # noqa: F401 - PopTorch's multi-IPU names, re-exported
    ParallelPhasedExecution,
    Phase,
    PipelinedExecution,
    SerialPhasedExecution,
    ShardedExecution,
    Stage,
    _IExecutionStrategy,
    _IPhasedExecution,
    _StagedExecution,
)
from .capture import blocks as _blocks
from .capture.blocks import BlockHook as _BlockHook  # noqa: F401 - its old home (tests, pickles)
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
        _blocks.enter_block(self.user_id, self.ipu_id, _blocks.block_inputs(args, kwargs))
        return self._layer_to_call(*args, **kwargs)

    def __repr__(self):
        return (f"BeginBlock({self._layer_to_call!r}, user_id={self.user_id}, "
                f"ipu_id={self.ipu_id})")


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
    _blocks.refuse_second_block(layer_to_call)
    _check_ids(user_id, ipu_id)
    return _blocks.add_block_hook(layer_to_call, _block_id(user_id), ipu_id)


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
            block._inputs = _blocks.block_inputs(args, kwargs)
            with block:
                return func(*args, **kwargs)
        return wrapper

    return decorator


def removeBlocks(module):
    """Removes the ``BeginBlock`` hooks of ``module`` and all its submodules."""
    assert isinstance(module, torch.nn.Module), (
        f"removeBlocks expects a torch.nn.Module (got {type(module)})")
    for m in module.modules():
        _blocks.remove_block_hooks(m)


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
