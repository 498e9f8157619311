"""The optimizer update lowered from its rules' traces
(``capture/update_capture.RuleCopies``): each kind of parameter's traced
rule is lowered once (``lower.lower``) and its IR ops are copied for every
parameter of the kind, at the parameter's shape.

The graph is the one lowering the fx graph of all the copies gave, op for op
and name for name (tests/unit/test_compile_speed_unit.py compares them):

- the copies are merged as torch.fx's CSE pass merges nodes: an op of the
  same target on the same arguments as an earlier op stands for it (each
  parameter's copy recomputes the same scalar hyperparameter arithmetic,
  ``1 - beta1``, ``-lr``, computed once per group instead);
- ops and tensors take the names the nodes of that graph take: one fx
  namespace names every copied node, merged ones too;
- a float64 scalar operand of an element-wise float op is cast once, right
  after it is made (``update_capture._cast_scalars_once``, which does it on
  a whole fx graph: a 0-d operand takes no part in type promotion, so the op
  casts it).

Making fx nodes for BERT-Large's 17,000 update ops (twice: LAMB's sharded
update and the whole-weight one for the numerics) and lowering them took
1.8 s of its 2.2 s update pass; copying IR ops takes 0.55 s.  The
whole-weight update is the sharded one laid out at whole shapes
(``reshaped``) where both copy the same rules: 0.1 s instead of a second
copy, marking and check (0.35 s).
"""
import dataclasses
import itertools
import operator
from typing import Optional

import torch
import torch.utils._pytree as pytree
from torch.fx.graph import _Namespace
from torch.fx.passes.dialect.common.cse_pass import get_CSE_banned_ops

from ..capture.update_capture import GraphOnly, RuleCopies
from ..ir.graph import Graph, Op, Tensor
from ..ir.kinds import Role
from ..ir.ops import cost_class, is_inplace
from ..ir.verify import verify_graph
from .lower import finish, lower

aten = torch.ops.aten
_CAST = aten._to_copy.default
_CAST_NAME = "_to_copy_default"     # what torch.fx names a node of aten._to_copy.default
_LOW_FLOATS = (torch.float32, torch.float16, torch.bfloat16)
_FLAT = (Tensor, bool, int, float, str, type(None), torch.dtype, torch.device, torch.layout,
         torch.memory_format)    # arguments that are leaves


