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
import copy
import dataclasses
import inspect
import math
import threading
import traceback
import weakref
from dataclasses import dataclass, field

import torch
import torch.utils._pytree as pytree
from torch.func import functionalize, grad_and_value
from torch.fx.experimental.proxy_tensor import make_fx

from ..errors import DataDependentError, DtypeError, Error, InputError, LossError
from . import blocks as _blocks
from . import losses as _losses
from . import scopes as _scopes
from . import update_rules as _opt
from .decompositions import decompositions, tracing_backends
from .mixed_precision import MixedPrecision

aten = torch.ops.aten
_tracing = threading.local()


def is_tracing():
    return getattr(_tracing, "active", False)


def tracing_training():
    """True while the training step (forward, loss and backward) is traced."""
    return is_tracing() and getattr(_tracing, "training", False)


@contextlib.contextmanager
def _tracing_scope(training=False):
    _tracing.active, _tracing.training = True, training
    try:
        yield
    finally:
        _tracing.active = _tracing.training = False


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


def forward_signature(module):
    """``inspect.signature`` of ``module.forward``, computed once per function
    (it costs about 0.2 ms, which a small model's step would pay every call)."""
    forward = module.forward
    func = getattr(forward, "__func__", forward)
    try:
        cached = _SIGNATURES.get(func)
        if cached is None:
            cached = _SIGNATURES[func] = inspect.signature(forward)
        return cached
    except TypeError:           # not weakly referenceable (a builtin)
        return inspect.signature(forward)


_SIGNATURES = weakref.WeakKeyDictionary()


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


def _user_frame(exc):
    """The innermost traceback line that belongs to the user's code."""
    frames = traceback.extract_tb(exc.__traceback__)
    for frame in reversed(frames):
        path = frame.filename.replace("\\", "/")
        if "/torch/" not in path and "/poptorchsim/" not in path:
            return f'{frame.filename}:{frame.lineno}: {frame.line}'
    return "unknown location"


DATA_DEPENDENT_HELP = (
    "The IPU program is static: it is traced once, so Python code inside "
    "forward() cannot depend on the values of tensors (.item(), .tolist(), "
    "bool(tensor), `if tensor:`, data-dependent shapes). Replace it with tensor "
    "operations such as torch.where, or move it out of forward().")


