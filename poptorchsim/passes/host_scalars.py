"""Host scalars: the optimizer's scalar arithmetic is host work, not IPU work.

torch.optim holds its hyperparameters as Python floats and computes with
them in float64 on the host: Adam's bias corrections ``1 - beta1 ** step``,
``lr / bias_correction1``, SGD's ``1 - dampening`` and ``-lr``, the step
count itself.  The captured update graph keeps that arithmetic (the
hyperparameters are float64 0-dim inputs, so the numerics equal
torch.optim's), but the IPU has no float64, and PopTorch never puts it on
the tiles: the host computes these scalars and the device receives the
float32 values its tensor ops read, as it receives the hyperparameters.

``mark_host_scalars`` sets ``op.host_scalar`` on every op whose results
are scalars (one element at most) computed only from values the host
knows: the float64 hyperparameters, the step counters the caller names,
scalar constants and the results of other host-scalar ops.  The engine
still runs these ops; the machine charges them no cycles
(``estimate.cost.op_cost``), no vertex state (``passes.memory``), and a
result that only other host-scalar ops read no tile memory
(``passes.tile_mapping``).  A result a device op reads (the float32 cast
of ``lr``, the new step count) lives on the tiles like a hyperparameter.
"""
import torch

from ..ir.verify import verify_graph

_NOT_SCALAR_WORK = ("host", "custom", "loop", "cond")


def _host_known_inputs(graph, counters):
    return {t.id for t in graph.inputs
            if (t.role == "hyper" and t.dtype == torch.float64) or t.name in counters}


def mark_host_scalars(graph, counters=()):
    """Marks ``graph``'s host-scalar ops (``op.host_scalar = True``);
    ``counters``: names of the graph's inputs that count steps, which the
    host keeps as torch.optim does.  Returns ``graph``."""
    known = _host_known_inputs(graph, set(counters))
    known.update(t.id for t in graph.tensors if t.role == "const" and t.numel <= 1)
    for op in graph.ops:
        ins = op.input_tensors()
        outs = op.outputs
        if (op.cost_class in _NOT_SCALAR_WORK or op.subgraphs or not ins or not outs
                or any(t is None or t.numel > 1 for t in outs)
                or any(t.id not in known for t in ins)):
            continue
        op.host_scalar = True
        known.update(t.id for t in outs)
    return verify_graph(graph)


def device_reads(graph):
    """Ids of the tensors of ``graph`` that live on the tiles because a
    device op reads them or the graph returns them."""
    read = {t.id for t in graph.outputs}
    for op in graph.ops:
        if not op.host_scalar:
            read.update(t.id for t in op.input_tensors())
    return read
