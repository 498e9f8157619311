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

import op_sweep  # noqa: E402

COMPLEX = "complex tensors: the IPU has no complex number types"
DYNAMIC = "PyTorch gives its output a data-dependent shape (or reads values)"
FACTORIZATION = "an iterative matrix factorization (SVD, eigen, QR): no IPU kernel"
NOT_ATEN = "a torch_nn custom operator, not ATen"
PROD_GRAD = "PyTorch's backward of a product reduction branches on zeros in the data"

REJECTED = {
    **{name: COMPLEX for name in (
        "view_as_complex.", "complex.", "stft.", "cdouble.", "cfloat.", "chalf.", "polar.",
        "fft.fft.", "fft.fft2.", "fft.fftn.", "fft.hfft.", "fft.hfft2.", "fft.hfftn.",
        "fft.rfft.", "fft.rfft2.", "fft.rfftn.", "fft.ifft.", "fft.ifft2.", "fft.ifftn.",
        "fft.ihfft.", "fft.ihfft2.", "fft.ihfftn.", "fft.irfft.", "fft.irfft2.",
        "fft.irfftn.", "linalg.eig.", "linalg.eigvals.")},
    **{name: DYNAMIC for name in (
        "masked_select.", "nonzero.", "argwhere.", "unique.", "unique_consecutive.",
        "tensor_split.", "corrcoef.", "cov.", "nn.functional.ctc_loss.",
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
    "scatter_reduce.prod": PROD_GRAD,
    "index_reduce.prod": PROD_GRAD,
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
