"""PopTorch basics on a simulated IPU: the README's walkthrough as one script.

Run it from the repository root:

    python tutorials/basics/basics.py          # 4,000 training samples, 3 epochs
    python tutorials/basics/basics.py --small  # fewer samples and epochs (CI)

Each numbered section below matches the section of README.md with the same
number.  The data is synthetic (two Gaussian blobs in 8 dimensions), so the
script needs no download and runs in seconds on a laptop.
"""
import argparse
import sys
import time

import torch
import torch.nn as nn

import poptorchsim as poptorch  # PopTorch programs say `import poptorch`


# ---------------------------------------------------------------------------
# The data and the model
# ---------------------------------------------------------------------------
FEATURES = 8


def make_blobs(n, seed):
    """``n`` samples of two Gaussian blobs, centred at -c and +c, labels 0/1."""
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, 2, (n,), generator=g)
    centre = torch.full((FEATURES,), 0.8)
    sign = labels.float().mul(2).sub(1).unsqueeze(1)          # -1 or +1
    x = sign * centre + torch.randn(n, FEATURES, generator=g)
    return torch.utils.data.TensorDataset(x, labels)


class ClassifierWithLoss(nn.Module):
    """A small MLP.  With labels it returns (output, loss), as PopTorch wants."""

    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(FEATURES, 32), nn.ReLU(), nn.Linear(32, 2))
        self.loss = nn.CrossEntropyLoss()

    def forward(self, x, labels=None):
        out = self.net(x)
        if labels is None:          # inference
            return out
        return out, self.loss(out, labels)


class TagSamples(nn.Module):
    """Wraps the classifier and also returns the id of every sample it saw."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, x, labels, sample_id):
        out, loss = self.inner(x, labels)
        return out, loss, sample_id


def header(number, title):
    print(f"\n== {number}. {title} ==")


def copy_of(model):
    """A fresh, unwrapped ClassifierWithLoss with ``model``'s weights."""
    fresh = ClassifierWithLoss()
    fresh.load_state_dict(model.state_dict())
    return fresh


def max_weight_diff(a, b):
    return max((p - q).abs().max().item() for p, q in zip(a.parameters(), b.parameters()))


