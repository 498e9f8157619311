"""A fast subset of the model-hub parity sweep (``benchmarks/model_hub.py``).

Models built from configs with random weights (nothing downloaded) train on
the simulated IPU and in eager PyTorch, and every parameter and buffer must
agree within 1e-4 (``model_hub.run_row``'s verdict, float64-arbitrated where
eager fp32 is itself unstable): Hugging Face GPT-2 with its tied embedding
and head (SGD, and pipelined over 2 IPUs in 3 stages with the tied layers on
IPU 0), BERT, ViT, and timm's ResNet-10t.  Skips cleanly without
``transformers`` or ``timm``; the other rows of the sweep are marked slow.
"""
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks"))
import model_hub as hub  # noqa: E402

FAST = [("gpt2", "sgd"), ("gpt2", "pipelined"), ("bert_cls", "adamw"), ("vit", "sgd"),
        ("timm_resnet10t", "replicated")]
SLOW = [("bert_mlm", "pipelined"), ("t5", "sgd"), ("bart", "sgd"), ("whisper", "pipelined"),
        ("llama", "adamw"), ("mistral", "pipelined"), ("clip", "replicated"),
        ("gpt2", "fp16"), ("timm_convnext_atto", "sgd"), ("timm_swin_tiny", "pipelined"),
        ("tv_mobilenet_v2", "replicated")]


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
