"""Scopes that annotate every op traced inside them: PopTorch's
``NameScope``, ``Attribute`` and ``MultiConv``.

As ``capture.blocks`` does for blocks, a scope sets a key of torch.fx's
node-meta annotation ``node.meta["custom"]`` while the model is traced, so
every fx node created inside carries it (nodes take a shallow copy: values
are replaced, never changed in place).  Lowering reads them
(``passes/lower.py``).  Outside tracing a scope does nothing.  The backward
pass is traced after the forward has left every scope, so scopes mark
forward ops only.
"""
import contextlib

import torch.fx.traceback as fx_traceback

from . import blocks as _blocks

NAME_SCOPE = "name_scope"     # "outer/inner"
ATTRIBUTES = "attributes"     # {attribute: {key: value}}
MULTICONV = "multiconv"       # a MultiConv group (face object)
_MISSING = object()


def current(key, default=None):
    return fx_traceback.current_meta.get("custom", {}).get(key, default)


@contextlib.contextmanager
def scope(key, value):
    """Nodes traced inside carry ``meta["custom"][key] = value``; the value
    before is restored on leaving."""
    if not _blocks.is_recording():
        yield
        return
    custom = fx_traceback.current_meta.setdefault("custom", {})
    old = custom.get(key, _MISSING)
    custom[key] = value
    try:
        yield
    finally:
        custom = fx_traceback.current_meta.setdefault("custom", {})
        if old is _MISSING:
            custom.pop(key, None)
        else:
            custom[key] = old


def node_scopes(node):
    """(name scope, attributes, multiconv group) of an fx node."""
    custom = node.meta.get("custom", {})
    return custom.get(NAME_SCOPE), custom.get(ATTRIBUTES), custom.get(MULTICONV)


@contextlib.contextmanager
def module_name_scopes(model, enabled=True):
    """While tracing, every op a submodule of ``model`` runs is in that
    module's name scope (``layer1/0/`` for ``model.layer1[0]``, nested as
    the calls nest), as PopTorch's name-scope hook does unless
    ``Options.disableModuleNamescope()``.  Hooks on the submodules, removed
    on leaving; outside tracing they do nothing."""
    if not enabled:
        yield
        return
    saved = []

    def enter(name):
        def pre_hook(module, args):  # noqa: ARG001 - torch's hook signature
            if not _blocks.is_recording():
                return
            custom = fx_traceback.current_meta.setdefault("custom", {})
            old = custom.get(NAME_SCOPE, _MISSING)
            saved.append(old)
            outer = None if old is _MISSING else old
            custom[NAME_SCOPE] = f"{outer}/{name}" if outer else name
        return pre_hook

    def leave(module, args, output):  # noqa: ARG001 - torch's hook signature
        if not _blocks.is_recording() or not saved:
            return
        old = saved.pop()
        custom = fx_traceback.current_meta.setdefault("custom", {})
        if old is _MISSING:
            custom.pop(NAME_SCOPE, None)
        else:
            custom[NAME_SCOPE] = old

    handles = []
    for qualified, module in model.named_modules():
        if not qualified:
            continue
        handles.append(module.register_forward_pre_hook(enter(qualified.rsplit(".", 1)[-1])))
        handles.append(module.register_forward_hook(leave))
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
