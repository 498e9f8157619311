"""The BSP engine: runs compiled programs, numerics through ATen.

Each IR graph becomes one Python function that calls the ATen overload of
every op in order (the way ``torch.fx`` generates code), so a step costs no
interpretation.  ``Engine.run_training`` and ``Engine.run_inference`` follow
the program's structure: the device-iteration loop, the accumulation loop,
one call per replica, the cross-replica reduction, the optimizer update, and
the device-to-host streams that the output mode asks for.
"""
import math
from collections import Counter

import torch

from ..ir.graph import Tensor
from .fp_checks import checked, make_check
from .kernels import as_strided, kernel_for
from .precision import host_kernel

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
    if getattr(graph, "outputs_overwrite_inputs", False):
        owned |= {t.id for t in graph.inputs if t.role in ("param", "state", "accumulator")}
    plan = {}
    for k, op in enumerate(graph.ops):
        if op.cost_class not in ("elementwise", "transcendental") or op.multi_output \
                or op.inplace or not op.outputs or op.outputs[0] is None:
            continue
        name = op.target.overloadpacket.__name__
        kernel = getattr(getattr(aten, name + "_", None), op.target._overloadname, None)
        if kernel is None:
            continue
        out = op.outputs[0]
        for pos in ((0, 1) if name in _COMMUTATIVE else (0,))[:len(op.args)]:
            a = op.args[pos]
            if isinstance(a, Tensor) and a.id in owned and uses[a.id] == 1 \
                    and a.id not in outputs and a.shape == out.shape and a.dtype == out.dtype:
                plan[k] = (kernel, pos)
                break
    return plan


def _aliases(target):
    schema = getattr(target, "_schema", None)
    return bool(schema) and any(r.alias_info is not None for r in schema.returns)


def run_loop(count, body, carried, read):
    """A loop op: ``body`` (a compiled graph) ``count`` times over the carried
    values; ``read``: the enclosing graph's tensors the body reads."""
    for _ in range(count):
        carried = body(carried + read)
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


