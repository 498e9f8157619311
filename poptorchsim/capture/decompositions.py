"""Which ATen operations capture decomposes, and the kernels it traces with.

The IR holds PyTorch's core ATen op set plus the few composite operations
poptorchsim lowers whole (``ir.ops``).  Every other operation that PyTorch
can decompose is decomposed while tracing, by PyTorch's own tables: the
core-ATen table torch.export and Inductor use, then the ATen-to-ATen entries
of ``torch._decomp``'s global table (never those of ``torch._refs``, which
produce prims).  An operation that is neither native nor decomposable is
still lowered: its numerics run through its ATen kernel and ``ir.ops`` gives
it a cost class from its tags.
"""
import contextlib
import functools
import warnings

import torch
from torch._decomp import core_aten_decompositions, decomposition_table, get_decompositions

from torch.overrides import TorchFunctionMode

from ..errors import DataDependentError
from ..ir.ops import is_native

aten = torch.ops.aten

# Batch norm mutates its running statistics without saying so in its schema;
# its functional decomposition makes the update visible.
_ALWAYS = (aten.native_batch_norm, aten._native_batch_norm_legit,
           aten._native_batch_norm_legit_no_training)


def _aten_to_aten(fn):
    module = getattr(fn, "__module__", "") or ""
    return not module.startswith(("torch._refs", "torch._prims"))


@functools.lru_cache(maxsize=None)
def _table():
    table = {}
    for source in (decomposition_table, core_aten_decompositions()):
        for op, fn in source.items():
            if isinstance(op, torch._ops.OpOverload) and not is_native(op) \
                    and _aten_to_aten(fn) and op.namespace == "aten":
                table[op] = fn
    table.update(get_decompositions(list(_ALWAYS)))
    return table


def decompositions():
    """The decomposition table capture traces with (op -> function)."""
    return dict(_table())


@contextlib.contextmanager
def _quietly(manager):
    """Enters and leaves ``manager`` with its warnings silenced (oneDNN's
    flags warn about TF32 on every change)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        manager.__enter__()
    try:
        yield
    finally:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            manager.__exit__(None, None, None)


class _StaticShapes(TorchFunctionMode):
    """Composite functions whose PyTorch kernels check tensor values even when
    their output shape is fixed by an argument: traced as the static formula
    instead.  ``F.one_hot(y, n)`` is ``y[..., None] == arange(n)``."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.nn.functional.one_hot or func is torch._C._nn.one_hot:
            return _one_hot(*args, **kwargs)
        return func(*args, **kwargs)


def _one_hot(tensor, num_classes=-1):
    if num_classes < 0:
        raise DataDependentError(
            "F.one_hot(tensor) without num_classes takes its class count from the "
            "largest value in the tensor, which the static IPU program cannot know. "
            "Pass the class count: F.one_hot(tensor, num_classes=N).")
    classes = torch.arange(num_classes, device=tensor.device, dtype=tensor.dtype)
    return (tensor.unsqueeze(-1) == classes).to(torch.int64)


@contextlib.contextmanager
def tracing_backends():
    """Kernels chosen for tracing: attention through its math formulation
    (matmuls and softmax, differentiable op by op, as the IPU computes it),
    RNNs without oneDNN's fused layer, and no fast-path kernels in
    ``nn.MultiheadAttention`` or ``nn.TransformerEncoder``; ``one_hot`` with
    a class count traced without reading its input."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    mha = getattr(torch.backends, "mha", None)
    fastpath = mha.get_fastpath_enabled() if mha is not None else None
    with sdpa_kernel([SDPBackend.MATH]), _quietly(torch.backends.mkldnn.flags(enabled=False)), \
            _StaticShapes():
        if mha is not None:
            mha.set_fastpath_enabled(False)
        try:
            yield
        finally:
            if mha is not None:
                mha.set_fastpath_enabled(fastpath)
