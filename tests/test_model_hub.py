"""A fast subset of the model-hub parity sweep (``benchmarks/model_hub.py``).

Models built from configs with random weights (nothing downloaded) train on
the simulated IPU and in eager PyTorch, and every parameter and buffer must
agree within 1e-4 (``model_hub.run_row``'s verdict, float64-arbitrated where
eager fp32 is itself unstable): Hugging Face GPT-2 with its tied embedding
and head (SGD, AdamW, fp16 with loss scaling, and pipelined over 2 IPUs in 3
stages, the embeddings before the first block and the tied head back on
IPU 0), BERT (masked LM with its tied decoder; classification pipelined over
4 IPUs), T5, BART and Whisper (conditional generation with labels), LLaMA
and Mistral (pipelined over 4 and 2 IPUs), CLIP (contrastive loss, 2
replicas), Swin, ViT (inference; 2 replicas with gradient accumulation),
timm's ResNet-10t (batch-norm running statistics per replica) and ConvNeXt
(4 IPUs).  Skips cleanly without ``transformers`` or ``timm``; more rows
are marked slow.
"""
import os
import sys

import pytest
import torch
from torch import nn

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks"))
import model_hub as hub

# about 35 s on one thread of the 2-core machine
FAST = [("gpt2", "sgd"), ("gpt2", "adamw"), ("gpt2", "pipelined"), ("gpt2", "fp16"),
        ("bert_mlm", "sgd"), ("bert_mlm", "pipelined"), ("bert_cls", "pipelined"),
        ("t5", "sgd"), ("t5", "pipelined"), ("bart", "sgd"), ("whisper", "pipelined"),
        ("llama", "pipelined"), ("mistral", "pipelined"), ("clip", "replicated"),
        ("swin", "adamw"), ("vit", "infer"), ("vit", "replicated"),
        ("timm_resnet10t", "sgd"), ("timm_resnet10t", "replicated"),
        ("timm_convnext_atto", "pipelined")]
# heavier compiles, or rows that need fp64 / frozen batch-norm arbitration
SLOW = [("timm_swin_tiny", "pipelined"), ("timm_efficientnet_b0", "fp16"),
        ("tv_mobilenet_v2", "pipelined"), ("tv_mnasnet0_5", "fp16")]


@pytest.fixture(autouse=True, scope="module")
def _one_torch_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _params(rows, marks=()):
    return [pytest.param(name, mode, id=f"{name}-{mode}", marks=list(marks))
            for name, mode in rows]


@pytest.mark.parametrize("name,mode", _params(FAST) + _params(SLOW, (pytest.mark.slow,)))
def test_row_matches_eager(name, mode):
    spec = hub.BY_NAME[name]
    if spec.package:
        pytest.importorskip(spec.package)
    row = hub.run_row(spec, mode)
    assert row.verdict.startswith("match"), (row, row.detail)
    assert "moved only" not in row.note, row


def test_table_and_verdict_classes():
    rows = [hub.Row("m", "timm", "sgd", 0.0, "match", 0.5, 0.01, 0.02, 0.5, "a|b"),
            hub.Row("m", "timm", "fp16", None, "refused: Error: no", note="")]
    text = hub.markdown(rows)
    assert text.splitlines()[0].startswith("| model | family | mode | max diff | verdict")
    assert "a\\|b" in text and "| 0.50 |" in text
    assert hub.summary(rows) == "1 match, 1 refused"
    assert hub.per_model_ratio(rows) == {"m": 0.5}
    assert [s.name for s in hub.select(["bert_*"])] == ["bert_mlm", "bert_cls"]
    assert hub.revisits([("a", 0), ("b", 1), ("c", 0)])
    assert not hub.revisits([("a", 0), ("b", 1)])


class _ItemInForward(nn.Module):
    """Python that needs a tensor's value inside forward: PopTorch cannot trace it."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 3)

    def forward(self, x, y):
        out = self.fc(x)
        if out.sum().item() > 1e9:
            out = out * 0
        return out, nn.functional.cross_entropy(out, y)


def _tiny(n, g):
    return torch.randn(n, 4, generator=g), torch.randint(0, 3, (n,), generator=g)


def test_typed_error_is_refused_and_linear_matches():
    refused = hub.run_row(hub.Spec("item", "torch", _ItemInForward, _tiny, []), "sgd")
    assert refused.verdict.startswith("refused: DataDependentError: "), refused

    def linear():
        return hub.zoo.WithLoss(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3)), "ce")
    spec = hub.Spec("mlp", "torch", linear, _tiny, [("model.2", 1)])
    for mode in hub.MODES:
        row = hub.run_row(spec, mode)
        assert row.verdict == "match", row
    assert hub.pipeline_stages(spec.blocks) == 2
    assert hub.pipeline_stages([("a", 1), ("b", 0)]) == 3
