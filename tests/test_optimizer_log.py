"""PopTorch's debug lines for the optimizer given to the device ("Updating
graph optimizer with ...", one line per group) and its info lines for the
optimizer state's transfers: the values, PopART's names, which are
constant, the state's types."""
import logging

import pytest
import torch
from conftest import LogRecords, quiet_options
from torch import nn

import poptorchsim as poptorch


class _Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 2)
        self.loss = nn.MSELoss()

    def forward(self, x, y):
        out = self.b(self.a(x))
        return out, self.loss(out, y)


@pytest.fixture
def records():
    log, rec = logging.getLogger("poptorchsim"), LogRecords()
    level = log.level
    log.setLevel(logging.DEBUG)
    log.addHandler(rec)
    yield rec
    log.removeHandler(rec)
    log.setLevel(level)


def _lines(rec, what):
    return [m for m in rec.messages if what in m]


def _data():
    return torch.ones(2, 4), torch.zeros(2, 2)


def test_the_compiled_optimizer_is_logged_with_popart_names(records):
    model = _Model()
    groups = [{"params": model.a.parameters()}, {"params": model.b.parameters(), "lr": 0.5}]
    opt = poptorch.optim.AdamW(groups, lr=0.01, weight_decay=0.0,
                               first_order_momentum_accum_type=torch.float16)
    tm = poptorch.trainingModel(model, quiet_options(), opt)
    tm(*_data())
    graph = _lines(records, "Updating graph optimizer with ADAMW")
    assert len(graph) == 1
    line = graph[0]
    # passed to the constructor: variable; left at their defaults: constant
    assert "defaultLearningRate=0.01," in line and "defaultWeightDecay=0," in line
    assert "defaultEps=1e-08 (const)" in line and "lossScaling=1 (const)" in line
    assert "accumType=float32, firstOrderMomentumAccumType=float16" in line
    assert line.endswith("useTfVariant=0, maxGradNorm=inf")
    # PopART's parameters in name order
    names = [p.split("=")[0] for p in line.split(", ")[1:7]]
    assert names == sorted(names)
    group0, group1 = (_lines(records, f"Updating group {g} optimizer with ADAMW")
                      for g in (0, 1))
    assert "learningRate=0.01," in group0[0] and "a.weight" in group0[0]
    assert "learningRate=0.5," in group1[0] and "b.bias" in group1[0]
    assert "defaultLearningRate" not in group0[0] and "lossScaling" not in group0[0]

    # a new value logs again; the same values do not
    opt.param_groups[1]["lr"] = 0.25
    tm.setOptimizer(opt)
    assert "learningRate=0.25," in _lines(records, "Updating group 1 optimizer")[-1]
    before = len(records.messages)
    tm.setOptimizer(opt)
    assert not [m for m in records.messages[before:] if "optimizer with" in m]


def test_sgd_separate_variant_logs_the_loss_scaling_as_velocity_scaling(records):
    model = _Model()
    tm = poptorch.trainingModel(model, quiet_options(),
                                torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    tm(*_data())
    line = _lines(records, "Updating graph optimizer with SGD2")[0]
    # torch.optim: lr is never constant, an attribute at its default is
    assert "defaultLearningRate=0.1," in line and "defaultMomentum=0.9," in line
    assert "defaultDampening=0 (const)" in line and "nesterov=0 (const)" in line
    assert "defaultVelocityScaling=1 (const)" in line and "lossScaling=1 (const)" in line


def test_the_optimizer_state_transfers_are_logged(records):
    model = _Model()
    opt = poptorch.optim.Adam(model.parameters(), lr=0.01)
    tm = poptorch.trainingModel(model, quiet_options(), opt)
    tm(*_data())
    state = opt.state_dict()
    assert _lines(records, "Writing optimiser state tensors from IPU to host.")
    opt.load_state_dict(state)
    tm(*_data())
    assert _lines(records, "Writing optimiser state tensors from host to IPU memory.")


def test_the_state_dict_is_read_again_only_after_the_device_changed_it(records):
    """PopTorch's cache: a second ``state_dict()`` with nothing run in
    between reads nothing; a call, or new hyperparameters, read again."""
    model = _Model()
    opt = poptorch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    tm = poptorch.trainingModel(model, quiet_options(), opt)
    tm(*_data())
    reads = lambda: len(_lines(records, "from IPU to host"))   # noqa: E731 - a one-line helper
    first = opt.state_dict()
    assert reads() == 1
    second = opt.state_dict()
    assert reads() == 1 and _lines(records, "Using cached optimiser state dict")
    assert all(torch.equal(first["ipu_state"][k], v) for k, v in second["ipu_state"].items())
    tm(*_data())
    third = opt.state_dict()
    assert reads() == 2
    assert any(not torch.equal(first["ipu_state"][k], v) for k, v in third["ipu_state"].items())
    opt.param_groups[0]["lr"] = 0.05
    tm.setOptimizer(opt)
    fourth = opt.state_dict()
    assert reads() == 3 and any(not torch.equal(third["ipu_param"][k], v)
                                for k, v in fourth["ipu_param"].items())
