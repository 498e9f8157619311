"""``torch.bincount`` as PopTorch runs it: ``minlength`` bins exactly (on the
IPU the minimum length is also the maximum), counts or summed weights."""
import pytest
import torch
from conftest import quiet_options
from torch import nn

import poptorchsim as poptorch


class _Count(nn.Module):
    def __init__(self, bins, weighted=False, method=False):
        super().__init__()
        self.bins, self.weighted, self.method = bins, weighted, method

    def forward(self, x, w):
        weights = w if self.weighted else None
        if self.method:
            return x.bincount(weights, minlength=self.bins)
        return torch.bincount(x, weights, minlength=self.bins)


@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("method", [False, True])
def test_bincount_equals_pytorch_within_its_bins(weighted, method):
    g = torch.Generator().manual_seed(0)
    x, w = torch.randint(0, 8, (50,), generator=g), torch.rand(50, generator=g)
    model = poptorch.inferenceModel(_Count(8, weighted, method), quiet_options())
    out = model(x, w)
    want = torch.bincount(x, w if weighted else None, minlength=8)
    # counts come back as int32, as PopTorch returns int64 results
    assert out.dtype == (torch.float32 if weighted else torch.int32)
    torch.testing.assert_close(out, want.to(out.dtype))


def test_values_past_the_bins_are_not_counted():
    x = torch.tensor([0, 1, 1, 5, 9, 9])
    out = poptorch.inferenceModel(_Count(4), quiet_options())(x, torch.ones(6))
    assert out.tolist() == [1, 2, 0, 0]


def test_bincount_without_minlength_is_popTorchs_error():
    model = poptorch.inferenceModel(_Count(0), quiet_options())
    with pytest.raises(poptorch.Error, match="Bincount `minlength` must be specified"):
        model(torch.tensor([0, 1]), torch.ones(2))
