"""Host kernels with vmap rules of their own, called without functorch's
Python path for ``torch.autograd.Function``.

The engine runs the micro-batches of a step as one ``torch.func.vmap`` call
(``batching.py``).  A few kernels batch by rules of their own (stochastic
rounding from each row's window, fp16 partials folding the rows into a
matrix product, random draws from each row's key, batch norm row by row):
each is a ``torch.autograd.Function`` with a static ``vmap(info, in_dims,
*args)`` rule, the form PyTorch documents.  Through ``Function.apply``,
functorch reaches that rule in Python (binding default arguments, pytree
walks, interpreter bookkeeping): about 1 ms a call, which at a few thousand
calls a step cost a GPT-2 step in fp16 with stochastic rounding a quarter of
its time.  ``apply`` calls the same rule directly: the batched arguments of
the innermost vmap level are unwrapped, the rule runs with that level
popped (as functorch runs it), and its results are wrapped back at their
batch dimensions.  Outside vmap, the function's ``forward`` runs as is (the
engine's kernels run without autograd).  Any other transform in force (a
gradient, nested levels the rule was not written for) takes
``Function.apply``'s own path."""
import torch
from torch._C import _functorch as _ft
from torch._C._functorch import TransformType

__all__ = ["apply"]


class _Info:
    """What a vmap rule reads of its ``info`` argument."""
    __slots__ = ("batch_size", "randomness")

    def __init__(self, batch_size):
        self.batch_size = batch_size
        self.randomness = "error"


def _unwrap(a, level):
    """(``a`` unwrapped, its batch dimension) when ``a`` is a tensor batched
    at ``level``, else (``a``, None)."""
    if isinstance(a, torch.Tensor) and _ft.is_batchedtensor(a) \
            and _ft.maybe_get_level(a) == level:
        return _ft.get_unwrapped(a), _ft.maybe_get_bdim(a)
    return a, None


def _wrap(out, dim, level):
    if isinstance(out, torch.Tensor) and dim is not None:
        return _ft._add_batch_dim(out, dim, level)
    return out


def apply(function, *args):
    """``function.apply(*args)`` for a ``torch.autograd.Function`` whose
    ``forward`` takes ``args`` and whose ``vmap`` rule batches it, with
    the rule called directly under vmap (see the module's docstring)."""
    if not torch._C._are_functorch_transforms_active():
        return function.forward(*args)
    top = _ft.peek_interpreter_stack()
    if top is None or top.key() != TransformType.Vmap:
        return function.apply(*args)
    level = top.level()
    pairs = [_unwrap(a, level) for a in args]
    inner = [a for a, _ in pairs]
    if any(isinstance(a, torch.Tensor) and _ft.is_batchedtensor(a) for a in inner):
        return function.apply(*args)        # nested levels: functorch's own path
    in_dims = tuple(d for _, d in pairs)
    saved = _ft.pop_dynamic_layer_stack()
    try:
        if all(d is None for d in in_dims):     # nothing batched: as functorch, forward
            return function.forward(*inner)
        info = _Info(_ft.CVmapInterpreterPtr(top).batchSize())
        out, out_dims = function.vmap(info, in_dims, *inner)
    finally:
        _ft.push_dynamic_layer_stack(saved)
    if isinstance(out, tuple):
        dims = out_dims if isinstance(out_dims, tuple) else (out_dims,) * len(out)
        return tuple(_wrap(o, d, level) for o, d in zip(out, dims))
    return _wrap(out, out_dims, level)
