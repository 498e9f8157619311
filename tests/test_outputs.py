"""Output shapes and values for every OutputMode (poptorch-api.md §4).

b_dim = rf * di * ga          (All)
      = rf * di * ga / N      (EveryN(N))
      = rf                    (Final, Sum)
if b_dim > 1: a scalar becomes [b_dim], otherwise shape[0] *= b_dim.
"""
import copy

import pytest
import torch
from conftest import RegressorWithLoss, quiet_options, reference_call, to_layout
from torch import nn

import poptorchsim

OutputMode = poptorchsim.OutputMode


def close(a, b):
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------------------
# Inference: input [10, 1, 5, 6], deviceIterations(10), Linear(6, 20)
# ---------------------------------------------------------------------------
@pytest.fixture
def linear_inference():
    model = nn.Linear(6, 20)
    x = torch.randn(10, 1, 5, 6)
    with torch.no_grad():
        expected = model(x)          # [10, 1, 5, 20]; row i = device iteration i
    return model, x, expected


def run_inference(model, x, mode, period=None, di=10):
    opts = quiet_options().deviceIterations(di)
    if mode is not None:
        opts.outputMode(mode, period)
    return poptorchsim.inferenceModel(model, opts)(x)


@pytest.mark.parametrize("mode", [None, OutputMode.Default, OutputMode.All])
def test_inference_all(linear_inference, mode):
    model, x, expected = linear_inference
    out = run_inference(model, x, mode)
    assert out.shape == torch.Size([10, 1, 5, 20])
    close(out, expected)


def test_inference_every_n(linear_inference):
    model, x, expected = linear_inference
    out = run_inference(model, x, OutputMode.EveryN, 5)
    assert out.shape == torch.Size([2, 1, 5, 20])
    close(out, expected[[4, 9]])


def test_inference_final(linear_inference):
    model, x, expected = linear_inference
    out = run_inference(model, x, OutputMode.Final)
    assert out.shape == torch.Size([1, 1, 5, 20])
    close(out, expected[9:10])


def test_inference_sum(linear_inference):
    model, x, expected = linear_inference
    out = run_inference(model, x, OutputMode.Sum)
    assert out.shape == torch.Size([1, 1, 5, 20])
    close(out, expected.sum(dim=0, keepdim=True))


@pytest.mark.parametrize("mode,period,b_dim", [
    (OutputMode.All, None, 8), (OutputMode.EveryN, 2, 4),
    (OutputMode.Final, None, 2), (OutputMode.Sum, None, 2)])
def test_inference_replicated(mode, period, b_dim):
    """di=4, rf=2, micro-batch 3: the replica dimension multiplies the batch."""
    di, rf, micro = 4, 2, 3
    model = nn.Linear(6, 5)
    x = torch.randn(di * rf * micro, 6)
    with torch.no_grad():
        ref = to_layout(model(x), di, 1, rf)[:, 0]           # [di, rf, micro, 5]
    opts = quiet_options().deviceIterations(di).replicationFactor(rf).outputMode(mode, period)
    out = poptorchsim.inferenceModel(model, opts)(x)
    assert out.shape == torch.Size([b_dim * micro, 5])
    if mode == OutputMode.All:
        expected = ref
    elif mode == OutputMode.EveryN:
        expected = ref[[1, 3]]
    elif mode == OutputMode.Final:
        expected = ref[-1]
    else:
        expected = ref.sum(0)
    close(out, expected.reshape(-1, 5))


def test_inference_scalar_output_all_gets_batch_dim():
    class Total(nn.Module):
        def forward(self, x):
            return x.sum()

    x = torch.arange(12, dtype=torch.float32).reshape(4, 3)
    out = poptorchsim.inferenceModel(Total(), quiet_options().deviceIterations(4))(x)
    assert out.shape == torch.Size([4])
    close(out, x.sum(dim=1))
    final = poptorchsim.inferenceModel(
        Total(), quiet_options().deviceIterations(4).outputMode(OutputMode.Final))(x)
    assert final.shape == torch.Size([])
    close(final, x[-1].sum())


# ---------------------------------------------------------------------------
# Training: deviceIterations(20), input [20, 10]
# ---------------------------------------------------------------------------
def run_training(mode, period=None, di=20, ga=1, rf=1, micro=1):
    torch.manual_seed(0)
    model = RegressorWithLoss(10, 10)
    ref_model = copy.deepcopy(model)
    n = di * ga * rf * micro
    x, y = torch.randn(n, 10), torch.randn(n, 10)
    opts = quiet_options().deviceIterations(di).replicationFactor(rf)
    opts.Training.gradientAccumulation(ga)
    if mode is not None:
        opts.outputMode(mode, period)
    training_model = poptorchsim.trainingModel(
        model, opts, torch.optim.SGD(model.parameters(), lr=0.01))
    out, loss = training_model(x, y)
    ref_out, ref_loss = reference_call(
        ref_model, torch.optim.SGD(ref_model.parameters(), lr=0.01), (x, y), di, ga, rf)
    return out, loss, ref_out, ref_loss      # ref_out [di, ga, rf, micro, 10]


def test_training_all():
    out, loss, ref_out, ref_loss = run_training(OutputMode.All)
    assert out.shape == torch.Size([20, 10])
    assert loss.shape == torch.Size([20])
    close(out, ref_out.reshape(20, 10))
    close(loss, ref_loss.reshape(20))


