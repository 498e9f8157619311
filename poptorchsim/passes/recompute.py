"""Recomputation: which forward ops of a training step run again before
their backward, instead of keeping their results alive in between.

PopART's ``autoRecomputation`` (``Options._Popart.set("autoRecomputation",
n)``, PopART's ``RecomputationType``) picks them, and
``poptorch.recomputationCheckpoint`` marks results that are always kept:

=============  ==  =====================================================
None           0   nothing is recomputed (checkpoints change nothing)
Standard       1   PopART's algorithm: the forward ops are cut into
                   intervals of decreasing length (about sqrt(2N) of
                   them); in each, the moment with the fewest bytes alive
                   is found and the ops whose results are alive then are
                   kept; every other forward op is recomputed
NormOnly       2   only the normalisations (batch, layer, group norm)
Pipeline       3   pipelined training: every forward stage but the last is
                   recomputed from its stashed inputs; only the tensors
                   that cross to another stage (and checkpoints) are kept.
                   PopTorch's default when a pipeline spans several IPUs
RecomputeAll   4   every forward op is recomputed, except checkpoints and
                   the ops between the last checkpoints and the loss
                   (PopART keeps that last segment: recomputing it would
                   happen right where it was computed)
=============  ==  =====================================================

``plan(graph, mode, pipelined)`` marks the recomputed ops
(``Op.recompute``) and leaves a ``Recomputation`` on the graph;
``gaps`` tells the memory planner when each recomputed buffer is dead.
A recomputed op runs once more before the backward of its segment (the
consecutive recomputed forward ops between two kept ones): its results
live from its forward run to its last forward reader, then from the
segment's recompute point (the first backward op that reads any of the
segment's results) to their last backward reader.  Numerics do not change:
the engine runs the graph once, recomputation only changes the memory and
cycle model.
"""
import bisect
import logging
import math
from dataclasses import dataclass, field

import numpy as np

from ..ir.interfaces import RecomputePlan

MODES = ("None", "Standard", "NormOnly", "Pipeline", "RecomputeAll")
NONE, STANDARD, NORM_ONLY, PIPELINE, RECOMPUTE_ALL = range(len(MODES))

_NEVER = ("host", "loop", "cond")          # ops that are never run twice


@dataclass
class Recomputation:
    """What ``plan`` decided for one graph."""
    mode: int = NONE
    ops: frozenset = frozenset()       # the recomputed ops
    segment: dict = field(default_factory=dict)    # recomputed op -> segment number
    checkpoints: int = 0               # ops marked by recomputationCheckpoint

    @property
    def name(self):
        return MODES[self.mode]

    def __bool__(self):
        return bool(self.ops)


# the type checker holds Recomputation to what the IR declares of it
_CHECKED: type[RecomputePlan] = Recomputation


def default_mode(mode, pipelined_over_ipus):
    """PopTorch turns Pipeline recomputation on for a pipeline over several
    IPUs unless ``autoRecomputation`` was set."""
    if mode is None:
        return PIPELINE if pipelined_over_ipus else NONE
    return int(mode)


def plan(graph, mode, pipelined=False):
    """In-place rewrite: marks the ops of training-step ``graph`` that
    ``mode`` recomputes (``op.recompute``) and sets ``graph.recompute``;
    returns the ``Recomputation``."""
    ops = graph.ops
    for op in ops:
        op.recompute = False
    checkpoints = {k for k, op in enumerate(ops)
                   if op.attrs.get("recomputation_checkpoint") and not op.backward}
    result = Recomputation(mode, checkpoints=len(checkpoints))
    graph.recompute = result
    if mode == NONE or not any(op.backward for op in ops):
        return result
    if mode == PIPELINE and not pipelined:
        logging.getLogger("poptorchsim").warning(
            "autoRecomputation 3 (RecomputationType::Pipeline) recomputes the forward "
            "stages of a pipeline; this model is not pipelined over several IPUs, so "
            "nothing is recomputed. Use 4 (RecomputeAll) or 1 (Standard) on one IPU.")
        return result
    forward = [k for k, op in enumerate(ops) if not op.backward]
    to_loss = _to_backward(ops, forward)
    if mode == RECOMPUTE_ALL:
        chosen = to_loss - checkpoints
        chosen -= _last_segment(ops, forward, chosen)
    elif mode == PIPELINE:
        last = max(ops[k].stage for k in forward)
        crossing = _crossing_stages(ops, forward)
        chosen = {k for k in to_loss if ops[k].stage != last} - checkpoints - crossing
    elif mode == NORM_ONLY:
        chosen = {k for k in to_loss if ops[k].cost_class == "norm"} - checkpoints
    elif mode == STANDARD:
        # views are no ops of PopART's (they alias their input): left out
        order = [k for k in forward if k in to_loss and ops[k].cost_class != "view"]
        chosen = set(order) - checkpoints - _standard_kept(ops, order)
    else:
        raise ValueError(f"autoRecomputation {mode} is not a RecomputationType")
    chosen = _needed(ops, forward, chosen)
    segment, n = {}, -1
    previous = None
    for k in forward:
        op = ops[k]
        if k in chosen:
            if previous is None or previous != op.stage:
                n += 1
            previous = op.stage
            segment[op] = n
            op.recompute = True
        elif op.cost_class != "view" and k in to_loss:
            previous = None          # a kept op ends the segment
    result.ops, result.segment = frozenset(ops[k] for k in chosen), segment
    return result


