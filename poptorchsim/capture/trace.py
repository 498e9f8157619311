"""Capture: a module, its optimizer and example inputs -> static fx graphs.

Two graphs describe a training step, both traced with ``make_fx`` over fake
tensors (no real compute) and functionalized (no mutation):

* the *step* graph: forward, loss and backward of one micro-batch,
  ``(params, buffers, inputs) -> (outputs, grads, new buffers)``, its
  backward made by torch's own autograd (``_grad_and_value``: the
  backward runs with grad mode off, as ``loss.backward()`` does, so every op
  takes the same backward kernel as in eager PyTorch);
* the *update* graph: one optimizer step for every trainable parameter,
  ``(params, grads, state, steps, hyper) -> (new params, new state, steps)``.

Inference has the forward alone.  Nothing here knows about tiles.
"""
import contextlib
import threading
from dataclasses import dataclass, field

import torch
import torch.utils._pytree as pytree
from torch.func import functionalize, grad_and_value
from torch.fx.experimental.proxy_tensor import make_fx

from ..errors import DataDependentError, Error, InputError, LossError
from . import blocks as _blocks
from . import losses as _losses
from .decompositions import TraceableForms, decompositions, tracing_backends
from .index_expansion import remove_index_expansions
from .mixed_precision import MixedPrecision
from .op_calls import PoptorchOpCalls
from .trace_checks import (
    check_multiconvs,
    constants_as_compiled,
    drop_constant_reads,
    explain_failure,
    forward_signature,
    held_constants,
    named_inputs,
    user_frame,
)
from .weightless import explain_meta_constant, fake_meta_example

aten = torch.ops.aten
_tracing = threading.local()


def is_tracing():
    return getattr(_tracing, "active", False)


def tracing_training():
    """True while the training step (forward, loss and backward) is traced."""
    return is_tracing() and getattr(_tracing, "training", False)


@contextlib.contextmanager
def tracing_scope(training=False):
    """While ``make_fx`` traces a step or an update rule.  The graph modules
    it makes write their Python code when first run or printed, not when
    made (PyTorch's lazy graph modules, as ``torch.compile`` makes them):
    the compiler reads their graphs and never runs them (BERT-Large's step:
    80 ms of code written and compiled for nothing)."""
    _tracing.active, _tracing.training = True, training
    try:
        with _lazy_graph_modules():
            yield
    finally:
        _tracing.active = _tracing.training = False


def _lazy_graph_modules():
    try:
        from torch.fx._lazy_graph_module import _use_lazy_graph_module
    except ImportError:         # a PyTorch release without them: made as usual
        return contextlib.nullcontext()
    return _use_lazy_graph_module(True)


@dataclass
class Capture:
    """What capture hands to lowering: fx graphs plus how to call them."""
    kind: str                          # "training" or "inference"
    graph: torch.fx.GraphModule        # step (training) or forward (inference)
    param_names: list
    trainable_names: list
    buffer_names: list
    input_spec: object                 # pytree spec of (args, kwargs)
    input_leaves: list                 # ("tensor", shape, dtype) | ("const", value)
    output_spec: object
    output_leaves: list                # ("tensor", i) | ("const", value)
    n_tensor_outputs: int
    loss_kind: str = ""
    example_inputs: list = field(default_factory=list)
    blocks: list = field(default_factory=list)   # (user_id, ipu_id) in entry order
    loss_scaling: bool = False         # the step's last input scales the loss
    tied: dict = field(default_factory=dict)     # name -> every module path of that tensor


