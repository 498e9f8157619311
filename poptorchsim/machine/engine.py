"""The engine: runs a call by walking ``Program.main``.

Each control step has one rule, as each has one cost rule in
``program_cost.py``:

=============== ============================================================
step            what the engine does
=============== ============================================================
Repeat          runs its body ``count`` times, numbering the iterations of
                its counter (``device_iteration`` picks the inputs' device
                iteration, ``accumulation`` the micro-batch; the
                accumulation loop starts a weight update's sums).  Where
                the training step allows (``batching.serial_reason``), the
                accumulation loop's calls of the step are collected as it
                walks and run after it as one batched call (``vmap``, 16
                micro-batches at a time): all replicas and micro-batches of
                one update hold the same weights
Call            the model's graph once per replica on that micro-batch
                (training: the gradients are added into the accumulators;
                a replica reads its input group's data and its group's row
                of a replica-grouped weight, ``replica_groups.py``); the
                optimizer update once (every replica holds the same
                weights; with sharded state, once per replica on its shard;
                with grouped weights, once per combination of rows)
AllReduce       the accumulated gradients summed across host processes
                (``distributed/``); within a process the replicas' gradients
                were summed as they were accumulated
ReduceScatter   the same, then the gradients of sharded state cut into one
                shard per replica
AllGather       after a sharded update: the replicas' shards put back
                together; before a call (sharded weights): nothing, the host
                holds whole weights
RemoteLoad,     nothing: a variable holds the same values in Streaming
RemoteStore     Memory as on the tiles
HostToDevice,   nothing: the inputs are indexed by the loops' counters and the
DeviceToHost    outputs kept as the output mode asks (``OutputCollector``)
=============== ============================================================

The graphs themselves run as generated Python (``codegen.compile_graph``).
"""
from typing import Any, Optional

import torch

from ..ir.visitor import StepVisitor
from . import replica_groups
from .call_state import Accumulation, Update, shard, unshard


