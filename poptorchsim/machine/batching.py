"""Many micro-batches of one weight update in one call.

Every micro-batch of one weight update (all replicas, all accumulation
steps) runs the training step with the same weights, so where the step
allows it the engine runs them as one ``torch.func.vmap`` call
(``batched_graph``) and sums their gradients, with the serial order's
results within fp32 rounding.  ``serial_reason`` says why a step must keep
the serial order instead.

Buffers the step writes (batch norm's running statistics and its counter)
carry from one micro-batch to the next, but in training nothing the step
returns besides them reads them: batch norm normalises with the batch's own
statistics.  Such a step is split in two (``buffer_split``): the *head*,
the whole step with the buffers' new values left out, runs batched; the
*tail*, the ops that make the buffers' new values from their old ones and
from values of the head (the normalised layers' inputs), runs once per
micro-batch in the serial order, on the buffers of that micro-batch's
replica.  The buffers come out bit for bit as in the serial order.
"""
from collections import Counter
from dataclasses import dataclass, replace
from typing import Any

import torch

from ..ir.graph import Graph, Tensor
from . import vmap_rules
from .codegen import compile_graph
from .streams import draws

aten = torch.ops.aten

_SERIAL_CLASSES = ("random", "host", "custom", "loop", "cond")

_BN_FORWARD = aten._native_batch_norm_legit_functional.default
_BN_BACKWARD = aten.native_batch_norm_backward.default


def _arg(op, index, name):
    return op.args[index] if len(op.args) > index else op.kwargs.get(name)


def _reached(op, tainted):
    """The indices of ``op``'s outputs that read a tensor of ``tainted``
    (ids).  In training, batch norm's normalised output and saved
    statistics do not read the running statistics (arguments 3 and 4), and
    its backward ignores them."""
    if op.target is _BN_FORWARD and _arg(op, 5, "training"):
        stats = [a for a in op.args[3:5] if isinstance(a, Tensor)]
        rest = [t for t in op.input_tensors() if all(t is not s for s in stats)]
        if any(t.id in tainted for t in rest):
            return set(range(len(op.outputs)))
        return {3, 4} if any(t.id in tainted for t in stats) else set()
    inputs = op.input_tensors()
    if op.target is _BN_BACKWARD and _arg(op, 7, "train"):
        inputs = [a for k, a in enumerate(op.args) if k not in (3, 4) and isinstance(a, Tensor)]
    if any(t.id in tainted for t in inputs):
        return set(range(len(op.outputs)))
    return set()


@dataclass(eq=False)
class BufferSplit:
    """A training step that writes its buffers, cut in two: ``head`` (the
    step's outputs less the buffers' new values, then ``boundary``) and
    ``tail`` (inputs: the buffers then ``boundary``; outputs: the buffers'
    new values)."""
    head: Graph
    tail: Graph
    boundary: list


def _running_stats(input, weight, bias, running_mean, running_var, training, momentum, eps):
    """Batch norm's new running statistics only (the tail's form of
    ``_native_batch_norm_legit_functional``): ATen's own update of them,
    bit for bit, without normalising the input."""
    mean, var = running_mean.clone(), running_var.clone()
    torch.batch_norm_update_stats(input, mean, var, momentum)
    return None, None, None, mean, var


def _without_running_stats(op):
    """Batch norm's backward in training without the running statistics,
    which it ignores (the head then needs none of their new values)."""
    if op.target is _BN_BACKWARD and _arg(op, 7, "train") and len(op.args) > 4:
        return replace(op, args=tuple(op.args[:3]) + (None, None) + tuple(op.args[5:]))
    return op


def _needed_only(graph):
    """``graph`` without the ops none of its outputs needs (the head's copy
    of the tail's ops: under ``vmap`` they would run batched for nothing)."""
    needed, kept = {t.id for t in graph.outputs}, []
    for op in reversed(graph.ops):
        if op.inplace or op.subgraphs or any(t is not None and t.id in needed
                                             for t in op.outputs):
            kept.append(op)
            needed |= {t.id for t in op.input_tensors()}
    return replace(graph, ops=kept[::-1])


