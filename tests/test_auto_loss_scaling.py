"""Automatic loss scaling (``Options.Training.setAutomaticLossScaling``) and
the fp16 gradient counts of ``precisionReport()``.

The rule is PopART's: histograms of the fp16 gradients of the backward
matmuls and convolutions, one bin edge at 65504 / 16; the scale halves when
more than 1e-7 of the values lie above the edge and doubles otherwise,
clipped at 2**15 for fp16 weights.
"""
import copy
import logging

import pytest
import torch
from conftest import LogRecords, quiet_options
from torch import nn

import poptorchsim as poptorch


class Net(nn.Module):
    """Two linear layers; the loss is the mean square error times ``gain``
    (a small gain makes fp16 gradients underflow, a large one overflow),
    marked with ``identity_loss`` so the backward pass starts after the gain."""

    def __init__(self, gain=1.0):
        super().__init__()
        self.fc1 = nn.Linear(16, 32)
        self.fc2 = nn.Linear(32, 4)
        self.gain = gain

    def forward(self, x, y):
        out = self.fc2(torch.relu(self.fc1(x)))
        loss = nn.functional.mse_loss(out.float(), y) * self.gain
        return out, poptorch.identity_loss(loss, reduction="none")


def _data(n=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 16, generator=g).half(), torch.randn(n, 4, generator=g)


def _model(gain=1.0, seed=0):
    torch.manual_seed(seed)
    return Net(gain).half()


def _als_options():
    opts = quiet_options()
    opts.Training.setAutomaticLossScaling(True)
    return opts


@pytest.mark.parametrize("optim", [poptorch.optim.SGD, poptorch.optim.Adam,
                                   poptorch.optim.AdamW, poptorch.optim.RMSprop,
                                   poptorch.optim.LAMB])
@pytest.mark.parametrize("initial_ls", [1.0, 2.0])
def test_scale_doubles_while_gradients_are_small(optim, initial_ls):
    """PopTorch's own check: the anchored ``finalLossScale`` of a call is the
    optimizer's loss_scaling times the update factor read from
    ``state_dict()['ipu_state']`` before the call; small gradients double it."""
    model = _model()
    opts = _als_options()
    opts.anchorTensor("ls_final", "finalLossScale", poptorch.OutputMode.Final)
    kwargs = {"lr": 0.0, "loss_scaling": initial_ls}
    if optim is poptorch.optim.SGD:
        kwargs["use_combined_accum"] = False
    optimizer = optim(model.parameters(), **kwargs)
    tm = poptorch.trainingModel(model, opts, optimizer)
    x, y = _data()
    tm.compile(x, y)
    factors = []
    for _ in range(5):
        factor = optimizer.state_dict()["ipu_state"]["lossScaleUpdateFactor"]
        tm(x, y)
        factors.append(float(factor))
        torch.testing.assert_close(tm.getAnchoredTensor("ls_final").float().reshape(()),
                                   torch.tensor(initial_ls * float(factor)))
    assert factors == [1.0, 2.0, 4.0, 8.0, 16.0]


def test_scale_halves_when_gradients_reach_the_bin_edge():
    # the same micro-batch at every step: gradients of a few units scaled by
    # 2**14 lie above the edge (4094) but stay finite; the scale halves
    # until they fall below it, then oscillates between the last two values
    model = _model(gain=16.0)
    optimizer = poptorch.optim.SGD(model.parameters(), lr=0.0, loss_scaling=2.0 ** 14)
    tm = poptorch.trainingModel(model, _als_options(), optimizer)
    x, y = _data()
    scales = []
    for _ in range(10):
        tm(x, y)
        scales.append(tm.precisionReport()["loss_scale"])
    assert scales[0] == 2.0 ** 13
    low = min(scales)
    assert low < 2.0 ** 13
    assert set(scales[scales.index(low):]) == {low, 2 * low}


def test_scale_clipped_at_two_to_the_fifteen_with_fp16_weights():
    model = _model(gain=2.0 ** -10)     # gradients stay below the bin edge at 2**15
    optimizer = poptorch.optim.SGD(model.parameters(), lr=0.0, loss_scaling=1024.0)
    opts = _als_options().deviceIterations(8)
    tm = poptorch.trainingModel(model, opts, optimizer)
    x, y = _data(64)
    tm(x, y)
    report = tm.precisionReport()["automatic_loss_scaling"]
    assert report["history"] == [2048.0, 4096.0, 8192.0, 16384.0, 32768.0, 32768.0,
                                 32768.0, 32768.0]
    assert report["update_factor"] == 32.0