class Engine(StepVisitor):
    """Device state, and the walk over a program's control steps that runs a
    call on it.  ``step_fn`` runs the model's graph (the training step or the
    inference forward), ``update_fn`` the optimizer update."""

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
        self.accumulation: Optional[Accumulation] = None   # None: plain sums
        # runs many micro-batches of the training step as one call
        # (batching.batched_graph, with its tail, n_boundary and deferred); None:
        # one after another
        self.batch_fn: Any = None
        self.watch = None           # the step's GradientWatch (fp16), or None
        # the executable's random streams (streams.Streams): each micro-batch,
        # update and inference micro-batch runs under its own key
        self.streams = None
        self._batch = None          # (device iteration, micro-batch, replica) collected
        # inputReplicaGrouping: the inputs' replica row each replica reads; None:
        # its own.  replicaGrouping: parameter index -> the row of the grouped
        # weight each replica holds (replica_groups.py)
        self.input_of = None
        self.weight_groups = {}
        super().__init__()          # a rule for each kind of control step (StepVisitor)

    def run(self, program, state, inputs, collector):
        """One call of ``program`` on ``state`` (params, buffers per replica;
        in training also opt_state, steps, hyper, grad_scale and, with
        automatic loss scaling, ``loss_scale``: the step's last output is then
        its gradient statistics and the update's last its new factor).
        ``inputs``: tensors shaped [di, ga, rf, micro, ...].  Returns what
        the collector kept."""
        self.written = []
        self._program, self._state, self._inputs, self._collector = (
            program, state, inputs, collector)
        self._counters = {}
        self._update: Optional[Update] = None
        self._batch = None
        self._scale = getattr(state, "loss_scale", None)   # automatic loss scaling
        try:
            with torch.no_grad():
                self._walk(program.main)
            if self.streams is not None:
                self.streams.calls += 1         # the next call draws afresh
        finally:
            self._program = self._state = self._inputs = self._collector = None
        return collector.result()

    def _walk(self, step):
        self.visit(step)

    # -- control -----------------------------------------------------------------
    def _Sequence(self, step):
        for s in step.steps:
            self._walk(s)

    def _Repeat(self, step):
        if step.counter == "accumulation":
            self._update = Update(list(getattr(self._state, "step_extra", None) or []))
            if self._batchable():
                self._batch = []
        for k in range(step.count):
            self._counters[step.counter] = k
            self._walk(step.body)
        if self._batch is not None:
            batch, self._batch = self._batch, None
            self._run_batched(batch)
        if step.counter == "device_iteration" and self._update is not None \
                and self._update.gather is not None:
            raise RuntimeError("poptorchsim internal error: a sharded optimizer update "
                               "without the all-gather after it")

    def _HostToDevice(self, step):
        pass

    def _DeviceToHost(self, step):
        pass

    def _RemoteLoad(self, step):
        pass

    def _RemoteStore(self, step):
        pass

    # -- graph calls ----------------------------------------------------------------
    def _Call(self, step):
        if step.graph.name == "optimizer_update":
            self._run_update_call()
        elif self._program.kind == "training":
            if self._batch is not None:     # run with the loop's others, after it
                i = self._counters.get("device_iteration", 0)
                g = self._counters.get("accumulation", 0)
                self._batch.extend((i, g, r) for r in range(step.replicas))
                return
            for r in range(step.replicas):
                self._micro_batch(r)
        else:
            for r in range(step.replicas):
                self._forward(r)

    def _forward(self, r):
        state, i = self._state, self._counters.get("device_iteration", 0)
        n_buf = len(state.buffers[0])
        if self.streams is not None:
            self.streams.set("forward", i, r)
        outs = self.step_fn(replica_groups.params_of(state.params, self.weight_groups, r)
                            + state.buffers[r] + [x[i, 0, self._row(r)] for x in self._inputs])
        n_out = len(outs) - n_buf
        state.buffers[r] = outs[n_out:]
        self._collector.add(i, 0, r, self._keep_writes(outs[:n_out]))

    @property
    def _u(self) -> Update:
        """The weight update the accumulation loop is gathering gradients for."""
        assert self._update is not None, "a training step runs inside a weight update"
        return self._update

    def _micro_batch(self, r):
        """One replica's training step on its micro-batch; the gradients are
        added into the update's accumulators."""
        state, u = self._state, self._u
        i = self._counters.get("device_iteration", 0)
        g = self._counters.get("accumulation", 0)
        n_train, n_buf = state.n_trainable, len(state.buffers[0])
        if self.streams is not None:
            self.streams.set("step", i, g, r)
        outs = self.step_fn(replica_groups.params_of(state.params, self.weight_groups, r)
                            + state.buffers[r] + [x[i, g, self._row(r)] for x in self._inputs]
                            + u.extra)
        if self._scale is not None:       # the gradient statistics
            u.stats = outs[-1] if u.stats is None else u.stats + outs[-1]
            outs = outs[:-1]
        n_out = len(outs) - n_train - n_buf
        grads = replica_groups.spread(outs[n_out:n_out + n_train], state.params,
                                      self.weight_groups, r)
        state.buffers[r] = outs[n_out + n_train:]
        self._collector.add(i, g, r, self._keep_writes(outs[:n_out]))
        if self.accumulation is None:
            u.acc = grads if u.acc is None else [a + b for a, b in zip(u.acc, grads)]
        else:
            u.acc = self.accumulation.add(u.acc, grads, u.k, state, self._apart)
        u.k += 1

    def _batchable(self):
        """May this weight update's micro-batches run as one batched call?
        (A batched function, no loss-scale statistics, no written inputs;
        ``batching.serial_reason`` checked the graph.)"""
        return (self.batch_fn is not None and self._scale is None and not self.n_writes
                and not self.weight_groups)

    def _row(self, r):
        """The inputs' replica row replica ``r`` reads."""
        return r if self.input_of is None else self.input_of[r]

    def _run_batched(self, batch, rows=16):
        """The training step of every (i, g, r) in ``batch``, ``rows`` at a
        time in one vmapped call: outputs kept in order, gradients summed
        into the update's accumulators; the buffers a step writes are
        updated micro-batch by micro-batch in the serial order by the
        batched function's ``tail`` (``batching.batched_graph``).  Should
        the batched call fail (an op vmap cannot batch), the engine runs
        serially from then on.  A call the fp16 gradient watch counts
        batches too: the watch counts the first row (``gradient_watch``),
        unless the batched call leaves weight gradients to after it
        (``batching._defer_weight_grads``): the counted micro-batch then
        runs on its own first."""
        state, u = self._state, self._u
        if self.watch is not None and self.watch.counting and batch and \
                getattr(self.batch_fn, "deferred", 0):
            # the batched call makes some weight gradients after it, out of the
            # watch's sight: the counted micro-batch runs on its own first
            (i, g, r), batch = batch[0], batch[1:]
            self._counters["device_iteration"], self._counters["accumulation"] = i, g
            self._micro_batch(r)
        n_train, n_buf = state.n_trainable, len(state.buffers[0])
        tail = getattr(self.batch_fn, "tail", None)
        shared = state.params + state.buffers[0]
        if tail is None and any(any(b is not c for b, c in zip(state.buffers[r], state.buffers[0]))
                                for r in range(1, len(state.buffers))):
            shared = None           # replicas hold different buffers the step reads
        if len(batch) == 1:
            shared = None           # one micro-batch: the step itself, unbatched
        for start in range(0, len(batch), rows):
            part = batch[start:start + rows]
            if shared is None:
                outs = None
            else:
                keys = None if self.streams is None else torch.stack(
                    [self.streams.key_of("step", i, g, r) for i, g, r in part])
                try:
                    outs = self.batch_fn(shared, [torch.stack([x[i, g, self._row(r)]
                                                               for i, g, r in part])
                                                  for x in self._inputs], u.extra, keys)
                except Exception:  # noqa: BLE001 - vmap cannot batch an op: go serial
                    self.batch_fn, outs = None, None
            if outs is None:
                for i, g, r in part:
                    self._counters["device_iteration"], self._counters["accumulation"] = i, g
                    self._micro_batch(r)
                continue
            n_out = len(outs) - n_train - (self.batch_fn.n_boundary if tail else n_buf)
            for k, (i, g, r) in enumerate(part):
                self._collector.add(i, g, r, [o[k] for o in outs[:n_out]])
                if tail is not None:
                    state.buffers[r] = tail(state.buffers[r]
                                            + [o[k] for o in outs[n_out + n_train:]])
            self._add_rows(outs[n_out:n_out + n_train], len(part))

    def _add_rows(self, rows, n):
        """The gradients of ``n`` micro-batches (one row each) added into the
        update's accumulators: fp32 gradients summed over the rows at once
        (within fp32 rounding of the serial order; a convolution's weight
        gradient may come already summed, as one row), others row by row
        in the serial order (an fp16 gradient is rounded per micro-batch,
        and accumulates in its accumulator's type)."""
        u = self._u
        if self.accumulation is None and all(o.dtype == torch.float32 for o in rows):
            grads = [o.sum(0) for o in rows]
            u.acc = grads if u.acc is None else [a + b for a, b in zip(u.acc, grads)]
            u.k += n
            return
        if self.accumulation is not None:
            rows = self.accumulation.cast(rows)     # each cast once, not once per row
        # each row's gradients (none without trainable parameters)
        per_row = list(zip(*(o.unbind(0) for o in rows))) if rows else [()] * n
        for k in range(n):
            grads = list(per_row[k])
            if self.accumulation is None:
                u.acc = grads if u.acc is None else [a + b for a, b in zip(u.acc, grads)]
            else:
                u.acc = self.accumulation.add(u.acc, grads, u.k, self._state, self._apart)
            u.k += 1

    @property
    def _apart(self):
        """SGD's combined variant across processes: the increments are summed
        apart from the velocity, reduced, then added to it."""
        return (self.reduce is not None and self.accumulation is not None
                and bool(self.accumulation.into))

    def _keep_writes(self, outs):
        """The model's outputs; mutated inputs' new values go to ``written``."""
        if not self.n_writes:
            return outs
        self.written.append(outs[len(outs) - self.n_writes:])
        return outs[:len(outs) - self.n_writes]

    # -- collectives -------------------------------------------------------------------
    def _reduce(self, indices):
        """The gradients of ``indices`` (not yet reduced) summed across host
        processes; the gradient statistics with the first of them."""
        u = self._update
        if self.reduce is None or u is None or u.acc is None:
            return
        todo = [i for i in indices if i not in u.reduced]
        if todo:
            if len(todo) == len(u.acc):
                u.acc = self.reduce(u.acc)
            else:
                summed = self.reduce([u.acc[i] for i in todo])
                for i, t in zip(todo, summed):
                    u.acc[i] = t
            u.reduced.update(todo)
            acc = self.accumulation
            if self._apart and acc is not None and len(u.reduced) == len(u.acc):
                u.acc = acc.finish(u.acc, self._state)
        if u.stats is not None and not u.stats_reduced:
            u.stats = self.reduce([u.stats.double()])[0].round()
            u.stats_reduced = True

    def _AllReduce(self, step):
        u = self._update
        if u is not None and u.acc is not None:
            self._reduce([i for i in range(len(u.acc)) if i not in self.shards])

    def _ReduceScatter(self, step):
        u = self._update
        if u is None or u.acc is None:
            return
        self._reduce(range(len(u.acc)))
        n = max(self.shards.values(), default=1)
        u.cut = {i: shard(u.acc[i], n) for i in self.shards}

    def _AllGather(self, step):
        u = self._update
        if u is None or u.gather is None:
            return          # sharded weights: the host holds them whole
        state, (params, new_state, runs) = self._state, u.gather
        for i in self.shards:
            params[i] = unshard([run[0][i] for run in runs], state.params[i].shape)
            new_state[i] = [[run[1][i][k] for run in runs] for k in range(len(new_state[i]))]
        n_train = state.n_trainable
        state.params[:n_train], state.opt_state = params, new_state
        u.gather = None

    # -- the optimizer update ----------------------------------------------------------
    def _run_update_call(self):
        state, u = self._state, self._u
        if self.streams is not None:
            self.streams.set("update", self._counters.get("device_iteration", 0))
        assert u.acc is not None, "the update follows its micro-batches' gradients"
        self._reduce(range(len(u.acc)))       # nothing left when the program reduced them
        if u.stats is not None:
            state.loss_scale.add(u.stats)
        if self.shards:
            self._sharded_update(state, u)
        elif self.weight_groups:
            state.params[:state.n_trainable], state.opt_state, state.steps, factor = \
                replica_groups.grouped_update(self._run_update, state, u.acc, self.weight_groups)
            self._scale_updated(state, factor)
        else:
            n_train = state.n_trainable
            state.params[:n_train], state.opt_state, state.steps, factor = self._run_update(
                state, state.params[:n_train], u.acc, state.opt_state)
            self._scale_updated(state, factor)

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

    @staticmethod
    def _scale_updated(state, factor):
        """After a weight update: the loss-scale update's factor takes effect."""
        if factor is not None:
            state.loss_scale.apply(state, factor)

    def _sharded_update(self, state, u):
        """Replicated tensor sharding of the optimizer state: every replica
        updates its shard of the weight and state (the gradients were cut by
        the reduce-scatter); the all-gather then puts the new weight back
        together.  Unsharded parameters are updated whole by every replica;
        replica 0's result is kept."""
        n_train = state.n_trainable
        params, acc = state.params[:n_train], u.acc
        n = max(self.shards.values())
        cut_p = {i: shard(params[i], n) for i in self.shards}
        cut_g = u.cut or {i: shard(acc[i], n) for i in self.shards}
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
        state.steps = new_steps
        u.gather = (new_params, new_state, runs)
        self._scale_updated(state, factor)
