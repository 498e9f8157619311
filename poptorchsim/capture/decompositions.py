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

from ..errors import DataDependentError, Error
from ..ir.ops import is_native
from . import ctc_loss

aten = torch.ops.aten

# Batch norm's mutating variant changes its running statistics in place;
# PyTorch's decomposition of it makes the update visible.
_ALWAYS = (aten._native_batch_norm_legit,)


def _native_batch_norm(input, weight, bias, running_mean, running_var, training, momentum,
                       eps):
    """``native_batch_norm`` updates its running statistics without saying so
    in its schema.  Traced as the fused functional kernel plus explicit
    copies of the new statistics, so the update is visible in the graph and
    the engine still runs one kernel (not a dozen element-wise ops)."""
    if running_mean is None:
        return aten._native_batch_norm_legit.no_stats(input, weight, bias, training,
                                                      momentum, eps)
    if not training:
        return aten._native_batch_norm_legit_no_training(input, weight, bias, running_mean,
                                                         running_var, momentum, eps)
    out, mean, rstd, new_mean, new_var = aten._native_batch_norm_legit_functional(
        input, weight, bias, running_mean, running_var, True, momentum, eps)
    running_mean.copy_(new_mean)
    running_var.copy_(new_var)
    return out, mean, rstd


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
    table[aten.native_batch_norm.default] = _native_batch_norm
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


class TraceableForms(TorchFunctionMode):
    """Calls that PyTorch cannot functionalize or trace as written, traced in
    an equivalent form (entered around the model's forward, where the
    user's calls are):

    * ``F.one_hot(y, n)``: its kernel checks the values of ``y`` even though
      ``n`` fixes the shape; traced as ``y[..., None] == arange(n)``;
    * ``torch.bincount(x, weights, minlength=n)``: PopTorch's form, whose
      length is ``minlength`` (on the IPU the minimum length is also the
      maximum: values from ``n`` up are not counted); traced as a
      scatter-add into ``n`` bins;
    * ``F.ctc_loss`` / ``torch.ctc_loss``: ATen's kernel reads the lengths
      on the host and its backward's shapes depend on them; traced as the
      same recursion over fixed shapes (``capture/ctc_loss.py``);
    * ``out=`` arguments (``torch.matmul(a, b, out=c)``): the result is
      computed, then copied into ``out`` (which functionalization handles,
      under autograd too)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.nn.functional.one_hot or func is torch._C._nn.one_hot:
            return _one_hot(*args, **kwargs)
        if func is torch.bincount or func is torch.Tensor.bincount:
            return _bincount(*args, **kwargs)
        if func is torch.nn.functional.ctc_loss:
            return ctc_loss.ctc_loss(*args, **kwargs)
        if func is torch.ctc_loss:
            return ctc_loss.aten_ctc_loss(*args, **kwargs)
        out = kwargs.get("out")
        if out is not None:
            result = func(*args, **{k: v for k, v in kwargs.items() if k != "out"})
            return _copy_out(out, result)
        return func(*args, **kwargs)


def _bincount(input, weights=None, minlength=0):
    if isinstance(minlength, bool) or not isinstance(minlength, int) or minlength <= 0:
        raise Error("Bincount `minlength` must be specified and must be a constant. On the "
                    "IPU MK2 platform the minimum length is also the maximum length "
                    "(poptorchsim: pass minlength=N, the number of bins; values of N and "
                    "more are not counted)")
    counted = input < minlength
    index = torch.where(counted, input, torch.zeros_like(input))
    if weights is None:
        values = counted.to(torch.int64)
    else:
        values = torch.where(counted, weights, torch.zeros_like(weights))
    return torch.zeros(minlength, dtype=values.dtype, device=input.device).scatter_add(
        0, index, values)


def _copy_out(out, result):
    if isinstance(out, torch.Tensor):
        if out.shape != result.shape:
            out.resize_(result.shape)
        return out.copy_(result)
    copied = [_copy_out(o, r) for o, r in zip(out, result)]
    return type(result)(copied) if not hasattr(result, "_fields") else type(result)(*copied)


def _one_hot(tensor, num_classes=-1):
    if num_classes < 0:
        raise DataDependentError(
            "OneHot num classes must be specified and must be constant. "
            "F.one_hot(tensor) without num_classes takes its class count from the "
            "largest value in the tensor, which the static IPU program cannot know. "
            "Pass the class count: F.one_hot(tensor, num_classes=N).")
    classes = torch.arange(num_classes, device=tensor.device, dtype=tensor.dtype)
    return (tensor.unsqueeze(-1) == classes).to(torch.int64)


def _no_packed_sequences(module, args):
    """A module forward pre-hook: RNNs reject ``PackedSequence`` inputs, whose
    batch sizes per time step make every shape depend on the lengths."""
    if isinstance(module, torch.nn.RNNBase) and args and \
            isinstance(args[0], torch.nn.utils.rnn.PackedSequence):
        raise Error(
            f"{type(module).__name__} received a PackedSequence: its per-step batch sizes "
            "come from the sequence lengths, so the IPU program would not be static. "
            "Pass the padded tensor instead (pad_sequence / pad_packed_sequence) and mask "
            "the padded steps, as PopTorch programs do.")


def _causal_hint(mask, is_causal=None, size=None):
    """``nn.Transformer``'s check whether a mask is the causal one compares
    its values (``bool((mask == causal).all())``), which a traced program
    cannot read.  The answer is only a hint: the mask itself is still
    applied, so a mask that is causal gives the same result either way."""
    return bool(is_causal)


def _exporting(compiling, exporting=None):
    """Sets torch.compiler's is_compiling / is_exporting flags (as
    torch.export's non-strict tracing does, so libraries such as Hugging Face
    transformers take their static, export-safe paths); returns the old ones."""
    compiler = torch.compiler
    if not hasattr(compiler, "_is_exporting_flag"):
        return (compiling, exporting)
    old = (compiler._is_compiling_flag, compiler._is_exporting_flag)
    compiler._is_compiling_flag = compiling
    compiler._is_exporting_flag = compiling if exporting is None else exporting
    return old


@contextlib.contextmanager
def tracing_backends():
    """Kernels chosen for tracing: attention through its math formulation
    (matmuls and softmax, differentiable op by op, as the IPU computes it),
    an LSTM through oneDNN's fused layer where eager PyTorch uses it (the IPU
    runs popnn's fused LSTM too), and no fast-path kernels in
    ``nn.MultiheadAttention`` or ``nn.TransformerEncoder``; RNNs given a
    ``PackedSequence`` fail with a
    clear error; torch.compiler reports exporting, as under torch.export;
    ``nn.Transformer`` does not read a mask's values to guess causality."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    mha = getattr(torch.backends, "mha", None)
    fastpath = mha.get_fastpath_enabled() if mha is not None else None
    with sdpa_kernel([SDPBackend.MATH]):
        if mha is not None:
            mha.set_fastpath_enabled(False)
        hook = torch.nn.modules.module.register_module_forward_pre_hook(_no_packed_sequences)
        flags = _exporting(True)
        transformer = torch.nn.modules.transformer
        detect = getattr(transformer, "_detect_is_causal_mask", None)
        if detect is not None:
            transformer._detect_is_causal_mask = _causal_hint
        try:
            yield
        finally:
            if detect is not None:
                transformer._detect_is_causal_mask = detect
            _exporting(*flags)
            hook.remove()
            if mha is not None:
                mha.set_fastpath_enabled(fastpath)
