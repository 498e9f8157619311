"""Gathers and scatters of an expanded index lowered as PopTorch lowers them
(``capture/index_expansion.py``): whole slices, no index of the data's
size; the same values and gradients as eager PyTorch."""
import pytest
import torch
from conftest import quiet_options
from torch import nn

import poptorchsim
from poptorchsim.testing import assert_trains_like_pytorch


def _targets(model):
    return [str(op.target) for op in model.getIR().graphs[model.getIR().model_graph].ops]


class Gather(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.dim = dim
        self.w = nn.Parameter(torch.randn(4, 6))

    def forward(self, index, y):
        shape = list(self.w.shape)
        shape[self.dim] = index.shape[self.dim]
        out = torch.gather(self.w * 2, self.dim, index.expand(shape))
        return out, nn.functional.mse_loss(out, y)


@pytest.mark.parametrize("dim", [0, 1])
def test_gather_of_an_expanded_index_is_an_index_select_and_trains_as_eager(dim):
    g = torch.Generator().manual_seed(dim)
    n = 3
    index_shape = [1, 1]
    index_shape[dim] = n
    index = torch.randint(0, (4, 6)[dim], index_shape, generator=g)
    out_shape = [4, 6]
    out_shape[dim] = n
    batches = [(index, torch.randn(out_shape, generator=g))]
    assert_trains_like_pytorch(Gather(dim), lambda p: torch.optim.SGD(p, lr=0.1), batches)
    m = poptorchsim.inferenceModel(Gather(dim), quiet_options())
    m(*batches[0])
    ops = _targets(m)
    assert any("index_select" in t for t in ops)
    assert not any("expand" in t or "gather" in t for t in ops)


class Scatter(nn.Module):
    def __init__(self, reduce, include_self):
        super().__init__()
        self.reduce, self.include_self = reduce, include_self

    def forward(self, inp, index, src):
        return inp.scatter_reduce(-2, index.expand_as(src), src, reduce=self.reduce,
                                  include_self=self.include_self)


@pytest.mark.parametrize("reduce", ["sum", "prod", "mean", "amax", "amin"])
@pytest.mark.parametrize("include_self", [True, False])
def test_scatter_of_an_expanded_index_gives_eagers_values(reduce, include_self):
    g = torch.Generator().manual_seed(1)
    inp, src = torch.randn(5, 3, generator=g), torch.randn(6, 3, generator=g)
    index = torch.randint(0, 5, (6, 1), generator=g)
    model = Scatter(reduce, include_self)
    m = poptorchsim.inferenceModel(model, quiet_options())
    torch.testing.assert_close(m(inp, index, src), model(inp, index, src))
    ops = _targets(m)
    assert not any("scatter" in t or "expand" in t for t in ops)
    assert any(("index_add" if reduce == "sum" else "index_reduce") in t for t in ops)


def test_an_index_expanded_along_the_gathered_dimension_is_left_alone():
    class Model(nn.Module):
        def forward(self, x, index):
            return torch.gather(x, 0, index.expand(3, 5))
    x, index = torch.randn(3, 5), torch.randint(0, 3, (1, 5))
    m = poptorchsim.inferenceModel(Model(), quiet_options())
    torch.testing.assert_close(m(x, index), Model()(x, index))
    assert any("gather" in t for t in _targets(m))
