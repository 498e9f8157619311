"""What one call of the engine keeps between its control steps: the outputs
the output mode streams back (``OutputCollector``), how a weight update
combines its micro-batches' gradients (``Accumulation``, ``Update``), and
replicated tensor sharding's cut and join of a tensor (``shard``,
``unshard``)."""
import torch


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

    def cast(self, grads):
        """``grads`` (or the stacked gradients of several micro-batches) in their
        accumulators' types, where ``add`` would cast them so (the same values,
        cast once)."""
        if self.into or self.running:
            return grads
        return [g if d is None or g.dtype == d else g.to(d) for g, d in zip(grads, self.dtypes)]

    def add(self, acc, grads, k, state, apart=False):
        """The accumulators after micro-batch ``k`` (from 0).  ``apart``: the
        combined variant's increments are summed apart from the velocity (they
        are reduced across processes first, see ``finish``)."""
        if acc is not None and not self.into and not self.running:
            # the sums in one call (PyTorch's foreach ops: each the same add)
            return list(torch._foreach_add(acc, self.cast(grads)))
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


class Update:
    """One weight update in progress: the gradient sums and what the
    collectives and the update have done with them."""

    def __init__(self, extra):
        self.acc = None           # accumulated gradients, per trainable parameter
        self.stats = None         # automatic loss scaling's gradient statistics
        self.k = 0                # micro-batches accumulated
        self.extra = extra        # the step's trailing inputs (the loss scaling)
        self.reduced = set()      # parameters whose gradients are reduced across processes
        self.stats_reduced = False
        self.cut = {}             # parameter -> its gradient's shards (reduce-scatter)
        self.gather = None        # a sharded update's results, until the all-gather
