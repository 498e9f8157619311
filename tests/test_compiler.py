"""The compiler's layers on their own: IR, verifier, tile mapping, memory, cycles."""
import pytest
import torch
import torch.nn as nn

import poptorchsim as poptorch
from poptorchsim.estimate.targets import MK2, TEST_IPU
from poptorchsim.ir.graph import Graph, Op
from poptorchsim.ir.verify import verify_graph
from poptorchsim.passes.tile_mapping import TileMapping


class MLP(nn.Module):
    def __init__(self, width=64):
        super().__init__()
        self.fc1 = nn.Linear(32, width)
        self.fc2 = nn.Linear(width, 4)
        self.loss = nn.CrossEntropyLoss()

    def forward(self, x, y):
        out = self.fc2(torch.relu(self.fc1(x)))
        return out, self.loss(out, y)


def _compiled(width=64, batch=8):
    torch.manual_seed(0)
    model = MLP(width)
    opts = poptorch.Options().showCompilationProgressBar(False)
    tm = poptorch.trainingModel(model, opts, torch.optim.SGD(model.parameters(), lr=0.1))
    tm.compile(torch.randn(batch, 32), torch.randint(0, 4, (batch,)))
    return tm


def test_ir_prints_program_graphs_and_aten_ops():
    text = str(_compiled().getIR())
    assert "program training" in text
    assert "repeat 1 (device_iteration)" in text
    assert "graph training_step(" in text and "graph optimizer_update(" in text
    assert "aten.addmm.default" in text and "# matmul" in text
    assert "%fc1.weight: f32[64,32]  # param" in text


def test_verifier_rejects_use_before_definition():
    g = Graph("bad")
    a = g.new_tensor("a", (2,), torch.float32, "activation")
    op = Op(0, "relu", torch.ops.aten.relu.default, (a,), {}, [], "elementwise")
    out = g.new_tensor("b", (2,), torch.float32, producer=op)
    op.outputs.append(out)
    g.ops.append(op)
    g.outputs = [out]
    with pytest.raises(poptorch.Error, match="reads %a before it is defined"):
        verify_graph(g)


@pytest.mark.parametrize("nbytes", [1, 63, 64, 4096, 638_977, 10_000_019])
def test_tile_mapping_bytes_add_up(nbytes):
    for target in (MK2, TEST_IPU):
        n_grains = -(-nbytes // 64)
        m = TileMapping(start=target.tiles - 3, n_tiles=min(target.tiles, n_grains),
                        nbytes=nbytes, grain=64)
        per_tile = m.bytes_per_tile(target.tiles)
        assert per_tile.shape == (target.tiles,)
        assert per_tile.sum() == nbytes
        assert per_tile.min() >= 0 and per_tile.max() == m.max_bytes()


def test_memory_report_counts_every_variable():
    tm = _compiled()
    mem = tm.memoryReport()
    params = sum(p.numel() * 4 for p in tm.model.parameters())
    weights = sum(v.sum() for k, v in mem.by_tensor.items() if k.startswith("fc"))
    assert weights == params
    assert mem.total.shape == (1472,)
    assert (mem.total <= mem.capacity).all()
    assert (mem.always_live >= MK2.code_bytes_per_tile).all()


def test_cycles_grow_with_work():
    # once a matmul fills every tile, 4x its output is about 4x its compute
    small = _compiled(width=2048, batch=256).cycleEstimate()
    big = _compiled(width=8192, batch=256).cycleEstimate()
    assert big["compute"] > 2 * small["compute"]
    assert big["total"] > small["total"] > 0
    assert set(small) >= {"compute", "exchange", "sync", "host", "total", "seconds"}


def test_compiles_quickly_and_reports_time():
    model = MLP()
    tm = poptorch.trainingModel(model, poptorch.Options(),
                                torch.optim.SGD(model.parameters(), lr=0.1))
    tm.compile(torch.randn(8, 32), torch.randint(0, 4, (8,)))
    assert 0 < tm.compilationTime().total_seconds() < 10