def buffer_split(graph):
    """``(BufferSplit, None)``, or ``(None, reason)`` when the step's other
    outputs read its buffers (batch norm in eval mode inside a training
    step, or a buffer feeding the loss), or an op writes in place what a
    buffer reaches."""
    buffers = [t for t in graph.inputs if t.role == "buffer"]
    n_buf = len(buffers)
    tainted = {t.id for t in buffers}
    reach = {}
    for op in graph.ops:
        hit = _reached(op, tainted)
        if hit and (op.inplace or op.subgraphs):
            return None, f"op {op.name} writes or loops over what the buffers reach"
        reach[op.id] = hit
        tainted |= {op.outputs[k].id for k in hit if op.outputs[k] is not None}
    cut = len(graph.outputs) - n_buf
    others, new = graph.outputs[:cut], graph.outputs[cut:]
    read = [t for t in others if t.id in tainted]
    if read:
        return None, f"the step's output {read[0].name} reads its buffers"
    # the tail: the ops that make the buffers' new values from tainted values
    needed, tail_ops, boundary, seen = {t.id for t in new if t.id in tainted}, [], [], set()
    for op in reversed(graph.ops):
        made = [t for k, t in enumerate(op.outputs) if t is not None and k in reach[op.id]]
        if not any(t.id in needed for t in made):
            continue
        tail_ops.append(op)
        for t in op.input_tensors():
            if t.id in tainted:
                needed.add(t.id)
            elif t.id not in seen and t.role != "const":
                seen.add(t.id)
                boundary.append(t)
    tail_ops.reverse()
    for t in new:                       # a new value made without the old ones
        if t.id not in tainted and t.id not in seen:
            seen.add(t.id)
            boundary.append(t)
    tail_ops = [replace(op, target=_running_stats)
                if op.target is _BN_FORWARD else op for op in tail_ops]
    head = _needed_only(replace(graph, ops=[_without_running_stats(op) for op in graph.ops],
                                outputs=list(others) + boundary))
    tail = Graph(graph.name + "/buffers", inputs=buffers + boundary, ops=tail_ops,
                 outputs=list(new), tensors=graph.tensors)
    return BufferSplit(head, tail, boundary), None


def serial_reason(graph):
    """Why ``graph`` (a training step) must run its micro-batches one after
    another, or None when they may run as one batched call: random ops
    drawing from PyTorch's generator in eager order (``RandomStreams.Eager``,
    or an op the counter-based streams do not draw for; those of
    ``streams.Streams`` draw per micro-batch and batch), host ops and custom
    ops, loops and conditionals, buffers the step's other outputs read,
    model inputs it writes, floating-point checks and automatic loss
    scaling's statistics.  Stochastic rounding reads the micro-batch's
    stream, and batches.
    fp16 programs batch: the gradient watch counts the first micro-batch
    of a call, which the engine runs on its own first."""
    streams = graph.streams
    for op in graph.ops:
        if op.cost_class == "random" and (not draws(op) or (streams is not None
                                                             and streams.handles(op))):
            continue            # drawn from the micro-batch's own stream, or nothing drawn
        if op.cost_class in _SERIAL_CLASSES or op.subgraphs:
            return f"{op.cost_class} op {op.name}"
    if graph.rounding is not None and streams is None:
        return "stochastic rounding"
    if graph.floating_point_checks:
        return "floating-point checks"
    if graph.statistics_outputs or graph.input_writes:
        return "automatic loss scaling statistics or written model inputs"
    if _writes_buffers(graph):
        return buffer_split(graph)[1]
    return None


def _writes_buffers(graph):
    buffers = [t for t in graph.inputs if t.role == "buffer"]
    n_buf = len(buffers)
    return bool(n_buf) and [t.id for t in graph.outputs[len(graph.outputs) - n_buf:]] \
        != [t.id for t in buffers]


_CONV_BACKWARD = aten.convolution_backward.default


