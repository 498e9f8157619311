"""Op coverage, generated over PyTorch's own operator table (OpInfo).

Every operator of ``op_db`` with a float32 sample runs forward on the
simulated IPU and, where differentiable, backward; both must equal eager
PyTorch (``op_sweep.check``).  An operator may instead be rejected with a
typed poptorchsim error only where the table below says why: the IPU has no
complex numbers, PyTorch gives it a data-dependent output shape, or it is an
iterative factorization with no IPU implementation.  A new rejection, or a
rejection that starts working, fails the test.
"""
import pytest

pytest.importorskip("expecttest")      # torch.testing._internal needs it

import op_sweep

COMPLEX = "complex tensors: the IPU has no complex number types"
DYNAMIC = "PyTorch gives its output a data-dependent shape (or reads values)"
FACTORIZATION = "an iterative matrix factorization (SVD, eigen, QR): no IPU kernel"
NOT_ATEN = "a torch_nn custom operator, not ATen"

REJECTED = {
    **{name: COMPLEX for name in (
        "view_as_complex.", "complex.", "stft.", "cdouble.", "cfloat.", "chalf.", "polar.",
        "fft.fft.", "fft.fft2.", "fft.fftn.", "fft.hfft.", "fft.hfft2.", "fft.hfftn.",
        "fft.rfft.", "fft.rfft2.", "fft.rfftn.", "fft.ifft.", "fft.ifft2.", "fft.ifftn.",
        "fft.ihfft.", "fft.ihfft2.", "fft.ihfftn.", "fft.irfft.", "fft.irfft2.",
        "fft.irfftn.", "linalg.eig.", "linalg.eigvals.")},
    **{name: DYNAMIC for name in (
        "masked_select.", "nonzero.", "argwhere.", "unique.", "unique_consecutive.",
        "tensor_split.", "corrcoef.", "cov.",
        "nn.functional.gaussian_nll_loss.", "linalg.lstsq.", "linalg.lstsq.grad_oriented")},
    **{name: FACTORIZATION for name in (
        "geqrf.", "ormqr.", "svd.", "svd_lowrank.", "pca_lowrank.", "norm.nuc",
        "linalg.cond.", "linalg.eigh.", "linalg.eigvalsh.", "linalg.householder_product.",
        "linalg.qr.", "linalg.matrix_rank.", "linalg.matrix_rank.hermitian", "linalg.svd.",
        "linalg.svdvals.")},
    **{name: NOT_ATEN for name in (
        "nn.functional.linear_cross_entropy.chunked",
        "nn.functional.linear_cross_entropy.chunked_none")},
}
REJECTED_IN_TRAINING = {
    "linalg.matrix_sqrth.": FACTORIZATION,
    "linalg.polar.": FACTORIZATION,
}
# PyTorch-internal operators called directly, where PyTorch's decomposition
# and its fused kernel disagree (users reach both through public functions,
# which the rows above cover and which match).
DIFFERENT = {
    "torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.":
        "the decomposition's auxiliary logsumexp output has another shape",
}

OPS = {f"{o.name}.{o.variant_test_name}": o for o in op_sweep.op_db()}


@pytest.mark.parametrize("name", list(OPS))
def test_operator_matches_eager(name):
    if name in DIFFERENT:
        with pytest.raises(AssertionError):
            op_sweep.check(OPS[name])
        pytest.xfail(DIFFERENT[name])
    outcome = op_sweep.check(OPS[name])
    if outcome.startswith("skipped"):
        pytest.skip(outcome)
    if outcome.startswith("rejected in training"):
        assert name in REJECTED_IN_TRAINING, f"{name} newly rejected in training: {outcome}"
        return
    if outcome.startswith("rejected"):
        assert name in REJECTED, f"{name} newly rejected: {outcome}"
        return
    assert outcome == "ok"
    assert name not in REJECTED and name not in REJECTED_IN_TRAINING, \
        f"{name} now works: remove it from the rejection table"


# -- cost classes --------------------------------------------------------------------------
import torch  # noqa: E402 - after the sys.path insert above
from torch import nn  # noqa: E402 - after the sys.path insert above

import poptorchsim  # noqa: E402 - after the sys.path insert above


class Apply(nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, *xs):
        return self.fn(*xs)


def _ops(fn, *inputs):
    model = poptorchsim.inferenceModel(
        Apply(fn), poptorchsim.Options().showCompilationProgressBar(False))
    model(*inputs)
    report = model.simulationReport()
    return {op["op"].split(".")[1]: op for op in report["ops"]}


@pytest.mark.parametrize("fn, op, cls", [
    (lambda x, i: x.gather(1, i), "gather", "gather"),
    (lambda x, i: x.scatter_reduce(1, i, x, "amax"), "scatter_reduce", "gather"),
    (lambda x, i: torch.sort(x)[0], "sort", "sort"),
    (lambda x, i: torch.topk(x, 3)[0], "topk", "sort"),
    (lambda x, i: torch.cumsum(x, 1), "cumsum", "sort"),
    (lambda x, i: x @ x.t(), "mm", "matmul"),
    (lambda x, i: torch.erf(x), "erf", "transcendental"),
    (lambda x, i: torch.nn.functional.glu(x), "glu", "elementwise"),
])
def test_every_lowered_op_has_a_cost(fn, op, cls):
    x = torch.randn(64, 32)
    i = torch.randint(0, 32, (64, 32))
    ops = _ops(fn, x, i)
    assert ops[op]["class"] == cls
    assert ops[op]["cycles"] > 0


def test_sort_costs_grow_as_a_sorting_network():
    """A bitonic sort of n elements takes log2(n)(log2(n)+1)/2 rounds over
    its data: sorting 16x longer rows costs more than 16x the cycles."""
    short = _ops(lambda x: torch.sort(x)[0], torch.randn(16, 256))["sort"]["cycles"]
    long = _ops(lambda x: torch.sort(x)[0], torch.randn(16, 4096))["sort"]["cycles"]
    scan = _ops(lambda x: torch.cumsum(x, 1), torch.randn(16, 4096))["cumsum"]["cycles"]
    assert long > short
    assert scan < long          # a scan takes log2(n) rounds, a sort log2(n)^2 / 2
