"""Precompilation and the executable cache, walked through.

1. With ``Options().enableExecutableCaching(folder)`` (or ``POPTORCH_CACHE_DIR``)
   the first process compiles and stores the program; a second process with
   the same model loads it instead of tracing and compiling.
2. ``model.compileAndExport(path, *inputs)`` writes the executable, options,
   model and optimizer to one file; ``poptorch.load(path)`` in another
   process gives back a model that trains on without compiling, and trains
   exactly as a freshly compiled one.
3. ``export_model=False`` stores the executable alone: ``poptorch.load``
   refuses it (PopTorch's AssertionError), ``loadExecutable`` into a wrapper
   you build yourself takes it.

Run: ``python tutorials/precompilation/precompilation.py [--small]``.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import torch
import torch.nn as nn

import poptorchsim as poptorch  # PopTorch programs say `import poptorch`


class Net(nn.Module):
    """A small CNN classifier with its loss."""

    def __init__(self, width):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, width, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(width, 2 * width, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2))
        self.head = nn.Linear(2 * width * 7 * 7, 10)
        self.loss = nn.CrossEntropyLoss()

    def forward(self, x, labels):
        out = self.head(self.features(x).flatten(1))
        return out, self.loss(out, labels)


def batch(step):
    g = torch.Generator().manual_seed(step)
    return torch.randn(8, 1, 28, 28, generator=g), torch.randint(0, 10, (8,), generator=g)


def wrapped(width, options):
    torch.manual_seed(0)
    model = Net(width)
    optimizer = poptorch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    return poptorch.trainingModel(model, options.showCompilationProgressBar(False), optimizer)


# -- what the child processes run ---------------------------------------------------------
def child_cached(width, folder):
    """A fresh process: compile (or load from the cache) and train 2 steps."""
    model = wrapped(width, poptorch.Options().enableExecutableCaching(folder))
    t0 = time.perf_counter()
    model.compile(*batch(0))
    seconds = time.perf_counter() - t0
    losses = [float(model(*batch(k))[1]) for k in range(2)]
    return {"compile_s": seconds, "loaded": getattr(model._compiled, "loaded_from", None)
            is not None, "losses": losses}


def child_load(path):
    """A fresh process: poptorch.load the exported file and train 4 steps."""
    t0 = time.perf_counter()
    model = poptorch.load(path)
    seconds = time.perf_counter() - t0
    losses = [float(model(*batch(k))[1]) for k in range(4)]
    return {"load_s": seconds, "losses": losses}


def in_child(*args):
    result = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", *args],
                            capture_output=True, text=True, timeout=600)
    if result.returncode:
        raise SystemExit(f"child process failed:\n{result.stderr[-3000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", action="store_true", help="a narrower network")
    parser.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        kind, *rest = args.child
        out = child_cached(int(rest[0]), rest[1]) if kind == "cached" else child_load(rest[0])
        print(json.dumps(out))
        return
    width = 4 if args.small else 16
    folder = tempfile.mkdtemp(prefix="precompilation_")
    t_start = time.perf_counter()

    print("== 1. The executable cache: two processes, one folder ==")
    cache = os.path.join(folder, "cache")
    first = in_child("cached", str(width), cache)
    second = in_child("cached", str(width), cache)
    files = os.listdir(cache)
    print(f"first process:  compiled in {first['compile_s']:.2f} s, stored "
          f"{len(files)} file ({os.path.getsize(os.path.join(cache, files[0])) / 1e6:.1f} MB)")
    print(f"second process: loaded={second['loaded']} in {second['compile_s']:.2f} s "
          f"({first['compile_s'] / second['compile_s']:.1f}x faster), losses "
          f"{second['losses']} (first process: {first['losses']})")
    if not second["loaded"] or second["losses"] != first["losses"]:
        raise SystemExit("the second process should load the program and train alike")

    print("\n== 2. compileAndExport here, poptorch.load in another process ==")
    path = os.path.join(folder, "net.poptorch")
    model = wrapped(width, poptorch.Options())
    model.compileAndExport(path, *batch(0))            # compiles, writes, does not run
    reference = [float(model(*batch(k))[1]) for k in range(4)]      # trained here
    loaded = in_child("load", path)
    print(f"poptorch.load took {loaded['load_s']:.2f} s; 4 steps in the new process: losses "
          f"{[round(v, 6) for v in loaded['losses']]}")
    print(f"the model compiled here, same 4 steps:            "
          f"{[round(v, 6) for v in reference]}")
    if loaded["losses"] != reference:
        raise SystemExit("the loaded model should train exactly as the compiled one")

    print("\n== 3. The executable alone: export_model=False ==")
    exe = os.path.join(folder, "exe.poptorch")
    wrapped(width, poptorch.Options()).compileAndExport(exe, *batch(0), export_model=False)
    try:
        poptorch.load(exe)
    except AssertionError as error:
        print(f"poptorch.load raised AssertionError: {str(error).splitlines()[0]}")
    else:
        raise SystemExit("poptorch.load of an executable without a model should fail")
    mine = wrapped(width, poptorch.Options())
    mine.loadExecutable(exe)
    print(f"loadExecutable into a wrapper built here: loss {float(mine(*batch(0))[1]):.4f}")
    print(f"\nDone in {time.perf_counter() - t_start:.1f} s.")


if __name__ == "__main__":
    main()