def lower_copies(copies: RuleCopies, name, roles, took: Optional[dict] = None) -> Graph:
    """The IR graph of the update ``copies`` describes; ``roles[i]`` = (name,
    role) of input ``i``, in ``capture_update``'s input order.  ``took``, if
    given, is filled with {tensor id: parameter index} for the tensors that
    take their parameter's shape (``reshaped`` lays them out at others)."""
    layouts, n_h = copies.layouts, copies.n_hyper
    n = len(layouts)
    names = _Namespace()            # the copies' graph names every node it copies ...
    made = _Namespace()             # ... and the nodes it keeps, whose names the casts' own
    # names step over (only those of the casts' base name, "_to_copy_default", can meet them)
    counts = [("params", n), ("grads", n)] + [
        (f"state_{i}", len(layout.slots_in)) for i, layout in enumerate(layouts)] + [
        ("steps", n), ("hyper", copies.n_groups * n_h), ("globals", copies.n_globals),
        ("grad_scale", 1)]
    for prefix, count in counts:
        for k in range(count):
            names.create_name(made.create_name(f"{prefix}_{k}", None), None)
    at = dict(zip(("params", "grads"), (0, n)))
    state_at = list(itertools.accumulate([2 * n] + [len(lay.slots_in) for lay in layouts]))
    at["steps"] = state_at[-1]
    at["hyper"] = at["steps"] + n
    at["globals"] = at["hyper"] + copies.n_groups * n_h
    at["grad_scale"] = at["globals"] + copies.n_globals

    def inputs_of(i):
        """Indices of parameter ``i``'s rule's inputs among the update's."""
        grp = copies.layouts[i].group
        return ([at["params"] + i, at["grads"] + i]
                + list(range(state_at[i], state_at[i + 1])) + [at["steps"] + i]
                + list(range(at["hyper"] + grp * n_h, at["hyper"] + (grp + 1) * n_h))
                + list(range(at["globals"], at["grad_scale"])) + [at["grad_scale"]])

    rules = {}
    for sub, _ in copies.rules:
        if id(sub) not in rules:
            rules[id(sub)] = _Rule(sub)
    # the inputs' shapes: the first rule that reads one gives it (at its parameter's shape)
    values: list = [None] * len(roles)
    for i, (sub, traced) in enumerate(copies.rules):
        rule, shape, traced = rules[id(sub)], layouts[i].shape, tuple(traced)
        for k, t in zip(inputs_of(i), rule.graph.inputs):
            if values[k] is None:
                values[k] = (_at(t.shape, traced, shape), t.dtype, i if t.shape == traced else None)
    graph = Graph(name)
    owner: dict = {}                # tensor -> the parameter whose shape it takes
    for (tname, role), value in zip(roles, values):
        # an unused group's hyperparameters: float64 scalars
        shape, dtype, of = value if value is not None else ((), torch.float64, None)
        graph.inputs.append(graph.new_tensor(tname, shape, dtype, role))
        if of is not None:
            owner[graph.inputs[-1]] = of
    ops: list = []
    merged = _Merged()
    outputs = []
    for i, (sub, traced) in enumerate(copies.rules):
        rule, traced = rules[id(sub)], tuple(traced)
        mine = dict(zip(rule.graph.inputs, (graph.inputs[k] for k in inputs_of(i))))
        first = len(ops)
        for node_name, op in rule.nodes:
            new_name = names.create_name(node_name, None)
            if op is None:              # a getitem or a node lowering drops: no op
                continue
            rule.copy(op, new_name, mine, traced, layouts[i].shape, merged, ops, made,
                      owner, i)
        for op in ops[first:]:
            op.rule_copy = i
        outputs.append([mine[t] for t in rule.graph.outputs])
    # (new params, new state, new steps), flattened
    flat = ([outs[0] for outs in outputs]
            + [t for outs, lay in zip(outputs, layouts) for t in outs[1:1 + len(lay.slots_out)]]
            + [outs[1 + len(lay.slots_out)] for outs, lay in zip(outputs, layouts)])
    graph.ops = _with_scalar_casts(ops, graph.inputs, made)
    graph.tensors = list(graph.inputs) + [t for op in graph.ops for t in op.outputs
                                          if t is not None]
    for k, t in enumerate(graph.tensors):
        t.id = k
    for k, op in enumerate(graph.ops):
        op.id = k
    graph.outputs = flat
    if took is not None:
        took.update((t.id, i) for t, i in owner.items())
    return finish(graph)


def reshaped(graph: Graph, took: dict, shapes: list) -> Graph:
    """``graph`` (from ``lower_copies``, its ops marked) with the tensors of
    ``took`` at ``shapes[their parameter]``: what ``lower_copies`` gives for
    the same rules at those shapes, op for op, name for name, without copying
    the rules again (the whole-weight update of a sharded one, for its
    numerics).  The caller checks the rules are the same and that no shape
    changes a scalar's or a 0-d tensor's part (the marks are kept)."""
    tensors: dict = {}
    for t in graph.tensors:
        c = object.__new__(Tensor)
        c.__dict__.update(t.__dict__)
        i = took.get(t.id)
        if i is not None:
            c.shape = tuple(shapes[i])
        tensors[t] = c
    ops = []
    for op in graph.ops:
        new = object.__new__(Op)
        new.__dict__.update(op.__dict__)
        new.args = _substitute(op.args, tensors)
        new.kwargs = _substitute(op.kwargs, tensors)
        new.attrs = dict(op.attrs)
        new._inputs = None
        new.outputs = [None if t is None else tensors[t] for t in op.outputs]
        for t in new.outputs:
            if t is not None:
                t.producer = new
        ops.append(new)
    return verify_graph(dataclasses.replace(
        graph, inputs=[tensors[t] for t in graph.inputs], ops=ops,
        outputs=[tensors[t] for t in graph.outputs],
        tensors=[tensors[t] for t in graph.tensors], input_writes=list(graph.input_writes)))


def _at(shape, traced, ours):
    """A shape of the rule traced at ``traced``, for a parameter of shape
    ``ours``: the parameter's tensors take its shape."""
    return tuple(ours) if shape == tuple(traced) else shape


