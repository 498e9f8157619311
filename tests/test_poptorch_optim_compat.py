"""PopTorch's optimizer state_dict behaviour (its optimizers_test.py through
the alias): ipu_param under PopART's names, the loaded state returned as
given until it is sent, no state for an offline target."""
import logging

import pytest
import torch

import poptorchsim as poptorch


class _Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(3, 3)

    def forward(self, x):
        out = self.lin(x)
        return out, poptorch.identity_loss(out.pow(2).sum(), reduction="sum")


def _trained(opt_cls, opts=None, **kwargs):
    torch.manual_seed(0)
    model = _Model()
    optimizer = opt_cls(model.parameters(), **kwargs)
    training = poptorch.trainingModel(model, opts or poptorch.Options(), optimizer=optimizer)
    return model, optimizer, training


@pytest.mark.parametrize("opt_cls", [poptorch.optim.Adam, poptorch.optim.AdamW,
                                     poptorch.optim.RMSprop, poptorch.optim.LAMB])
def test_ipu_param_popart_names(opt_cls):
    _, optimizer, training = _trained(opt_cls, lr=0.05, weight_decay=0.025, loss_scaling=0.75)
    training.compile(torch.randn(2, 3))
    param = optimizer.state_dict()["ipu_param"]
    for w in ("lin.weight", "lin.bias"):
        assert param[f"learningRate___specific___{w}"].item() == pytest.approx(0.05)
        assert param[f"weightDecay___specific___{w}"].item() == pytest.approx(0.025)
    assert param["lossScaling_FLOAT"].item() == pytest.approx(0.75)
    # eps and betas were not passed: constant, compiled in, no tensor
    assert not any(k.startswith(("adamEps", "adaptiveEps", "adamBeta")) for k in param)


def test_ipu_param_sgd_compound_scalars():
    lr, wd, ls = 0.05, 0.025, 0.75
    _, optimizer, training = _trained(poptorch.optim.SGD, lr=lr, weight_decay=wd,
                                      loss_scaling=ls)
    training.compile(torch.randn(2, 3))
    param = optimizer.state_dict()["ipu_param"]
    # PopART's SGD0: lr (1 - dm) / ls and 1 - lr (1 - dm) wd
    assert param["scaledLearningRate0___specific___lin.bias"].item() == pytest.approx(lr / ls)
    assert param["weightDecayScaleFactor0___specific___lin.weight"].item() == \
        pytest.approx(1 - lr * wd)
    assert param["lossScaling_FLOAT"].item() == pytest.approx(ls)


def test_state_dict_after_load_is_the_loaded_one():
    _, optimizer, training = _trained(poptorch.optim.Adam, lr=0.01)
    x = torch.randn(2, 3)
    training(x)
    s0 = optimizer.state_dict()
    key = "Accl1___lin.weight"
    s0["ipu_state"][key] = torch.full_like(s0["ipu_state"][key], 3.0)
    del s0["ipu_state"]["Accl2___lin.bias"]
    optimizer.load_state_dict(s0)
    s1 = optimizer.state_dict()     # not sent yet: as given
    assert torch.equal(s1["ipu_state"][key], s0["ipu_state"][key])
    assert "Accl2___lin.bias" not in s1["ipu_state"]
    training(x)                     # sent, then the device moves on
    s2 = optimizer.state_dict()
    assert "Accl2___lin.bias" in s2["ipu_state"]
    assert not torch.equal(s2["ipu_state"][key], s0["ipu_state"][key])


def test_offline_target_has_no_state():
    opts = poptorch.Options()
    opts.useOfflineIpuTarget()
    _, optimizer, training = _trained(poptorch.optim.SGD, opts, lr=0.0)
    training.compile(torch.ones(2, 3))
    state = optimizer.state_dict()
    assert state["ipu_state"] is None and state["ipu_param"] is None


@pytest.mark.parametrize("subclassed", [True, False])
@pytest.mark.parametrize("base", [poptorch.optim.SGD, torch.optim.AdamW])
def test_subclassed_optimizer_warning(subclassed, base):
    cls = type("MyOpt", (base,), {}) if subclassed else base
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    log = logging.getLogger("poptorchsim")
    log.addHandler(handler)
    try:
        _, _, training = _trained(cls, lr=0.01)
        training.compile(torch.randn(2, 3))
    finally:
        log.removeHandler(handler)
    warned = any("Poptorch does not run Python optimizer code directly" in r.getMessage()
                 for r in records)
    assert warned == subclassed
