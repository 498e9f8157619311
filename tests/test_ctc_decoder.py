"""``poptorch.ctc_beam_search_decoder``: CTC prefix beam search, checked
against an exhaustive decoder, on the simulated IPU as in eager PyTorch."""
import itertools
import math

import pytest
import torch
from conftest import quiet_options

import poptorchsim as poptorch


def exhaustive(log_probs, blank, top_paths):
    """``[(log probability, labels)]``, best first: every alignment of
    ``log_probs`` (``[time, classes]``) collapsed (repeats merged, blanks
    dropped), the probabilities of each label sequence summed."""
    time, classes = log_probs.shape
    totals = {}
    for alignment in itertools.product(range(classes), repeat=time):
        score = sum(float(log_probs[t, c]) for t, c in enumerate(alignment))
        labels = tuple(c for i, c in enumerate(alignment)
                       if c != blank and (i == 0 or c != alignment[i - 1]))
        totals.setdefault(labels, []).append(score)
    ranked = sorted(((math.log(sum(math.exp(s) for s in v)), k) for k, v in totals.items()),
                    key=lambda sk: (-sk[0], sk[1]))
    return ranked[:top_paths]


class Decoder(torch.nn.Module):
    def __init__(self, **kw):
        super().__init__()
        self.kw = kw

    def forward(self, log_probs, lengths):
        return poptorch.ctc_beam_search_decoder(log_probs, lengths, **self.kw)


@pytest.mark.parametrize("blank", [0, 2])
def test_a_wide_beam_finds_the_exact_best_paths(blank):
    torch.manual_seed(1)
    log_probs = torch.randn(4, 2, 3).log_softmax(-1)
    lengths = torch.tensor([4, 3], dtype=torch.int32)
    pm = poptorch.inferenceModel(Decoder(blank=blank, beam_width=50, top_paths=3),
                                 quiet_options())
    scores, sizes, paths = pm(log_probs, lengths)
    assert scores.shape == (2, 3) and sizes.shape == (2, 3) and paths.shape == (2, 3, 4)
    for b in range(2):
        expected = exhaustive(log_probs[:lengths[b], b], blank, 3)
        for k, (score, labels) in enumerate(expected):
            assert scores[b, k].item() == pytest.approx(score, abs=1e-5)
            assert sizes[b, k].item() == len(labels)
            assert paths[b, k, :len(labels)].tolist() == list(labels)
            assert not paths[b, k, len(labels):].any()


def test_poptorchs_own_test_shapes_and_eager_agree():
    """PopTorch's ctc_decoder_test.py: raw scores, random lengths, defaults."""
    torch.manual_seed(42)
    log_probs = torch.randn(9, 3, 10)
    lengths = torch.randint(5, 9, (3,), dtype=torch.int)
    pm = poptorch.inferenceModel(Decoder(), quiet_options())
    result = pm(log_probs, lengths)
    assert result[0].shape == (3, 1) and result[1].shape == (3, 1)
    assert result[2].shape == (3, 1, 9)
    for got, expected in zip(result, Decoder()(log_probs, lengths)):
        torch.testing.assert_close(got, expected, rtol=0, atol=0)


def test_the_decoder_is_one_costed_op():
    log_probs, lengths = torch.randn(6, 2, 5), torch.tensor([6, 6])
    costs = []
    for width in (2, 8):
        pm = poptorch.inferenceModel(Decoder(beam_width=width), quiet_options())
        pm(log_probs, lengths)
        ops = [op for op in pm.getIR().graphs["inference_forward"].ops
               if op.cost_class == "custom"]
        assert len(ops) == 1
        costs.append(pm.cycleEstimate()["compute"])
    assert costs[1] > costs[0]           # a wider beam scores more extensions


@pytest.mark.parametrize("args, message", [
    ((3, torch.tensor([1])), "probs must be a torch.tensor argument"),
    ((torch.randn(3, 1, 4), [3]), "lengths must be a torch.tensor argument"),
    ((torch.randn(3, 4), torch.tensor([3])), "Input probablities tensor must be rank-3"),
    ((torch.randn(3, 2, 4), torch.tensor([3])), "lengths must have shape \\[batch_size\\]"),
    ((torch.randn(3, 1, 4), torch.tensor([3]), 4), "blank \\(4\\) must be a class index"),
    ((torch.randn(3, 1, 4), torch.tensor([3]), 0, 2, 3),
     "top_paths \\(3\\) must be between 1 and beam_width \\(2\\)"),
])
def test_errors(args, message):
    with pytest.raises(poptorch.Error, match=message):
        poptorch.ctc_beam_search_decoder(*args)