def _to_backward(ops, forward):
    """Forward ops whose results the backward reads, directly or through
    other forward ops (PopART's ``toLoss``), and that can run twice."""
    wanted = {t.id for op in ops if op.backward for t in op.input_tensors()}
    found = set()
    for k in reversed(forward):
        op = ops[k]
        if any(t is not None and t.id in wanted for t in op.outputs):
            if op.cost_class not in _NEVER:
                found.add(k)
            wanted.update(t.id for t in op.input_tensors())
    return found


def _producers(ops, forward):
    made = {}
    for k in forward:
        for t in ops[k].outputs:
            if t is not None:
                made[t.id] = k
    return made


def _last_segment(ops, forward, chosen):
    """PopART's ``allCheckpointAfterLastCheckpoint``: walking back from the
    loss through recomputed ops, every op met is kept."""
    made = _producers(ops, forward)
    readers = {t.id for op in ops if op.backward for t in op.input_tensors()}
    losses = [k for k in forward if k in chosen or ops[k].cost_class != "view"]
    # the loss: the last forward op whose result the backward reads
    seeds = [k for k in reversed(losses)
             if any(t is not None and t.id in readers for t in ops[k].outputs)][:1]
    kept, stack = set(), list(seeds)
    while stack:
        k = stack.pop()
        if k in kept or (k not in chosen and k not in seeds):
            continue
        kept.add(k)
        stack.extend(made[t.id] for t in ops[k].input_tensors() if t.id in made)
    return kept


def _crossing_stages(ops, forward):
    """Forward ops whose results a forward op of another stage reads: the
    next stage's inputs, stashed rather than recomputed."""
    made = _producers(ops, forward)
    found = set()
    for k in forward:
        for t in ops[k].input_tensors():
            p = made.get(t.id)
            if p is not None and ops[p].stage != ops[k].stage:
                found.add(p)
    return found


def _decreasing_intervals(n):
    """PopART's ``getDecreasingIntervals``: [0, n) cut into intervals each one
    shorter than the one before, about sqrt(2n) of them (scaled by 0.75)."""
    if n == 1:
        return [(0, 1)]
    size = int(int(math.sqrt(2.0 * n)) - 1)
    size = int(size * 0.75)
    intervals, i = [], 0
    while i + size <= n and size > 0:
        intervals.append((i, i + size))
        i += size
        size -= 1
    while i < n:
        intervals.append((i, i + 1))
        i += 1
    return intervals