def bind_inputs(module, args, kwargs):
    """Args and kwargs bound to ``forward``'s signature, defaults filled in."""
    sig = forward_signature(module)
    params = [p for p in sig.parameters.values()
              if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    variadic = any(p.kind == p.VAR_POSITIONAL for p in sig.parameters.values())
    if len(args) > len(params) and not variadic:
        names = [p.name for p in params]
        raise AssertionError(f"Too many arguments provided: expected {names} "
                             f"({len(names)}) but got {len(args)}")
    for i, p in enumerate(params):
        if i >= len(args) and p.name not in kwargs and p.default is p.empty:
            raise Error(f"Mandatory parameter {p.name} missing: "
                        f"{type(module).__name__}.forward{sig} needs it; pass it "
                        f"positionally or as {p.name}=...")
    try:
        bound = sig.bind(*args, **kwargs)
    except TypeError as exc:
        raise Error(f"{exc}: the inputs do not match "
                    f"{type(module).__name__}.forward{sig}") from None
    bound.apply_defaults()
    return tuple(bound.args), dict(bound.kwargs)


def _flatten_inputs(args, kwargs):
    leaves, spec = pytree.tree_flatten((args, kwargs))
    described, tensors = [], []
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            described.append(("tensor", tuple(leaf.shape), leaf.dtype))
            tensors.append(leaf)
        else:
            described.append(("const", leaf))
    return described, spec, tensors


def _rebuild_inputs(described, spec, tensors):
    it = iter(tensors)
    leaves = [next(it) if d[0] == "tensor" else d[1] for d in described]
    return pytree.tree_unflatten(leaves, spec)


DATA_DEPENDENT_HELP = (
    "The IPU program is static: it is traced once, so Python code inside "
    "forward() cannot depend on the values of tensors (.item(), .tolist(), "
    "bool(tensor), `if tensor:`, data-dependent shapes). Replace it with tensor "
    "operations such as torch.where, or move it out of forward().")


def _check_inputs(module, args, kwargs):
    """Inputs no program can take, refused before tracing."""
    for name, value in named_inputs(module, args, kwargs):
        for leaf in pytree.tree_leaves(value):
            if isinstance(leaf, torch.Tensor) and leaf.device.type == "meta":
                raise InputError(
                    f"Input {name} is a tensor on the meta device: it has a shape "
                    f"({list(leaf.shape)}) but no values, so the model cannot run on it. "
                    "Pass a tensor with data (a CPU tensor, as PopTorch takes inputs).")


def _trace(fn, example, what, blocks_seen=None, stack_traces=False):
    """``fn`` traced over fake copies of ``example``: functionalized, ATen ops
    outside the op set poptorchsim lowers decomposed by PyTorch's own tables.
    Tensors that ``fn`` reaches other than through its arguments (attributes,
    closures) are traced as constants (fx ``get_attr`` nodes)."""
    try:
        with tracing_scope(what == "training step"), _blocks.recording() as entered, \
                tracing_backends():
            gm = make_fx(functionalize(fn, remove="mutations"), tracing_mode="fake",
                         decomposition_table=decompositions(), _allow_non_fake_inputs=True,
                         record_stack_traces=stack_traces)(*fake_meta_example(example))
        if blocks_seen is not None:
            blocks_seen.extend(dict.fromkeys(entered))     # unique, in entry order
    except Error:
        raise
    except Exception as exc:  # classified below
        name = type(exc).__name__
        if name in ("GuardOnDataDependentSymNode", "DataDependentOutputException",
                    "DynamicOutputShapeException") or "data-dependent" in str(exc) \
                or "data is not allocated" in str(exc):     # read a fake tensor's values
            raise DataDependentError(
                f"While tracing the {what}, forward() used the value of a tensor "
                f"at {user_frame(exc)} ({name}). {DATA_DEPENDENT_HELP}") from None
        raise
    drop_constant_reads(gm)
    remove_index_expansions(gm)      # as PopTorch's canonicalisation does
    check_multiconvs(gm)
    for node in gm.graph.nodes:
        if node.target in (aten._local_scalar_dense.default, aten.item.default):
            stack = node.meta.get("stack_trace", "") or ""
            where = stack.strip().splitlines()[-2:] if stack else []
            at = ": " + " ".join(w.strip() for w in where) if where else ""
            raise DataDependentError(
                f"While tracing the {what}, forward() read a tensor's value into "
                f"Python (.item() or similar){at}. {DATA_DEPENDENT_HELP}")
    return gm


def _trace_model(fn, example, what, blocks, stack_traces, inputs):
    """``_trace`` of a model's step: inputs checked first, and a common
    mistake behind an exception of forward() raised as a typed error."""
    _check_inputs(*inputs)
    held = held_constants(inputs[0])
    try:
        gm = _trace(fn, example, what, blocks, stack_traces)
    except Error:
        raise
    except Exception as exc:  # re-raised unless explained
        explained = explain_failure(exc, what, *inputs) or \
            explain_meta_constant(exc, inputs[0], what)
        if explained is None:
            raise
        raise explained from exc
    constants_as_compiled(gm, held)
    return gm


def register_dict_types(value):
    """Inputs and outputs of a ``dict`` subclass (an ``OrderedDict`` subclass,
    say) are taken apart like dicts and rebuilt as their own type, as PopTorch
    does, with no custom argument parser: ``torch.utils._pytree`` knows only
    the exact types, and would keep such an input whole (its tensors compiled
    into the model as constants) or return traced tensors inside an output."""
    if isinstance(value, dict):
        cls = type(value)
        if cls not in pytree.SUPPORTED_NODES:
            def unflatten(values, keys, cls=cls):
                try:
                    return cls(zip(keys, values))
                except TypeError:           # an __init__ of its own
                    obj = cls.__new__(cls)
                    dict.update(obj, zip(keys, values))
                    return obj
            pytree.register_pytree_node(
                cls, lambda d: (list(d.values()), tuple(d.keys())), unflatten)
        for v in value.values():
            register_dict_types(v)
    elif isinstance(value, (list, tuple)):
        for v in value:
            register_dict_types(v)


def _grad_and_value(fn):
    """``torch.func.grad_and_value(fn, has_aux=True)`` whose backward runs as
    ``loss.backward()`` does: without building a graph of its own.

    ``torch.func`` differentiates with ``create_graph=True`` (so transforms
    nest), and under grad mode autograd picks the differentiable form of a
    backward where an op has two: oneDNN's LSTM layer then differentiates
    through a re-trace of every time step (1,600 ops for a small LSTM instead
    of one fused backward), SiLU, GroupNorm and dropout through element-wise
    formulas.  Eager training uses the fused backward kernels, and so does
    the captured step.  Built on ``torch._functorch``'s own helpers; where a
    PyTorch release lacks them, ``torch.func.grad_and_value`` is used."""
    try:
        from torch._functorch import eager_transforms as et
        helpers = (et.grad_increment_nesting, et._wrap_all_tensors, et._create_differentiable,
                   et._autograd_grad, et._undo_create_differentiable)
    except (ImportError, AttributeError):
        return grad_and_value(fn, has_aux=True)
    nesting, wrap, differentiable, autograd_grad, undo = helpers

    def run(diff_args, *rest):
        with nesting() as level, torch.enable_grad():
            diff_args, rest = wrap(diff_args, level), wrap(rest, level)
            pytree.tree_map_(lambda t: differentiable(t, level), diff_args)
            loss, aux = fn(diff_args, *rest)
            flat, spec = pytree.tree_flatten(diff_args)
            grads = autograd_grad((loss,), flat, create_graph=False)
            grads = undo(pytree.tree_unflatten(grads, spec), level)
            return grads, (undo(loss, level), undo(aux, level))
    return run


def _select_loss(recorded):
    """``(loss, kind, where)``: the identity loss, or else the one loss
    function's result (PopTorch's rule), and the line that made it."""
    identity = [r for r in recorded if r[0] == "identity_loss"]
    candidates = identity or recorded
    if not candidates:
        raise LossError(
            "Couldn't find a loss in graph! A trainingModel's forward() must "
            "compute its loss with a torch loss function (torch.nn.CrossEntropyLoss, "
            "F.mse_loss, ...) or mark it with poptorchsim.identity_loss(loss, "
            "reduction='mean').")
    if len(candidates) > 1:
        # a loss another loss is computed from is not final (an identity_loss
        # inside a custom loss function, reducing a term): the final one is
        candidates = [c for c in candidates
                      if not any(d is not c and _computed_from(d[1], c[1]) for d in candidates)]
    if len(candidates) > 1:
        raise LossError(
            "Multiple independent losses found in graph. Graph must have one final "
            "loss. Wrap final graph loss in poptorch.identity_loss.")
    kind, loss, where = candidates[0]
    return loss, kind, where


def _computed_from(tensor, source):
    """Is ``tensor`` computed from ``source`` (its autograd graph reaches
    ``source``'s)?"""
    target = source.grad_fn
    if target is None or tensor.grad_fn is None:
        return False
    seen, stack = set(), [tensor.grad_fn]
    while stack:
        fn = stack.pop()
        if fn is None or fn in seen:
            continue
        if fn is target:
            return True
        seen.add(fn)
        stack.extend(f for f, _ in fn.next_functions)
    return False


def _warn_unused_terms(recorder, loss, kind, where, out):
    """A training model that returns a value computed from its loss (``ce +
    dice``, ``0.5 * loss``) trains on the loss function's result alone, as
    PopTorch does: said once, at compile time, naming both lines."""
    terms = recorder.unused_terms(loss, pytree.tree_leaves(out))
    if not terms:
        return
    import logging
    logging.getLogger("poptorchsim").warning(
        "The training model returns a value computed from its loss (%s) that the "
        "backward pass does not use: only the result of %s (%s) is differentiated, "
        "as in PopTorch, so terms added to it or factors applied to it after the loss "
        "function are not trained. To train on the returned value, return "
        "poptorch.identity_loss(value, reduction='none') instead.",
        terms[0], kind, where)


@contextlib.contextmanager
def _no_distribution_checks():
    """``torch.distributions`` without argument validation while tracing, as
    PopTorch does: validation reads tensor values, which a static program
    cannot do."""
    saved = torch.distributions.Distribution._validate_args
    torch.distributions.Distribution.set_default_validate_args(False)
    try:
        yield
    finally:
        torch.distributions.Distribution.set_default_validate_args(saved)


def _call_checked(module, state, args, kwargs, buffer_names):
    """``functional_call`` that also catches a forward() removing or
    reassigning a buffer or parameter (PopTorch's texts)."""
    from torch.nn.utils.stateless import _reparametrize_module

    from ..errors import Error
    with _reparametrize_module(module, state, tie_weights=True), TraceableForms(), \
            _blocks.following_crossings(), MixedPrecision(), _no_distribution_checks(), \
            PoptorchOpCalls():
        out = module(*args, **kwargs)
        for name, tensor in state.items():
            kind = "Buffer" if name in buffer_names else "Parameter"
            owner, _, attr = name.rpartition(".")
            sub = module.get_submodule(owner) if owner else module
            store = sub._buffers if kind == "Buffer" else sub._parameters
            if attr not in store and getattr(sub, attr, None) is None:
                raise Error(f"{kind} {name} is removed from the model when calling the "
                            "forward method.")
            current = store.get(attr, getattr(sub, attr, None))
            if current is not tensor:
                raise Error(
                    f"{kind} {name} is reassigned within the model when calling the "
                    f"forward method. This is not supported. Consider using "
                    f"self.{name}.copy_(src) to copy data from a source tensor, where src "
                    "is the name of the source tensor.")
    return out


def _split_state(module):
    params = dict(module.named_parameters())
    buffers = dict(module.named_buffers())
    return params, buffers


def tied_names(module):
    """``{name: [every name of the same tensor]}`` for parameters and buffers
    reachable by several module paths (``head.weight = emb.weight``), keyed
    by the name ``named_parameters()`` keeps.  Such a tensor is one input of
    the traced program: ``_call_checked`` binds every path to it, so the
    gradients of all its uses sum as in eager autograd."""
    paths = {}
    for named in (module.named_parameters(remove_duplicate=False),
                  module.named_buffers(remove_duplicate=False)):
        for name, tensor in named:
            paths.setdefault(id(tensor), []).append(name)
    return {names[0]: names for names in paths.values() if len(names) > 1}


def capture_training(module, args, kwargs, in_optimizer, stack_traces=False,
                     loss_scaling=False):
    """Trace forward + loss + backward of one micro-batch.

    Parameters that require grad and belong to the optimizer are trained;
    the others are held constant.  ``stack_traces``: every node records the
    line of the model that made it (slower; for error messages).
    ``loss_scaling``: the step takes one more input, the loss scaling, and
    differentiates the loss multiplied by it (in the loss's type, as the
    IPU seeds the backward pass), so the gradients come out scaled."""
    params, buffers = _split_state(module)
    param_names = list(params)
    trainable = [n for n in param_names if params[n].requires_grad and n in in_optimizer]
    frozen = [n for n in param_names if n not in trainable]
    buffer_names = list(buffers)
    described, spec, tensors = _flatten_inputs(args, kwargs)
    out_info = {}

    def step(p_train, p_frozen, bufs, inputs, *scale):
        def loss_of(p_train, bufs, inputs):
            # buffers and inputs are arguments, so forward() may change them in place
            a, kw = _rebuild_inputs(described, spec, inputs)
            with _losses.LossRecorder() as recorder:
                out = _call_checked(module, {**p_train, **p_frozen, **bufs}, a, kw,
                                    bufs)
            loss, kind, where = _select_loss(recorder.losses)
            _warn_unused_terms(recorder, loss, kind, where, out)
            _blocks.begin_backward()       # what autograd traces next is backward
            out_info["loss_kind"] = kind
            scalar = loss if loss.dim() == 0 else loss.sum()
            if scale:
                scalar = scalar * scale[0].to(scalar.dtype)
            register_dict_types(out)
            return scalar, (out, bufs)
        grads, (_, (out, new_bufs)) = _grad_and_value(loss_of)(p_train, bufs, inputs)
        leaves, out_spec = pytree.tree_flatten(out)
        out_info["spec"] = out_spec
        out_info["leaves"] = leaves
        t_out = [x for x in leaves if isinstance(x, torch.Tensor)]
        return (t_out, [grads[n] for n in trainable], [new_bufs[n] for n in buffer_names])

    example = (
        {n: params[n].detach() for n in trainable},
        {n: params[n].detach() for n in frozen},
        {n: buffers[n].detach() for n in buffer_names},
        [t.detach() for t in tensors],
    ) + ((torch.ones((), dtype=torch.float32),) if loss_scaling else ())
    blocks = []
    gm = _trace_model(step, example, "training step", blocks, stack_traces,
                      (module, args, kwargs))
    return _finish(Capture("training", gm, trainable + frozen, trainable, buffer_names,
                           spec, described, None, None, 0,
                           loss_kind=out_info.get("loss_kind", ""),
                           example_inputs=tensors, blocks=blocks,
                           loss_scaling=loss_scaling, tied=tied_names(module)), out_info)


def capture_inference(module, args, kwargs, stack_traces=False):
    """Trace the forward of one micro-batch, in eval mode."""
    params, buffers = _split_state(module)
    param_names = list(params)
    buffer_names = list(buffers)
    described, spec, tensors = _flatten_inputs(args, kwargs)
    out_info = {}

    def forward(p, bufs, inputs):
        a, kw = _rebuild_inputs(described, spec, inputs)
        out = _call_checked(module, {**p, **bufs}, a, kw, bufs)
        register_dict_types(out)
        leaves, out_spec = pytree.tree_flatten(out)
        out_info["spec"], out_info["leaves"] = out_spec, leaves
        return ([x for x in leaves if isinstance(x, torch.Tensor)],
                [bufs[n] for n in buffer_names])

    modes = {m: m.training for m in module.modules()}
    module.eval()
    try:
        with torch.no_grad():
            example = ({n: params[n].detach() for n in param_names},
                       {n: buffers[n].detach() for n in buffer_names},
                       [t.detach() for t in tensors])
            blocks = []
            gm = _trace_model(forward, example, "inference forward", blocks, stack_traces,
                              (module, args, kwargs))
    finally:
        for m, mode in modes.items():
            m.training = mode
    return _finish(Capture("inference", gm, param_names, [], buffer_names, spec,
                           described, None, None, 0, example_inputs=tensors,
                           blocks=blocks, tied=tied_names(module)), out_info)


def _finish(capture, out_info):
    leaves = out_info["leaves"]
    described, k = [], 0
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            described.append(("tensor", k))
            k += 1
        else:
            described.append(("const", leaf))
    capture.output_spec = out_info["spec"]
    capture.output_leaves = described
    capture.n_tensor_outputs = k
    return capture
