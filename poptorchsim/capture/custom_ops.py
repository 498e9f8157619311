"""Operations that must reach the IR whole: ``nop`` and user custom ops.

Each is a ``torch.library`` operator (a real op with a fake kernel), so
``make_fx`` records it as one node that lowering turns into one IR op.
Tracing a training step puts three transforms around it: torch.func's
grad (``capture.trace._grad_and_value``), ``functionalize`` and ``make_fx``.
What works under all three:

* ``torch.library.custom_op`` + ``register_autograd`` does not: its
  generated ``autograd.Function`` has no ``setup_context``, which
  torch.func requires;
* an ``autograd.Function`` with ``setup_context`` passes the grad
  transform, which then re-dispatches ``custom_function_call`` to the
  functionalize layer, where PyTorch has no rule ("NYI: Functionalize rule
  for custom_function_call").

So every op here is an ``autograd.Function`` (``forward`` +
``setup_context`` + ``backward``) whose forward and backward each call one
library op, and ``differentiable_call`` gives ``custom_function_call`` a
functionalize rule for the duration of the call: run the Function's
forward under the functionalize layer (its library op is functional, and
no autograd is needed below that layer).  The forward and the backward
then appear in the traced graph as one node each.  In eager PyTorch the
same Function runs as any other.
"""
import contextlib
import json

import torch
from torch._C._functorch import TransformType
from torch._functorch.autograd_function import custom_function_call

from ..ir.custom import CUSTOM_NAMESPACE

NAMESPACE = "poptorchsim"            # poptorchsim's own ops (nop)

_own = torch.library.Library(NAMESPACE, "FRAGMENT")
_custom = torch.library.Library(CUSTOM_NAMESPACE, "FRAGMENT")


def _run_forward(interpreter, function, *operands):
    return function.forward(*operands)


@contextlib.contextmanager
def _functionalize_rule():
    table = custom_function_call.functorch_table
    old = table.get(TransformType.Functionalize)
    table[TransformType.Functionalize] = _run_forward
    try:
        yield
    finally:
        table[TransformType.Functionalize] = old


def differentiable_call(function, *args):
    """``function.apply(*args)`` that also traces under functionalize."""
    if not torch._C._are_functorch_transforms_active():
        return function.apply(*args)
    with _functionalize_rule():
        return function.apply(*args)


# ---------------------------------------------------------------------------
# nop
# ---------------------------------------------------------------------------
_own.define("nop(Tensor x) -> Tensor")
_own.impl("nop", lambda x: x.clone(), "CompositeExplicitAutograd")
torch.library.register_fake(f"{NAMESPACE}::nop", lambda x: torch.empty_like(x), lib=_own)


class _Nop(torch.autograd.Function):
    """Identity whose forward is one op; the gradient passes through."""

    @staticmethod
    def forward(x):
        return torch.ops.poptorchsim.nop.default(x)

    @staticmethod
    def setup_context(ctx, inputs, output):
        pass

    @staticmethod
    def backward(ctx, grad):
        return grad


def nop(x):
    return differentiable_call(_Nop, x)


# ---------------------------------------------------------------------------
# custom ops
# ---------------------------------------------------------------------------
_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int32,
           torch.int64, torch.int16, torch.int8, torch.uint8, torch.bool]


def encode_outputs(examples):
    """(flat shape list, dtype codes) describing the example outputs: the
    op's schema holds ints, and its fake kernel rebuilds the outputs."""
    shapes, dtypes = [], []
    for t in examples:
        shapes += [t.dim(), *t.shape]
        dtypes.append(_DTYPES.index(t.dtype))
    return shapes, dtypes


def _decode(shapes, dtypes):
    out, k = [], 0
    for code in dtypes:
        rank = shapes[k]
        out.append((tuple(shapes[k + 1:k + 1 + rank]), _DTYPES[code]))
        k += 1 + rank
    return out


