"""Graphs as Python functions, numerics through ATen.

Each IR graph becomes one Python function that calls the ATen overload of
every op in order (the way ``torch.fx`` generates code), so a step costs no
interpretation.  The engine (``engine.py``) calls these functions as it
walks the program's control steps.
"""
import functools
import math
from collections import Counter
from typing import Any

import torch

from ..ir.graph import Tensor
from . import host_device, segments
from .fp_checks import checked, make_check
from .kernels import as_strided, kernel_for
from .precision import HALF, host_kernel, takes_wide
from .streams import loop_key, random_kernel

_SIMPLE = (int, float, bool, str, type(None))
aten = torch.ops.aten


_COMMUTATIVE = ("add", "mul")


def _in_place(graph):
    """{op index: (in-place kernel, argument it overwrites)}: element-wise ops
    that may write their result into an operand's memory, as the IPU's
    planner does, instead of allocating (on the host, fresh allocations of
    large tensors cost page faults: the optimizer update of a ResNet ran 5x
    slower than torch.optim's in-place update).

    The operand must be read by this op alone, not be a graph output, match
    the result's shape and dtype, and own its memory: made by an op that
    neither views nor aliases its input, or (in a graph whose outputs
    overwrite its inputs, the optimizer update) a weight, optimizer state or
    gradient accumulator."""
    uses = Counter(t.id for op in graph.ops for t in op.input_tensors())
    outputs = {t.id for t in graph.outputs}
    owned = {t.id for op in graph.ops
             if op.cost_class != "view" and not op.inplace and not _aliases(op.target)
             and not op.subgraphs        # a loop's or branch's result may be its input
             for t in op.outputs if t is not None}
    if graph.outputs_overwrite_inputs:
        owned |= {t.id for t in graph.inputs if t.role in ("param", "state", "accumulator")}
    plan = {}
    for k, op in enumerate(graph.ops):
        if op.cost_class not in ("elementwise", "transcendental") or op.multi_output \
                or op.inplace or not op.outputs or op.outputs[0] is None:
            continue
        kernel, positions = _in_place_form(op.target)
        if kernel is None:
            continue
        out = op.outputs[0]
        for pos in positions[:len(op.args)]:
            a = op.args[pos]
            if isinstance(a, Tensor) and a.id in owned and uses[a.id] == 1 \
                    and a.id not in outputs and a.shape == out.shape and a.dtype == out.dtype:
                plan[k] = (kernel, pos)
                break
    return plan


@functools.lru_cache(maxsize=None)
def _in_place_form(target):
    """(the in-place overload of element-wise ``target`` or None, the
    positions of the operands it may write: the first, or either of a
    commutative op's two)."""
    name = target.overloadpacket.__name__
    kernel = getattr(getattr(aten, name + "_", None), target._overloadname, None)
    return kernel, ((0, 1) if name in _COMMUTATIVE else (0,))


@functools.lru_cache(maxsize=None)
def _aliases(target):
    schema = getattr(target, "_schema", None)
    return schema is not None and any(r.alias_info is not None for r in schema.returns)


def run_loop(count, body, carried, read, streams=None):
    """A loop op: ``body`` (a compiled graph) ``count`` times over the carried
    values; ``read``: the enclosing graph's tensors the body reads.  Each
    iteration draws its own random numbers: ``streams``' key is mixed with
    the iteration's index while it runs."""
    outer = streams.key if streams is not None else None
    try:
        for k in range(count):
            if streams is not None:
                streams.key = loop_key(outer, k)
            carried = body(carried + read)
    finally:
        if streams is not None:
            streams.key = outer
    return carried


def run_cond(condition, then, orelse, then_reads, else_reads, taken):
    """A conditional op: one branch (a compiled graph), chosen by the
    one-element boolean tensor ``condition``; ``taken`` counts the choices
    ([then, else])."""
    if bool(condition):
        taken[0] += 1
        return then(then_reads)
    taken[1] += 1
    return orelse(else_reads)


def _narrow(x):
    """A wide value (fp16 values held in fp32) as fp16: exact."""
    return x.to(torch.float16) if x.dtype == torch.float32 else x


