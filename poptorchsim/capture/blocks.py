"""Which pipeline block the ops being traced belong to.

The face's ``BeginBlock`` hooks and ``Block`` scopes call ``enter_block``
while a model is traced; every fx node created afterwards carries
``node.meta["custom"]["block"] = (user_id, ipu_id)`` (torch.fx's node-meta
annotation).  Outside tracing these calls do nothing.  Backward nodes are
given blocks later, from the forward nodes they read (``assign_blocks``).

``BlockHook`` is the forward pre-hook ``BeginBlock`` puts on a module
(``add_block_hook``); the auto-split (``runtime/planning/autosplit.py``) adds the same
hooks with ``begin_block``.
"""
import contextlib
import threading

import torch
import torch.fx.traceback as fx_traceback
import torch.utils._pytree as pytree
from torch.overrides import TorchFunctionMode

from ..errors import createPoptorchError

_state = threading.local()

# The block of ops traced after a ``with Block`` scope has closed and before
# another block begins: PopTorch has no active IPU there and refuses them.
NO_ACTIVE_BLOCK = ("<no active block>", None)


def _log():
    return getattr(_state, "blocks", None)


def is_recording():
    return _log() is not None


def enter_block(user_id, ipu_id, inputs=()):
    """Ops traced from now on belong to block ``user_id`` on ``ipu_id``.

    ``inputs``: the tensors entering the block.  A gradient hook on each makes
    the backward pass switch back to the previous block once the block's own
    backward is done, so every backward op lands in its forward op's block.
    Before the first block the previous block is PopTorch's default block
    (no block, ``None``: IPU 0), where the backward of the ops traced before
    any block then runs too."""
    log = _log()
    if log is None:
        return
    custom = fx_traceback.current_meta.setdefault("custom", {})
    previous = custom.get("block")
    custom["block"] = (None if user_id is None else str(user_id), ipu_id)
    log.append(custom["block"])
    if previous != NO_ACTIVE_BLOCK and previous != custom["block"]:
        for t in inputs:
            # a leaf (a parameter handed to a block) was made by no block
            if isinstance(t, torch.Tensor) and t.requires_grad and (
                    previous is not None or t.grad_fn is not None):
                t.register_hook(_switch_to(previous))


def _switch_to(block):
    def hook(grad):
        fx_traceback.current_meta.setdefault("custom", {})["block"] = block
    return hook


def begin_backward():
    """What autograd traces from now on is the backward pass.  It starts in
    the block the forward pass ended in (the last one entered, when a
    ``Block`` scope has closed already)."""
    log = _log()
    if log is not None:
        custom = fx_traceback.current_meta.setdefault("custom", {})
        custom["backward"] = True
        if custom.get("block") in (None, NO_ACTIVE_BLOCK) and log:
            custom["block"] = log[-1]


def leave_block(previous):
    """Restores ``previous`` (the value ``current_block`` returned); where no
    block was active before the scope, none is now (``NO_ACTIVE_BLOCK``)."""
    if _log() is None:
        return
    custom = fx_traceback.current_meta.setdefault("custom", {})
    custom["block"] = NO_ACTIVE_BLOCK if previous is None else previous


def current_block():
    """The active block, or None (none begun yet, or the last scope closed)."""
    if _log() is None:
        return None
    block = fx_traceback.current_meta.get("custom", {}).get("block")
    return None if block == NO_ACTIVE_BLOCK else block


_UNSEEN = object()


class _BlockCrossings(TorchFunctionMode):
    """Sees every tensor that flows from one block into another (``Block``
    scopes pass no inputs to ``enter_block``), the default block (``None``,
    ops before the first block) included, and hooks its gradient, so the
    backward pass switches back to the producing block there."""

    def __init__(self):
        super().__init__()
        self.produced = {}         # id(tensor) -> block (None: the default block)
        self.keep = []             # the tensors, so their ids stay unique
        self.hooked = set()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        custom = fx_traceback.current_meta.get("custom", {})
        block = custom.get("block")
        follow = block != NO_ACTIVE_BLOCK and not custom.get("backward")
        if follow:
            for t in _tensors((args, kwargs)):
                if t.requires_grad:
                    src = self.produced.get(id(t), _UNSEEN)
                    if src is None and t.grad_fn is None:
                        continue     # a leaf made ready before the forward (a parameter)
                    if src is not _UNSEEN and src != block and (id(t), src) not in self.hooked:
                        self.hooked.add((id(t), src))
                        t.register_hook(_switch_to(src))
        out = func(*args, **kwargs)
        if follow:
            for t in _tensors(out):
                self.produced[id(t)] = block
                self.keep.append(t)
        return out


