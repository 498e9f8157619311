"""Which pipeline block the ops being traced belong to.

The face's ``BeginBlock`` hooks and ``Block`` scopes call ``enter_block``
while a model is traced; every fx node created afterwards carries
``node.meta["custom"]["block"] = (user_id, ipu_id)`` (torch.fx's node-meta
annotation).  Outside tracing these calls do nothing.  Backward nodes are
given blocks later, from the forward nodes they read (``assign_blocks``).
"""
import contextlib
import threading

import torch.fx.traceback as fx_traceback

_state = threading.local()


def _log():
    return getattr(_state, "blocks", None)


def is_recording():
    return _log() is not None


def enter_block(user_id, ipu_id):
    """Ops traced from now on belong to block ``user_id`` on ``ipu_id``."""
    log = _log()
    if log is None:
        return
    custom = fx_traceback.current_meta.setdefault("custom", {})
    custom["block"] = (None if user_id is None else str(user_id), ipu_id)
    log.append((custom["block"]))


def leave_block(previous):
    """Restores ``previous`` (the value ``current_block`` returned)."""
    if _log() is None:
        return
    custom = fx_traceback.current_meta.setdefault("custom", {})
    if previous is None:
        custom.pop("block", None)
    else:
        custom["block"] = previous


def current_block():
    if _log() is None:
        return None
    return fx_traceback.current_meta.get("custom", {}).get("block")


@contextlib.contextmanager
def recording():
    """While tracing: collect blocks in the order the model enters them."""
    _state.blocks = []
    try:
        with fx_traceback.preserve_node_meta():
            fx_traceback.current_meta.pop("custom", None)
            yield _state.blocks
    finally:
        fx_traceback.current_meta.pop("custom", None)
        _state.blocks = None


def node_block(node):
    return node.meta.get("custom", {}).get("block")
