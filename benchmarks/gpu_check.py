#!/usr/bin/env python3
"""The GPU check (issue 33): everything the CUDA host device promises, in one run.

    python benchmarks/gpu_check.py [--examples DIR [--app-deps DIRS]] [--json PATH]
        [--only speed|parity|apps] [--workers N] [--log-dir DIR]     (or: make gpu-check)

On a machine with a CUDA device it runs, with the simulator's host side on
CUDA (``poptorchsim.setHostDevice("cuda")`` / ``POPTORCHSIM_DEVICE=cuda``),
speed first, then parity, then the applications (on a GPU machine without
the package registries: ``benchmarks/gpu_bundle.sh``, then
``benchmarks/gpu_session.sh``):

1. **parity**: ``tests/test_host_device.py`` (a training model on CUDA
   against eager CUDA, the IR the same as the CPU's; the device state kept
   apart and read back lazily), the Triton rounding kernel against the
   CPU's values, and the model-hub sweep's CI subset
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

It ends with one table: check, figure, bar, pass (written after each part,
``--json``).  Without CUDA it says so and exits 0 (CI is CPU-only).
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


def _pytest(paths, env, workers=0, timeout=None):
    """(passed, failed, skipped) of pytest over ``paths`` (``workers`` > 0:
    pytest-xdist processes)."""
    extra = ["-n", str(workers)] if workers else []
    try:
        done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                               *extra, *paths], cwd=ROOT, env=env, capture_output=True,
                              text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        print(out[-3000:], f"\n(timed out after {timeout} s)", flush=True)
        return 0, 1, 0
    tail = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else done.stderr[-500:]
    counts = {k: int(n) for n, k in re.findall(r"(\d+) (passed|failed|skipped|error)", tail)}
    if counts.get("failed") or counts.get("error"):
        print(done.stdout[-6000:], flush=True)
    print(tail, flush=True)
    return (counts.get("passed", 0), counts.get("failed", 0) + counts.get("error", 0),
            counts.get("skipped", 0))


TRITON_ON_CUDA = "tests/test_precision.py::test_triton_stochastic_round_on_cuda_equals_the_cpus"


def parity(rows, workers=0):
    env = dict(os.environ, POPTORCHSIM_DEVICE="cuda")
    host = ["tests/test_host_device.py", TRITON_ON_CUDA]
    for name, paths, n in (("host device tests", host, 0),
                           ("model-hub subset", ["tests/test_model_hub.py"], workers)):
        passed, failed, skipped = _pytest(paths, env, n, timeout=300)
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


def applications(rows, examples, deps="", log_dir=None):
    """Graphcore's BERT ``demo_tiny_128`` (its 360 steps, timed whole, start-up
    and compile included) and ViT-B/16 pretraining at its test's size (the
    step time the program itself prints for its last step, ``Mean step
    duration``)."""
    env = dict(os.environ, POPTORCHSIM_DEVICE="cuda")
    logs = log_dir or os.path.join(ROOT, "benchmarks", "out", "gpu_apps")
    for app, steps, limit in (("bert-tiny", 360, 240), ("vit-pretrain", 2, 240)):
        t0 = time.monotonic()
        done = subprocess.run([sys.executable, os.path.join(HERE, "graphcore_apps.py"),
                               "--examples", examples, "--only", app, "--steps", str(steps),
                               "--timeout", str(limit),
                               "--log-dir", logs, *(["--deps-all", deps] if deps else [])],
                              env=env, capture_output=True, text=True)
        seconds = time.monotonic() - t0
        row = [ln for ln in done.stdout.splitlines() if ln.startswith(f"| {app} |")]
        ok = done.returncode == 0 and bool(row) and "| PASS: " in row[-1]   # not SKIPPED
        print(row[-1] if row else done.stdout[-2000:] + done.stderr[-2000:], flush=True)
        if app == "bert-tiny":
            rows.append(("BERT demo_tiny_128: 360 steps", f"{seconds / 60:.2f} min (all in)",
                         "< 2 min, MLM acc > 0.85", ok and seconds < 120))
        else:
            try:
                with open(os.path.join(logs, f"{app}.log")) as f:
                    step = [float(x) for x in re.findall(r"Step: \d+/\d+ .*?step duration: "
                                                         r"([\d.]+) seconds", f.read())]
            except OSError:
                step = []
            # its "Mean step duration" is that step's own time (pretrain.py); the
            # first step also fills the data loader's workers
            last = step[-1] if step else float("inf")
            rows.append(("ViT-B/16 pretraining step (its test's size)",
                         f"{last:.1f} s/step (last of {len(step)})", "< 10 s", ok and last < 10))


def _table(rows, path=None):
    width = max([len(r[0]) for r in rows] + [5])
    print(f"\n{'check':<{width}}  {'figure':<30} {'bar':<24} pass")
    for check, figure, bar, ok in rows:
        print(f"{check:<{width}}  {figure:<30} {bar:<24} {'yes' if ok else 'NO'}", flush=True)
    if path:
        with open(path, "w") as f:
            json.dump([dict(zip(("check", "figure", "bar", "pass"), r)) for r in rows], f,
                      indent=1)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--examples", default=None, help="a checkout of graphcore/examples")
    p.add_argument("--json", metavar="PATH")
    p.add_argument("--app-deps", default="", metavar="DIR[:DIR]",
                   help="the applications' Python packages (graphcore_apps.py --deps-all)")
    p.add_argument("--log-dir", default=None, help="the applications' output goes here")
    p.add_argument("--workers", type=int, default=0,
                   help="pytest-xdist processes for the model-hub subset")
    p.add_argument("--only", action="append", choices=("parity", "speed", "apps"),
                   help="run this part only (may be repeated)")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print(f"gpu_check: this PyTorch ({torch.__version__}) sees no CUDA device: nothing "
              "to check (the CPU's checks are `make test` and benchmarks/host_speed.py)")
        return 0
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}, "
          f"TF32 matmul {torch.backends.cuda.matmul.allow_tf32}, "
          f"cuDNN TF32 {torch.backends.cudnn.allow_tf32}\n", flush=True)
    parts = args.only or ("parity", "speed", "apps")
    rows = []
    if "speed" in parts:
        speed(rows)
        _table(rows, args.json)
    if "parity" in parts:
        parity(rows, args.workers)
        _table(rows, args.json)
    if "apps" in parts:
        if args.examples:
            applications(rows, args.examples, args.app_deps, args.log_dir)
        else:
            print("Graphcore's applications: skipped (no --examples checkout)")
    _table(rows, args.json)
    return 0 if all(r[3] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