class _RowByRow(torch.autograd.Function):
    """``kernel(*args)``; under ``vmap``, once per row, the results stacked.
    functorch batches batch norm by moving the rows into the channels
    (copies, and a decomposed backward): 2-5x slower than the kernel run
    row by row, which also gives the serial order's values bit for bit."""

    @staticmethod
    def forward(kernel, *args):
        return tuple(_no_none(kernel(*args)))

    @staticmethod
    def setup_context(ctx, inputs, output):
        pass

    @staticmethod
    def vmap(info, in_dims, kernel, *args):
        dims = [d if isinstance(a, torch.Tensor) else None for a, d in zip(args, in_dims[1:])]
        moved = [a.movedim(d, 0) if d is not None else a for a, d in zip(args, dims)]
        rows = [_no_none(kernel(*[a[i] if d is not None else a for a, d in zip(moved, dims)]))
                for i in range(info.batch_size)]
        outs = [torch.stack([r[k] for r in rows]) if rows[0][k].numel() else rows[0][k]
                for k in range(len(rows[0]))]
        return tuple(outs), tuple(0 if o.numel() else None for o in outs)


def _no_none(outs):
    """A kernel's results with each absent one (a masked-out gradient) an
    empty tensor, which ``torch.autograd.Function`` can return."""
    return [torch.empty(0) if o is None else o for o in outs]


def _row_by_row(kernel):
    def run(*args):
        return vmap_rules.apply(_RowByRow, kernel, *args)
    return run


def _batch_norm_by_rows(head):
    """``head`` with batch norm in training, forward and backward, run row
    by row under ``vmap`` (``_RowByRow``)."""
    def by_rows(op):
        if (op.target is _BN_FORWARD and _arg(op, 5, "training")) or \
                (op.target is _BN_BACKWARD and _arg(op, 7, "train")):
            return replace(op, target=_row_by_row(op.target))
        return op
    return replace(head, ops=[by_rows(op) for op in head.ops])


def _summed_weight_grads(graph, summed):
    """The convolution backward ops whose weight (and bias) gradients are
    among ``graph.outputs[slice(*summed)]`` and read by no op, of a weight the
    graph takes as input: their gradients need only the sum over the
    micro-batches, which one convolution backward over the micro-batches
    folded into the batch dimension computes (under ``vmap`` they would be
    made one micro-batch at a time, as a grouped convolution 2-3x slower
    than the summed one)."""
    uses = Counter(t.id for op in graph.ops for t in op.input_tensors())
    outs = Counter(t.id for t in graph.outputs[slice(*summed)])
    every = Counter(t.id for t in graph.outputs)
    inputs = {t.id for t in graph.inputs}
    found = []
    for op in graph.ops:
        if op.target is not _CONV_BACKWARD or not op.backward or op.inplace:
            continue
        mask, weight = list(op.args[10]), op.args[2]
        grads = [op.outputs[k] for k in (1, 2) if mask[k]]
        if isinstance(weight, Tensor) and weight.id in inputs and grads and all(
                t is not None and outs[t.id] == every[t.id] == 1 and not uses[t.id]
                for t in grads):
            found.append(op)
    return found


def _defer_weight_grads(head, summed):
    """``head`` with the weight gradients of ``_summed_weight_grads`` left to
    a convolution backward after the batched call: its ops compute only
    their input gradient, and its outputs (less those gradients) end with
    each deferred op's gradient and input, one row per micro-batch.
    Returns (head, deferred ops, output position -> (op index, output))."""
    deferred = _summed_weight_grads(head, summed) if summed else []
    if not deferred:
        return head, [], {}
    index = {op.id: d for d, op in enumerate(deferred)}
    ops = []
    for op in head.ops:
        if op.id not in index:
            ops.append(op)
        elif op.args[10][0]:            # the input gradient stays in the batched call
            ops.append(replace(op, args=op.args[:10] + ([True, False, False],),
                               outputs=[op.outputs[0], None, None]))
    made = {op.outputs[k].id: (index[op.id], k) for op in deferred for k in (1, 2)
            if op.outputs[k] is not None}
    slots = {pos: made[t.id] for pos, t in enumerate(head.outputs) if t.id in made}
    outputs = [t for t in head.outputs if t.id not in made]
    outputs += [a for op in deferred for a in op.args[:2]]
    return replace(head, ops=ops, outputs=outputs), deferred, slots