def _standard_kept(ops, order):
    """PopART's Standard recomputation: the forward ops kept.  After each
    forward op, the live set holds the ops whose results some later forward
    op still reads (and op i itself); in every interval the live set of
    fewest bytes is kept.

    Op ``j`` is alive after ops ``j`` to ``last_read[j] - 1``, so the bytes
    alive after each op are a running sum of those spans (linear in the
    ops, not a live set per op), and the live sets are read only at the
    moments each interval picks."""
    if not order:
        return set()
    n = len(order)
    position = {k: i for i, k in enumerate(order)}
    last_read: dict = {}
    made = _producers(ops, order)
    for k in order:
        for t in ops[k].input_tensors():
            p = made.get(t.id)
            if p is not None:
                last_read[p] = max(last_read.get(p, position[p]), position[k])
    nbytes = [0 if ops[k].cost_class == "view" else
              sum(t.nbytes for t in ops[k].outputs if t is not None) for k in order]
    # op j (at position j) is alive after the ops j .. max(j, last_read - 1)
    until = [max(j, last_read.get(order[j], j) - 1) for j in range(n)]
    change = [0] * (n + 1)
    for j in range(n):
        change[j] += nbytes[j]
        change[until[j] + 1] -= nbytes[j]
    memory, alive = [], 0
    for i in range(n):
        alive += change[i]
        memory.append(alive)
    best = sorted({min(range(begin, end), key=lambda i: memory[i])
                   for begin, end in _decreasing_intervals(n)})
    kept = set()
    for j in range(n):
        # alive at some chosen moment i: j <= i <= until[j]
        b = bisect.bisect_left(best, j)
        if b < len(best) and best[b] <= until[j]:
            kept.add(order[j])
    return kept


def _needed(ops, forward, chosen):
    """Only the chosen ops whose results the backward reads, directly or
    through other recomputed ops (or views), run again; views never do."""
    wanted = {t.id for op in ops if op.backward for t in op.input_tensors()}
    needed = set()
    for k in reversed(forward):
        op = ops[k]
        if not any(t is not None and t.id in wanted for t in op.outputs):
            continue
        if op.cost_class == "view":          # aliases its input: nothing to run
            wanted.update(t.id for t in op.input_tensors())
        elif k in chosen:
            needed.add(k)
            wanted.update(t.id for t in op.input_tensors())
    return needed


def gaps(graph, find, ids):
    """For the memory planner: ``(lo, hi, recomputed, extend)``.

    ``ids``: the activation buffers (root tensor ids, ``find`` maps a tensor
    to its root).  A recomputed buffer is dead at the ops strictly between
    ``lo[n]`` (its last forward use) and ``hi[n]`` (its segment's recompute
    point); ``lo = hi = -1`` for the others.  ``recomputed[n]``: the buffer
    is not kept between forward and backward (nor stashed).  ``extend``:
    buffer id -> the latest recompute point at which a recomputed op reads
    it (a checkpoint must live until then)."""
    rec = graph.recompute if graph is not None else None
    n_ids = len(ids)
    lo = np.full(n_ids, -1, dtype=np.int64)
    hi = np.full(n_ids, -1, dtype=np.int64)
    recomputed = np.zeros(n_ids, dtype=bool)
    if not rec:
        return lo, hi, recomputed, {}
    index = {i: n for n, i in enumerate(ids)}
    kept: set = set()
    seg: dict = {}
    fwd_last: dict = {}
    bwd_first: dict = {}
    for k, op in enumerate(graph.ops):
        for t in op.input_tensors():
            r = find(t).id
            if r in index:
                if op.backward:
                    bwd_first.setdefault(r, k)
                else:
                    fwd_last[r] = k
        if op.backward or op.cost_class == "view":     # a view writes nothing
            continue
        for t in op.outputs:
            if t is None:
                continue
            r = find(t).id
            if r not in index:
                continue
            fwd_last[r] = max(fwd_last.get(r, k), k)
            if op in rec.ops:
                seg.setdefault(r, rec.segment[op])
            else:
                kept.add(r)
    kept.update(find(t).id for t in graph.outputs)
    point: dict = {}
    for r, s in seg.items():
        if r not in kept and r in bwd_first:
            point[s] = min(point.get(s, bwd_first[r]), bwd_first[r])
    for r, s in seg.items():
        if r in kept or r not in bwd_first or s not in point:
            continue
        n = index[r]
        recomputed[n] = True
        if point[s] > fwd_last[r] + 1:
            lo[n], hi[n] = fwd_last[r], point[s]
    extend: dict = {}
    for op in rec.ops:
        p = point.get(rec.segment[op])
        if p is None:
            continue
        for t in op.input_tensors():
            r = find(t).id
            # a kept buffer; one a recomputed op writes is written again
            if r in index and (r not in seg or r in kept):
                extend[r] = max(extend.get(r, p), p)
    return lo, hi, recomputed, extend
