#!/usr/bin/env python3
"""poptorchsim against Poplar's own IPU Model figures, layer by layer.

The reference is poplibs' ``tests/benchmark_results.csv`` at commit
8dcde1ec (2021-03-16), its ``IpuModel2`` rows: cycles, total memory and
max-tile memory of each benchmark layer (convolutions, fully connected,
gemm, LSTM, GRU, max pooling, reductions, embeddings), rebuilt here from
``tests/CMakeLists.txt`` with each tool's defaults (docs/poplar_tools.md).
The ResNet-50, VGG-16 and AlexNet rows are held out: not in the data file,
never printed, never fitted.

Prints every row (Poplar's cycles, ours, the ratio; total and max-tile
memory with theirs), the summary per kind (median error max(r, 1/r) - 1,
share of rows within 0.8-1.25, the worst rows) and writes a PNG of ours
against Poplar's.

    python benchmarks/poplar_layers.py [--kinds conv,fc] [--png benchmarks/out/poplar_layers.png]
                                       [--json benchmarks/out/poplar_layers.json]
"""
import argparse
import json
import os
import sys
from dataclasses import asdict

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from poptorchsim import validation


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--kinds", default="", help="comma-separated kinds (default: all)")
    parser.add_argument("--png", default="benchmarks/out/poplar_layers.png")
    parser.add_argument("--json", default="")
    args = parser.parse_args()
    table = validation.reference()["rows"]
    if args.kinds:
        kinds = set(args.kinds.split(","))
        table = [r for r in table if validation.kind_of(r) in kinds]
    rows = validation.compare([r["name"] for r in table], progress=True)
    print(validation.row_table(rows))
    print()
    print(validation.summary_table(rows, worst=10))
    os.makedirs(os.path.dirname(args.png) or ".", exist_ok=True)
    print(f"\nplot: {validation.plot(rows, args.png)}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump([asdict(r) for r in rows], f, indent=1)


if __name__ == "__main__":
    main()