def _named_inputs(module, args, kwargs):
    """``(name, value)`` of each input, named after ``forward``'s parameters."""
    sig = forward_signature(module)
    names = [p.name for p in sig.parameters.values()
             if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    for i, value in enumerate(args):
        yield (names[i] if i < len(names) else f"args[{i}]"), value
    yield from kwargs.items()


def _check_inputs(module, args, kwargs):
    """Inputs no program can take, refused before tracing."""
    for name, value in _named_inputs(module, args, kwargs):
        for leaf in pytree.tree_leaves(value):
            if isinstance(leaf, torch.Tensor) and leaf.device.type == "meta":
                raise InputError(
                    f"Input {name} is a tensor on the meta device: it has a shape "
                    f"({list(leaf.shape)}) but no values, so the model cannot run on it. "
                    "Pass a tensor with data (a CPU tensor, as PopTorch takes inputs).")


_INDEX_TYPE = ("for index, but got torch.float", "expected scalar type Long",
               "to have one of the following scalar types: Long, Int",
               "Expected floating point type for target with class probabilities")


def _explain_failure(exc, what, module, args, kwargs):
    """A typed error naming the cause and the fix of a common mistake behind
    ``exc``, an exception forward() raised while traced; None otherwise."""
    message = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    inputs = list(_named_inputs(module, args, kwargs))
    if any(text in str(exc) for text in _INDEX_TYPE):
        floats = [n for n, v in inputs if isinstance(v, torch.Tensor)
                  and v.dtype.is_floating_point]
        return DtypeError(
            f"While tracing the {what}, the operation at {_user_frame(exc)} needs "
            f"integer class labels or indices but got a floating-point tensor ({message}). "
            "Class labels of CrossEntropyLoss and NLLLoss, and indices of embeddings and "
            "gather, must be int64: convert them with .long()"
            + (f" (floating-point inputs: {', '.join(floats)})" if floats else "")
            + ". Floating-point targets of CrossEntropyLoss are class probabilities, "
            "with the shape of the logits.")
    lists = [n for n, v in inputs if isinstance(v, (list, tuple)) and v
             and all(isinstance(x, (int, float, bool)) for x in pytree.tree_leaves(v))]
    if lists:
        return InputError(
            f"While tracing the {what}, forward() raised {type(exc).__name__} at "
            f"{_user_frame(exc)} ({message}); its input {', '.join(lists)} is a Python "
            "list of numbers, which the program compiles in as constants, not a tensor. "
            "Pass torch.tensor(...) for data that forward() computes with.")
    return None


def _trace(fn, example, what, blocks_seen=None, stack_traces=False):
    """``fn`` traced over fake copies of ``example``: functionalized, ATen ops
    outside the op set poptorchsim lowers decomposed by PyTorch's own tables.
    Tensors that ``fn`` reaches other than through its arguments (attributes,
    closures) are traced as constants (fx ``get_attr`` nodes)."""
    try:
        with _tracing_scope(what == "training step"), _blocks.recording() as entered, \
                tracing_backends():
            gm = make_fx(functionalize(fn, remove="mutations"), tracing_mode="fake",
                         decomposition_table=decompositions(), _allow_non_fake_inputs=True,
                         record_stack_traces=stack_traces)(*example)
        if blocks_seen is not None:
            blocks_seen.extend(dict.fromkeys(entered))     # unique, in entry order
    except Error:
        raise
    except Exception as exc:  # noqa: BLE001 - classified below
        name = type(exc).__name__
        if name in ("GuardOnDataDependentSymNode", "DataDependentOutputException",
                    "DynamicOutputShapeException") or "data-dependent" in str(exc) \
                or "data is not allocated" in str(exc):     # read a fake tensor's values
            raise DataDependentError(
                f"While tracing the {what}, forward() used the value of a tensor "
                f"at {_user_frame(exc)} ({name}). {DATA_DEPENDENT_HELP}") from None
        raise
    _drop_constant_reads(gm)
    _check_multiconvs(gm)
    for node in gm.graph.nodes:
        if node.target in (aten._local_scalar_dense.default, aten.item.default):
            stack = node.meta.get("stack_trace", "") or ""
            where = stack.strip().splitlines()[-2:] if stack else []
            raise DataDependentError(
                f"While tracing the {what}, forward() read a tensor's value into "
                f"Python (.item() or similar){': ' + ' '.join(w.strip() for w in where) if where else ''}. "
                f"{DATA_DEPENDENT_HELP}")
    return gm


def _trace_model(fn, example, what, blocks, stack_traces, inputs):
    """``_trace`` of a model's step: inputs checked first, and a common
    mistake behind an exception of forward() raised as a typed error."""
    _check_inputs(*inputs)
    try:
        return _trace(fn, example, what, blocks, stack_traces)
    except Error:
        raise
    except Exception as exc:  # noqa: BLE001 - re-raised unless explained
        explained = _explain_failure(exc, what, *inputs)
        if explained is None:
            raise
        raise explained from exc


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


def _check_multiconvs(gm):
    """A ``MultiConv`` scope must hold a convolution (PopTorch's text)."""
    groups, with_conv = {}, set()
    for node in gm.graph.nodes:
        group = node.meta.get("custom", {}).get(_scopes.MULTICONV)
        if group is None:
            continue
        groups[id(group)] = group
        if node.target in (aten.convolution.default, aten.conv2d.default,
                           aten.conv1d.default, aten.conv3d.default):
            with_conv.add(id(group))
    if set(groups) - with_conv:
        raise Error("Unexpected end_multi_conv, is the IR malformed? (a poptorch.MultiConv "
                    "scope holds no convolution: put the convolutions to run together "
                    "inside it, or remove it)")


def _constant_ancestors(node):
    """The nodes ``node`` is computed from, or None where one is a graph input:
    a value read from constants only (closure or attribute tensors, traced as
    ``get_attr``) is known when the program is compiled."""
    seen, todo = {}, [node]
    while todo:
        n = todo.pop()
        if n in seen:
            continue
        if n.op == "placeholder":
            return None
        seen[n] = None
        todo.extend(n.all_input_nodes)
    return seen


def _drop_constant_reads(gm):
    """``.item()`` (a slice bound, an index) of a tensor that forward() holds
    as a constant was read at trace time and its value compiled in, as
    PopTorch does; the read and the constant arithmetic leading to it leave
    the graph.  A read of a tensor computed from the inputs stays, and is
    refused by the caller."""
    changed = False
    for node in list(gm.graph.nodes):
        if node.target not in (aten._local_scalar_dense.default, aten.item.default) \
                or node.users:
            continue
        ancestors = _constant_ancestors(node)
        if ancestors is None:
            continue
        order = [n for n in gm.graph.nodes if n in ancestors]
        for n in reversed(order):
            if not n.users:
                gm.graph.erase_node(n)
        changed = True
    if changed:
        gm.graph.lint()
        gm.recompile()


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
        raise LossError(
            "Multiple independent losses found in graph. Graph must have one final "
            "loss. Wrap final graph loss in poptorch.identity_loss.")
    kind, loss, where = candidates[0]
    return loss, kind, where


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
    with _reparametrize_module(module, state, tie_weights=True), MixedPrecision(), \
            _no_distribution_checks():
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


@dataclass(frozen=True)
class ParamUpdate:
    """One trainable parameter as the update graph sees it."""
    shape: tuple
    dtype: torch.dtype              # the weight's
    grad_dtype: torch.dtype         # the gradient input's (the accumulator's)
    group: int                      # its param_group
    slots_in: tuple = ()            # ((state name, dtype), ...) the update reads
    slots_out: tuple = ()           # ... and writes


def _update_rule(plan, layout, unit_scale):
    """``(prepare, apply)`` for one parameter: ``prepare(grad, grad_scale)``
    gives the gradient in the compute type with the loss scaling and the
    mean reduction taken out; ``apply(param, g, state, step, hyper, globals,
    grad_scale)`` gives the new parameter and state in their stored types.
    The rule computes in float32 (float64 for a float64 weight)."""
    rule = _opt.RULES[plan.kind]
    flags = plan.group_flags(layout.group)
    in_names = [n for n, _ in layout.slots_in]
    cdt = torch.promote_types(layout.dtype, torch.float32)

    def prepare(grad, grad_scale):
        g = grad.to(cdt)
        return g if unit_scale or not rule.scale_grad else g * grad_scale

    def apply(param, g, state, step, hyper, globals_, grad_scale):
        h = dict(zip(plan.hyper, hyper))
        h.update(zip(plan.globals, globals_))
        h["grad_scale"] = grad_scale
        st = {n: s.to(cdt) for n, s in zip(in_names, state)}
        new, new_state = rule.fn(param.to(cdt), g, st, h, step, flags)
        return new.to(param.dtype), [new_state[n].to(dt) for n, dt in layout.slots_out]
    return prepare, apply


def _example(layout):
    return (torch.zeros(layout.shape, dtype=layout.dtype),
            torch.zeros(layout.shape, dtype=layout.grad_dtype),
            [torch.zeros(layout.shape, dtype=dt) for _, dt in layout.slots_in],
            torch.zeros((), dtype=torch.float32))


def capture_update(plan, layouts, n_groups, unit_scale=False, traces=None):
    """Trace one optimizer step over every trainable parameter.

    ``plan``: the ``UpdatePlan`` (rule, flags per group, types, loss
    scaling, ``max_grad_norm``: clip by the global gradient norm first, as
    ``clip_grad_norm_`` does); ``layouts``: a ``ParamUpdate`` per trainable
    parameter; ``unit_scale``: the gradient scale input is always 1 (one
    micro-batch on one replica per update, no loss scaling), so gradients
    are used as they are.  Inputs: ``(params, grads, state, steps, hyper,
    globals, grad_scale)``; outputs ``(new params, new state, new steps)``.
    ``traces``: a dict keeping the rules traced per parameter layout, to
    share with another capture of the same optimizer (the update over whole
    weights of a sharded one).
    """
    n_h, n_g = len(plan.hyper), len(plan.globals)
    if plan.max_grad_norm is None and layouts:
        stitched = _update_by_parameter(plan, layouts, n_groups, unit_scale,
                                        {} if traces is None else traces)
        if stitched is not None:
            return stitched
    rules = [_update_rule(plan, layout, unit_scale) for layout in layouts]
    max_grad_norm = plan.max_grad_norm

    def update(params, grads, state, steps, hyper, globals_, grad_scale):
        grads = [prepare(g, grad_scale) for (prepare, _), g in zip(rules, grads)]
        if max_grad_norm is not None:
            total = torch.linalg.vector_norm(
                torch.stack([torch.linalg.vector_norm(g) for g in grads]))
            coef = torch.clamp(max_grad_norm / (total + 1e-6), max=1.0)
            grads = [g * coef for g in grads]
        new_params, new_state, new_steps = [], [], []
        for i, ((_, apply), layout) in enumerate(zip(rules, layouts)):
            grp = layout.group
            step = steps[i] + 1
            p_new, s_new = apply(params[i], grads[i], state[i], step,
                                 hyper[grp * n_h:(grp + 1) * n_h], globals_, grad_scale)
            new_params.append(p_new)
            new_state.append(s_new)
            new_steps.append(step)
        return new_params, new_state, new_steps

    examples = [_example(layout) for layout in layouts]
    example = (
        [e[0] for e in examples], [e[1] for e in examples], [e[2] for e in examples],
        [e[3] for e in examples],
        [torch.zeros((), dtype=torch.float64) for _ in range(n_groups * n_h)],
        [torch.zeros((), dtype=torch.float64) for _ in range(n_g)],
        torch.ones((), dtype=torch.float32),
    )
    with _tracing_scope():
        return _cast_scalars_once(make_fx(update, tracing_mode="fake")(*example))


class GraphOnly:
    """An fx graph where lowering takes a ``GraphModule`` (``.graph``): the
    stitched update graph is lowered, never run, so it needs no Python code
    generated for it."""

    def __init__(self, graph):
        self.graph = graph


def _update_by_parameter(plan, layouts, n_groups, unit_scale, traces):
    """The update graph of ``capture_update`` built from small traces of the
    rule, copied once per parameter: without global clipping every
    parameter's update is independent, and models repeat a few layouts many
    times (tracing each op costs about a millisecond).

    The rules are element-wise with whole-tensor reductions, so the rule
    traced for one shape is the rule for every shape of the same types and
    param group: only the shapes of its tensors change.  It is traced once
    per such kind of parameter (and once more, at a second shape, to check
    that the two traces agree op for op), and each copy takes its
    parameter's shape; a kind whose trace depends on the shape (a tensor of
    another shape, a list argument, traces that disagree) is traced for
    every shape, and so is a 0-d or empty parameter (type promotion treats
    0-d tensors apart).  The copies are merged as torch.fx's CSE pass merges them
    (``_Copies``).  None when a traced rule holds tensor constants."""
    n, n_h, n_g = len(layouts), len(plan.hyper), len(plan.globals)

    def one(layout):
        prepare, apply = _update_rule(plan, layout, unit_scale)

        def update(param, grad, state, step, hyper, globals_, grad_scale):
            step = step + 1
            p_new, s_new = apply(param, prepare(grad, grad_scale), state, step, hyper,
                                 globals_, grad_scale)
            return p_new, s_new, step
        return update

    def trace(layout):
        key = ("layout", plan, unit_scale, layout)
        if key not in traces:
            example = _example(layout) + (
                [torch.zeros((), dtype=torch.float64) for _ in range(n_h)],
                [torch.zeros((), dtype=torch.float64) for _ in range(n_g)],
                torch.ones((), dtype=torch.float32))
            traces[key] = make_fx(one(layout), tracing_mode="fake")(*example).graph
        return traces[key]

    template = {}                   # layout -> (traced graph, the shape it was traced at)
    kinds = {}
    for layout in dict.fromkeys(layouts):
        kinds.setdefault(_replace_shape(layout, None), []).append(layout)
    with _tracing_scope():
        for kind, members in kinds.items():
            # [graph, the shape it was traced at, whether it holds for every shape]
            known = traces.setdefault(("kind", plan, unit_scale, kind), [None, None, None])
            if known[0] is None:
                first = _representative(members)
                known[:2] = trace(first), first.shape
            sub, shape = known[0], known[1]
            if any(node.op == "get_attr" for node in sub.nodes):
                return None
            # a 0-d parameter promotes with the 0-d hyperparameters (float32 * float64
            # is float64 there), an empty one has no elements: never a copy of
            # another shape's trace
            others = [m for m in members if m.shape != shape and _plain(m.shape)
                      and _plain(shape)]
            if others and known[2] is None:
                known[2] = _shape_free(sub, shape)
                if known[2]:
                    second = _second(others, shape)
                    known[2] = _same_rule(sub, shape, trace(second), second.shape)
            for layout in members:
                if layout.shape == shape or (known[2] and layout in others):
                    template[layout] = (sub, shape)
                else:
                    own = trace(layout)
                    if any(node.op == "get_attr" for node in own.nodes):
                        return None
                    template[layout] = (own, layout.shape)
    copies = _Copies()
    inputs = copies.inputs
    params, grads = inputs("params", n), inputs("grads", n)
    state = [inputs(f"state_{i}", len(layout.slots_in)) for i, layout in enumerate(layouts)]
    steps = inputs("steps", n)
    hyper = inputs("hyper", n_groups * n_h)
    globals_ = inputs("globals", n_g)
    grad_scale, = inputs("grad_scale", 1)
    new_params, new_state, new_steps = [], [], []
    for i, layout in enumerate(layouts):
        grp, n_out = layout.group, len(layout.slots_out)
        sub, traced_shape = template[layout]
        ours = ([params[i], grads[i]] + state[i] + [steps[i]]
                + hyper[grp * n_h:(grp + 1) * n_h] + globals_ + [grad_scale])
        outs = pytree.tree_leaves(copies.copy(sub, ours, traced_shape, layout.shape))
        new_params.append(outs[0])                 # make_fx returns a flat list
        new_state.append(outs[1:1 + n_out])
        new_steps.append(outs[1 + n_out])
    graph = copies.graph
    scalar = torch.empty((), dtype=torch.float64, device="meta")
    for node in hyper + globals_:          # groups without trainable parameters
        node.meta.setdefault("val", scalar)
    graph.output((new_params, new_state, new_steps))
    return _cast_scalars_once(GraphOnly(graph))


class _Copies:
    """The stitched update graph: each parameter's copy of its traced rule,
    merged as ``graph_copy`` of every copy followed by torch.fx's CSE pass
    (``torch.fx.passes.dialect.common.cse_pass``) would merge them, without
    building the graph of all copies: a node is copied unless an earlier
    node of the same target on the same arguments stands for it (each
    parameter's copy recomputes the same scalar hyperparameter arithmetic,
    ``1 - dampening``, ``-lr``, computed once per group instead), and every
    node keeps the name it takes in the graph of all copies (``names``
    follows that graph's namespace)."""

    def __init__(self):
        from torch.fx.passes.dialect.common.cse_pass import get_CSE_banned_ops
        self.graph = torch.fx.Graph()
        self.names = torch.fx.graph._Namespace()
        self.banned = get_CSE_banned_ops()
        self.seen, self.tokens = {}, {}
        self.values = {}            # (shape, dtype) -> a meta tensor of them

    def inputs(self, prefix, count):
        nodes = [self.graph.placeholder(f"{prefix}_{k}") for k in range(count)]
        for node in nodes:
            self.names.create_name(node.name, None)
        return nodes

    def _value(self, node, traced_shape, shape):
        """``node``'s value at ``shape``: tensors of the traced parameter's
        shape take the parameter's."""
        v = node.meta["val"]
        if shape == traced_shape or not isinstance(v, torch.Tensor) \
                or tuple(v.shape) != traced_shape:
            return v
        if (shape, v.dtype) not in self.values:
            self.values[shape, v.dtype] = torch.empty(shape, dtype=v.dtype, device="meta")
        return self.values[shape, v.dtype]

    def copy(self, sub, ours, traced_shape, shape):
        """Copies graph ``sub`` (traced at ``traced_shape``) for a parameter of
        ``shape`` whose inputs are the placeholders ``ours``; returns the
        copy's outputs."""
        theirs = [node for node in sub.nodes if node.op == "placeholder"]
        env = {}
        for mine, node in zip(ours, theirs):
            mine.meta.setdefault("val", self._value(node, traced_shape, shape))
            env[node] = mine
        for node in sub.nodes:
            if node.op == "placeholder":
                continue
            if node.op == "output":
                return torch.fx.node.map_arg(node.args[0], env.__getitem__)
            name = self.names.create_name(node.name, None)
            args = torch.fx.node.map_arg(node.args, env.__getitem__)
            kwargs = torch.fx.node.map_arg(node.kwargs, env.__getitem__)
            key = None
            if node.op != "get_attr" and \
                    getattr(node.target, "overloadpacket", node.target) not in self.banned:
                flat, args_spec = _flatten(args)
                flat_kw, kwargs_spec = _flatten(kwargs)
                token = {"target": node.target, "args": tuple(flat), "args_spec": args_spec,
                         "kwargs": tuple(flat_kw), "kwargs_spec": kwargs_spec}
                key = (node.target, hash((token["args"], token["kwargs"])))
                if key in self.seen and self.tokens[key] == token:
                    env[node] = self.seen[key]
                    continue
            new = self.graph.create_node(node.op, node.target, args, kwargs, name, node.type)
            new.meta = copy.copy(node.meta)
            if shape != traced_shape and "val" in node.meta:
                new.meta["val"] = self._value(node, traced_shape, shape)
                new.meta.pop("tensor_meta", None)
            env[node] = new
            if key is not None and key not in self.seen:
                self.seen[key], self.tokens[key] = new, token
        raise AssertionError("a traced graph without an output")


_IMMUTABLE_LIST = torch.fx.immutable_collections.immutable_list
_IMMUTABLE_DICT = torch.fx.immutable_collections.immutable_dict
_SEQUENCES = (tuple, list, _IMMUTABLE_LIST)
_MAPPINGS = (dict, _IMMUTABLE_DICT)
_LEAVES = (torch.fx.Node, bool, int, float, str, type(None), torch.dtype, torch.device,
           torch.layout, torch.memory_format)


class _Unusual(Exception):
    """A container ``_flatten`` leaves to pytree."""


def _flatten(x):
    """``pytree.tree_flatten(x)`` for the arguments of fx nodes: the same
    leaves, and a structure that is equal exactly where pytree's specs are
    (the containers' types, a mapping's keys, the children's structures):
    tuples, lists, dicts and fx's immutable ones walked directly, any other
    container left to pytree."""
    leaves = []

    def walk(y):
        t = type(y)
        if t in _SEQUENCES:
            return (t, tuple(walk(z) for z in y))
        if t in _MAPPINGS:
            return (t, tuple(y), tuple(walk(z) for z in y.values()))
        if isinstance(y, _LEAVES):
            leaves.append(y)
            return None
        raise _Unusual
    try:
        return leaves, ("spec", walk(x))
    except _Unusual:
        flat, spec = pytree.tree_flatten(x)
        return flat, ("pytree", spec)


def _replace_shape(layout, shape):
    return dataclasses.replace(layout, shape=shape)


def _representative(members):
    """The layout a kind of parameter is traced at: one whose tensors cannot
    be mistaken for the rule's scalars (two elements or more)."""
    return next((m for m in members if len(m.shape) and math.prod(m.shape) > 1),
                next((m for m in members if len(m.shape)), members[0]))


def _plain(shape):
    """A shape another shape's trace may stand for: one dimension or more, and
    elements."""
    return len(shape) > 0 and math.prod(shape) > 0


def _second(others, shape):
    """Another shape of the kind (``others``: none 0-d, none ``shape``) to
    trace it again at: of another rank where there is one."""
    return next((m for m in others if len(m.shape) != len(shape)), others[0])


_SCALAR_ARGS = (bool, int, float, torch.dtype, torch.device, torch.layout,
                torch.memory_format, type(None))


def _shape_free(graph, shape):
    """The traced rule names no shape: every tensor in it has the
    parameter's ``shape`` or none (a scalar), and every argument that is not
    a tensor is a scalar (no sizes, no dimension lists)."""
    for node in graph.nodes:
        for v in pytree.tree_leaves(node.meta.get("val")):
            if isinstance(v, torch.Tensor) and tuple(v.shape) not in (shape, ()):
                return False
        if node.op != "call_function":
            continue
        for arg in list(node.args) + list(node.kwargs.values()):
            if isinstance(arg, (list, tuple)):
                if not all(isinstance(a, torch.fx.Node) for a in arg):
                    return False
            elif not isinstance(arg, (torch.fx.Node,) + _SCALAR_ARGS):
                return False
    return True


def _same_rule(a, shape_a, b, shape_b):
    """Graphs ``a`` and ``b``, traced at ``shape_a`` and ``shape_b``, hold the
    same ops on the same arguments, their tensors of the parameter's shape
    in the same places."""
    nodes_a, nodes_b = list(a.nodes), list(b.nodes)
    if len(nodes_a) != len(nodes_b):
        return False
    index_a = {node: k for k, node in enumerate(nodes_a)}
    index_b = {node: k for k, node in enumerate(nodes_b)}

    def spec(node, index):
        return pytree.tree_map_only(torch.fx.Node, lambda n: ("node", index[n]),
                                    (node.args, node.kwargs))

    def kind(v, shape):
        if not isinstance(v, torch.Tensor):
            return v
        return (v.dtype, "param" if tuple(v.shape) == shape else tuple(v.shape))

    for x, y in zip(nodes_a, nodes_b):
        if (x.op, x.target, x.name) != (y.op, y.target, y.name) or \
                spec(x, index_a) != spec(y, index_b):
            return False
        vx = [kind(v, shape_a) for v in pytree.tree_leaves(x.meta.get("val"))]
        vy = [kind(v, shape_b) for v in pytree.tree_leaves(y.meta.get("val"))]
        if vx != vy:
            return False
    return True


def _cast_scalars_once(gm):
    """Hyperparameters are float64 scalars, as torch.optim's Python floats
    are, and their arithmetic stays float64.  An element-wise op of float32
    tensors casts such a scalar operand to float32 before computing (a 0-dim
    operand does not take part in type promotion): that cast is made once
    per scalar here, not inside every parameter's op.  Same values."""
    graph = gm.graph
    casts = {}
    for node in list(graph.nodes):
        out = node.meta.get("val")
        if node.op != "call_function" or not isinstance(out, torch.Tensor) \
                or not isinstance(node.target, torch._ops.OpOverload) \
                or torch.Tag.pointwise not in node.target.tags \
                or out.dtype not in (torch.float32, torch.float16, torch.bfloat16):
            continue

        def cast(arg, dtype=out.dtype):
            val = arg.meta.get("val") if isinstance(arg, torch.fx.Node) else None
            if not isinstance(val, torch.Tensor) or val.dim() != 0 or val.dtype != torch.float64:
                return arg
            if (arg, dtype) not in casts:
                with graph.inserting_after(arg):
                    node_ = graph.call_function(aten._to_copy.default, (arg,), {"dtype": dtype})
                node_.meta["val"] = torch.empty((), dtype=dtype, device="meta")
                casts[arg, dtype] = node_
            return casts[arg, dtype]
        node.args = tuple(cast(a) for a in node.args)
    if casts and isinstance(gm, torch.fx.GraphModule):
        gm.recompile()
    return gm
