"""The attention and recurrent example trains each model well above chance
(four classes: 25%) on the simulated IPU."""
import importlib.util
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_sequence_models_learn(capsys):
    spec = importlib.util.spec_from_file_location(
        "sequence_models", ROOT / "examples/sequence_models/train.py")
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    accuracy = example.main(["--epochs", "3", "--train-samples", "1600",
                             "--test-samples", "400"])
    out = capsys.readouterr().out
    for name in ("transformer_encoder", "causal_attention", "lstm"):
        assert f"{name}: test accuracy" in out
        assert accuracy[name] >= 0.6, out
    assert "fits" in out and "matmul" in out