class _Merged:
    """The ops kept so far, by what they compute (torch.fx's CSE pass's key:
    the target and the arguments' leaves and structure; first come, first
    kept, as that pass keeps them)."""

    def __init__(self):
        self.banned = get_CSE_banned_ops()
        self.seen: dict = {}


class _Rule:
    """One traced rule lowered once: its IR graph and, for every node after
    its inputs, (the node's name, its op or None)."""

    def __init__(self, sub):
        values: dict = {}
        n_inputs = sum(node.op == "placeholder" for node in sub.nodes)
        self.graph = lower(GraphOnly(sub, dead_code_free=True), "rule",
                           [(f"in_{k}", Role.ACTIVATION) for k in range(n_inputs)],
                           values=values)
        ops = iter(self.graph.ops)
        self.nodes = []
        # op -> (its name's scope prefix, its arguments' leaves and structure, its
        # keywords', whether the arguments are a flat tuple, the keywords hold no tensor)
        self.spec = {}
        for node in sub.nodes:
            if node.op in ("placeholder", "output"):
                continue
            value = values.get(node)
            op = None
            if node.target is not operator.getitem and value is not None:
                op = next(ops)
                made = value if isinstance(value, list) else [value]
                if [t for t in made if t is not None] != \
                        [t for t in op.outputs if t is not None]:
                    raise AssertionError(f"rule node {node.name} is not op {op.name}")
                prefix = op.name[:len(op.name) - len(node.name)]
                args, args_spec = _flatten(op.args)
                kwargs, kwargs_spec = _flatten(op.kwargs)
                # arguments a flat tuple, keyword arguments without tensors: a copy's
                # are its leaves and the rule's keywords
                flat = type(op.args) is tuple and len(args) == len(op.args) and \
                    all(type(a) in _FLAT for a in op.args)
                plain = type(op.kwargs) is dict and not any(
                    type(v) is Tensor or type(v) not in _FLAT for v in op.kwargs.values())
                self.spec[op] = (prefix, tuple(args), args_spec, tuple(kwargs), kwargs_spec,
                                 flat, plain)
            self.nodes.append((node.name, op))
        if next(ops, None) is not None:
            raise AssertionError("a rule's op without a node")

    def copy(self, op, name, mine, traced, shape, merged, ops, made, owner, i):
        """Copies ``op`` for parameter ``i`` of ``shape`` (``mine``: this rule's
        tensors -> the parameter's), unless an earlier op computes the same;
        ``owner``: tensor -> ``i`` for the outputs that take its shape."""
        prefix, args, args_spec, kwargs, kwargs_spec, flat, plain = self.spec[op]
        key = token = None
        target = op.target
        leaves = None
        if getattr(target, "overloadpacket", target) not in merged.banned:
            leaves = tuple([mine.get(x, x) if type(x) is Tensor else x for x in args])
            kw_leaves = kwargs if plain else tuple(
                [mine.get(x, x) if type(x) is Tensor else x for x in kwargs])
            token = (target, leaves, args_spec, kw_leaves, kwargs_spec)
            try:
                key = (target, hash((leaves, kw_leaves)))
            except TypeError:           # an unhashable argument: never merged
                key = None
            if key is not None and key in merged.seen:
                earlier, their_token = merged.seen[key]
                if their_token == token:
                    for t, e in zip(op.outputs, earlier.outputs):
                        if t is not None:
                            mine[t] = e
                    return
        new = object.__new__(Op)         # a copy of op's fields (copy.copy's, cheaper)
        new.__dict__.update(op.__dict__)
        new.name = prefix + name
        if name.startswith(_CAST_NAME):     # the only names the casts' names can meet
            made.create_name(name, None)
        new.args = leaves if flat and leaves is not None else _substitute(op.args, mine)
        new.kwargs = dict(op.kwargs) if plain else _substitute(op.kwargs, mine)
        new.attrs = dict(op.attrs)
        new._inputs = None
        new.outputs = []
        for k, t in enumerate(op.outputs):
            if t is None:
                new.outputs.append(None)
                continue
            out = Tensor(0, f"{new.name}_{k}" if op.multi_output else new.name,
                         _at(t.shape, traced, shape), t.dtype, Role.ACTIVATION, new)
            if t.shape == traced:
                owner[out] = i
            new.outputs.append(out)
            mine[t] = out
        # (an op with a traced layout, as_strided, takes sizes: its rule is not
        # shape-free, so it is copied only at the shape it was traced at, and the
        # layout copied with its fields holds)
        ops.append(new)
        if key is not None and key not in merged.seen:
            merged.seen[key] = (new, token)