def _fold(rows):
    return rows.reshape((rows.shape[0] * rows.shape[1],) + tuple(rows.shape[2:]))


def _unfolded(grad, inp, weight, stride, padding, dilation, rows=None):
    """A 2-D convolution's weight gradient as the input's patches (im2col)
    times the output gradient, one matrix product over every sample and
    position: on the CPU 3-4x faster than ATen's convolution backward for
    small feature maps with many channels (ResNet's last stage at 2x2).
    ``rows``: the samples are ``rows`` micro-batches one after another, and
    each micro-batch gets its own gradient (stacked), still one product."""
    cols = torch.nn.functional.unfold(inp, tuple(weight.shape[2:]), dilation=dilation,
                                      padding=padding, stride=stride)
    g = grad.reshape(grad.shape[0], grad.shape[1], -1)
    if rows is None:
        return torch.einsum("nol,nkl->ok", g, cols).reshape(weight.shape)
    g = g.reshape((rows, -1) + tuple(g.shape[1:]))
    cols = cols.reshape((rows, -1) + tuple(cols.shape[1:]))
    return torch.einsum("bnol,bnkl->bok", g, cols).reshape((rows,) + tuple(weight.shape))


class _WeightGrad:
    """The weight (and bias) gradient of one deferred convolution backward
    over the folded micro-batches, by one of two exact forms of it: ATen's
    convolution backward, or ``_unfolded`` for 2-D convolutions with one
    group whose output has at most ``UNFOLD_POSITIONS`` positions a sample
    (there im2col and one product run 1.5-4x faster on the CPU; on larger
    maps 2-8x slower).  Both sum the same products in another order (within
    fp32 rounding of each other); the choice depends on the shapes alone,
    so that runs repeat bit for bit.

    Summed (``per_row`` False): one gradient, the sum over the micro-batches.
    ``per_row``: one gradient per micro-batch, stacked, computed in fp32 and
    rounded to the op's result types (fp16 gradients are rounded micro-batch
    by micro-batch, as in the serial order): ATen's form then runs once
    per micro-batch, the unfolded one still as one product."""

    UNFOLD_POSITIONS = 8

    def __init__(self, op, per_row=False):
        self.op = op
        self.per_row = per_row
        self.mask = [False, bool(op.args[10][1]), bool(op.args[10][2])]
        self.dtypes = [op.outputs[k].dtype if op.outputs[k] is not None else None
                       for k in (1, 2)]
        stride, padding, dilation, transposed, _, groups = op.args[4:10]
        self.unfoldable = (not transposed and groups == 1 and len(stride) == 2
                           and self.mask[1])

    def _aten(self, grad, inp, weight, rows):
        if not rows:
            return _CONV_BACKWARD(grad, inp, weight, *self.op.args[3:10], self.mask)[1:]
        parts = [_CONV_BACKWARD(g, x, weight, *self.op.args[3:10], self.mask)[1:]
                 for g, x in zip(grad.chunk(rows), inp.chunk(rows))]
        return tuple(torch.stack([p[k] for p in parts]) if parts[0][k] is not None else None
                     for k in (0, 1))

    def _unfold(self, grad, inp, weight, rows):
        stride, padding, dilation = self.op.args[4:7]
        if not self.mask[2]:
            bias = None
        elif rows:
            bias = grad.reshape((rows, -1) + tuple(grad.shape[1:])).sum((1, 3, 4))
        else:
            bias = grad.sum((0, 2, 3))
        return _unfolded(grad, inp, weight, stride, padding, dilation, rows), bias

    def __call__(self, grad, inp, weight):
        rows = None
        if self.per_row:
            rows = len(grad)
            grad, inp, weight = _fold(grad).float(), _fold(inp).float(), weight.float()
        else:
            grad, inp = _fold(grad), _fold(inp)
        small = grad.shape[-1] * grad.shape[-2] <= self.UNFOLD_POSITIONS
        choice = "_unfold" if self.unfoldable and small else "_aten"
        out = getattr(self, choice)(grad, inp, weight, rows)
        if not self.per_row:
            return tuple(o.unsqueeze(0) if o is not None else None for o in out)
        return tuple(o.to(d) if o is not None else None for o, d in zip(out, self.dtypes))


