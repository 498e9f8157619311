"""Scopes that annotate every op traced inside them: PopTorch's
``NameScope``, ``Attribute`` and ``MultiConv``, and the imperative forms
of the first two that ``torch.ops.poptorch`` offers (``push_name_scope`` /
``pop_name_scope``, ``set_attribute`` / ``clear_attribute``).

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

from ..errors import Error
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


def joined_name(name):
    """``name`` inside the name scope in force: ``outer/name``."""
    outer = current(NAME_SCOPE)
    return f"{outer}/{name}" if outer else name


def _name_stack():
    """The name scopes open in the trace under way, innermost last (None
    when nothing is traced)."""
    state = _blocks.trace_state()
    return None if state is None else state.setdefault("name_scopes", [])


def _show(stack):
    custom = fx_traceback.current_meta.setdefault("custom", {})
    if stack:
        custom[NAME_SCOPE] = stack[-1]
    else:
        custom.pop(NAME_SCOPE, None)


def push_name_scope(name):
    """Ops traced from now on are named ``outer/name/...``, until the
    matching ``pop_name_scope``: PopTorch's ``torch.ops.poptorch.
    push_name_scope``.  ``NameScope`` and the modules' own name scopes push
    and pop on the same stack, as in PopTorch, so a pop closes the scope
    pushed last, whoever pushed it."""
    stack = _name_stack()
    if stack is None:
        return
    stack.append(joined_name(name))
    _show(stack)


def pop_name_scope(strict=True):
    """Closes the name scope pushed last.  ``strict``: refuse a pop with no
    scope open (the modules' own hooks are not strict)."""
    stack = _name_stack()
    if stack is None:
        return
    if not stack:
        if not strict:
            return
        raise Error("torch.ops.poptorch.pop_name_scope() was called with no name scope "
                    "open: each pop_name_scope() closes the scope of an earlier "
                    "push_name_scope(name) in the same forward(); remove the extra pop, "
                    "or use `with poptorch.NameScope(name):`.")
    stack.pop()
    _show(stack)


def _set_attributes(change):
    if not _blocks.is_recording():
        return
    custom = fx_traceback.current_meta.setdefault("custom", {})
    values = {attr: dict(kv) for attr, kv in (custom.get(ATTRIBUTES) or {}).items()}
    change(values)
    values = {attr: kv for attr, kv in values.items() if kv}
    if values:
        custom[ATTRIBUTES] = values
    else:
        custom.pop(ATTRIBUTES, None)


def set_attribute(attribute, key, value):
    """Ops traced from now on carry ``attribute[key] = value`` (PopTorch's
    ``torch.ops.poptorch.set_attribute``, which ``Attribute`` scopes call)."""
    _set_attributes(lambda values: values.setdefault(attribute, {}).__setitem__(key, value))


def clear_attribute(attribute, key):
    """Ops traced from now on no longer carry ``attribute[key]``."""
    _set_attributes(lambda values: values.get(attribute, {}).pop(key, None))


def node_scopes(node):
    """(name scope, attributes, multiconv group) of an fx node."""
    custom = node.meta.get("custom", {})
    return custom.get(NAME_SCOPE), custom.get(ATTRIBUTES), custom.get(MULTICONV)


@contextlib.contextmanager
def module_name_scopes(model, enabled=True):
    """While tracing, every op a submodule of ``model`` runs is in that
    module's name scope (``layer1/0/`` for ``model.layer1[0]``, nested as
    the calls nest), as PopTorch's name-scope hook does unless
    ``Options.disableModuleNamescope()``: each call pushes the module's
    name before ``forward`` and pops it after.  Hooks on the submodules,
    removed on leaving; outside tracing they do nothing."""
    if not enabled:
        yield
        return

    def enter(name):
        def pre_hook(module, args):  # torch's hook signature
            push_name_scope(name)
        return pre_hook

    def leave(module, args, output):  # torch's hook signature
        pop_name_scope(strict=False)

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
