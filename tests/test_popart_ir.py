"""``_debugGetPopartIR()`` (the program as PopART's serialised IR, JSON) and
PopTorch's debug log of the lowering, both written from poptorchsim's IR."""
import json
import logging

import pytest
import torch
from conftest import poptorchsim_log, quiet_options
from torch import nn

import poptorchsim


def _ops(model, of_type=None):
    ops = json.loads(model._debugGetPopartIR())["maingraph"]
    return [op for op in ops if of_type is None or op["type"] == of_type]


class Convs(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Conv2d(1, 2, 3), nn.Conv2d(1, 2, 3)

    def forward(self, x):
        with poptorchsim.MultiConv():
            y = self.a(x)
            z = self.b(torch.abs(x))
        return torch.relu(y + z)


def test_the_model_graph_with_popart_types_and_one_multiconv_per_group():
    m = poptorchsim.inferenceModel(Convs(), quiet_options())
    m(torch.randn(2, 1, 8, 8))
    types = [op["type"] for op in _ops(m)]
    assert types.count("MultiConv") == 1 and "Conv" not in types
    assert {"Abs", "Add", "Relu"} <= set(types)
    multi = _ops(m, "MultiConv")[0]
    assert len(multi["outputs"]) == 2 and multi["outputs"][0]["shape"] == ["2", "2", "6", "6"]


class Scatters(nn.Module):
    def forward(self, inp, index, src):
        return torch.cat([inp.scatter_reduce(0, index, s, reduce="amax") for s in src], dim=1)


def test_each_scatter_is_a_scatter_reduce_with_its_reduction():
    m = poptorchsim.inferenceModel(Scatters(), quiet_options())
    src = [torch.randn(8, 4) for _ in range(3)]
    m(torch.randn(4, 4), torch.randint(0, 4, (8, 4)), src)
    scatters = _ops(m, "ScatterReduce")
    assert len(scatters) == 3
    assert all(op["attributes"]["reduction"] == "amax" for op in scatters)


class Linear2(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 2)

    def forward(self, x, y):
        out = self.fc(x)
        return out, nn.functional.mse_loss(out, y)


def test_training_adds_each_weights_optimizer_ops():
    for optimizer, expected in ((lambda p: torch.optim.SGD(p, lr=0.1), {"SGD0VarUpdate": 2}),
                                (lambda p: torch.optim.AdamW(p, lr=0.1),
                                 {"AdamUpdater": 2, "AdamVarUpdate": 2})):
        model = Linear2()
        m = poptorchsim.trainingModel(model, quiet_options(), optimizer(model.parameters()))
        m(torch.randn(3, 4), torch.randn(3, 2))
        types = [op["type"] for op in _ops(m)]
        assert {t: types.count(t) for t in expected} == expected
        assert "MatMul" in types
        assert not {"SGD0VarUpdate", "AdamVarUpdate"} - set(expected) & set(types)


class TwoStages(nn.Module):
    def forward(self, x):
        with poptorchsim.Block(ipu_id=0):
            x = x * 4
        with poptorchsim.Block(ipu_id=1):
            x = x * 2
        return x


def test_the_lowering_log_says_where_each_op_runs():
    with poptorchsim_log() as records:
        poptorchsim.inferenceModel(TwoStages(), quiet_options().deviceIterations(2)).compile(
            torch.randn(2, 5))
    with poptorchsim_log(logging.INFO) as quiet:
        poptorchsim.inferenceModel(TwoStages(), quiet_options().deviceIterations(2)).compile(
            torch.randn(2, 5))
    assert not any("lowered to PopART" in line for line in quiet.messages)
    lines = records.messages
    assert lines.count("Graph lowered to PopART {") == 1       # at debug level only
    assert "enablePipelining set to value 1" in lines
    assert any(" Mul:0 " in line and " mode(Pipelined), ipu(0), stage(0)" in line
               for line in lines)
    assert any(" Mul:0/1 " in line and " mode(Pipelined), ipu(1), stage(1)" in line
               for line in lines)


@pytest.mark.parametrize("default_block_ops", [False, True])
def test_auto_increment_stages_are_logged_as_popTorch_numbers_them(default_block_ops):
    """AutoStage.AutoIncrement numbers blocks in the order they are entered,
    PopTorch's default block 0: with no op before the first block, the log
    says stage(1) for it (the program's stage 0), else stage(0) and on."""
    class Net(nn.Module):
        def forward(self, x):
            if default_block_ops:
                x = x + 1
            with poptorchsim.Block(ipu_id=0):
                x = x * 2
            with poptorchsim.Block(ipu_id=1):
                return x * 3

    opts = quiet_options().deviceIterations(4)
    opts.setExecutionStrategy(poptorchsim.PipelinedExecution(
        poptorchsim.AutoStage.AutoIncrement))
    with poptorchsim_log() as records:
        poptorchsim.inferenceModel(Net(), opts).compile(torch.randn(4, 5))
    lines = [line for line in records.messages if " Mul:" in line]
    first = 0 if default_block_ops else 1
    assert " mode(Pipelined), ipu(0), stage(%d)" % first in lines[0]
    assert " mode(Pipelined), ipu(1), stage(%d)" % (first + 1) in lines[1]


class ThreeBlocks(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(8, 7), nn.Linear(7, 6), nn.Linear(6, 5)

    def forward(self, x):
        with poptorchsim.Block("A"):
            x = self.a(x)
        with poptorchsim.Block("B"):
            x = self.b(x)
        with poptorchsim.Block("C"):
            return self.c(x)


def test_the_lowering_log_of_serial_phases_numbers_them_as_popart():
    """Activations off chip after each phase: PopART's phase of the user's
    phase p is 4p, and 3 more phases separate the backward pass."""
    strategy = poptorchsim.SerialPhasedExecution("A", "B", "C")
    for name in "ABC":
        strategy.stage(name).ipu(0)
    strategy.setTensorsLiveness(poptorchsim.Liveness.OffChipAfterEachPhase)
    opts = quiet_options().setExecutionStrategy(strategy)
    with poptorchsim_log() as records:
        poptorchsim.inferenceModel(ThreeBlocks(), opts).compile(torch.randn(2, 8))
    lines = records.messages
    assert "executionPhaseSettings.phases set to value 12" in lines
    assert "executionPhaseSettings.stages set to value 1" in lines
    assert "location_weight set to value useOnChipStorage(False)" in lines
    assert any("mode(Phased), ipu(0), phase(8)" in line for line in lines)
