"""The optimizer update's copies of its rule compiled once per distinct
text (``machine/segments.py``): training runs bit for bit as with one line
per op, fp16 with stochastic rounding too, and the update's code holds far
fewer lines than it has ops."""
import pytest
import torch
from conftest import quiet_options
from torch import nn

import poptorchsim as poptorch
from poptorchsim.machine import segments


def _model(dtype):
    torch.manual_seed(0)
    layers = []
    for _ in range(4):
        layers += [nn.Linear(16, 16), nn.LayerNorm(16), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(16, 4)).to(dtype)


class _WithLoss(nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, x, y):
        out = self.model(x)
        return out, nn.functional.cross_entropy(out.float(), y)


def _train(kind, dtype, steps=3):
    """(the trained weights and optimizer state, the compiled update's
    source, its number of ops, of parameters)."""
    model = _WithLoss(_model(dtype))
    params = list(model.parameters())
    groups = [{"params": params[::2]}, {"params": params[1::2], "weight_decay": 0.0}]
    scaling = {"loss_scaling": 64.0} if dtype == torch.half else {}
    optimizer = {"lamb": poptorch.optim.LAMB, "adamw": poptorch.optim.AdamW}[kind](
        groups, lr=1e-2, **scaling)
    opts = quiet_options()
    opts.Training.gradientAccumulation(2)
    opts.Precision.enableStochasticRounding(dtype == torch.half)
    tm = poptorch.trainingModel(model, opts, optimizer)
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x = torch.randn(8, 16, generator=g).to(dtype)
        tm(x, torch.randint(0, 4, (8,), generator=g))
    state = {k: v.clone() for k, v in tm.model.state_dict().items()}
    for i, slots in enumerate(tm._state.opt_state):           # exp_avg, exp_avg_sq
        state.update({f"state {i}/{k}": v.clone() for k, v in enumerate(slots)})
    update = tm._compiled.program.graphs["optimizer_update"]
    source = tm._engine.update_fn.source
    n_params = len(params)
    tm.destroy()
    return state, source, len(update.ops), n_params


@pytest.mark.parametrize("kind,dtype", [("lamb", torch.float), ("adamw", torch.float),
                                        ("lamb", torch.half)])
def test_shared_update_code_trains_bit_for_bit_as_one_line_per_op(monkeypatch, kind, dtype):
    shared, source, n_ops, n_params = _train(kind, dtype)
    monkeypatch.setattr(segments, "MIN_OPS", 10 ** 9)        # every copy written inline
    flat, flat_source, _, _ = _train(kind, dtype)
    assert shared.keys() == flat.keys() and len(shared) > 2 * n_params
    for name in shared:
        assert torch.equal(shared[name], flat[name]), name
    # 18 parameters: their copies share a few functions
    functions = source.count("\ndef _s")
    assert 1 <= functions < n_params / 3
    assert "def _s" not in flat_source
    assert flat_source.count("\n") > n_ops > 2 * source.count("\n")
