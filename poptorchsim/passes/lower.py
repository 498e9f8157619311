"""Lowering: an fx graph of ATen ops -> an IR ``Graph``.

One IR op per fx ``call_function`` node; ``getitem`` nodes become references
to an op's n-th output; a functionalized input mutation (``copy_`` into a
placeholder) becomes the new value itself, because the graphs return new
state explicitly.  A mutated model input (``x += 1`` in forward) is also
returned, right after the model's own outputs (``graph.input_writes`` names
the inputs), so the runtime can write it back to the caller's tensor as PopTorch
does.  Every operation without a cost class is collected, and all of them
are reported in a single error, each with the line of the model that made it.

Loops and conditionals (``poptorchsim.for_loop`` / ``cond``) arrive as
marker ops around their bodies, traced inline; every op between a loop's
markers goes into the loop op's body graph, every op between a
conditional's markers into its ``then`` or ``else`` graph.  A body reading
a tensor of an enclosing graph gets it as an extra input (``_Scope``).
"""
import dataclasses
import operator
from collections import OrderedDict

import torch
import torch.utils._pytree as pytree

from ..capture.blocks import NO_ACTIVE_BLOCK
from ..capture.control_flow import MARKERS
from ..capture.control_flow import OPS as FLOW
from ..errors import Error, UnsupportedOperationError
from ..ir.graph import Graph, Op, Tensor
from ..ir.kinds import CostClass
from ..ir.ops import COND, LOOP, cost_class, is_inplace, unsupported_reason
from ..ir.verify import verify_graph

aten = torch.ops.aten
_STRIDED = (aten.as_strided.default, aten.as_strided_.default)


def _meta_tensor(val):
    return isinstance(val, torch.Tensor)


def _where(node, code=False):
    """The line of the user's model behind ``node`` (fx's stack trace);
    ``code``: followed by the line's text (``File "m.py", line 8, in
    forward: z = h / y``)."""
    stack = (node.meta.get("stack_trace") or "").strip().splitlines()
    for k in range(len(stack) - 1, -1, -1):
        line = stack[k].strip()
        if line.startswith("File") and "/torch/" not in line and "/poptorchsim/" not in line:
            text = stack[k + 1].strip() if k + 1 < len(stack) else ""
            if code and text and not text.startswith("File"):
                return f"{line}: {text}"
            return line
    if node.meta.get("custom", {}).get("backward"):
        return "in the backward pass (autograd of an operation above)"
    return ""


def _unsupported(node, target):
    """Why ``target`` cannot go on the IPU, or None."""
    why = unsupported_reason(target)
    if why is None:
        val = node.meta.get("val")
        vals = (val,) if isinstance(val, torch.Tensor) else pytree.tree_leaves(val)
        if any(isinstance(v, torch.Tensor) and v.is_complex() for v in vals):
            why = "complex tensors: the IPU has no complex number types"
        elif any(isinstance(v, torch.Tensor) and not all(isinstance(d, int) for d in v.shape)
                 or isinstance(v, torch.SymInt) for v in vals):
            # a shape PyTorch's trace left symbolic (a boolean-mask index,
            # nonzero's count): known only once the values are
            why = "its output shape depends on tensor values"
    return why


class NoActiveBlockError(Error):
    """An op traced where no pipeline block is active (PopTorch's text)."""


class _Scope:
    """A graph being filled: the whole program's, or a loop body or a branch
    inside it.  ``free``: tensors of enclosing graphs the body reads -> its
    inputs standing for them; ``outer``: those tensors, as the enclosing graph
    names them (the op's arguments)."""

    def __init__(self, graph, **info):
        self.graph, self.info = graph, info
        self.free, self.outer = {}, []


_LIST, _DICT = torch.fx.immutable_collections.immutable_list, \
    torch.fx.immutable_collections.immutable_dict


def _map_only(kind, fn, x):
    """``pytree.tree_map_only(kind, fn, x)``, the containers fx arguments are
    made of (tuples, lists, dicts and fx's immutable ones) walked directly,
    anything else handed to pytree: the same result, without pytree's cost
    per leaf (lowering maps every argument of every node)."""
    if isinstance(x, kind):
        return fn(x)
    t = type(x)
    if t is tuple:
        return tuple([_map_only(kind, fn, y) for y in x])
    if t is list:
        return [_map_only(kind, fn, y) for y in x]
    if t is dict:
        return {k: _map_only(kind, fn, v) for k, v in x.items()}
    if t is _LIST:
        return _LIST([_map_only(kind, fn, y) for y in x])
    if t is _DICT:
        return _DICT({k: _map_only(kind, fn, v) for k, v in x.items()})
    if t in _LEAVES:
        return x
    return pytree.tree_map_only(kind, fn, x)


_LEAVES = (int, float, bool, str, type(None), torch.dtype, torch.device, torch.layout,
           torch.memory_format)


