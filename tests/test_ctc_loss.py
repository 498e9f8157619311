"""CTC loss in a traced program (capture/ctc_loss.py): lengths as tensors or
lists, padded or concatenated targets, every reduction, impossible
alignments; values and gradients equal eager PyTorch's."""
import pytest
import torch
import torch.nn.functional as F

import poptorchsim as poptorch
from poptorchsim.capture.ctc_loss import aten_ctc_loss
from poptorchsim.testing import assert_trains_like_pytorch, quiet_options

T, N, C = 12, 4, 6          # frames, batch, classes (class 0 the blank)


def _targets(g, s=5, blank=0):
    labels = torch.randint(0, C - 1, (N, s), generator=g)
    return labels + (labels >= blank).long()           # never the blank


@pytest.mark.parametrize("reduction", ["none", "mean", "sum"])
@pytest.mark.parametrize("blank", [0, 3])
def test_the_recursion_equals_aten_values_and_gradients(reduction, blank):
    g = torch.Generator().manual_seed(1)
    log_probs = torch.randn(T, N, C, generator=g).log_softmax(-1).requires_grad_()
    targets = _targets(g, blank=blank)
    in_len = torch.tensor([12, 11, 9, 12])
    tgt_len = torch.tensor([5, 3, 4, 1])
    expected = F.ctc_loss(log_probs, targets, in_len, tgt_len, blank=blank,
                          reduction=reduction)
    got = aten_ctc_loss(log_probs, targets, in_len, tgt_len, blank,
                        {"none": 0, "mean": 1, "sum": 2}[reduction])
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-5)
    # ATen's gradient with respect to log_probs (not through a log_softmax)
    weights = torch.randn(expected.shape, generator=g)
    want, = torch.autograd.grad((expected * weights).sum(), log_probs)
    have, = torch.autograd.grad((got * weights).sum(), log_probs)
    torch.testing.assert_close(have, want, rtol=1e-5, atol=1e-6)


def test_concatenated_targets_and_an_unbatched_input():
    g = torch.Generator().manual_seed(2)
    log_probs = torch.randn(T, N, C, generator=g).log_softmax(-1)
    tgt_len = torch.tensor([2, 5, 3, 4])
    flat = torch.randint(1, C, (int(tgt_len.sum()),), generator=g)
    in_len = torch.full((N,), T)
    torch.testing.assert_close(aten_ctc_loss(log_probs, flat, in_len, tgt_len, 0, 0),
                               F.ctc_loss(log_probs, flat, in_len, tgt_len, reduction="none"))
    one = log_probs[:, 0]
    torch.testing.assert_close(aten_ctc_loss(one, flat[:2], [T], [2], 0, 0),
                               F.ctc_loss(one, flat[:2], [T], [2], reduction="none"))


class Recogniser(torch.nn.Module):
    """Frames -> class scores -> CTC loss against fixed targets (lengths
    as tensors or lists, as the model holds them)."""

    def __init__(self, targets, in_len, tgt_len, zero_infinity=False, reduction="mean"):
        super().__init__()
        self.proj = torch.nn.Linear(8, C)
        self.targets, self.in_len, self.tgt_len = targets, in_len, tgt_len
        self.zero_infinity, self.reduction = zero_infinity, reduction

    def forward(self, frames):
        scores = self.proj(frames).log_softmax(-1)
        loss = F.ctc_loss(scores, self.targets, self.in_len, self.tgt_len,
                          zero_infinity=self.zero_infinity, reduction=self.reduction)
        return scores, loss


@pytest.mark.parametrize("lengths", ["tensors", "lists"])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_a_model_with_ctc_loss_trains_like_pytorch(lengths, reduction):
    g = torch.Generator().manual_seed(3)
    targets = _targets(g)
    in_len, tgt_len = torch.tensor([12, 10, 12, 8]), torch.tensor([5, 2, 4, 3])
    if lengths == "lists":
        in_len, tgt_len = in_len.tolist(), tgt_len.tolist()
    torch.manual_seed(0)
    model = Recogniser(targets, in_len, tgt_len, reduction=reduction)
    batches = [(torch.randn(T, N, 8, generator=g),) for _ in range(2)]
    assert_trains_like_pytorch(model, lambda p: torch.optim.SGD(p, lr=0.05), batches)


def test_an_impossible_alignment_is_infinite_or_zero_as_in_eager():
    """A target of 6 labels cannot align with 3 frames: ATen's loss is
    infinite; with zero_infinity it is zero and passes no gradient."""
    g = torch.Generator().manual_seed(4)
    targets = _targets(g, s=6)
    in_len, tgt_len = torch.tensor([12, 3, 12, 12]), torch.tensor([6, 6, 2, 4])
    frames = torch.randn(T, N, 8, generator=g)
    for zero_infinity in (False, True):
        torch.manual_seed(0)
        model = Recogniser(targets, in_len, tgt_len, zero_infinity, reduction="none")
        _, expected = model(frames)
        _, got = poptorch.inferenceModel(model, quiet_options())(frames)
        torch.testing.assert_close(got, expected)
        assert torch.isinf(got[1]) != zero_infinity
    torch.manual_seed(0)
    model = Recogniser(targets, in_len, tgt_len, zero_infinity=True, reduction="sum")
    assert_trains_like_pytorch(model, lambda p: torch.optim.SGD(p, lr=0.05), [(frames,)])


def test_float16_log_probs_and_an_unknown_reduction_are_refused_as_eager_refuses_them():
    """Eager PyTorch's CTC loss takes float32 or float64 only, and names a
    reduction it does not know; the traced form says the same."""
    g = torch.Generator().manual_seed(5)
    targets = _targets(g)
    in_len, tgt_len = torch.full((N,), T), torch.tensor([5, 3, 4, 1])
    half = torch.randn(T, N, C, generator=g).log_softmax(-1).half()
    with pytest.raises(poptorch.Error, match="CTC loss of torch.float16 log_probs: .*"
                                             r"log_probs.float\(\)"):
        aten_ctc_loss(half, targets, in_len, tgt_len)
    model = Recogniser(targets, in_len, tgt_len, reduction="avg")
    with pytest.raises(ValueError, match="avg is not a valid value for reduction"):
        model(torch.randn(T, N, 8, generator=g))          # eager
    with pytest.raises(ValueError, match="avg is not a valid value for reduction"):
        poptorch.inferenceModel(model, quiet_options())(torch.randn(T, N, 8, generator=g))
