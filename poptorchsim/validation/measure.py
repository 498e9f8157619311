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
    scalar = lambda t: t is not None and len(t.shape) == 0   # noqa: E731
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
    not-always-live.  ``code=False``: without the control code and vertex
    code, for a reference compiled without IPU code (its figures count none)."""
    report = compiled.memory
    per_tile = np.asarray(report.total, dtype=float)
    gaps = np.asarray(report.including_gaps, dtype=float)
    if not code:
        per_tile = per_tile - report.code_bytes_per_tile
        # a tile without AMP work holds its bytes alone; one with AMP work
        # is counted from the interleaved region's start, code or not
        interleaved = (report.interleaved if report.interleaved is not None
                       else np.zeros(len(per_tile), dtype=bool))
        gaps = np.where(interleaved, gaps, per_tile)
    return float(per_tile.sum()), float(np.max(gaps))