def lower(gm, name, roles, n_model_outputs=0, values=None):
    """Lower ``gm`` to an IR graph; ``roles[i]`` = (name, role) of placeholder i;
    the first ``n_model_outputs`` outputs are the model's own.  ``values``: a
    dict given every node's IR value (a Tensor, a list of them for a
    multi-output op; none for a node lowering drops)."""
    if not getattr(gm, "dead_code_free", False):    # capture/update_capture.GraphOnly
        gm.graph.eliminate_dead_code()
    graph = root = Graph(name)
    scopes = [_Scope(root)]
    owner = {}                  # tensor -> the graph that defines it
    env: dict = {}
    unsupported: OrderedDict = OrderedDict()
    writes = {}                 # input tensor -> its new value (input mutations)
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    if len(placeholders) != len(roles):
        raise AssertionError(f"{len(placeholders)} placeholders but {len(roles)} roles")
    for node, (tname, role) in zip(placeholders, roles):
        val = node.meta["val"]
        t = graph.new_tensor(tname, val.shape, val.dtype, role)
        graph.inputs.append(t)
        env[node] = t
        owner[t] = root

    def bring(t, level=None):
        """``t`` as the graph of scope ``level`` (default: the innermost) reads
        it: itself, or the input that stands for it in a body."""
        level = len(scopes) - 1 if level is None else level
        scope = scopes[level]
        if owner.get(t, root) is scope.graph or level == 0:
            return t
        if t not in scope.free:
            outer = bring(t, level - 1)
            inner = scope.graph.new_tensor(t.name, t.shape, t.dtype)
            scope.graph.inputs.append(inner)
            owner[inner] = scope.graph
            scope.free[t] = inner
            scope.outer.append(outer)
        return scope.free[t]

    def arg(x):
        return _map_only(torch.fx.Node, lambda n: _map_only(Tensor, bring, env[n]), x)

    def append(g, op, vals):
        """Adds control-flow ``op`` to ``g`` with new tensors for its results
        (``vals``: their fake values); returns them."""
        op.outputs = [g.new_tensor(f"{op.name}_{i}", v.shape, v.dtype, producer=op)
                      for i, v in enumerate(vals)]
        for t in op.outputs:
            owner[t] = g
        g.ops.append(op)
        return op.outputs

    for node in gm.graph.nodes:
        graph = scopes[-1].graph
        if node.op == "call_function" and node.target in MARKERS:
            if not unsupported:
                _control_flow(node, scopes, env, arg, bring, append, owner)
            continue
        if node.op == "get_attr":
            value = getattr(gm, node.target)
            env[node] = graph.new_tensor(node.target.replace(".", "_"), value.shape,
                                         value.dtype, "const", value=value)
            owner[env[node]] = graph
        elif node.op == "call_function":
            target = node.target
            if target is aten.copy_.default and node.args[0].op == "placeholder":
                dst, src = env.get(node.args[0]), env.get(node.args[1])
                if dst is not None and src is not None and dst.shape == src.shape \
                        and dst.dtype == src.dtype:
                    env[node] = src
                    if dst.role == "input":
                        writes[dst] = src
                    continue
                target = aten.copy.default
            why = None if target is operator.getitem else _unsupported(node, target)
            if why is not None:
                key = str(target)
                count, _, where = unsupported.get(key, (0, why, _where(node)))
                unsupported[key] = (count + 1, why, where)
                continue
            if unsupported:
                continue   # after the first unsupported op, only look for more
            if target is operator.getitem:
                src = env[node.args[0]]
                env[node] = src[node.args[1]]
                if node.meta.get("recomputation_checkpoint") and \
                        getattr(env[node], "producer", None) is not None:
                    # one result of a multi-output op (a layer norm's): keep the op's
                    env[node].producer.attrs["recomputation_checkpoint"] = True
                continue
            cls = cost_class(target)
            val = node.meta.get("val")
            if node.meta.get("custom", {}).get("block") == NO_ACTIVE_BLOCK \
                    and not node.meta.get("custom", {}).get("backward"):
                where = _where(node)
                raise NoActiveBlockError(
                    "No active Block, all the ops must belong to a Block: "
                    f"{target}{' (' + where + ')' if where else ''} runs after a "
                    "`with poptorch.Block(...)` scope (or a BlockFunction) has closed and "
                    "before another block begins. Move it into a Block, or start blocks "
                    "with poptorch.BeginBlock(module) or poptorch.Block.start(), which "
                    "stay active until the next block.")
            if val is None and not node.users:
                continue      # a check with no result (aten._linalg_check_errors)
            op = Op(len(graph.ops), node.name, target, arg(tuple(node.args)),
                    arg(dict(node.kwargs)), [], cls, inplace=is_inplace(target),
                    available_memory=node.meta.get("available_memory"),
                    block=node.meta.get("custom", {}).get("block"),
                    backward=bool(node.meta.get("custom", {}).get("backward", False)))
            _scoped(op, node)
            if node.meta.get("stack_trace"):
                op.source = _where(node, code=True)
            if target in _STRIDED:       # the engine re-lays its input out if needed
                first = node.args[0].meta["val"]
                op.traced_layout = (tuple(first.shape), tuple(first.stride()),
                                    int(first.storage_offset()))
            if isinstance(val, (tuple, list)):
                op.multi_output = True
                for i, v in enumerate(val):
                    if not _meta_tensor(v):
                        op.outputs.append(None)
                        continue
                    shape, dtype = _saved_state(target, i, node) or (v.shape, v.dtype)
                    op.outputs.append(graph.new_tensor(f"{op.name}_{i}", shape, dtype,
                                                       producer=op))
                    owner[op.outputs[-1]] = graph
                env[node] = op.outputs
            elif _meta_tensor(val):
                t = graph.new_tensor(op.name, val.shape, val.dtype, producer=op)
                owner[t] = graph
                op.outputs.append(t)
                env[node] = t
            else:
                raise UnsupportedOperationError(
                    f"{target} returns a {type(val).__name__}, not a tensor; "
                    "the IPU graph only holds tensor-valued operations.")
            graph.ops.append(op)
        elif node.op == "output":
            if unsupported:
                break
            graph = root
            outs = [env[n] for n in pytree.tree_leaves(node.args[0])]
            model_inputs = [t for t in graph.inputs if t.role == "input"]
            graph.input_writes = [model_inputs.index(t) for t in writes]
            # the model's own outputs come first; its input writes follow them
            graph.outputs = outs[:n_model_outputs] + list(writes.values()) + \
                outs[n_model_outputs:]
    if unsupported:
        lines = [f"  {name} (used {count}x: {why}){chr(10) + '    ' + where if where else ''}"
                 for name, (count, why, where) in unsupported.items()]
        raise UnsupportedOperationError(
            f"The model uses {len(unsupported)} operation(s) that poptorchsim cannot "
            "place on the IPU:\n" + "\n".join(lines) + "\nReplace them with supported "
            "operations, or compute them on the host before calling the model.")
    if values is not None:
        values.update(env)
    return finish(graph)


