"""``poptorchsim.testing``: the helpers a user runs in their own CI to check
that a model trains through the simulator as in plain PyTorch."""
import pytest
import torch
from torch import nn

import poptorchsim
from poptorchsim.testing import assert_trains_like_pytorch, quiet_options, zoo


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(6, 8)
        self.b = nn.Linear(8, 3)
        self.loss = nn.CrossEntropyLoss()

    def forward(self, x, y):
        out = self.b(torch.relu(self.a(x)))
        return out, self.loss(out, y)


def _batches(n, size, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(size, 6, generator=g), torch.randint(0, 3, (size,), generator=g))
            for _ in range(n)]


def test_accumulated_and_replicated_training_passes():
    opts = quiet_options().deviceIterations(2).replicationFactor(2)
    opts.Training.gradientAccumulation(2)
    losses = assert_trains_like_pytorch(
        Net(), lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9), _batches(2, 16), opts)
    assert len(losses) == 2


def test_pipelined_training_passes():
    model = Net()
    model.b = poptorchsim.BeginBlock(model.b, ipu_id=1)
    opts = quiet_options().deviceIterations(1)
    opts.Training.gradientAccumulation(4)
    assert_trains_like_pytorch(model, lambda p: torch.optim.Adam(p, lr=0.01),
                               _batches(2, 8), opts)


def test_it_fails_when_the_two_runs_differ():
    """Different learning rates for the two copies: the check must fail."""
    rates = iter([0.1, 0.2])
    with pytest.raises(AssertionError):
        assert_trains_like_pytorch(Net(), lambda p: torch.optim.SGD(p, lr=next(rates)),
                                   _batches(2, 4))


def test_it_refuses_a_run_where_nothing_trains():
    with pytest.raises(AssertionError, match="did not move"):
        assert_trains_like_pytorch(Net(), lambda p: torch.optim.SGD(p, lr=0.0), _batches(1, 4))


def test_the_zoo_is_importable_without_the_tests():
    case = zoo.BY_NAME["gru"]
    model = zoo.build(case, case.seed)
    (*inputs, target), = zoo.make_batches(case, model, 1)
    out, loss = zoo.WithLoss(model, case.loss)(*inputs, target)
    assert loss.dim() == 0 and out.shape[0] == case.batch
