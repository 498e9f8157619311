"""Compiling a rebuilt layer and reading our figures off the compile."""
import numpy as np


def compile_layer(layer):
    """The ``Compiled`` executable of ``layer`` (meta weights: no values)."""
    import torch

    from .. import Options, inferenceModel, trainingModel
    opts = Options().showCompilationProgressBar(False)
    # the IPU Model reports the memory of a layer that does not fit; so do we
    opts._Popart.setEngineOptions({"debug.allowOutOfMemory": "true"})
    if layer.training:
        model = trainingModel(layer.module, opts,
                              torch.optim.SGD(layer.module.parameters(), lr=1.0))
    else:
        model = inferenceModel(layer.module, opts)
    model.compile(*layer.inputs)
    return model._executable


def _harness_ops(graph):
    """Ops of ``graph`` that the harness added around the layer: the loss
    (a sum to a scalar) and its seed, the input's scaling by the
    one-element parameter and that parameter's gradient (a product with
    the input, summed).  Each touches a 0-dim tensor, or only feeds one."""
    ops = graph.ops
    scalar = lambda t: t is not None and len(t.shape) == 0   # noqa: E731 - a one-line helper
    harness = {id(op) for op in ops
               if any(scalar(t) for t in op.outputs) or any(scalar(t) for t in op.input_tensors())}
    consumers = {}
    for op in ops:
        for t in op.input_tensors():
            consumers.setdefault(id(t), []).append(op)
    for op in reversed(ops):
        users = [u for t in op.outputs if t is not None for u in consumers.get(id(t), [])]
        if users and all(id(u) in harness for u in users) and op.cost_class == "elementwise":
            harness.add(id(op))
    return harness


def layer_cycles(compiled, layer):
    """Cycles of the layer's own ops: every op of the step (or inference)
    graph but the harness's, and, for layers whose tool updates weights
    (convolution, fully connected), the optimizer update's ops on them."""
    total = 0.0
    for name, graph in compiled.program.graphs.items():
        costs = compiled.costs[name]
        if name == "optimizer_update":
            if layer.kind not in ("conv", "fc"):
                continue
            # the tools update in place in the data type (matMulAcc, a
            # scaled add); PopTorch's SGD casts fp16 weights around its
            # update, which the tools do not: the casts are not counted
            total += sum(c.total for op, c in zip(graph.ops, costs)
                         if op.cost_class != "copy"
                         and any(t is not None and len(t.shape) for t in op.outputs))
            continue
        skip = _harness_ops(graph)
        total += sum(c.total for op, c in zip(graph.ops, costs) if id(op) not in skip)
    return total


def memory_figures(compiled, code=True):
    """(total bytes over the tiles, the fullest tile's bytes including gaps)
    as PopVision's memory report counts them: always-live plus the peak of
    not-always-live.  ``code=False``: without the runtime and control code,
    for a reference compiled without IPU code (its figures count none).

    The tools hold what the layer needs and nothing of PopTorch's optimizer:
    they update weights in place (conv, fc) or return the gradients (LSTM,
    GRU), so neither the gradient accumulators, the optimizer state and
    hyperparameters, nor the optimizer graph's peak (PopTorch SGD's fp32
    casts) are counted; the gradients themselves are the training step's
    results, in its not-always-live peak."""
    report = compiled.memory
    tiles = len(report.total)
    optimizer = [name for name, role in report.roles.items()
                 if role in ("accumulator", "state", "hyper")]
    always = np.asarray(report.always_live, dtype=float).copy()
    for name in optimizer:
        always -= report.by_tensor[name]
    peak = np.zeros(tiles)
    for name, (usage, _, _) in report.graphs.items():
        if name != "optimizer_update" and len(usage):
            peak = np.maximum(peak, np.asarray(usage).max(axis=0))
    total = always + peak
    per_tile = total if code else total - report.code_bytes_per_tile - report.control_code
    # a tile with AMP work is counted from the interleaved region's start
    # (the region below holds its code), code or not; another holds its bytes
    gaps = report.with_gaps(total)
    if report.interleaved is not None:
        gaps = np.where(report.interleaved, gaps, per_tile)
    return float(per_tile.sum()), float(np.max(gaps))