def eager_sgd_steps(model, lr, batches):
    """Plain PyTorch: one SGD step per (x, y) in ``batches``."""
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    for x, y in batches:
        opt.zero_grad()
        _, loss = model(x, y)
        loss.backward()
        opt.step()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", action="store_true",
                        help="fewer samples and epochs (what CI runs)")
    args = parser.parse_args()
    n_train, n_test, epochs = (1000, 512, 2) if args.small else (4000, 1024, 3)
    start = time.perf_counter()
    torch.manual_seed(0)
    train_ds, test_ds = make_blobs(n_train, seed=1), make_blobs(n_test, seed=2)
    lr = 0.1
    print(f"Synthetic data: {n_train} training and {n_test} test samples, "
          f"{FEATURES} features, 2 classes")

    # -----------------------------------------------------------------------
    header(1, "Wrap a model in two lines")
    # -----------------------------------------------------------------------
    model = ClassifierWithLoss()
    opts = poptorch.Options()
    optimizer = poptorch.optim.SGD(model.parameters(), lr=lr)
    training_model = poptorch.trainingModel(model, opts, optimizer)

    x, y = train_ds[:16]
    out, loss = training_model(x, y)           # the first call compiles, then runs
    print(f"compiled in {training_model.compilationTime().total_seconds():.2f} s; "
          f"one call: output {tuple(out.shape)}, loss {loss.item():.3f}")
    print(f"the host model holds the new weights: "
          f"model.net[0].weight[0, :3] = "
          f"{[round(v, 4) for v in model.net[0].weight[0, :3].tolist()]}")

    # -----------------------------------------------------------------------
    header(2, "Options: chaining, freezing and clone()")
    # -----------------------------------------------------------------------
    chained = poptorch.Options().deviceIterations(4).replicationFactor(1)
    chained.Training.gradientAccumulation(1)      # Training returns its own object
    print(f"chained: device_iterations={chained.device_iterations}, "
          f"replication_factor={chained.replication_factor}, "
          f"gradient_accumulation={chained.Training.gradient_accumulation}")
    try:
        opts.deviceIterations(4)        # `opts` was frozen by trainingModel
    except AttributeError as error:
        print(f"changing the options given to trainingModel: AttributeError: {error}")
    copy_of_opts = opts.clone().deviceIterations(4)   # an unfrozen copy
    print(f"opts.clone().deviceIterations(4) works: {copy_of_opts.device_iterations} "
          f"(the original still says {opts.device_iterations})")

    # -----------------------------------------------------------------------
    header(3, "The DataLoader and the combined batch")
    # -----------------------------------------------------------------------
    opts = poptorch.Options().deviceIterations(4).showCompilationProgressBar(False)
    train_loader = poptorch.DataLoader(opts, train_ds, batch_size=16, shuffle=True)
    x, y = next(iter(train_loader))
    dropped = n_train - len(train_loader) * train_loader.combinedBatchSize
    print(f"batch_size=16 x deviceIterations=4 x replicationFactor=1 x "
          f"gradientAccumulation=1 = combinedBatchSize {train_loader.combinedBatchSize}")
    print(f"one item: x {tuple(x.shape)}, y {tuple(y.shape)}; {len(train_loader)} items "
          f"per epoch, drop_last=True drops the last {dropped} samples")
    big = poptorch.Options().deviceIterations(4).replicationFactor(2)
    big.Training.gradientAccumulation(2)
    big_loader = poptorch.DataLoader(big, train_ds, batch_size=16)
    print(f"with replicationFactor(2) and gradientAccumulation(2): combinedBatchSize "
          f"{big_loader.combinedBatchSize} = 16 x 4 x 2 x 2, {len(big_loader)} items")

    # -----------------------------------------------------------------------
    header(4, "deviceIterations: one call, N weight updates")
    # -----------------------------------------------------------------------
    training_model.destroy()        # unwrap the model before wrapping it again
    training_model = poptorch.trainingModel(model, opts, optimizer)
    before = copy_of(model)
    out, loss = training_model(x, y)          # 64 samples: 4 steps of 16
    eager_sgd_steps(before, lr, zip(x.split(16), y.split(16)))
    print(f"one call on {x.shape[0]} samples = 4 SGD steps of 16 in plain PyTorch: "
          f"max weight difference {max_weight_diff(model, before):.1e}")
    print(f"it returns the last micro-batch only (OutputMode.Final): "
          f"output {tuple(out.shape)}, loss {tuple(loss.shape)}")
    for epoch in range(epochs):
        losses = [training_model(x, y)[1].item() for x, y in train_loader]
        print(f"epoch {epoch + 1}: {len(losses)} calls = {4 * len(losses)} weight "
              f"updates, mean loss {sum(losses) / len(losses):.3f}")

    # -----------------------------------------------------------------------
    header(5, "Replication and gradient accumulation")
    # -----------------------------------------------------------------------
    training_model.destroy()
    di, ga, rf, micro = 2, 2, 2, 4
    opts = poptorch.Options().deviceIterations(di).replicationFactor(rf)
    opts.Training.gradientAccumulation(ga)
    opts.showCompilationProgressBar(False)
    n = di * ga * rf * micro
    x, y = train_ds[:n]
    ids = torch.arange(n)
    layout = ids.reshape(di, ga, rf, micro)   # [deviceIterations, gradAccum, replicas, micro]
    print(f"a combined batch of {n} samples is read as [deviceIterations={di}, "
          f"gradientAccumulation={ga}, replicas={rf}, micro-batch={micro}]:")
    for i in range(di):
        for g in range(ga):
            print(f"  iteration {i}, accumulation step {g}: "
                  + ", ".join(f"replica {r} gets {layout[i, g, r].tolist()}"
                              for r in range(rf)))
    tagged = poptorch.trainingModel(TagSamples(model), opts, optimizer)
    before = copy_of(model)
    out, loss, seen = tagged(x, y, ids)
    print(f"OutputMode.Final returns the last micro-batch of each replica: "
          f"sample ids {seen.tolist()}")
    # one weight update per device iteration, over ga x rf micro-batches (mean)
    eager_sgd_steps(before, lr, zip(x.split(ga * rf * micro), y.split(ga * rf * micro)))
    print(f"each iteration is one update, averaged over {ga} x {rf} micro-batches of "
          f"{micro}: the same as plain PyTorch on batches of {ga * rf * micro} "
          f"(max weight difference {max_weight_diff(model, before):.1e})")
    tagged.destroy()

    opts = poptorch.Options().deviceIterations(4).replicationFactor(2)
    opts.Training.gradientAccumulation(2)
    opts.showCompilationProgressBar(False)
    train_loader = poptorch.DataLoader(opts, train_ds, batch_size=8, shuffle=True)
    training_model = poptorch.trainingModel(model, opts, optimizer)
    for epoch in range(epochs):
        losses = [training_model(x, y)[1] for x, y in train_loader]
        print(f"epoch {epoch + 1}: {len(losses)} calls of {train_loader.combinedBatchSize}"
              f" samples, loss per replica {tuple(losses[-1].shape)}, mean loss "
              f"{torch.stack(losses).mean().item():.3f}")

    # -----------------------------------------------------------------------
    header(6, "Output modes")
    # -----------------------------------------------------------------------
    di, ga, rf, micro = 4, 2, 2, 8
    x, y = train_ds[:di * ga * rf * micro]
    print(f"deviceIterations={di}, gradientAccumulation={ga}, replicationFactor={rf}, "
          f"micro-batch {micro}, input {tuple(x.shape)}:")
    modes = [(poptorch.OutputMode.All, None, f"{micro} x di x ga x rf"),
             (poptorch.OutputMode.Final, None, f"{micro} x rf"),
             (poptorch.OutputMode.Sum, None, f"{micro} x rf"),
             (poptorch.OutputMode.EveryN, 2, f"{micro} x di/N x ga x rf")]
    for mode, period, rows in modes:
        scratch = copy_of(model)           # leave `model` as it is
        mode_opts = opts.clone().deviceIterations(di).outputMode(mode, period)
        mode_opts.Training.gradientAccumulation(ga)
        scratch_model = poptorch.trainingModel(
            scratch, mode_opts, poptorch.optim.SGD(scratch.parameters(), lr=lr))
        out, loss = scratch_model(x, y)
        name = mode.name + (f"({period})" if period else "")
        print(f"  {name:10s} output {str(tuple(out.shape)):9s} loss "
              f"{str(tuple(loss.shape)):5s} rows = {rows}")
        scratch_model.destroy()
    print("  (Sum adds over di x ga: divide by 8 for a mean; "
          "EveryN(2) keeps iterations 1 and 3)")

    # -----------------------------------------------------------------------
    header(7, "Inference after training")
    # -----------------------------------------------------------------------
    inference_opts = poptorch.Options().deviceIterations(4)
    inference_opts.showCompilationProgressBar(False)
    test_loader = poptorch.DataLoader(inference_opts, test_ds, batch_size=16)
    inference_model = poptorch.inferenceModel(model, inference_opts)

    def accuracy():
        correct = total = 0
        for x, y in test_loader:
            correct += (inference_model(x).argmax(dim=1) == y).sum().item()
            total += y.numel()
        return 100.0 * correct / total

    acc = accuracy()
    x_all, y_all = test_ds[:]
    with torch.no_grad():
        host_acc = 100.0 * (model(x_all).argmax(1) == y_all).float().mean().item()
    print(f"test accuracy on the simulated IPU: {acc:.1f}% "
          f"(plain PyTorch on the host model: {host_acc:.1f}%)")
    training_model.detachFromDevice()   # weights to the host, device released
    print(f"training model detached: isAttachedToDevice() = "
          f"{training_model.isAttachedToDevice()}")
    probe = x_all[:64]
    before = inference_model(probe)
    training_model(*next(iter(train_loader)))   # a call attaches it again
    after = inference_model(probe)              # re-reads the trained weights
    with torch.no_grad():
        host = model(probe)
    print(f"one more training call re-attaches it: isAttachedToDevice() = "
          f"{training_model.isAttachedToDevice()}")
    print(f"the inference model follows the training: its outputs moved by up to "
          f"{(after - before).abs().max().item():.1e} and match the host model's to "
          f"{(after - host).abs().max().item():.1e}")

    # -----------------------------------------------------------------------
    header(8, "Reading the compiled program")
    # -----------------------------------------------------------------------
    ir = str(training_model.getIR())
    lines = ir.splitlines()
    program = lines[:lines.index("")] if "" in lines else lines
    print("print(training_model.getIR()) starts with the program:")
    for line in program:
        print("  | " + line)
    print(f"  ... then the graphs it calls ({len(lines) - len(program)} more lines)")
    report = training_model.memoryReport()
    busiest = int(report.total.max())
    print(f"memory: busiest tile {busiest / 1024:.1f} KiB of {report.capacity / 1024:.0f} "
          f"KiB ({100.0 * busiest / report.capacity:.1f}%), "
          f"{int(report.total.sum()) / 2**20:.1f} MiB on all {report.total.size} tiles")
    cycles = training_model.cycleEstimate()
    samples = train_loader.combinedBatchSize
    parts = ", ".join(f"{k} {100.0 * cycles[k] / cycles['total']:.0f}%"
                      for k in ("compute", "exchange", "sync", "host"))
    print(f"cycle estimate: {cycles['total']:,.0f} cycles per call = "
          f"{cycles['seconds'] * 1e6:.0f} us for {samples} samples "
          f"(~{samples / cycles['seconds']:,.0f} samples/s on the simulated Mk2)")
    print(f"where the cycles go: {parts}")

    final_acc = accuracy()
    print(f"\nDone in {time.perf_counter() - start:.1f} s. "
          f"Final test accuracy: {final_acc:.1f}%")
    return 0


if __name__ == "__main__":
    sys.exit(main())
