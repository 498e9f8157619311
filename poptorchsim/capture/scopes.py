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
