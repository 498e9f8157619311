"""The Hugging Face GPT-2 example (tied LM head, embeddings outside any block,
pipelined over 4 IPUs in 5 stages, 2 replicas) trains as plain PyTorch."""
import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def test_gpt2_pipelined_replicated_trains_as_pytorch(capsys):
    pytest.importorskip("transformers")
    spec = importlib.util.spec_from_file_location(
        "language_model", ROOT / "examples/language_model/train.py")
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    diff = example.main(["--steps", "2"])
    out = capsys.readouterr().out
    assert "stages 5 on IPUs [0, 1, 2, 3, 0]" in out
    assert "LM head tied to the embedding: True" in out
    assert diff < 1e-4
