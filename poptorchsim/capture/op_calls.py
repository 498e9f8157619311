"""``torch.ops.poptorch.*`` calls while a model is traced.

PopTorch's Python API is written over its ``poptorch`` operator library
(``NameScope`` calls ``torch.ops.poptorch.push_name_scope``, ``BeginBlock``
``begin_ipu_block``, ...), and programs call those operators directly too
(Graphcore's CNN benchmark names its layers with ``push_name_scope``).
poptorchsim's API works the other way round: each function marks the trace
itself.  So the face registers, for every operator of the library, a
*handler* that does what the matching Python API call does, and while a
model is traced ``PoptorchOpCalls`` (a ``TorchFunctionMode``, entered
innermost, where the model runs) sends each ``torch.ops.poptorch`` call to
its handler before any dispatch: the call traces, runs and costs exactly as
the Python API call would.  The arguments are checked against the
operator's schema first, with PyTorch's own error.

Outside a trace the operators' kernels call the same handlers
(``_api/op_library.py``).
"""
import torch
from torch.overrides import TorchFunctionMode

NAMESPACE = "poptorch"
_HANDLERS = {}            # operator name -> handler(*args, **kwargs)


def register_handler(name, handler):
    """``torch.ops.poptorch.<name>`` calls ``handler`` while a model is traced."""
    _HANDLERS[name] = handler


def handler(name):
    return _HANDLERS[name]


def _overload(func):
    """The ``OpOverload`` of a ``torch.ops.poptorch`` callable, else None."""
    if isinstance(func, torch._ops.OpOverloadPacket):
        if not func._qualified_op_name.startswith(NAMESPACE + "::"):
            return None
        return getattr(func, "default", None)
    if isinstance(func, torch._ops.OpOverload) and func.namespace == NAMESPACE:
        return func
    return None


_check_schema = getattr(torch._C, "_check_schema_allow_fake_script_object", None)


def check_arguments(overload, args, kwargs):
    """PyTorch's schema check of a call (its RuntimeError where a value has
    the wrong type)."""
    if _check_schema is not None:
        _check_schema(overload._schema, *args, **kwargs)


class PoptorchOpCalls(TorchFunctionMode):
    """Routes ``torch.ops.poptorch`` calls to their handlers (see above)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        overload = _overload(func) if isinstance(
            func, (torch._ops.OpOverloadPacket, torch._ops.OpOverload)) else None
        run = _HANDLERS.get(overload._opname) if overload is not None else None
        if run is None:
            return func(*args, **kwargs)
        check_arguments(overload, args, kwargs)
        return run(*args, **kwargs)