def test_update_period_and_bin_edge_from_popart_options():
    model = _model()
    optimizer = poptorch.optim.SGD(model.parameters(), lr=0.0)
    opts = _als_options().deviceIterations(6)
    opts._Popart.set("automaticLossScalingSettings.updatePeriod", 3)
    tm = poptorch.trainingModel(model, opts, optimizer)
    x, y = _data(48)
    tm(x, y)
    assert tm.precisionReport()["automatic_loss_scaling"]["history"] == [1, 1, 2, 2, 2, 4]

    # an edge at the bottom of the range: every value is above it, the scale halves
    model = _model()
    opts = _als_options().deviceIterations(2)
    opts._Popart.set("automaticLossScalingSettings.binEdgeLocation", 0.0)
    tm = poptorch.trainingModel(model, opts, poptorch.optim.SGD(model.parameters(), lr=0.0))
    tm(*_data(16))
    assert tm.precisionReport()["automatic_loss_scaling"]["history"] == [0.5, 0.25]


def _train(model, opts, optimizer, steps, x, y):
    tm = poptorch.trainingModel(model, opts, optimizer)
    for _ in range(steps):
        tm(x, y)
    return tm


def test_automatic_scaling_rescues_underflowing_gradients():
    """With a loss scaled down by 2**-20 the fp16 gradients underflow: at a
    loss scaling of 1 the weights never move; automatic loss scaling raises
    the scale until they train close to fp32 (the learning rate compensates
    the gain)."""
    gain, lr, steps = 2.0 ** -20, 0.05 * 2.0 ** 20, 16
    x, y = _data(32)

    reference = _model(gain).float()
    torch_opt = torch.optim.SGD(reference.parameters(), lr=lr)
    for _ in range(steps):
        torch_opt.zero_grad()
        reference(x.float(), y)[1].backward()
        torch_opt.step()

    plain = _model(gain)
    start = copy.deepcopy(plain.state_dict())
    tm = _train(plain, quiet_options(), poptorch.optim.SGD(plain.parameters(), lr=lr),
                steps, x, y)
    lost = tm.precisionReport()["gradients"]
    assert lost["underflowed"] > 0.1 * lost["values"]
    assert {row["op"] for row in lost["ops"]} >= {"mm", "_to_copy_1"}   # where they were lost
    moved_plain = (plain.fc1.weight.float() - start["fc1.weight"].float()).abs().max()

    auto = _model(gain)
    tm = _train(auto, _als_options(), poptorch.optim.SGD(auto.parameters(), lr=lr), steps, x, y)
    report = tm.precisionReport()
    assert report["loss_scale"] == 2.0 ** 15
    assert report["gradients"]["underflowed"] == 0
    err_auto = (auto.fc1.weight.float() - reference.fc1.weight).abs().max()
    err_plain = (plain.fc1.weight.float() - reference.fc1.weight).abs().max()
    assert moved_plain < 1e-3
    assert err_auto < 0.25 * err_plain


def test_underflow_and_overflow_counted_and_warned():
    x, y = _data()
    model = _model(2.0 ** -20)
    tm = poptorch.trainingModel(model, quiet_options(),
                                poptorch.optim.SGD(model.parameters(), lr=0.0))
    records = LogRecords()
    logging.getLogger("poptorchsim").addHandler(records)
    try:
        tm(x, y)
        tm(x, y)
    finally:
        logging.getLogger("poptorchsim").removeHandler(records)
    grads = tm.precisionReport()["gradients"]
    assert grads["underflowed"] > 0 and grads["overflowed"] == 0
    assert grads["ops"] and grads["ops"][0]["underflowed"] > 0
    assert sum("underflowed to zero" in m for m in records.messages) == 1   # warned once
    assert "loss_scaling" in records.text

    model = _model(1.0)
    tm = poptorch.trainingModel(model, quiet_options(), poptorch.optim.SGD(
        model.parameters(), lr=0.0, loss_scaling=2.0 ** 15))
    tm(x, y * 1000)
    grads = tm.precisionReport()["gradients"]
    assert grads["overflowed"] > 0 and grads["nonfinite"] >= grads["overflowed"]

    # scaled up, the same small gradients survive
    model = _model(2.0 ** -20)
    tm = poptorch.trainingModel(model, quiet_options(), poptorch.optim.SGD(
        model.parameters(), lr=0.0, loss_scaling=2.0 ** 14))
    tm(x, y)
    grads = tm.precisionReport()["gradients"]
    assert grads["underflowed"] < 0.01 * grads["values"]


def test_replicas_and_accumulation_update_the_scale_once_per_weight_update():
    model = _model()
    opts = _als_options().replicationFactor(2).deviceIterations(2)
    opts.Training.gradientAccumulation(2)
    tm = poptorch.trainingModel(model, opts, poptorch.optim.SGD(model.parameters(), lr=0.0))
    tm(*_data(16))
    assert tm.precisionReport()["automatic_loss_scaling"]["history"] == [2.0, 4.0]