def define(qualname, forward, backward):
    """Defines ``CUSTOM_NAMESPACE::qualname`` and its gradient op
    ``qualname_grad``; returns the ``autograd.Function`` calling them.

    ``forward(*inputs, **attributes)`` returns a tensor or a sequence of
    them; ``backward(grad_outputs, inputs, outputs, **attributes)`` returns
    one gradient (or None) per input.  Without ``backward`` the gradient is
    PyTorch's autograd of ``forward``, run when the gradient op runs."""
    _custom.define(f"{qualname}(Tensor[] inputs, int[] shapes, int[] dtypes, str attributes)"
                   " -> Tensor[]")
    _custom.define(f"{qualname}_grad(Tensor[] grads, Tensor[] inputs, Tensor[] outputs, "
                   "str attributes) -> Tensor[]")

    def run_forward(inputs, shapes, dtypes, attributes):
        out = forward(*inputs, **json.loads(attributes))
        out = [out] if isinstance(out, torch.Tensor) else list(out)
        declared = _decode(shapes, dtypes)
        got = [(tuple(t.shape), t.dtype) for t in out]
        if got != declared:
            from ..errors import Error
            raise Error(f"Custom op {qualname} returned {got} but its example_outputs "
                        f"declare {declared}: pass example_outputs of the shapes and "
                        "dtypes the forward function returns.")
        return [t.contiguous() for t in out]

    def run_backward(grads, inputs, outputs, attributes):
        attrs = json.loads(attributes)
        if backward is not None:
            result = backward(list(grads), list(inputs), list(outputs), **attrs)
        else:
            result = _autograd_of(forward, grads, inputs, attrs)
        result = list(result)
        return [torch.zeros_like(x) if g is None else g.contiguous()
                for g, x in zip(result, inputs)]

    def fake_forward(inputs, shapes, dtypes, attributes):
        return [torch.empty(shape, dtype=dtype) for shape, dtype in _decode(shapes, dtypes)]

    def fake_backward(grads, inputs, outputs, attributes):
        return [torch.empty_like(x) for x in inputs]

    _custom.impl(qualname, run_forward, "CompositeExplicitAutograd")
    _custom.impl(f"{qualname}_grad", run_backward, "CompositeExplicitAutograd")
    torch.library.register_fake(f"{CUSTOM_NAMESPACE}::{qualname}", fake_forward, lib=_custom)
    torch.library.register_fake(f"{CUSTOM_NAMESPACE}::{qualname}_grad", fake_backward,
                                lib=_custom)
    fwd_op = getattr(torch.ops.poptorchsim_custom, qualname).default
    grad_op = getattr(torch.ops.poptorchsim_custom, f"{qualname}_grad").default
    return _function_for(qualname, fwd_op, grad_op)


def _autograd_of(forward, grads, inputs, attrs):
    """The gradient of ``forward`` by PyTorch's autograd, on real tensors."""
    with torch.enable_grad():
        leaves = [x.detach().requires_grad_(x.dtype.is_floating_point) for x in inputs]
        out = forward(*leaves, **attrs)
        out = [out] if isinstance(out, torch.Tensor) else list(out)
        pairs = [(o, g) for o, g in zip(out, grads) if o.requires_grad]
        wanted = [x for x in leaves if x.requires_grad]
        found = iter(torch.autograd.grad([o for o, _ in pairs], wanted,
                                         [g for _, g in pairs], allow_unused=True)
                     if pairs and wanted else [None] * len(wanted))
    return [next(found) if x.requires_grad else None for x in leaves]


def _function_for(qualname, fwd_op, grad_op):
    def forward(spec, *inputs):
        shapes, dtypes, attributes = spec
        return tuple(fwd_op(list(inputs), shapes, dtypes, attributes))

    def setup_context(ctx, inputs, output):
        spec, tensors = inputs[0], inputs[1:]
        ctx.attributes = spec[2]
        ctx.n_inputs = len(tensors)
        ctx.save_for_backward(*tensors, *output)

    def backward(ctx, *grads):
        saved = ctx.saved_tensors
        inputs, outputs = saved[:ctx.n_inputs], saved[ctx.n_inputs:]
        grads = [torch.zeros_like(o) if g is None else g for g, o in zip(grads, outputs)]
        return (None, *grad_op(list(grads), list(inputs), list(outputs), ctx.attributes))

    return type(f"CustomOp_{qualname}", (torch.autograd.Function,), {
        "forward": staticmethod(forward), "setup_context": staticmethod(setup_context),
        "backward": staticmethod(backward)})


def call(function, inputs, example_outputs, attributes):
    """Runs a custom op defined by ``define``: a list of output tensors."""
    shapes, dtypes = encode_outputs(example_outputs)
    spec = (shapes, dtypes, json.dumps(attributes or {}, sort_keys=True))
    return list(differentiable_call(function, spec, *inputs))