def compile_graph(graph, branches=None, rounding=None, watch=None, fp_checks=None,
                  in_place=True, streams=None, traced_dtypes=None, wide_outputs=frozenset()):
    """A Python function ``f(list_of_inputs) -> list_of_outputs`` for ``graph``.

    Its ``branches`` attribute maps each conditional op's name (in sub-graphs
    too) to [times the then branch ran, times the else branch ran].
    ``rounding`` (default: the graph's ``rounding`` attribute): a
    ``precision.Rounding`` when fp16 results round stochastically.
    ``watch`` (default: the graph's ``watch``): a ``precision.GradientWatch``
    counting the values the ops marked ``watched`` lose to fp16.
    ``fp_checks`` (default: the graph's ``floating_point_checks``): each
    computing op's result is checked right after it runs and a
    floating-point exception raised as the IPU would (``fp_checks.py``); the
    ops then run out of place, so that an operand is still there to look at
    and nothing the call was given is overwritten before the exception.
    ``streams`` (default: the graph's ``streams``): the executable's
    ``streams.Streams``; random ops it handles draw from it (keyed by the
    micro-batch and the op), the others from PyTorch's generator.
    ``traced_dtypes`` (default: the graph's outputs do not overwrite its inputs,
    i.e. it is not the optimizer update, traced dtype-blind): the graph was
    traced with its run-time dtypes, and ops rounding stochastically read
    which results are fp16 from the IR.

    *Wide values* (stochastic rounding in such a graph, no floating-point
    checks): an op computed in fp32 whose fp16 results round
    stochastically returns them in fp32, the fp16 values exactly, and the
    ops that compute in fp32 anyway, views and ops that only move values
    (``precision.takes_wide``) take them as they are: no fp16 tensor is
    made and widened again between them (in a GPT-2 step, 250 million
    values a call).  Every other op, and the graph's outputs, get fp16
    (``_narrow``), but the outputs at the positions ``wide_outputs``, which
    the caller casts to fp32 (fp16 gradients into fp32 accumulators).  The
    values are those of the fp16 program, bit for bit
    (``tests/test_wide_values.py``)."""
    branches = {} if branches is None else branches
    if fp_checks is None:
        fp_checks = graph.floating_point_checks
    rounding = rounding if rounding is not None else graph.rounding
    watch = watch if watch is not None else graph.watch
    streams = streams if streams is not None else graph.streams
    glb: dict[str, Any] = {}
    names = {}
    traced = {}         # globals holding traced tensors and devices (``_place``)
    in_place = {} if fp_checks or not in_place else _in_place(graph)
    if traced_dtypes is None:
        traced_dtypes = not graph.outputs_overwrite_inputs
    wide = traced_dtypes and rounding is not None and not fp_checks
    maybe_wide: set = set()      # ids of the fp16 tensors that may be held in fp32
    glb["_narrow"] = _narrow

    def name_of(t):
        if t.id not in names:
            names[t.id] = f"v{t.id}"
            if t.role == "const":
                glb[names[t.id]] = traced[names[t.id]] = t.value
        return names[t.id]

    def const(value):
        if isinstance(value, _SIMPLE) and not (isinstance(value, float)
                                               and not math.isfinite(value)):
            return repr(value)
        key = f"_c{len(glb)}"
        glb[key] = value
        if isinstance(value, (torch.Tensor, torch.device)):
            traced[key] = value
        return key

    reads = set()
    takes = [False]         # does the op being rendered take wide values?

    def render(x):
        if isinstance(x, Tensor):
            if x.role != "const":
                reads.add(name_of(x))
            if x.id in maybe_wide and not takes[0]:
                return f"_narrow({name_of(x)})"
            return name_of(x)
        if isinstance(x, list):
            return "[" + ", ".join(render(y) for y in x) + "]"
        if isinstance(x, tuple):
            return "(" + "".join(render(y) + ", " for y in x) + ")"
        return const(x)

    lines = ["def run(inputs):"]
    if graph.inputs:
        lines.append("    " + "".join(name_of(t) + ", " for t in graph.inputs) + "= inputs")
    views: dict = {}        # (view op, its arguments) -> the name of its first result
    body = []         # (line, names it reads, names it makes)
    groups = []       # per line: the rule copy its op belongs to (Op.rule_copy)
    for k, op in enumerate(graph.ops):
        fn = f"_op{k}"
        reads = set()
        kernel, op_args = op.target, list(op.args)
        into = False
        takes[0] = wide and takes_wide(op)
        if takes[0]:
            maybe_wide.update(t.id for t in op.outputs if t is not None and t.dtype == HALF)
        if k in in_place:
            kernel, pos = in_place[k]
            op_args[0], op_args[pos] = op_args[pos], op_args[0]
            if rounding is not None:    # rounded out of place, written into the operand
                kernel, into = op.target, True
        args = [render(a) for a in op_args]
        args += [f"{key}={render(v)}" for key, v in op.kwargs.items()]
        if op.subgraphs:           # a loop or a conditional: its sub-graphs compiled
            for name, sub in op.subgraphs.items():
                glb[f"{fn}_{name}"] = compile_graph(sub, branches, rounding, watch,
                                                     fp_checks, streams=streams,
                                                     traced_dtypes=traced_dtypes)
            if op.cost_class == "loop":
                glb[fn] = run_loop
                glb[f"{fn}_streams"] = streams
                args = [repr(op.attrs["count"]), f"{fn}_body"] + args + [f"{fn}_streams"]
            else:
                glb[fn] = run_cond
                glb[f"{fn}_taken"] = branches.setdefault(op.name, [0, 0])
                args = [args[0], f"{fn}_then", f"{fn}_else"] + args[1:] + [f"{fn}_taken"]
        elif op.target in (aten.as_strided.default, aten.as_strided_.default):
            glb[fn] = as_strided
            args.append(f"traced={const(op.traced_layout)}")
        elif op.cost_class == "random" and streams is not None and streams.handles(op):
            glb[fn] = random_kernel(op, streams)
        else:
            glb[fn] = host_kernel(op, kernel_for(kernel, op_args, op.kwargs), rounding, into,
                                  traced_dtypes, takes[0])
            if watch is not None and op.watched:
                glb[fn] = watch.wrap(op, glb[fn], kernel_for(op.target, list(op.args),
                                                             op.kwargs), rounding, takes[0])
        call = f"{fn}({', '.join(args)})"
        check = ""
        if fp_checks and checked(op):
            glb[f"{fn}_fp"] = make_check(op, graph.name)
            operands = "".join(name_of(t) + ", " for t in op.input_tensors())
            check = f"\n    {fn}_fp({{}}, ({operands}))"
        if op.cost_class == "view" and not op.inplace and not op.multi_output:
            # the same view of the same tensor twice (an RNN's weight
            # transposed at every time step) is made once
            if (op.target, call[len(fn):]) in views:
                names[op.outputs[0].id] = views[op.target, call[len(fn):]]
                continue
            views[op.target, call[len(fn):]] = name_of(op.outputs[0])
        if op.multi_output:
            outs = "".join((name_of(t) if t is not None else "_") + ", " for t in op.outputs)
            made = [name_of(t) for t in op.outputs if t is not None]
            result = "(" + "".join(m + ", " for m in made) + ")"
            body.append((f"    {outs}= {call}" + check.format(result), reads, made))
        else:
            made = [name_of(op.outputs[0])]
            body.append((f"    {made[0]} = {call}" + check.format(made[0]), reads, made))
        groups.append(op.rule_copy)
    # each intermediate is released after its last use, as eager autograd
    # frees activations during backward (holding them all until the return
    # made large models page-fault on fresh memory at every step)
    keep = {name_of(t) for t in graph.outputs} | {name_of(t) for t in graph.inputs}
    last = {}
    for i, (_, used, made) in enumerate(body):
        for n in made + sorted(used):        # never read: released at once
            last[n] = i
    free: list[list] = [[] for _ in body]
    for n, i in last.items():
        if n not in keep:
            free[i].append(n)
    device = host_device.current()
    if device.type != "cpu":        # before the shared functions take their constants
        _place(glb, traced, device)
    # the lines, each followed by what dies there; copies of a rule as calls of
    # a function per distinct text (segments.py)
    calls, shared = segments.assemble(body, free, groups, keep, glb)
    lines += calls
    returned = []
    for k, t in enumerate(graph.outputs):    # the graph's outputs: fp16 as fp16
        takes[0] = k in wide_outputs
        returned.append(render(t))
    lines.append("    return [" + ", ".join(returned) + "]")
    source = "\n".join(lines) + ("\n" + shared if shared else "")
    code = compile(source, f"<poptorchsim graph {graph.name}>", "exec")
    exec(code, glb)  # noqa: S102 - our own generated code
    run: Any = glb["run"]          # the generated function, with its source and branches
    run.source = source
    run.branches = branches
    return run


def _place(glb, traced, device):
    """Points a compiled graph's traced CPU tensors and devices (constants,
    factory ops' ``device=``) at ``device``, the host device it runs on
    (``host_device.py``): the graph itself, and so the IR, the estimate and
    ``getIR()``, are the same on every host device."""
    for key, value in traced.items():
        if isinstance(value, torch.device):
            glb[key] = device if value.type == "cpu" else value
        elif value.device.type == "cpu":
            glb[key] = value.to(device)
