"""The optimizer update captured: the update rules (``update_rules.py``)
traced with ``make_fx`` over every trainable parameter's layout, one trace
per kind of parameter (dtypes, group, state slots), which
``passes/update_copies.py`` lowers once and copies to each parameter's
shape (``RuleCopies``); or, where that cannot be (global clipping, a rule
that holds constants), one trace of the whole update, which
``passes/update.py`` lowers.  (The model's step is captured in
``trace.py``.)"""
import dataclasses
import math
from dataclasses import dataclass

import torch
import torch.utils._pytree as pytree
from torch.fx.experimental.proxy_tensor import make_fx

from . import update_rules as _opt
from .trace import tracing_scope
from .weightless import fake_meta_example

aten = torch.ops.aten


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
    """A parameter's (param, grad, state slots, step) to trace its update
    over: shapes without values (``meta``, traced as fake CPU tensors by
    ``weightless.fake_meta_example``), so no parameter-sized tensor is
    allocated on the host."""
    return (torch.empty(layout.shape, dtype=layout.dtype, device="meta"),
            torch.empty(layout.shape, dtype=layout.grad_dtype, device="meta"),
            [torch.empty(layout.shape, dtype=dt, device="meta") for _, dt in layout.slots_in],
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
    Returns ``RuleCopies`` (the rule traced per kind of parameter), or the
    fx ``GraphModule`` of the whole update.  ``traces``: a dict keeping the
    rules traced per parameter layout, to share with another capture of the
    same optimizer (the update over whole weights of a sharded one).
    """
    n_h, n_g = len(plan.hyper), len(plan.globals)
    if plan.max_grad_norm is None and layouts:
        # the whole update kept too: the planner compiles the same update
        # under many configurations (runtime/planning/planner.py)
        key = ("update", plan, tuple(layouts), n_groups, unit_scale)
        try:
            copies = traces.get(key) if traces is not None else None
        except TypeError:             # an unhashable plan: not kept
            key = None
        if copies is None:
            copies = _update_by_parameter(plan, layouts, n_groups, unit_scale,
                                          {} if traces is None else traces)
            if traces is not None and key is not None and copies is not None:
                traces[key] = copies
        if copies is not None:
            return copies
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
    with tracing_scope():
        return _cast_scalars_once(make_fx(update, tracing_mode="fake")(
            *fake_meta_example(example)))


class GraphOnly:
    """An fx graph where lowering takes a ``GraphModule`` (``.graph``): a
    traced rule is lowered, never run, so it needs no Python code generated
    for it.  ``dead_code_free``: its dead code was removed once, when it was
    traced, so lowering need not look for any."""

    def __init__(self, graph, dead_code_free=False):
        self.graph = graph
        self.dead_code_free = dead_code_free


def _update_by_parameter(plan, layouts, n_groups, unit_scale, traces):
    """The update of ``capture_update`` as small traces of the rule, to be
    copied once per parameter (``RuleCopies``): without global clipping every
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
    0-d tensors apart).  None when a traced rule cannot be copied op for op
    (``_copyable``: it holds tensor constants, say)."""
    n_h, n_g = len(plan.hyper), len(plan.globals)

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
            graph = make_fx(one(layout), tracing_mode="fake")(
                *fake_meta_example(example)).graph
            graph.eliminate_dead_code()     # once here, not in every copy (GraphOnly)
            traces[key] = graph
        return traces[key]

    template = {}                   # layout -> (traced graph, the shape it was traced at)
    kinds = {}
    for layout in dict.fromkeys(layouts):
        kinds.setdefault(_replace_shape(layout, None), []).append(layout)
    with tracing_scope():
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
    rules = [template[layout] for layout in layouts]
    if not all(_copyable(sub) for sub in {id(sub): sub for sub, _ in rules}.values()):
        return None
    return RuleCopies(list(layouts), rules, n_groups, n_h, n_g)


@dataclass
class RuleCopies:
    """The update over every parameter as copies of its traced rules,
    lowered by ``passes/update_copies.py``: ``rules[i]`` is parameter
    ``i``'s rule, ``(fx graph, the shape it was traced at)``, shared by the
    parameters of its kind.  The update's inputs are those of
    ``capture_update``."""
    layouts: list
    rules: list
    n_groups: int
    n_hyper: int            # hyperparameters per param group
    n_globals: int


def _copyable(graph):
    """A traced rule whose nodes lower one by one, each to at most one op:
    no constants, control-flow markers or writes into its inputs."""
    from .control_flow import MARKERS
    for node in graph.nodes:
        if node.op == "get_attr" or node.op == "call_function" and (
                node.target in MARKERS or node.target is aten.copy_.default):
            return False
    return True


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
        args = tuple(cast(a) for a in node.args)
        if any(a is not b for a, b in zip(args, node.args)):
            node.args = args        # (setting them re-registers every use: only on a change)
    if casts and isinstance(gm, torch.fx.GraphModule):
        gm.recompile()
    return gm
