#!/usr/bin/env python3
"""Estimated against published IPU throughput (../shared/reference/ipu-facts.md §3c).

Each configuration is compiled by poptorchsim for a Mk2 IPU and its estimated
samples per second (from the machine's cycle model plus the host call
overhead) divided by the figure Graphcore published.  Bar: every ratio
between 0.5 and 2.

* Efficient-data-loading tutorial CNN (PopTorch), training, batch 16,
  deviceIterations 50, poptorch.optim.SGD(lr=0.001, momentum=0.9), synthetic
  data: 46,739 items/s.
* PopXL MNIST MLP (784-512-512-512-10, GELU), inference, micro-batch 80,
  one replica, host-timed session.run: 99,971 samples/s.
"""
import argparse
import json
import sys

import torch
import torch.nn as nn

import poptorchsim as poptorch


class DataLoadingCNN(nn.Module):
    """The efficient-data-loading tutorial's model, with its loss."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 5, 3)
        self.pool = nn.MaxPool2d(2, 2)
        self.conv2 = nn.Conv2d(5, 12, 5)
        self.norm = nn.GroupNorm(3, 12)
        self.fc1 = nn.Linear(41772, 100)
        self.fc2 = nn.Linear(100, 10)
        self.loss = nn.NLLLoss()

    def forward(self, x, labels):
        x = self.pool(torch.relu(self.conv1(x)))
        x = self.norm(torch.relu(self.conv2(x)))
        x = torch.relu(self.fc1(torch.flatten(x, start_dim=1)))
        x = torch.log_softmax(self.fc2(x), dim=0)
        return x, self.loss(x, labels)


class PopXLMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(784, 512), nn.Linear(512, 512)
        self.fc3, self.fc4 = nn.Linear(512, 512), nn.Linear(512, 10)

    def forward(self, x):
        x = x.reshape(-1, 28 * 28)
        x = nn.functional.gelu(self.fc1(x))
        x = nn.functional.gelu(self.fc2(x))
        x = nn.functional.gelu(self.fc3(x))
        return self.fc4(x)


def _quiet(opts):
    return opts.showCompilationProgressBar(False)


def data_loading_cnn():
    batch, di = 16, 50
    model = DataLoadingCNN()
    opts = _quiet(poptorch.Options().deviceIterations(di).enableSyntheticData(True))
    tm = poptorch.trainingModel(model, opts,
                                poptorch.optim.SGD(model.parameters(), lr=0.001, momentum=0.9))
    tm.compile(torch.randn(batch * di, 1, 128, 128), torch.randint(0, 10, (batch * di,)))
    return tm, batch * di, 46_739


def popxl_mlp_inference():
    batch = 80
    im = poptorch.inferenceModel(PopXLMLP(), _quiet(poptorch.Options()))
    im.compile(torch.randn(batch, 28, 28))
    return im, batch, 99_971


CONFIGS = {
    "efficient-data-loading CNN, training, synthetic (PopTorch)": data_loading_cnn,
    "PopXL MNIST MLP, inference, micro-batch 80": popxl_mlp_inference,
}


def run():
    rows = []
    for name, build in CONFIGS.items():
        executor, samples, published = build()
        est = executor.cycleEstimate()
        estimated = samples / est["seconds"]
        total = est["total"]
        split = {k: est[k] / total for k in ("compute", "exchange", "sync", "host")}
        rows.append({"config": name, "samples_per_call": samples, "estimated": estimated,
                     "published": published, "ratio": estimated / published, "split": split})
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", help="write the results here")
    args = p.parse_args(argv)
    rows = run()
    print(f"{'configuration':58s} {'estimated':>11s} {'published':>10s} {'ratio':>6s}")
    for r in rows:
        split = " ".join(f"{k} {v:.0%}" for k, v in r["split"].items())
        print(f"{r['config']:58s} {r['estimated']:11,.0f} {r['published']:10,d} "
              f"{r['ratio']:6.2f}   ({split})")
    ok = all(0.5 <= r["ratio"] <= 2.0 for r in rows)
    print("all ratios within [0.5, 2]" if ok else "SOME RATIOS OUTSIDE [0.5, 2]")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