def test_training_every_n():
    out, loss, ref_out, ref_loss = run_training(OutputMode.EveryN, 5)
    assert out.shape == torch.Size([4, 10])
    assert loss.shape == torch.Size([4])
    iterations = [4, 9, 14, 19]
    close(out, ref_out[iterations].reshape(4, 10))
    close(loss, ref_loss[iterations].reshape(4))


@pytest.mark.parametrize("mode", [None, OutputMode.Default, OutputMode.Final])
def test_training_final(mode):
    out, loss, ref_out, ref_loss = run_training(mode)
    assert out.shape == torch.Size([1, 10])
    assert loss.shape == torch.Size([])
    close(out, ref_out[-1, 0, 0])
    close(loss, ref_loss[-1, 0, 0])


def test_training_sum():
    out, loss, ref_out, ref_loss = run_training(OutputMode.Sum)
    assert out.shape == torch.Size([1, 10])
    assert loss.shape == torch.Size([])
    close(out, ref_out.sum(dim=(0, 1, 2)))
    close(loss, ref_loss.sum())


def test_training_replicated_final():
    """rf=2, Final: each replica's last micro-batch, concatenated; loss [2]."""
    out, loss, ref_out, ref_loss = run_training(None, di=3, rf=2, micro=2)
    assert out.shape == torch.Size([2 * 2, 10])
    assert loss.shape == torch.Size([2])
    close(out, ref_out[-1, -1].reshape(4, 10))
    close(loss, ref_loss[-1, -1])


def test_training_replicated_sum():
    out, loss, ref_out, ref_loss = run_training(OutputMode.Sum, di=3, ga=2, rf=2, micro=2)
    assert out.shape == torch.Size([4, 10])
    assert loss.shape == torch.Size([2])
    close(out, ref_out.sum(dim=(0, 1)).reshape(4, 10))
    close(loss, ref_loss.sum(dim=(0, 1)))


def test_training_all_with_accumulation_and_replicas():
    di, ga, rf, micro = 2, 3, 2, 2
    out, loss, ref_out, ref_loss = run_training(OutputMode.All, di=di, ga=ga, rf=rf,
                                                micro=micro)
    assert out.shape == torch.Size([di * ga * rf * micro, 10])
    assert loss.shape == torch.Size([di * ga * rf])
    close(out, ref_out.reshape(-1, 10))
    close(loss, ref_loss.reshape(-1))


def test_training_every_n_with_accumulation():
    """EveryN returns all ga * rf entries of every N-th device iteration."""
    di, ga, rf, micro = 4, 2, 1, 2
    out, loss, ref_out, ref_loss = run_training(OutputMode.EveryN, 2, di=di, ga=ga,
                                                rf=rf, micro=micro)
    assert out.shape == torch.Size([di * ga * rf * micro // 2, 10])
    assert loss.shape == torch.Size([di * ga * rf // 2])
    close(out, ref_out[[1, 3]].reshape(-1, 10))
    close(loss, ref_loss[[1, 3]].reshape(-1))


# ---------------------------------------------------------------------------
# Dtypes, structure and backward()
# ---------------------------------------------------------------------------
def test_int64_output_comes_back_as_int32():
    class ArgMax(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(6, 4)

        def forward(self, x):
            return self.fc(x).argmax(dim=-1)

    model = ArgMax()
    x = torch.randn(8, 6)
    out = poptorchsim.inferenceModel(model, quiet_options())(x)
    assert out.dtype == torch.int32
    with torch.no_grad():
        assert torch.equal(out, model(x).int())


def test_float64_input_runs_as_float32():
    model = nn.Linear(6, 4)
    x = torch.randn(8, 6, dtype=torch.float64)
    out = poptorchsim.inferenceModel(model, quiet_options())(x)
    assert out.dtype == torch.float32
    with torch.no_grad():
        close(out, model(x.float()))


def test_output_structure_preserved():
    class Structured(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(6, 4)

        def forward(self, x):
            y = self.fc(x)
            return {"logits": y, "pair": (y.relu(), y.sum(dim=1))}

    model = Structured()
    x = torch.randn(8, 6)
    out = poptorchsim.inferenceModel(model, quiet_options().deviceIterations(2))(x)
    assert isinstance(out, dict) and set(out) == {"logits", "pair"}
    assert isinstance(out["pair"], tuple) and len(out["pair"]) == 2
    with torch.no_grad():
        expected = model(x)
    close(out["logits"], expected["logits"])
    close(out["pair"][0], expected["pair"][0])
    close(out["pair"][1], expected["pair"][1])


@pytest.mark.parametrize("training", [True, False])
def test_backward_on_output_raises(training):
    model = RegressorWithLoss(10, 10)
    x, y = torch.randn(4, 10), torch.randn(4, 10)
    if training:
        out, loss = poptorchsim.trainingModel(model, quiet_options())(x, y)
    else:
        out, loss = poptorchsim.inferenceModel(model, quiet_options())(x, y)
    for t in (out, loss):
        with pytest.raises(poptorchsim.Error,
                           match=r"backward\(\) cannot be called explicitly on outputs "
                                 r"of a PopTorch model"):
            t.backward()


def test_host_side_constant_output_keeps_its_shape():
    """b_dim = 1 for outputs that do not depend on the inputs (§4)."""
    class WithConstant(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(6, 4)

        def forward(self, x):
            return self.fc(x), torch.ones(3)

    model = WithConstant()
    x = torch.randn(8, 6)
    out, const = poptorchsim.inferenceModel(model, quiet_options().deviceIterations(2))(x)
    assert out.shape == torch.Size([8, 4])
    assert const.shape == torch.Size([3])
    close(const, torch.ones(3))
