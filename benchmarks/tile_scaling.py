#!/usr/bin/env python3
"""Compile cost of a 1472-tile Mk2 against the 4-tile test IPU (MNIST network).

Per-tile quantities are arrays over tiles, so the tile count should barely
change compile time.  Bar: Mk2 at most 1.1x the 4-tile IPU.  The 4-tile IPU
cannot hold the network, so it compiles with Poplar's debug.allowOutOfMemory.
"""
import argparse
import logging
import os
import statistics
import sys
import time

import torch

import poptorchsim as poptorch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples", "mnist"))
from train import Network, TrainingModelWithLoss


def compile_seconds(version):
    model = TrainingModelWithLoss(Network(dropout=0.0))
    opts = poptorch.Options().deviceIterations(50).showCompilationProgressBar(False)
    opts.useIpuModelVersion(version)
    opts._Popart.setEngineOptions({"debug.allowOutOfMemory": "true"})
    tm = poptorch.trainingModel(model, opts, torch.optim.SGD(model.parameters(), lr=0.05))
    t0 = time.perf_counter()
    tm.compile(torch.randn(400, 1, 28, 28), torch.randint(0, 10, (400,)))
    return time.perf_counter() - t0, tm.memoryReport().total.max()


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=7)
    args = p.parse_args(argv)
    logging.getLogger("poptorchsim").setLevel(logging.ERROR)
    compile_seconds("ipu2")                      # warm-up: imports, first trace
    times = {"test": [], "ipu2": []}
    for _ in range(args.rounds):                 # interleaved
        for version in times:
            times[version].append(compile_seconds(version)[0])
    small, mk2 = statistics.median(times["test"]), statistics.median(times["ipu2"])
    print(f"compile, 4-tile test IPU: {small * 1e3:.0f} ms (median of {args.rounds})")
    print(f"compile, 1472-tile Mk2:   {mk2 * 1e3:.0f} ms")
    print(f"ratio Mk2 / 4-tile: {mk2 / small:.2f} (bar: at most 1.1)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