def finish(graph):
    """A lowered graph's MultiConv groups and shared available-memory
    proportions, then the graph verified."""
    _group_multiconvs(graph)
    _share_available_memory(graph)
    return verify_graph(graph)


def _control_flow(node, scopes, env, arg, bring, append, owner):
    """Handles a loop or conditional marker: opens or closes a body scope,
    and on closing adds the loop or conditional op to the enclosing graph."""
    target, name, vals = node.target, node.name, node.meta.get("val")
    custom = node.meta.get("custom", {})
    # the loop or conditional runs in the block it was traced in
    where = {"block": custom.get("block"), "backward": bool(custom.get("backward", False))}
    if target is FLOW["loop_begin"]:
        carried, count = arg(node.args[0]), node.args[1]
        body = Graph(f"{name}_body")
        for t in carried:
            x = body.new_tensor(t.name, t.shape, t.dtype)
            body.inputs.append(x)
            owner[x] = body
        scopes.append(_Scope(body, carried=carried, count=count))
        env[node] = list(body.inputs)
    elif target is FLOW["loop_end"]:
        body = scopes[-1]
        body.graph.outputs = [bring(env[n]) for n in node.args[0]]
        scopes.pop()
        parent = scopes[-1].graph
        op = Op(len(parent.ops), name, LOOP, (body.info["carried"], body.outer), {}, [],
                CostClass.LOOP, multi_output=True, subgraphs={"body": body.graph},
                attrs={"count": body.info["count"]}, **where)
        env[node] = append(parent, op, vals)
    elif target is FLOW["cond_begin"]:
        condition = arg(node.args[0])
        scopes.append(_Scope(Graph(f"{name}_then"), condition=condition))
        env[node] = condition
    elif target is FLOW["cond_else"]:
        then = scopes[-1]
        then.graph.outputs = [bring(env[n]) for n in node.args[0]]
        scopes.pop()
        scopes.append(_Scope(Graph(f"{then.graph.name[:-5]}_else"), then=then))
        env[node] = [None] * len(node.args[0])      # read by cond_end only
    elif target is FLOW["cond_end"]:
        orelse = scopes[-1]
        orelse.graph.outputs = [bring(env[n]) for n in node.args[0]]
        scopes.pop()
        then = orelse.info["then"]
        parent = scopes[-1].graph
        op = Op(len(parent.ops), name, COND,
                (then.info["condition"], then.outer, orelse.outer), {}, [], CostClass.COND,
                multi_output=True, subgraphs={"then": then.graph, "else": orelse.graph},
                **where)
        env[node] = append(parent, op, vals)


