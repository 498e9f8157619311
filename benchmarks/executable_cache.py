"""Compile time with and without the executable cache: ResNet-18 training.

Each round starts two fresh processes on one empty cache folder
(``POPTORCH_CACHE_DIR``): the first compiles a torchvision ResNet-18 (no
weights, batch 4 of 224x224, SGD with momentum) and stores the executable,
the second finds it and loads it.  Each process reports the time of
``model.compile(x, y)``, the time from its start to the end of compile
(interpreter, imports and model construction included) and the loss and
weights after one training step, which must be equal in both processes.
Times are medians over the rounds.

    python benchmarks/executable_cache.py [--rounds 3] [--json results.json]
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

STARTED = time.perf_counter()
BATCH = 4


def child(cache_dir, build, out):
    """One process: compile (or load) and train one step; write the timings."""
    import hashlib

    import torch
    import torchvision

    import poptorchsim as poptorch
    from poptorchsim.runtime.executables import cache
    # the parent's build id: others may edit poptorchsim's sources while this runs
    cache.build_id = lambda: build

    class WithLoss(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.net = torchvision.models.resnet18()
            self.loss = torch.nn.CrossEntropyLoss()

        def forward(self, x, y):
            out = self.net(x)
            return out, self.loss(out, y)

    torch.manual_seed(0)
    model = WithLoss()
    optimizer = poptorch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    opts = poptorch.Options().showCompilationProgressBar(False).enableExecutableCaching(cache_dir)
    training = poptorch.trainingModel(model, opts, optimizer)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(BATCH, 3, 224, 224, generator=g)
    y = torch.randint(0, 1000, (BATCH,), generator=g)
    t0 = time.perf_counter()
    training.compile(x, y)
    compile_s = time.perf_counter() - t0
    since_start = time.perf_counter() - STARTED
    _, loss = training(x, y)
    weights = hashlib.sha256(model.net.conv1.weight.detach().numpy().tobytes()).hexdigest()
    with open(out, "w") as f:
        json.dump({"compile_s": compile_s, "start_to_compiled_s": since_start,
                   "loaded": getattr(training._compiled, "loaded_from", None) is not None,
                   "loss": float(loss), "weights": weights}, f)


def run_child(cache_dir, build, out):
    t0 = time.perf_counter()
    subprocess.run([sys.executable, __file__, "--child", cache_dir, build, out], check=True)
    with open(out) as f:
        result = json.load(f)
    result["process_s"] = time.perf_counter() - t0
    return result


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    from poptorchsim.runtime.executables import cache
    build = cache.build_id()
    cold, warm = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            folder = os.path.join(tmp, f"cache{r}")
            first = run_child(folder, build, os.path.join(tmp, f"cold{r}.json"))
            second = run_child(folder, build, os.path.join(tmp, f"warm{r}.json"))
            assert not first["loaded"] and second["loaded"], (first, second)
            assert (first["loss"], first["weights"]) == (second["loss"], second["weights"]), \
                "the cached executable trained differently"
            cold.append(first)
            warm.append(second)
            size = sum(os.path.getsize(os.path.join(folder, n)) for n in os.listdir(folder))
    summary = {}
    print(f"ResNet-18 training, batch {BATCH}, {args.rounds} rounds (medians); "
          f"cache file {size / 1e6:.1f} MB")
    print(f"{'':22}{'empty cache':>14}{'warm cache':>14}{'ratio':>8}")
    for key, label in (("compile_s", "compile()"),
                       ("start_to_compiled_s", "start to compiled"),
                       ("process_s", "whole process")):
        c = statistics.median(r[key] for r in cold)
        w = statistics.median(r[key] for r in warm)
        summary[key] = {"empty_cache": c, "warm_cache": w, "ratio": c / w}
        print(f"{label:22}{c:13.2f}s{w:13.2f}s{c / w:7.1f}x")
    print(f"loss after one step, both processes: {cold[0]['loss']:.6f} (weights equal)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rounds": args.rounds, "cache_bytes": size, **summary}, f, indent=2)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        child(*sys.argv[2:5])
    else:
        main()
