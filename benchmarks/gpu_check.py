#!/usr/bin/env python3
"""The GPU check (issue 33): everything the CUDA host device promises, in one run.

    python benchmarks/gpu_check.py [--examples DIR] [--json PATH]     (or: make gpu-check)

On a machine with a CUDA device it runs, with the simulator's host side on
CUDA (``poptorchsim.setHostDevice("cuda")`` / ``POPTORCHSIM_DEVICE=cuda``):

1. **parity**: ``tests/test_host_device.py`` (a training model on CUDA
   against eager CUDA, the IR the same as the CPU's; the device state kept
   apart and read back lazily) and the model-hub sweep's CI subset
   (``tests/test_model_hub.py``: Hugging Face, timm and torchvision models,
   inference, training, pipelined, replicated and fp16, at the sweep's
   tolerances, against eager PyTorch on the same GPU: the sweep's eager
   reference runs on ``POPTORCHSIM_DEVICE``);
2. **speed**: host milliseconds per micro-batch of a training step through
   the simulator on CUDA against eager PyTorch on the same GPU, for GPT-2
   (``host_speed.gpt2``) and ResNet-18: fp32 (bar: at most 1.2x eager
   CUDA fp32), and fp16 with float partials and stochastic rounding (bar: at
   most 2x eager CUDA fp16);
3. **Graphcore's applications**, unchanged, with ``--examples`` (a
   checkout of graphcore/examples, as ``benchmarks/graphcore_apps.py``
   takes it): BERT ``demo_tiny_128``'s 360 steps (bars: under 2 minutes,
   and its own check, mean MLM accuracy of the last 10 steps above 0.85)
   and the ViT-B/16 pretraining test's configuration (bar: under 10 s per
   step).

It ends with one table: check, figure, bar, pass.  Without CUDA it says so
and exits 0 (CI is CPU-only).
"""
import argparse
import json
import os
import re
import subprocess
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)


def _pytest(paths, env):
    """(passed, failed, skipped) of pytest over ``paths``."""
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           *paths], cwd=ROOT, env=env, capture_output=True, text=True)
    tail = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else done.stderr[-500:]
    counts = {k: int(n) for n, k in re.findall(r"(\d+) (passed|failed|skipped|error)", tail)}
    print(tail, flush=True)
    return (counts.get("passed", 0), counts.get("failed", 0) + counts.get("error", 0),
            counts.get("skipped", 0))


def parity(rows):
    env = dict(os.environ, POPTORCHSIM_DEVICE="cuda")
    for name, paths in (("host device tests", ["tests/test_host_device.py"]),
                        ("model-hub subset", ["tests/test_model_hub.py"])):
        passed, failed, skipped = _pytest(paths, env)
        rows.append((f"parity: {name}", f"{passed} passed, {failed} failed, {skipped} skipped",
                     "none failed", failed == 0 and passed > 0))


def speed(rows):
    import host_speed as hs
    specs = {"resnet18": hs.resnet18()}
    if hs.gpt2() is not None:
        specs["gpt2"] = hs.gpt2()
    for name, spec in specs.items():
        e32 = hs.eager(spec, torch.float, steps=10, device="cuda")
        e16 = hs.eager(spec, torch.half, steps=10, device="cuda")
        s32 = hs.simulated(spec, torch.float, 4, steps=8, device="cuda")
        s16 = hs.simulated(spec, torch.half, 4, steps=8, rounding=True, device="cuda")
        print(f"{name}: eager CUDA fp32 {e32:.2f} ms, sim {s32:.2f} ms; eager CUDA fp16 "
              f"{e16:.2f} ms, sim fp16+SR {s16:.2f} ms", flush=True)
        rows.append((f"speed: {name} fp32 vs eager CUDA", f"{s32 / e32:.2f}x", "<= 1.2x",
                     s32 <= 1.2 * e32))
        rows.append((f"speed: {name} fp16 + SR vs eager CUDA fp16", f"{s16 / e16:.2f}x",
                     "<= 2x", s16 <= 2 * e16))


def applications(rows, examples):
    env = dict(os.environ, POPTORCHSIM_DEVICE="cuda")
    for app, steps in (("bert-tiny", 360), ("vit-pretrain", 2)):
        t0 = time.monotonic()
        done = subprocess.run([sys.executable, os.path.join(HERE, "graphcore_apps.py"),
                               "--examples", examples, "--only", app],
                              env=env, capture_output=True, text=True)
        seconds = time.monotonic() - t0
        row = [ln for ln in done.stdout.splitlines() if ln.startswith(f"| {app} |")]
        ok = done.returncode == 0 and bool(row) and "| PASS: " in row[-1]   # not SKIPPED
        print(row[-1] if row else done.stdout[-2000:], flush=True)
        if app == "bert-tiny":
            rows.append(("BERT demo_tiny_128: 360 steps", f"{seconds / 60:.2f} min",
                         "< 2 min, MLM acc > 0.85", ok and seconds < 120))
        else:
            rows.append(("ViT-B/16 pretraining step", f"{seconds / steps:.1f} s/step "
                         "(with start-up)", "< 10 s", ok and seconds / steps < 10))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--examples", default=None, help="a checkout of graphcore/examples")
    p.add_argument("--json", metavar="PATH")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print(f"gpu_check: this PyTorch ({torch.__version__}) sees no CUDA device: nothing "
              "to check (the CPU's checks are `make test` and benchmarks/host_speed.py)")
        return 0
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}, "
          f"TF32 matmul {torch.backends.cuda.matmul.allow_tf32}, "
          f"cuDNN TF32 {torch.backends.cudnn.allow_tf32}\n", flush=True)
    rows = []
    parity(rows)
    speed(rows)
    if args.examples:
        applications(rows, args.examples)
    else:
        print("Graphcore's applications: skipped (no --examples checkout)")
    width = max(len(r[0]) for r in rows)
    print(f"\n{'check':<{width}}  {'figure':<28} {'bar':<24} pass")
    for check, figure, bar, ok in rows:
        print(f"{check:<{width}}  {figure:<28} {bar:<24} {'yes' if ok else 'NO'}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump([dict(zip(("check", "figure", "bar", "pass"), r)) for r in rows], f,
                      indent=1)
    return 0 if all(r[3] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