_SCALARS = (int, float, bool, str, type(None), torch.dtype, torch.device, torch.layout,
            torch.memory_format, torch.Size)


def _tensors(x, found=None):
    """The tensors among ``pytree.tree_leaves(x)``, in order: tuples, lists
    and dicts walked directly (every torch call of a traced model passes
    here), other containers by pytree."""
    found = [] if found is None else found
    if isinstance(x, torch.Tensor):
        found.append(x)
        return found
    t = type(x)
    if t is tuple or t is list:
        for y in x:
            if isinstance(y, torch.Tensor):
                found.append(y)
            elif not isinstance(y, _SCALARS):
                _tensors(y, found)
    elif t is dict:
        for y in x.values():
            _tensors(y, found)
    elif not isinstance(x, _SCALARS):
        found.extend(y for y in pytree.tree_leaves(x) if isinstance(y, torch.Tensor))
    return found


@contextlib.contextmanager
def recording():
    """While tracing: collect blocks in the order the model enters them, and
    follow tensors across block boundaries."""
    _state.blocks, _state.extra, _state.crossings = [], {}, _BlockCrossings()
    try:
        with fx_traceback.preserve_node_meta():
            fx_traceback.current_meta.pop("custom", None)
            yield _state.blocks
    finally:
        fx_traceback.current_meta.pop("custom", None)
        _state.blocks = _state.extra = _state.crossings = None


def following_crossings():
    """The mode that follows tensors across block boundaries, entered
    around the model's forward (where the user's torch calls are: entered
    outside ``make_fx`` it would also see every call PyTorch makes inside
    the trace, three times as many); a no-op context when not recording."""
    mode = getattr(_state, "crossings", None) if is_recording() else None
    return mode if mode is not None else contextlib.nullcontext()


def trace_state():
    """A dict private to the trace under way (scopes opened by
    ``torch.ops.poptorch`` calls and not yet closed), or None when nothing
    is traced."""
    return getattr(_state, "extra", None) if is_recording() else None


def node_block(node):
    return node.meta.get("custom", {}).get("block")


def node_is_backward(node):
    return bool(node.meta.get("custom", {}).get("backward", False))


# ---------------------------------------------------------------------------
# BeginBlock's forward pre-hook
# ---------------------------------------------------------------------------
def block_inputs(args, kwargs=None):
    """The tensors entering a block: ``enter_block`` hooks their gradients so
    that backward ops land in the block of their forward ops."""
    leaves = pytree.tree_leaves((args, kwargs or {}))
    return tuple(t for t in leaves if isinstance(t, torch.Tensor))


class BlockHook:
    """The forward pre-hook ``BeginBlock`` registers: enters the block each
    time the module is called.  Later modules stay in it until another
    block begins."""

    def __init__(self, user_id, ipu_id):
        self.user_id = user_id
        self.ipu_id = ipu_id

    def __call__(self, module, args, kwargs=None):
        enter_block(self.user_id, self.ipu_id, block_inputs(args, kwargs))

    def __repr__(self):
        return f"BeginBlock(user_id={self.user_id}, ipu_id={self.ipu_id})"


def block_hooks(module):
    """The keys of ``module``'s own ``BlockHook`` forward pre-hooks."""
    return [key for key, hook in module._forward_pre_hooks.items()
            if isinstance(hook, BlockHook)]


def refuse_second_block(module):
    """PopTorch's error for a module that already begins a block."""
    if block_hooks(module):
        raise createPoptorchError("module has already been assigned to a block.")


def add_block_hook(module, user_id, ipu_id):
    """Makes ``module`` begin block ``user_id`` (a string) on ``ipu_id``;
    returns the module."""
    module.register_forward_pre_hook(BlockHook(user_id, ipu_id), with_kwargs=True)
    return module


def begin_block(module, user_id, ipu_id):
    """``BeginBlock(module, user_id, ipu_id)`` for ids known to be valid."""
    refuse_second_block(module)
    return add_block_hook(module, user_id, ipu_id)


def remove_block_hooks(module):
    """Removes ``module``'s own ``BlockHook``s (not its submodules')."""
    for key in block_hooks(module):
        del module._forward_pre_hooks[key]
        module._forward_pre_hooks_with_kwargs.pop(key, None)
