"""Annotations on traced tensors: PopTorch's ``set_available_memory``.

While a model is traced, ``annotate(tensor, key, value)`` finds the fx node
that produces ``tensor`` (looking through torch.func's grad and
functionalization wrappers to the traced fake tensor) and stores ``value`` in
that node's ``meta``; lowering copies it onto the IR op.  Outside tracing it
does nothing.
"""
import torch
from torch.fx.experimental import proxy_tensor


def _innermost(t):
    f = torch._C._functorch
    for _ in range(16):
        if f.is_gradtrackingtensor(t) or f.is_batchedtensor(t):
            t = f.get_unwrapped(t)
        elif f.is_functionaltensor(t):
            torch._sync(t)
            t = torch._from_functional_tensor(t)
        else:
            return t
    return t


def annotate(tensor, key, value):
    mode = proxy_tensor.get_proxy_mode()
    if mode is None:
        return False
    inner = _innermost(tensor)
    proxy = proxy_tensor.get_proxy_slot(inner, mode.tracer, None, lambda slot: slot.proxy)
    if proxy is None:
        return False
    proxy.node.meta[key] = value
    return True


def annotate_producer(tensor, key, value):
    """``annotate`` on the op that computed ``tensor``, looking through the
    views after it (``torch.matmul`` of 3-D by 2-D tensors traces as a
    view, an ``mm`` and a view back)."""
    mode = proxy_tensor.get_proxy_mode()
    if mode is None:
        return False
    from ..ir.ops import cost_class
    inner = _innermost(tensor)
    proxy = proxy_tensor.get_proxy_slot(inner, mode.tracer, None, lambda slot: slot.proxy)
    if proxy is None:
        return False
    node = proxy.node
    while node.op == "call_function" and node.args and \
            isinstance(node.args[0], torch.fx.Node) and cost_class(node.target) == "view":
        node = node.args[0]
    node.meta[key] = value
    return True
