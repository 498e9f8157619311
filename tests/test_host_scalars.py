"""Host-side scalars are not IPU work (issue 20, item 6): the optimizer
update's float64 scalar arithmetic (bias corrections, ``lr /
bias_correction``, ``1 - dampening``, the step count) is marked
``op.host_scalar`` by ``passes/host_scalars.py``; the machine charges it no
cycles and no tile memory, getIR() shows the marking, and the engine still
runs it, so the weights equal eager torch.optim's (docs/cost_model.md,
"Host scalars")."""
import copy

import pytest
import torch
from conftest import (
    ClassifierWithLoss,
    assert_state_close,
    classification_batch,
    quiet_options,
    reference_call,
)

import poptorchsim as poptorch
from poptorchsim.passes.memory import _used_tiles
from poptorchsim.profiling import op_table

OPTIMIZERS = {
    "Adam": lambda p: torch.optim.Adam(p, lr=1e-2),
    "AdamW": lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.1),
    "LAMB": lambda p: poptorch.optim.LAMB(p, lr=1e-2),
    "SGD": lambda p: torch.optim.SGD(p, lr=1e-2, momentum=0.9, dampening=0.1),
}


def _train(make, calls=3, di=1):
    torch.manual_seed(0)
    model = ClassifierWithLoss()
    ref = copy.deepcopy(model)
    opt, ref_opt = make(model.parameters()), make(ref.parameters())
    tm = poptorch.trainingModel(model, quiet_options().deviceIterations(di), opt)
    for c in range(calls):
        batch = classification_batch(4 * di, seed=40 + c)
        tm(*batch)
        reference_call(ref, ref_opt, batch, di)
    return model, ref, tm


def _update(tm):
    compiled = tm._compiled
    graph = tm.getIR().graphs["optimizer_update"]
    return compiled, graph, compiled.costs["optimizer_update"]


def _float64(op):
    return any(t is not None and t.dtype == torch.float64
               for t in list(op.outputs) + list(op.input_tensors()))


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_float64_scalars_are_host_work_and_the_weights_equal_eager(name):
    model, ref, tm = _train(OPTIMIZERS[name])
    # the engine ran the host scalars: three steps equal torch.optim's
    assert_state_close(model, ref)
    compiled, graph, costs = _update(tm)
    tiles = compiled.target.tiles
    f64 = [(op, c) for op, c in zip(graph.ops, costs) if _float64(op)]
    assert f64, "the update holds float64 scalar arithmetic"
    for op, cost in f64:
        assert op.host_scalar, op.name
        assert cost.total == 0 and cost.flops == 0, op.name
        assert not _used_tiles(op, tiles).any(), op.name
        for t in op.outputs:
            if t.dtype == torch.float64:        # never on the tiles
                assert t.mapping.bytes_per_tile(tiles).sum() == 0, t.name
    # nor among the update's live buffers
    _, _, buffers = compiled.memory.graphs["optimizer_update"]
    assert not [t for t in buffers if t.dtype == torch.float64
                and t.mapping.bytes_per_tile(tiles).any()]
    # a tensor-sized float32 op of the update is still IPU work, charged
    tensor_ops = [(op, c) for op, c in zip(graph.ops, costs)
                  if op.cost_class == "elementwise" and op.outputs[0] is not None
                  and op.outputs[0].numel > 1 and op.outputs[0].dtype == torch.float32]
    assert tensor_ops
    for op, cost in tensor_ops:
        assert not op.host_scalar, op.name
        assert cost.compute > 0 and cost.sync > 0, op.name
        assert _used_tiles(op, tiles).any(), op.name
    assert sum(c.total for c in costs) > 0


@pytest.mark.parametrize("name", ["Adam", "LAMB"])
def test_the_marking_leaves_the_numerics_bit_for_bit(name, monkeypatch):
    """The engine runs what the IR holds, marked or not: the same three
    steps without the pass give the very same weights."""
    marked, _, _ = _train(OPTIMIZERS[name])
    from poptorchsim.passes import update
    monkeypatch.setattr(update, "mark_host_scalars", lambda graph, counters=(): graph)
    plain, _, tm = _train(OPTIMIZERS[name])
    assert not any(op.host_scalar for op in tm.getIR().graphs["optimizer_update"].ops)
    for (n, p), q in zip(marked.named_parameters(), plain.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=0, msg=n)


def test_getir_prints_the_marking_and_the_op_table_names_it():
    _, _, tm = _train(OPTIMIZERS["Adam"], calls=1)
    text = str(tm.getIR())
    bias_corrections = [line for line in text.splitlines() if "aten.pow.Tensor_Tensor" in line]
    assert bias_corrections and all("# elementwise, host scalar;" in line
                                    for line in bias_corrections)
    # the update's tensor work is printed as before
    assert any("# elementwise;" in line and "f32[8,6]" in line.split("=")[0]
               for line in text.splitlines())
    rows = [line for line in op_table(tm.simulationReport()).splitlines()
            if "host scalar" in line]
    assert any("aten.pow.Tensor_Tensor" in r and "float64" in r for r in rows)
    assert all(r.split()[-2] == "0" for r in rows)       # no cycles per call


def test_the_host_scalars_leave_the_update_cheaper_and_the_step_unchanged():
    """Turning the marking off (every op IPU work again) only adds to the
    update's cycles; the training step's costs do not move."""
    _, _, tm = _train(OPTIMIZERS["Adam"], calls=1)
    compiled, graph, costs = _update(tm)
    from poptorchsim.estimate.cost import op_cost
    marked = [op for op in graph.ops if op.host_scalar]
    try:
        for op in marked:
            op.host_scalar = False
        charged = [op_cost(op, compiled.target) for op in marked]
    finally:
        for op in marked:
            op.host_scalar = True
    assert len(marked) >= 12 and all(c.total > 0 for c in charged)
    assert all(c.total == 0 for op, c in zip(graph.ops, costs) if op.host_scalar)
    step = compiled.program.graphs["training_step"]
    assert not any(op.host_scalar for op in step.ops)