def _substitute(x, mine):
    """``x`` (an op's arguments) with this rule's tensors replaced by the
    parameter's."""
    t = type(x)
    if t is Tensor:
        return mine.get(x, x)
    if t is tuple:
        return tuple([_substitute(y, mine) for y in x])
    if t is list:
        return [_substitute(y, mine) for y in x]
    if t is dict:
        return {k: _substitute(v, mine) for k, v in x.items()}
    if t in _SEQUENCES:
        return t([_substitute(y, mine) for y in x])
    if t in _MAPPINGS:
        return t({k: _substitute(v, mine) for k, v in x.items()})
    return x


def _with_scalar_casts(ops, inputs, made):
    """``ops`` with a cast of every float64 scalar operand of an element-wise
    float op, one per operand and type, placed right after the operand is
    made (the latest cast first, where one operand has several), as
    ``update_capture._cast_scalars_once`` places them in an fx graph."""
    position = {t: (-1, k) for k, t in enumerate(inputs)}
    for i, op in enumerate(ops):
        for k, t in enumerate(op.outputs):
            if t is not None:
                position[t] = (i, k)
    casts: dict = {}
    after: list = []            # (position of the operand, -count, cast op)
    pointwise: dict = {}        # target -> an element-wise ATen op?
    for op in ops:
        out = op.outputs[0] if len(op.outputs) == 1 else None
        if op.multi_output or out is None or out.dtype not in _LOW_FLOATS:
            continue
        target = op.target
        if target not in pointwise:
            pointwise[target] = isinstance(target, torch._ops.OpOverload) and \
                torch.Tag.pointwise in target.tags
        if not pointwise[target]:
            continue
        args = tuple([_cast(a, out.dtype, casts, after, position, made) for a in op.args])
        if any(a is not b for a, b in zip(args, op.args)):
            op.args = args
    if not after:
        return ops
    after.sort(key=lambda entry: (entry[0], entry[1]))
    merged_ops, k = [], 0
    for i, op in enumerate([None] + ops):
        # the casts of what op i - 1 made (i = 0: of the inputs) follow it, in its
        # parameter's copy of the rule
        if op is not None:
            merged_ops.append(op)
        while k < len(after) and after[k][0][0] == i - 1:
            after[k][2].rule_copy = -1 if op is None else op.rule_copy
            merged_ops.append(after[k][2])
            k += 1
    return merged_ops


def _cast(arg, dtype, casts, after, position, made):
    """``arg`` cast to ``dtype`` where it is a float64 scalar (the cast made
    once per operand and type, and queued to follow the operand), else
    ``arg``."""
    if type(arg) is not Tensor or arg.shape != () or arg.dtype != torch.float64:
        return arg
    cast = casts.get((arg, dtype))
    if cast is None:
        name = made.create_name(_CAST_NAME, None)
        cast = Op(0, name, _CAST, (arg,), {"dtype": dtype}, [], cost_class(_CAST),
                  inplace=is_inplace(_CAST))
        cast.outputs.append(Tensor(0, name, (), dtype, Role.ACTIVATION, cast))
        casts[arg, dtype] = cast
        after.append((position[arg], -len(after), cast))
    return cast.outputs[0]


_IMMUTABLE_LIST = torch.fx.immutable_collections.immutable_list
_IMMUTABLE_DICT = torch.fx.immutable_collections.immutable_dict
_SEQUENCES = (tuple, list, _IMMUTABLE_LIST)
_MAPPINGS = (dict, _IMMUTABLE_DICT)
_LEAVES = (Tensor, torch.fx.Node, bool, int, float, str, type(None), torch.dtype,
           torch.device, torch.layout, torch.memory_format)


class _Unusual(Exception):
    """A container ``_flatten`` leaves to pytree."""


def _flatten(x):
    """``pytree.tree_flatten(x)`` for the arguments of ops: the same leaves,
    and a structure that is equal exactly where pytree's specs are (the
    containers' types, a mapping's keys, the children's structures): tuples,
    lists, dicts and fx's immutable ones walked directly, any other
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