def test_factor_round_trips_through_state_dict():
    model = _model()
    optimizer = poptorch.optim.SGD(model.parameters(), lr=0.0)
    tm = poptorch.trainingModel(model, _als_options(), optimizer)
    x, y = _data()
    for _ in range(3):
        tm(x, y)
    saved = optimizer.state_dict()
    assert float(saved["ipu_state"]["lossScaleUpdateFactor"]) == 8.0
    tm(x, y)
    optimizer.load_state_dict(saved)
    tm(x, y)          # ran with the loaded factor 8, so now 16
    assert tm.precisionReport()["automatic_loss_scaling"]["update_factor"] == 16.0


def test_histograms_are_ops_of_the_program_with_a_cost():
    x, y = _data()
    plain = _model()
    tm_plain = poptorch.trainingModel(plain, quiet_options(),
                                      poptorch.optim.SGD(plain.parameters(), lr=0.0,
                                                         loss_scaling=2.0))
    tm_plain.compile(x, y)
    counts = {}
    for method in (0, 1):
        auto = _model()
        opts = _als_options()
        opts._Popart.set("automaticLossScalingSettings.gradientTensorTrackingMethod", method)
        tm = poptorch.trainingModel(auto, opts, poptorch.optim.SGD(auto.parameters(), lr=0.0,
                                                                    loss_scaling=2.0))
        tm.compile(x, y)
        ir = str(tm.getIR())
        counts[method] = ir.count("gradient_histogram.default")
        assert "loss_scale_update" in ir and "finalLossScale" in ir
        assert tm.cycleEstimate()["total"] > tm_plain.cycleEstimate()["total"]
    assert counts[0] == 3                     # the 3 backward matmuls
    assert counts[1] > counts[0]              # the default: every non-view fp16 gradient
    assert "gradient_histogram" not in str(tm_plain.getIR())


def test_errors():
    x, y = _data()
    model = _model().float()
    tm = poptorch.trainingModel(model, _als_options(),
                                poptorch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(poptorch.Error, match="No tracked gradient tensors of type fp16"):
        tm(x.float(), y)

    opts = _als_options()
    opts._Popart.set("automaticLossScalingSettings.binEdgeLocation", 1.5)
    model = _model()
    tm = poptorch.trainingModel(model, opts, poptorch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(poptorch.Error, match="Out of range value for 'binEdgeLocation'"):
        tm(x, y)

    opts = _als_options()
    opts._Popart.set("automaticLossScalingSettings.thresholdUpperCountProportion", -1.0)
    model = _model()
    tm = poptorch.trainingModel(model, opts, poptorch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(poptorch.Error, match="thresholdUpperCountProportion"):
        tm(x, y)


def test_fp32_training_unchanged_and_unwatched():
    x, y = _data()
    model = _model().float()
    ref = copy.deepcopy(model)
    tm = poptorch.trainingModel(model, quiet_options(),
                                poptorch.optim.SGD(model.parameters(), lr=0.1))
    tm(x.float(), y)
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    ref(x.float(), y)[1].backward()
    opt.step()
    torch.testing.assert_close(model.fc1.weight, ref.fc1.weight, rtol=1e-5, atol=1e-6)
    report = tm.precisionReport()
    assert report["gradients"] is None and report["automatic_loss_scaling"] is None


def test_momentum_is_unaffected_by_the_changing_scale():
    """SGD keeps its velocity multiplied by the optimizer's loss scaling;
    automatic loss scaling's factor changes only how the gradients are
    scaled, so without underflow it trains as a fixed scale does."""
    x, y = _data()
    results = []
    for opts in (_als_options(), quiet_options()):
        model = _model()
        optimizer = poptorch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9,
                                       loss_scaling=4.0)
        tm = poptorch.trainingModel(model, opts, optimizer)
        for _ in range(5):
            tm(x, y)
        tm.copyWeightsToHost()
        optimizer.state_dict()
        results.append((model.fc1.weight.clone(),
                        optimizer.state[model.fc1.weight]["momentum_buffer"].float().clone(),
                        tm.precisionReport()["loss_scale"]))
    (w_auto, v_auto, scale_auto), (w_fixed, v_fixed, scale_fixed) = results
    assert scale_auto == 128.0 and scale_fixed == 4.0
    torch.testing.assert_close(w_auto, w_fixed)
    torch.testing.assert_close(v_auto, v_fixed)


def test_each_step_of_a_call_uses_the_scale_the_previous_update_chose():
    """With several weight updates per call (deviceIterations), each step
    scales its loss by the scale the previous update chose."""
    model = _model()
    opts = _als_options().deviceIterations(4)
    opts.anchorTensor("scale", "finalLossScale", poptorch.OutputMode.All)
    tm = poptorch.trainingModel(model, opts, poptorch.optim.SGD(model.parameters(), lr=0.0))
    tm(*_data(32))
    used = tm.getAnchoredTensor("scale").float().flatten().tolist()
    assert used == [1.0, 2.0, 4.0, 8.0]
    assert tm.precisionReport()["automatic_loss_scaling"]["history"] == [2.0, 4.0, 8.0, 16.0]
