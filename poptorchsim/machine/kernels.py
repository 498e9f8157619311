"""Which host function runs each IR op.

Every op is an ATen overload.  Calling the overload object (or its ``_op``)
goes through the JIT's schema-driven argument parsing, about 1.5 us more per
call than PyTorch's public bindings (``torch.mm``, ``Tensor.add_``), which
parse arguments in C++ and reach the same kernel.  Graphs of small ops spend
most of their host time there, so each op runs through the public binding of
the same name when that binding provably dispatches to the same overload
with the same tensors: checked once per (overload, argument types) by
calling the binding on meta tensors under a dispatch mode that records what
it dispatched.  Anything else (no binding, a Python wrapper, another overload
chosen) keeps the overload's own entry point.
"""
import types

import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from ..ir.graph import Tensor

aten = torch.ops.aten

_BUILTIN = (types.BuiltinFunctionType, types.MethodDescriptorType)


def as_strided(x, size, stride, offset=None, *, traced):
    """``as_strided`` as traced: ``traced`` = (shape, stride, storage offset)
    of its input in the trace.  Real kernels may lay a tensor out otherwise
    than the trace's meta kernels did; the input is then copied into the
    traced layout first, so the same elements are read."""
    shape, in_stride, in_offset = traced
    if tuple(x.stride()) != in_stride or x.storage_offset() != in_offset:
        y = torch.empty_strided(shape, in_stride, dtype=x.dtype, device=x.device)
        y.copy_(x)
        offset = (offset if offset is not None else in_offset) - in_offset
        return aten.as_strided.default(y, size, stride, offset)
    return aten.as_strided.default(x, size, stride, offset)


# Views whose result depends on the input's strides run as what they mean:
# a reshape copies only when the real layout cannot be viewed that way.
_REPLACED = {aten.view.default: torch.Tensor.reshape,
             aten._unsafe_view.default: torch.Tensor.reshape}


def _under_grad_mode(kernel):
    """``kernel`` run with grad mode on (no tensor here requires grad, so
    nothing is recorded)."""
    def run(*args, **kwargs):
        with torch.enable_grad():
            return kernel(*args, **kwargs)
    return run


# oneDNN's LSTM layer keeps the workspace its backward needs only when grad
# mode is on; the engine runs graphs under no_grad.
_GRAD_MODE = {aten.mkldnn_rnn_layer.default}


class _Dispatched(Exception):
    pass


class _FirstDispatch(TorchDispatchMode):
    """Stops at the first ATen call and reports it."""

    def __torch_dispatch__(self, func, types_, args=(), kwargs=None):
        raise _Dispatched(func, args, kwargs or {})


def _kind(x):
    if isinstance(x, Tensor):
        return ("T", x.dtype)
    if isinstance(x, (list, tuple)):
        return (type(x).__name__,) + tuple(_kind(y) for y in x)
    if isinstance(x, torch.dtype):
        return x
    return type(x).__name__


def _meta(x):
    if isinstance(x, Tensor):
        return torch.empty(tuple(int(s) for s in x.shape), dtype=x.dtype, device="meta")
    if isinstance(x, list):
        return [_meta(y) for y in x]
    if isinstance(x, tuple):
        return tuple(_meta(y) for y in x)
    return x


def _binding(overload):
    name = overload.overloadpacket.__name__
    for home in (torch, torch.Tensor):
        f = getattr(home, name, None)
        if isinstance(f, _BUILTIN):
            return f
    return None


def _dispatches_to(binding, overload, args, kwargs):
    """Does ``binding(*args, **kwargs)`` reach ``overload`` with the same tensors?"""
    margs, mkwargs = _meta(args), _meta(kwargs)
    mine = [t for t in pytree.tree_leaves((margs, mkwargs)) if isinstance(t, torch.Tensor)]
    try:
        with _FirstDispatch():
            binding(*margs, **mkwargs)
    except _Dispatched as seen:
        func, a, k = seen.args
        theirs = [t for t in pytree.tree_leaves((a, k)) if isinstance(t, torch.Tensor)]
        return func is overload and len(theirs) == len(mine) \
            and all(x is y for x, y in zip(theirs, mine))
    except Exception:  # noqa: BLE001 - the binding does not take these arguments
        return False
    return False


_CHECKED: dict = {}    # (overload, argument kinds) -> binding or None


def kernel_for(target, args, kwargs):
    """The host function that runs ``target(*args, **kwargs)`` (IR arguments)."""
    if target in _REPLACED:
        return _REPLACED[target]
    if target in _GRAD_MODE:
        return _under_grad_mode(target._op)
    if not isinstance(target, torch._ops.OpOverload):
        return target
    key = (target, tuple([_kind(a) for a in args]),
           tuple([(k, _kind(v)) for k, v in kwargs.items()]))
    if key not in _CHECKED:
        binding = _binding(target)
        _CHECKED[key] = binding if binding is not None and \
            _dispatches_to(binding, target, args, kwargs) else None
    fast = _CHECKED[key]
    return fast if fast is not None else getattr(target, "_op", target)