_AMP_CLASSES = ("matmul", "conv", "rnn")       # ops the AMP units run


def _scoped(op, node):
    """What the scopes around ``node``'s trace say of its op
    (``capture/scopes.py``): ``NameScope`` prefixes its name,
    ``Attribute`` and ``MultiConv`` give it attributes, and so do
    ``serializedMatMul`` and ``recomputationCheckpoint`` (annotations,
    ``capture/annotations.py``)."""
    custom = node.meta.get("custom", {})
    if custom.get("name_scope"):
        op.name = f"{custom['name_scope']}/{op.name}"
    if custom.get("attributes"):
        op.attrs["attributes"] = custom["attributes"]
    if custom.get("multiconv") is not None and op.cost_class == "conv" and not op.backward:
        op.attrs["multiconv"] = custom["multiconv"]
    if node.meta.get("serialization") is not None:
        op.attrs["serialization"] = node.meta["serialization"]
    if node.meta.get("recomputation_checkpoint"):
        op.attrs["recomputation_checkpoint"] = True     # passes/recompute.py


def _saved_state(target, i, node):
    """(shape, dtype) the IPU gives output ``i`` of ``target`` where the traced
    one says nothing of it: a fused LSTM layer's workspace, which oneDNN's
    meta kernel sizes 0, holds what popnn's forward keeps for the backward,
    the gates and the cell state of every time step."""
    if target is not aten.mkldnn_rnn_layer.default or i != 3:
        return None
    x, w_hh = node.args[0].meta["val"], node.args[2].meta["val"]
    return (x.shape[0], x.shape[1], w_hh.shape[0] + w_hh.shape[1]), x.dtype


def _group_multiconvs(graph):
    """Each ``MultiConv`` scope's convolutions, in trace order, become the
    members of one group of this graph (a copy: a scope object may be
    traced into several graphs)."""
    groups: dict = {}
    for op in graph.ops:
        group = op.attrs.get("multiconv")
        if group is not None:
            groups.setdefault(id(group), (group, []))[1].append(op)
    for group, ops in groups.values():
        group.check(len(ops))
        mine = dataclasses.replace(group, members=ops)
        for op in ops:
            op.attrs["multiconv"] = mine


def _share_available_memory(graph):
    """Gradient matmuls and convolutions take the available-memory proportion
    of the forward op they differentiate (as PopART's grad ops copy it): those
    that read the same weight, or produce its gradient, in the same block."""
    root: dict = {}
    for op in graph.ops:
        if op.cost_class == "view" and op.outputs and op.outputs[0] is not None:
            ins = op.input_tensors()
            if ins:
                root[op.outputs[0].id] = root.get(ins[0].id, ins[0])
    annotated = []
    for op in graph.ops:
        if op.available_memory is not None and op.cost_class in _AMP_CLASSES:
            weights = [root.get(t.id, t) for t in op.input_tensors()]
            weights = [w for w in weights if w.role == "param"]
            annotated.append((op, weights))
    if not annotated:
        return
    # the AMP ops that may take one: by the weights they read, by the shapes they make
    readers: dict = {}
    makers: dict = {}
    index: dict = {}
    for k, op in enumerate(graph.ops):
        if op.cost_class not in _AMP_CLASSES or op.available_memory is not None:
            continue
        index[op] = k
        for t in op.input_tensors():
            readers.setdefault(root.get(t.id, t).id, []).append(op)
        for t in op.outputs:
            if t is not None:
                makers.setdefault(t.shape, []).append(op)
    for fwd, weights in annotated:
        shapes = {w.shape for w in weights} | {tuple(reversed(w.shape)) for w in weights}
        found = {op for w in weights for op in readers.get(w.id, ())}
        found.update(op for shape in shapes for op in makers.get(shape, ()))
        for op in sorted(found, key=index.__getitem__):
            if op.available_memory is None and op.block == fwd.block:
                op.available_memory = fwd.available_memory


_CASTS = ("_to_copy", "convert_element_type", "clone")


def mark_role(graph, input_name, role):
    """``op.role = role`` for the ops of ``graph`` that read its
    input ``input_name``, directly or through casts and views (the loss
    scaling's multiplications, the gradients' unscaling), so that reports
    can name them.  A role already set is kept.  Returns ``graph``."""
    carriers = {t.id for t in graph.inputs if t.name == input_name}
    for op in graph.ops:
        if not carriers.intersection(t.id for t in op.input_tensors()):
            continue
        op.role = op.role or role
        packet = getattr(op.target, "overloadpacket", None)
        if op.cost_class == "view" or getattr(packet, "__name__", "") in _CASTS:
            carriers.update(t.id for t in op.outputs if t is not None)
    return graph
