"""Annotations on traced tensors: PopTorch's ``set_available_memory``.

While a model is traced, ``annotate(tensor, key, value)`` finds the fx node
that produces ``tensor`` (looking through torch.func's grad and
functionalization wrappers to the traced fake tensor) and stores ``value`` in
that node's ``meta``; lowering copies it onto the IR op.  Outside tracing it
does nothing.
"""
import torch
from torch.fx.experimental import proxy_tensor


def innermost(t):
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


def _traced_node(tensor):
    """The fx node that made ``tensor`` in the trace under way, or None
    (not tracing, or a tensor the trace did not make)."""
    mode = proxy_tensor.get_proxy_mode()
    if mode is None:
        return None
    proxy = proxy_tensor.get_proxy_slot(innermost(tensor), mode.tracer, None,
                                        lambda slot: slot.proxy)
    return None if proxy is None else proxy.node


def annotate(tensor, key, value):
    node = _traced_node(tensor)
    if node is None:
        return False
    node.meta[key] = value
    return True


def annotate_producer(tensor, key, value):
    """``annotate`` on the op that computed ``tensor``, looking through the
    views after it (``torch.matmul`` of 3-D by 2-D tensors traces as a
    view, an ``mm`` and a view back)."""
    from ..ir.ops import cost_class
    node = _traced_node(tensor)
    if node is None:
        return False
    while node.op == "call_function" and node.args and \
            isinstance(node.args[0], torch.fx.Node) and cost_class(node.target) == "view":
        node = node.args[0]
    node.meta[key] = value
    return True
