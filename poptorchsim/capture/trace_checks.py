"""Checks and explanations around a trace (``capture/trace.py``): where in
the user's code a failure happened, the typed error that explains a common
mistake, and the clean-ups of a traced graph (constant ``.item()`` reads
dropped, ``MultiConv`` scopes checked)."""
import inspect
import traceback
import weakref

import torch
import torch.utils._pytree as pytree

from ..errors import DtypeError, Error, InputError
from ..ir.ops import is_inplace
from . import scopes as _scopes

aten = torch.ops.aten


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


def user_frame(exc):
    """The innermost traceback line that belongs to the user's code."""
    frames = traceback.extract_tb(exc.__traceback__)
    for frame in reversed(frames):
        path = frame.filename.replace("\\", "/")
        if "/torch/" not in path and "/poptorchsim/" not in path:
            return f'{frame.filename}:{frame.lineno}: {frame.line}'
    return "unknown location"


def named_inputs(module, args, kwargs):
    """``(name, value)`` of each input, named after ``forward``'s parameters."""
    sig = forward_signature(module)
    names = [p.name for p in sig.parameters.values()
             if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    for i, value in enumerate(args):
        yield (names[i] if i < len(names) else f"args[{i}]"), value
    yield from kwargs.items()


_INDEX_TYPE = ("for index, but got torch.float", "expected scalar type Long",
               "to have one of the following scalar types: Long, Int",
               "Expected floating point type for target with class probabilities")


def explain_failure(exc, what, module, args, kwargs):
    """A typed error naming the cause and the fix of a common mistake behind
    ``exc``, an exception forward() raised while traced; None otherwise."""
    message = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    inputs = list(named_inputs(module, args, kwargs))
    if any(text in str(exc) for text in _INDEX_TYPE):
        floats = [n for n, v in inputs if isinstance(v, torch.Tensor)
                  and v.dtype.is_floating_point]
        return DtypeError(
            f"While tracing the {what}, the operation at {user_frame(exc)} needs "
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
            f"{user_frame(exc)} ({message}); its input {', '.join(lists)} is a Python "
            "list of numbers, which the program compiles in as constants, not a tensor. "
            "Pass torch.tensor(...) for data that forward() computes with.")
    return None


def check_multiconvs(gm):
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


def drop_constant_reads(gm):
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


def held_constants(module):
    """The tensors ``module``'s tree holds as plain attributes (not
    parameters or buffers), which forward() reads as constants: {id: (the
    tensor, its version counter, a copy)}, taken before the trace
    (``constants_as_compiled``)."""
    held = {}
    for m in module.modules():
        for value in vars(m).values():
            if isinstance(value, torch.Tensor) and not isinstance(value, torch.nn.Parameter) \
                    and id(value) not in held and not value.is_inference():
                held[id(value)] = (value, value._version, value.detach().clone())
    return held


def _attr(gm, target):
    owner, _, name = target.rpartition(".")
    return getattr(gm.get_submodule(owner) if owner else gm, name)


def _out_of_place(target):
    """The out-of-place overload of an in-place ATen op (``add_.Tensor`` ->
    ``add.Tensor``), or None."""
    name = getattr(getattr(target, "overloadpacket", None), "__name__", "")
    packet = getattr(aten, name[:-1], None) if name.endswith("_") else None
    return getattr(packet, target._overloadname, None) if packet is not None else None


def constants_as_compiled(gm, held):
    """A tensor that forward() holds as a plain attribute is a constant of
    the program, as PopTorch compiles it (its user guide's ``buffers.py``):

    * its value is the one it had before the trace.  The trace ran
      forward() once on it, so an in-place update there changed the
      attribute once, as PopTorch's trace does, but the program starts from
      the value before;
    * an in-place op on it computes a new value, which the graph's later
      reads of it see; no run writes the attribute (each run starts again
      from the constant).  A buffer (``register_buffer``) is the way to
      keep a value from run to run.

    ``held``: ``held_constants`` of the model, taken before the trace."""
    order = {n: k for k, n in enumerate(gm.graph.nodes)}
    key_of, nodes_of = {}, {}       # node -> its constant's id; id -> nodes holding it
    latest = {}                     # id -> the node of its value after in-place updates
    target_key = {}                 # get_attr target -> its constant's id (before any swap)
    changed = False
    for node in list(gm.graph.nodes):
        if node.op == "get_attr":
            if node.target not in target_key:
                value = _attr(gm, node.target)
                if not isinstance(value, torch.Tensor):
                    continue
                target_key[node.target] = id(value)
                entry = held.get(id(value))
                if entry is not None and entry[0] is value and value._version != entry[1]:
                    owner, _, name = node.target.rpartition(".")
                    setattr(gm.get_submodule(owner) if owner else gm, name, entry[2])
                    changed = True
            key = target_key[node.target]
            if key in latest:               # read again after an update: the new value
                node.replace_all_uses_with(latest[key])
                continue
            key_of[node] = key
            nodes_of.setdefault(key, []).append(node)
            continue
        if node.op != "call_function" or not node.args or node.args[0] not in key_of:
            continue
        functional = _out_of_place(node.target) if is_inplace(node.target) else None
        if functional is None:
            continue
        key, at = key_of[node.args[0]], order[node]
        with gm.graph.inserting_before(node):
            new = gm.graph.call_function(functional, node.args, node.kwargs)
        new.meta = dict(node.meta)
        order[new] = at
        node.replace_all_uses_with(new)
        gm.graph.erase_node(node)
        for held_node in nodes_of[key]:     # later reads see the new value
            held_node.replace_all_uses_with(
                new, delete_user_cb=lambda user, at=at: order.get(user, len(order)) > at)
        key_of[new] = key
        nodes_of[key].append(new)
        latest[key] = new
        changed = True
    if changed:
        for node in list(gm.graph.nodes):   # the reads left without a user
            if node.op == "get_attr" and node.target in target_key and not node.users:
                gm.graph.erase_node(node)
        gm.graph.lint()
        gm.recompile()
