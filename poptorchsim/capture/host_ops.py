"""Ops that reach the host in the middle of a graph: printing and CPU callbacks.

Both are ``torch.library`` operators in the ``poptorchsim`` namespace, so
``make_fx`` and functionalization record them where the model called them
and the engine runs their kernels every time the graph runs (each
micro-batch):

* ``poptorchsim::ipu_print_tensor(x, title, ...)`` prints ``x`` to stderr
  (as Poplar's ``PrintTensor`` does) and returns it unchanged;
* ``poptorchsim::host_call(inputs, key)`` calls the Python function
  registered under ``key`` with the real input values and returns its
  outputs (PopTorch's ``poptorch.CPU``).

How ``print_tensor`` gets its gradient printed.  ``torch.library.custom_op``
with ``register_autograd`` cannot be traced here: the training step is
differentiated by torch.func's grad transform inside functionalization, and
the generated ``autograd.Function`` fails there ("must override the
setup_context staticmethod"; with one, functionalization has no rule for
``custom_function_call``).  So the print op carries no autograd formula at
all.  Where the tensor needs a gradient, the op prints a detached copy (a
node with a side effect, which dead-code elimination keeps) and the model
continues with a view of the tensor, whose gradient hook passes the
incoming gradient through a second print op: the backward graph then holds
``ipu_print_tensor(grad, "<title>_gradient")`` on the gradient's path.
Hooks are plain autograd, which torch.func traces.
"""
import sys
import weakref

import torch
import torch.fx
from torch._functorch.pyfunctorch import temporarily_clear_interpreter_stack
from torch.library import custom_op
from torch.utils._python_dispatch import _disable_current_modes

from ..errors import Error
from .tensor_text import format_tensor

NAMESPACE = "poptorchsim"


@custom_op(f"{NAMESPACE}::ipu_print_tensor", mutates_args=())
def print_tensor(x: torch.Tensor, title: str, summarise_threshold: int, edge_items: int,
                 max_line_width: int, digits: int, float_format: str, separator: str,
                 open_bracket: str, close_bracket: str) -> torch.Tensor:
    """Prints ``x`` to stderr; returns a copy of it."""
    text = format_tensor(x, title, summarise_threshold, edge_items, max_line_width, digits,
                         float_format, separator, open_bracket, close_bracket)
    print(text, file=sys.stderr, flush=True)
    return x.clone()


@print_tensor.register_fake
def _(x, *_format):
    return torch.empty_like(x)


PRINT = torch.ops.poptorchsim.ipu_print_tensor.default
torch.fx.node.has_side_effect(PRINT)


def traced_print(x, title, print_gradient, fmt):
    """``x`` printed where the graph reaches it; its gradient printed in the
    backward when ``print_gradient`` and ``x`` takes part in autograd."""
    if not (torch.is_grad_enabled() and x.requires_grad):
        return print_tensor(x, title, *fmt)
    print_tensor(x.detach(), title, *fmt)
    y = x.view_as(x)
    if print_gradient:
        grad_title = f"{title}_gradient" if title else "gradient"
        y.register_hook(lambda grad: print_tensor(grad, grad_title, *fmt))
    return y


# -- CPU callbacks ----------------------------------------------------------------
class HostFunction:
    """A Python function the graph calls on the host, with the (shape,
    dtype) of each output it returned when traced."""

    def __init__(self, fn, name, out_meta):
        self.fn, self.name, self.out_meta = fn, name, out_meta


_CALLBACKS = weakref.WeakValueDictionary()     # key -> HostFunction
_next_key = [0]


def _callback(key):
    found = _CALLBACKS.get(key)
    if found is None:
        raise Error(f"The CPU op {key.rsplit('#', 1)[0]!r} is not registered in this "
                    "process: its poptorch.CPU object was deleted, or the program was "
                    "loaded from the executable cache without tracing the model. Keep "
                    "the model alive, or compile it again without the cache.")
    return found


def _outside_trace(fn, *args):
    """``fn(*args)`` run eagerly on real tensors, unseen by the trace (no
    dispatch or torch-function modes, no torch.func transforms)."""
    with _disable_current_modes(), temporarily_clear_interpreter_stack(), \
            torch._C.DisableTorchFunction(), torch.no_grad():
        return fn(*args)


class HostCallable:
    """PopTorch's ``CPU(layer_to_call, ID)``: ``traced`` puts a call of the
    function into the graph being traced.  Each distinct output signature
    gets its own key (a function may be called with several shapes)."""

    def __init__(self, fn, name):
        self.fn, self.name = fn, name
        self._functions = {}           # out_meta -> (HostFunction, key)

    def traced(self, inputs):
        for x in inputs:
            if not isinstance(x, torch.Tensor):
                raise Error(f"The CPU op {self.name!r} takes tensors only, got "
                            f"{type(x).__name__}: pass other values to the function "
                            "through its closure or object.")
        example = _outside_trace(
            lambda: self.fn(*[torch.zeros(x.shape, dtype=x.dtype) for x in inputs]))
        single = not isinstance(example, (list, tuple))
        outs = [torch.as_tensor(o) for o in ([example] if single else example)]
        meta = tuple((tuple(o.shape), o.dtype) for o in outs)
        if meta not in self._functions:
            _next_key[0] += 1
            key = f"{self.name}#{_next_key[0]}"
            function = HostFunction(self.fn, self.name, meta)
            _CALLBACKS[key] = function
            self._functions[meta] = (function, key)
        results = host_call(list(inputs), self._functions[meta][1])
        return results[0] if single else results


@custom_op(f"{NAMESPACE}::host_call", mutates_args=())
def host_call(inputs: list[torch.Tensor], key: str) -> list[torch.Tensor]:
    """Runs the registered function on the host with the real values."""
    f = _callback(key)
    outs = f.fn(*inputs)
    outs = [torch.as_tensor(o) for o in (outs if isinstance(outs, (list, tuple)) else [outs])]
    got = tuple((tuple(o.shape), o.dtype) for o in outs)
    if got != f.out_meta:
        raise Error(f"The CPU op {f.name!r} returned {_describe(got)} at run time but "
                    f"{_describe(f.out_meta)} when the model was traced: a CPU op must "
                    "return the same shapes and dtypes every call.")
    return [o.clone() for o in outs]


def _describe(meta):
    return "(" + ", ".join(f"{str(d).replace('torch.', '')}{list(s)}" for s, d in meta) + ")"


@host_call.register_fake
def _(inputs, key):
    return [torch.empty(shape, dtype=dtype) for shape, dtype in _callback(key).out_meta]


HOST_CALL = torch.ops.poptorchsim.host_call.default
torch.fx.node.has_side_effect(HOST_CALL)

HOST_OPS = frozenset((PRINT, HOST_CALL))