def batched_graph(graph, summed=None, per_row=False, wide=frozenset()):
    """``f(shared, batched, extra, keys) -> outputs stacked along a new first
    dim``: ``graph`` run once per row of the ``batched`` inputs
    (``torch.func.vmap`` over the graph's function, compiled without
    in-place writes, which vmap cannot take into shared tensors); ``shared``
    (weights, buffers) and ``extra`` (trailing inputs) are the same for
    every row; ``keys`` (one row per micro-batch: ``Streams.key_of``) key
    the random numbers each row draws, as in the serial order.

    ``summed``: (start, stop) of the outputs the caller only sums over the
    rows (the gradients); of those, convolution weight gradients come back
    already summed, as one row (``_summed_weight_grads``), or with
    ``per_row`` one row per micro-batch, made by one product after the
    batched call rather than per row inside it (``_WeightGrad``).  ``wide``:
    ids of the outputs the caller casts to fp32 (fp16 gradients into fp32
    accumulators), returned as wide values where the step holds them so
    (``codegen.compile_graph``'s ``wide_outputs``: no narrowing to fp16 to
    be widened again).

    For a step that writes its buffers, ``f`` runs the head of its
    ``buffer_split`` (its outputs end with the boundary values, one row per
    micro-batch) and ``f.tail(buffers + boundary row)`` the buffers' update
    of one micro-batch; ``f.tail`` is None otherwise."""
    split = buffer_split(graph)[0] if _writes_buffers(graph) else None
    head = split.head if split else graph
    if graph.rounding is not None:
        summed = None       # each gradient rounds stochastically in its own op, as serially
    head, deferred, slots = _defer_weight_grads(_batch_norm_by_rows(head), summed)
    n_head = len(head.outputs) - 2 * len(deferred)
    once = Counter(t.id for t in head.outputs)      # (an output also read by the tail: fp16)
    wide_outputs = frozenset(k for k, t in enumerate(head.outputs)
                             if t.id in wide and once[t.id] == 1)
    fn = compile_graph(head, in_place=False, wide_outputs=wide_outputs)
    position = {t.id: k for k, t in enumerate(graph.inputs)}
    weight_grads = [_WeightGrad(op, per_row) for op in deferred]

    streams = graph.streams

    def run(shared, batched, extra, keys=None):
        keyed = streams is not None and keys is not None

        def one(*rows):
            if keyed:               # the last row is the micro-batch's random key
                streams.key, streams.batched = rows[-1], True
                rows = rows[:-1]
            return fn(list(shared) + list(rows) + list(extra))
        if keyed:
            streams.pool(None)      # drawn before the batched call (vmap draws nothing)
            batched = list(batched) + [keys]
        try:
            outs = torch.func.vmap(one)(*batched)
        finally:
            if keyed:
                streams.key, streams.batched = keys[-1], False
        if not deferred:
            return outs
        sums = []
        for d, (op, weight_grad) in enumerate(zip(deferred, weight_grads)):
            grad, inp = outs[n_head + 2 * d], outs[n_head + 2 * d + 1]
            sums.append((None,) + weight_grad(grad, inp, shared[position[op.args[2].id]]))
        kept = iter(outs[:n_head])
        return [sums[slots[pos][0]][slots[pos][1]] if pos in slots else next(kept)
                for pos in range(n_head + len(slots))]
    batched: Any = run      # the batched step, with what the engine reads of it
    batched.tail = compile_graph(split.tail) if split else None
    batched.n_boundary = len(split.boundary) if split else 0
    batched.deferred = len(deferred)
    batched.wide_outputs = wide_outputs
    return batched