def compile_graph(graph, branches=None, rounding=None, watch=None, fp_checks=None):
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
    and nothing the call was given is overwritten before the exception."""
    branches = {} if branches is None else branches
    if fp_checks is None:
        fp_checks = bool(getattr(graph, "floating_point_checks", False))
    rounding = rounding if rounding is not None else getattr(graph, "rounding", None)
    watch = watch if watch is not None else getattr(graph, "watch", None)
    glb = {}
    names = {}
    in_place = {} if fp_checks else _in_place(graph)

    def name_of(t):
        if t.id not in names:
            names[t.id] = f"v{t.id}"
            if t.role == "const":
                glb[names[t.id]] = t.value
        return names[t.id]

    def const(value):
        if isinstance(value, _SIMPLE) and not (isinstance(value, float) and not math.isfinite(value)):
            return repr(value)
        key = f"_c{len(glb)}"
        glb[key] = value
        return key

    reads = set()

    def render(x):
        if isinstance(x, Tensor):
            if x.role != "const":
                reads.add(name_of(x))
            return name_of(x)
        if isinstance(x, list):
            return "[" + ", ".join(render(y) for y in x) + "]"
        if isinstance(x, tuple):
            return "(" + "".join(render(y) + ", " for y in x) + ")"
        return const(x)

    lines = ["def run(inputs):"]
    if graph.inputs:
        lines.append("    " + "".join(name_of(t) + ", " for t in graph.inputs) + "= inputs")
    views = {}        # (view op, its arguments) -> the name of its first result
    body = []         # (line, names it reads, names it makes)
    for k, op in enumerate(graph.ops):
        fn = f"_op{k}"
        reads = set()
        kernel, op_args = op.target, list(op.args)
        into = False
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
                                                     fp_checks)
            if op.cost_class == "loop":
                glb[fn] = run_loop
                args = [repr(op.attrs["count"]), f"{fn}_body"] + args
            else:
                glb[fn] = run_cond
                glb[f"{fn}_taken"] = branches.setdefault(op.name, [0, 0])
                args = [args[0], f"{fn}_then", f"{fn}_else"] + args[1:] + [f"{fn}_taken"]
        elif op.target in (aten.as_strided.default, aten.as_strided_.default):
            glb[fn] = as_strided
            args.append(f"traced={const(op.traced_layout)}")
        else:
            glb[fn] = host_kernel(op, kernel_for(kernel, op_args, op.kwargs), rounding, into)
            if watch is not None and op.attrs.get("watched"):
                glb[fn] = watch.wrap(op, glb[fn], kernel_for(op.target, list(op.args),
                                                             op.kwargs))
        call = f"{fn}({', '.join(args)})"
        check = ""
        if fp_checks and checked(op):
            glb[f"{fn}_fp"] = make_check(op, graph.name)
            operands = "".join(render(t) + ", " for t in op.input_tensors())
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
    # each intermediate is released after its last use, as eager autograd
    # frees activations during backward (holding them all until the return
    # made large models page-fault on fresh memory at every step)
    keep = {name_of(t) for t in graph.outputs} | {name_of(t) for t in graph.inputs}
    last = {}
    for i, (_, used, made) in enumerate(body):
        for n in made + sorted(used):        # never read: released at once
            last[n] = i
    free = [[] for _ in body]
    for n, i in last.items():
        if n not in keep:
            free[i].append(n)
    for (line, _, _), dead in zip(body, free):
        lines.append(line)
        if dead:
            lines.append("    del " + ", ".join(sorted(dead)))
    lines.append("    return [" + ", ".join(name_of(t) for t in graph.outputs) + "]")
    source = "\n".join(lines)
    code = compile(source, f"<poptorchsim graph {graph.name}>", "exec")
    exec(code, glb)  # noqa: S102 - our own generated code
    run = glb["run"]
    run.source = source
    run.branches = branches
    return run


class OutputCollector:
    """Keeps the outputs that the output mode streams back to the host."""

    def __init__(self, mode, period, device_iterations, accumulation, replicas):
        self.mode, self.period = mode, period
        self.di, self.ga, self.rf = device_iterations, accumulation, replicas
        self.kept = []            # list of lists of tensors, in [di, ga, rf] order
        self.sums = None

    def wants(self, i, g):
        if self.mode == "All":
            return True
        if self.mode == "EveryN":
            return (i + 1) % self.period == 0
        if self.mode == "Final":
            return i == self.di - 1 and g == self.ga - 1
        return False

    def add(self, i, g, r, outs):
        if self.mode == "Sum":
            if self.sums is None:
                self.sums = [[None] * len(outs) for _ in range(self.rf)]
            row = self.sums[r]
            for k, t in enumerate(outs):
                row[k] = t.clone() if row[k] is None else row[k] + t
        elif self.wants(i, g):
            self.kept.append(outs)

    def result(self):
        return self.sums if self.mode == "Sum" else self.kept


def shard(t, n):
    """Replicated tensor sharding: ``t`` flattened, zero-padded to a multiple
    of ``n`` elements and cut into ``n`` equal shards (one per replica)."""
    flat = t.reshape(-1)
    size = -(-flat.numel() // n)
    if size * n != flat.numel():
        flat = torch.cat([flat, flat.new_zeros(size * n - flat.numel())])
    return list(flat.view(n, size).clone().unbind(0))


def unshard(parts, shape):
    """The whole tensor of ``shape`` from its shards (an all-gather)."""
    n = 1
    for s in shape:
        n *= int(s)
    return torch.cat([p.reshape(-1) for p in parts])[:n].view(shape)


class Accumulation:
    """How one weight update combines the gradients of its micro-batches, as
    PopART's gradient accumulators do: summed (a running mean with
    MeanReductionStrategy.Running) in the accumulator's type; for SGD's
    combined variant, added straight into the combined velocity tensor (slot
    0 of the parameter's state), each scaled by ``state.combined_scale``."""

    def __init__(self, dtypes, running=False, into=()):
        self.dtypes = list(dtypes)      # per parameter: the accumulator's type, or None
        self.running = running
        self.into = set(into)           # parameters accumulating into their velocity

    def add(self, acc, grads, k, state, apart=False):
        """The accumulators after micro-batch ``k`` (from 0).  ``apart``: the
        combined variant's increments are summed apart from the velocity (they
        are reduced across processes first, see ``finish``)."""
        out = []
        for i, g in enumerate(grads):
            a = None if acc is None else acc[i]
            if i in self.into:
                if a is None:
                    a = state.opt_state[i][0]
                    a = torch.zeros_like(a) if apart else a
                out.append(torch.add(a, g.to(a.dtype), alpha=state.combined_scale[i]))
                continue
            dtype = self.dtypes[i] or g.dtype
            if a is None:
                out.append(g.to(dtype))
            elif self.running:          # s = f/(f+1) s + 1/(f+1) g, rounded once
                out.append((a.float() * (k / (k + 1)) + g.float() * (1 / (k + 1))).to(dtype))
            else:
                out.append(a + g.to(dtype))
        return out

    def finish(self, acc, state):
        """The velocities added to their reduced increments (see ``add``)."""
        return [state.opt_state[i][0] + a if i in self.into else a for i, a in enumerate(acc)]


class Engine:
    """Device state and the loops that run a compiled program on it."""

    def __init__(self, step_fn, update_fn=None, shards=None, n_writes=0):
        self.step_fn = step_fn
        self.update_fn = update_fn
        # model inputs that forward() mutates: their new values follow the
        # model's outputs; ``written`` keeps them per micro-batch, in
        # [device iteration, accumulation, replica] order
        self.n_writes = n_writes
        self.written = []
        # index of a trainable parameter -> replicas its optimizer state is
        # sharded over; ``state.opt_state`` then holds one shard per replica
        self.shards = dict(shards or {})
        self.reduce = None      # sums gradients across processes (distributed/)
        # per trainable parameter: (state slots the update reads, slots it
        # writes); None: all of them, both ways
        self.slot_counts = None
        self.accumulation = None    # an Accumulation; None: plain sums

    def run_inference(self, params, buffers, inputs, collector, di, rf):
        """``inputs``: tensors shaped [di, 1, rf, micro, ...]."""
        n_buf = len(buffers[0])
        self.written = []
        with torch.no_grad():
            for i in range(di):
                for r in range(rf):
                    outs = self.step_fn(params + buffers[r] + [x[i, 0, r] for x in inputs])
                    n_out = len(outs) - n_buf
                    buffers[r] = outs[n_out:]
                    collector.add(i, 0, r, self._keep_writes(outs[:n_out]))
        return collector.result()

    def run_training(self, state, inputs, collector, di, ga, rf):
        """One call: ``di`` weight updates, each over ``ga * rf`` micro-batches.

        ``state`` holds lists: params (trainable first, then frozen), buffers
        (one list per replica), opt_state, steps, hyper and grad_scale; with
        automatic loss scaling, ``loss_scale`` (a ``precision.LossScale``):
        the step's last output is then its gradient statistics, and the
        update takes the loss-scale update's inputs last and gives the new
        factor last.
        """
        n_train = state.n_trainable
        n_buf = len(state.buffers[0])
        accumulation = self.accumulation
        scale = getattr(state, "loss_scale", None)
        apart = self.reduce is not None and accumulation is not None and accumulation.into
        self.written = []
        with torch.no_grad():
            for i in range(di):
                acc = stats = None
                k = 0
                # the loss scaling (automatic loss scaling changes it after an update)
                extra = list(getattr(state, "step_extra", None) or [])
                for g in range(ga):
                    for r in range(rf):
                        outs = self.step_fn(state.params + state.buffers[r]
                                            + [x[i, g, r] for x in inputs] + extra)
                        if scale is not None:       # the gradient statistics
                            stats = outs[-1] if stats is None else stats + outs[-1]
                            outs = outs[:-1]
                        n_out = len(outs) - n_train - n_buf
                        grads = outs[n_out:n_out + n_train]
                        state.buffers[r] = outs[n_out + n_train:]
                        collector.add(i, g, r, self._keep_writes(outs[:n_out]))
                        # accumulate (and, across replicas, all-reduce)
                        if accumulation is None:
                            acc = grads if acc is None else [a + b for a, b in zip(acc, grads)]
                        else:
                            acc = accumulation.add(acc, grads, k, state, apart)
                        k += 1
                if self.reduce is not None:
                    acc = self.reduce(acc)
                    if apart:
                        acc = accumulation.finish(acc, state)
                    if stats is not None:
                        stats = self.reduce([stats.double()])[0].round()
                if stats is not None:
                    scale.add(stats)
                if self.shards:
                    self._sharded_update(state, acc)
                else:
                    self._update(state, acc)
        return collector.result()

    def _keep_writes(self, outs):
        """The model's outputs; mutated inputs' new values go to ``written``."""
        if not self.n_writes:
            return outs
        self.written.append(outs[len(outs) - self.n_writes:])
        return outs[:len(outs) - self.n_writes]

    def _run_update(self, state, params, grads, opt_state, steps=None):
        """One call of the update graph: (params, opt_state, steps) after it,
        and automatic loss scaling's new factor (None without it)."""
        n_train = len(params)
        counts = self.slot_counts or [(len(slots), len(slots)) for slots in opt_state]
        flat_state = [s for (n_in, _), slots in zip(counts, opt_state) for s in slots[:n_in]]
        steps = state.steps if steps is None else steps
        scale = getattr(state, "loss_scale", None)
        scaler = scale.update_inputs() if scale is not None else []
        new = self.update_fn(params + grads + flat_state
                             + steps + state.hyper + [state.grad_scale] + scaler)
        factor = None
        if scaler:
            factor, new = new[-1], new[:-1]
        new_state, at = [], n_train
        for _, n_out in counts:
            new_state.append(new[at:at + n_out])
            at += n_out
        return new[:n_train], new_state, new[at:], factor

    def _update(self, state, acc):
        n_train = state.n_trainable
        state.params[:n_train], state.opt_state, state.steps, factor = self._run_update(
            state, state.params[:n_train], acc, state.opt_state)
        self._scale_updated(state, factor)

    @staticmethod
    def _scale_updated(state, factor):
        """After a weight update: the loss-scale update's factor takes effect."""
        if factor is not None:
            state.loss_scale.apply(state, factor)

    def _sharded_update(self, state, acc):
        """Replicated tensor sharding of the optimizer state: the summed
        gradient is cut into shards (the reduce-scatter), every replica
        updates its shard of the weight and state, and the new weight is put
        back together (the all-gather).  Unsharded parameters are updated
        whole by every replica; replica 0's result is kept."""
        n_train = state.n_trainable
        params = state.params[:n_train]
        n = max(self.shards.values())
        cut_p = {i: shard(params[i], n) for i in self.shards}
        cut_g = {i: shard(acc[i], n) for i in self.shards}
        # the update writes its variables in place: replicas after the first
        # update copies of the unsharded ones, taken before any replica runs
        calls = []
        for r in range(n):
            own = (lambda t: t) if r == 0 else (lambda t: t.clone())
            calls.append((
                [cut_p[i][r] if i in cut_p else own(p) for i, p in enumerate(params)],
                [cut_g[i][r] if i in cut_g else own(g) for i, g in enumerate(acc)],
                [[slot[r] for slot in slots] if i in cut_p else [own(v) for v in slots]
                 for i, slots in enumerate(state.opt_state)],
                [own(step) for step in state.steps]))
        runs = [self._run_update(state, *call) for call in calls]
        new_params, new_state, new_steps, factor = runs[0]
        for i in self.shards:
            new_params[i] = unshard([run[0][i] for run in runs], params[i].shape)
            new_state[i] = [[run[1][i][k] for run in runs] for k in range(len(new_state[i]))]
        state.params[:n_train], state.opt_state, state.steps = new_params, new_state, new_steps
        self._scale_updated(state, factor)
