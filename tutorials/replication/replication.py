"""Replication, replicated tensor sharding and off-chip optimizer state: the README's walkthrough.

Run it from the repository root:

    python tutorials/replication/replication.py          # trains 16 steps
    python tutorials/replication/replication.py --small  # trains 4 steps (CI)
    python tutorials/replication/replication.py --out reports   # keep the reports

Each numbered section below matches the section of README.md with the same
number.  The MNIST MLP of Graphcore's remote-variables tutorial trains on 4
replicas (data parallelism) and learns what plain PyTorch learns; its Adam
state is then sharded across the replicas (replicated tensor sharding),
moved to Streaming Memory, and both, with the cost of each next to the
figures Graphcore published; last, the same training runs in 2 processes
started by poptorchsim's launcher.  Compiling is cheap (the model is traced
with fake tensors); training does the real arithmetic on the host CPU.
"""
import argparse
import copy
import importlib.util
import os
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import torch
import torch.nn as nn

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path[:0] = [str(HERE)]      # mnist_mlp.py beside this file

import poptorchsim as poptorch  # noqa: E402 - PopTorch programs say `import poptorch`
from poptorchsim.profiling import summary, write_report  # noqa: E402
from poptorchsim.validation.published import REMOTE_CASES  # noqa: E402 - the seed's five cases
from mnist_mlp import (ACCUMULATION, CLASSES, LR, MICRO_BATCH, MLP, REPLICAS,  # noqa: E402
                       digits)

PER_STEP = MICRO_BATCH * ACCUMULATION * REPLICAS        # 256 samples per weight update


# ---------------------------------------------------------------------------
# Helpers
# ---------------------------------------------------------------------------
def header(number, title):
    print(f"\n== {number}. {title} ==")


def kib(nbytes):
    return f"{nbytes / 1024:,.0f} KiB"


def mib(nbytes):
    return f"{nbytes / 2**20:.2f} MiB"


def wrapped(text, indent="  "):
    return textwrap.fill(text, width=92, initial_indent=indent, subsequent_indent=indent)


def replicated_options(optimizer_location=None):
    """4 replicas x gradientAccumulation(8), no progress bar; optionally
    where Adam's state lives."""
    opts = poptorch.Options().showCompilationProgressBar(False)
    opts.replicationFactor(REPLICAS)
    opts.Training.gradientAccumulation(ACCUMULATION)
    if optimizer_location is not None:
        opts.TensorLocations.setOptimizerLocation(optimizer_location)
    return opts


def state_location(threshold=None, on_chip=True):
    """Adam's state on chip or in Streaming Memory, sharded across the
    replicas when it has at least ``threshold`` elements (None: not sharded)."""
    settings = poptorch.TensorLocationSettings().useOnChipStorage(on_chip)
    if threshold is not None:
        settings.useReplicatedTensorSharding(True)
        settings.minElementsForReplicatedTensorSharding(threshold)
    return settings


def adam(model):
    return poptorch.optim.Adam(model.parameters(), lr=LR)


def train(model, opts, loader, steps):
    """``steps`` calls of a trainingModel; returns it and the mean loss of each call."""
    training_model = poptorch.trainingModel(model, opts, adam(model))
    losses = []
    for step, (x, y) in enumerate(loader):
        if step == steps:
            break
        losses.append(training_model(x, y)[1].mean().item())   # one loss per replica
    return training_model, losses


def pytorch_step(model, optimizer, x, y, ga=ACCUMULATION, rf=REPLICAS):
    """One trainingModel call in plain PyTorch: the combined batch is laid out
    [ga, rf, micro-batch], and the weight update uses the mean gradient of the
    ga x rf micro-batches (tests/conftest.py reference_call)."""
    x = x.reshape(ga, rf, -1, *x.shape[1:])
    y = y.reshape(ga, rf, -1)
    optimizer.zero_grad()
    for g in range(ga):
        for r in range(rf):
            _, loss = model(x[g, r], y[g, r])
            (loss / (ga * rf)).backward()
    optimizer.step()


def max_weight_diff(a, b):
    """The largest difference between two state_dicts."""
    return max((a[k] - b[k]).abs().max().item() for k in a)


def accuracy(model, x, y):
    with torch.no_grad():
        return (model(x).argmax(1) == y).float().mean().item()


def saved_files(directory, written):
    names = [os.path.basename(p) for k, p in written.items() if p.endswith(".png")]
    return f"{directory}: {', '.join(sorted(names))}"


def program_text(training_model):
    """The program part of getIR(): the text before the first blank line."""
    return str(training_model.getIR()).split("\n\n")[0]


class SmallClassifier(nn.Module):
    """256 -> 512 -> 10, small enough for the 4-tile test IPU, almost."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(256, 512)
        self.fc2 = nn.Linear(512, CLASSES)
        self.loss = nn.CrossEntropyLoss()

    def forward(self, x, labels):
        out = self.fc2(torch.relu(self.fc1(x)))
        return out, self.loss(out, labels)


def on_test_ipu(optimizer_location):
    """SmallClassifier with Adam on the test IPU (4 tiles x 624 KiB), 4 replicas,
    gradientAccumulation(2), micro-batch 4: compiled, or the OutOfMemoryError."""
    torch.manual_seed(0)
    model = SmallClassifier()
    opts = poptorch.Options().showCompilationProgressBar(False).useIpuModelVersion("test")
    opts.replicationFactor(4)
    opts.Training.gradientAccumulation(2)
    if optimizer_location is not None:
        opts.TensorLocations.setOptimizerLocation(optimizer_location)
    training_model = poptorch.trainingModel(model, opts, adam(model))
    n = 4 * 2 * 4
    try:
        training_model.compile(torch.randn(n, 256), torch.randint(0, CLASSES, (n,)))
    except poptorch.OutOfMemoryError as error:
        return None, error
    memory = training_model.memoryReport()
    result = (memory.total.max(), memory.capacity)
    training_model.destroy()
    return result, None


def bar_chart(rows, path):
    """Estimated and published samples/s of the five cases, side by side."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = ["no sharding", "fc1.weight\nsharded", "weights'\nsharded", "all\nsharded",
              "on chip"]
    fig, ax = plt.subplots(figsize=(8, 4.2))
    xs = range(len(rows))
    ax.bar([x - 0.2 for x in xs], [r["estimated"] for r in rows], width=0.4,
           label="poptorchsim estimate", color="tab:blue")
    ax.bar([x + 0.2 for x in xs], [r["published"] for r in rows], width=0.4,
           label="published (Graphcore's tutorial)", color="tab:orange")
    ax.set_xticks(list(xs))
    ax.set_xticklabels(labels[:len(rows)])
    ax.set_ylabel("samples / s")
    ax.set_title("MNIST MLP, 4 replicas, Adam state in Streaming Memory (left 4) or on chip")
    ax.yaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:,.0f}"))
    ax.legend(loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


# ---------------------------------------------------------------------------
# The walkthrough
# ---------------------------------------------------------------------------
def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", action="store_true",
                        help="train 4 steps instead of 16 (what CI runs)")
    parser.add_argument("--out", metavar="DIR",
                        help="where the reports go (default: a new temporary directory)")
    args = parser.parse_args()
    steps = 4 if args.small else 16
    out = args.out or tempfile.mkdtemp(prefix="poptorchsim-replication-")
    os.makedirs(out, exist_ok=True)
    start = time.perf_counter()

    x_all, y_all, source = digits()
    n_train = steps * PER_STEP
    train_ds = torch.utils.data.TensorDataset(x_all[:n_train], y_all[:n_train])
    x_test, y_test = x_all[n_train:], y_all[n_train:]
    torch.manual_seed(0)
    model = MLP()
    initial = copy.deepcopy(model.state_dict())
    n_params = sum(p.numel() for p in model.parameters())
    print(f"MLP 784 -> 512 -> 512 -> 10: {n_params / 1e6:.2f} M parameters, Adam; "
          f"{source}; reports go to {out}")

    # -----------------------------------------------------------------------
    header(1, "Replicas in one process")
    # -----------------------------------------------------------------------
    opts = replicated_options()
    loader = poptorch.DataLoader(opts, train_ds, batch_size=MICRO_BATCH)
    print(f"replicationFactor({REPLICAS}) x gradientAccumulation({ACCUMULATION}) x "
          f"micro-batch {MICRO_BATCH}: the DataLoader gives {loader.combinedBatchSize} "
          f"samples per call, one weight update")
    reference = copy.deepcopy(model)                   # plain PyTorch, same start
    reference_opt = torch.optim.Adam(reference.parameters(), lr=LR)
    replicated, losses = train(model, opts, loader, steps)
    for x, y in loader:
        pytorch_step(reference, reference_opt, x, y)

    report = replicated.simulationReport()
    rep = report["replication"]
    print(f"simulationReport()['replication']: {rep['replicas']} replicas x "
          f"{rep['ipus_per_replica']} IPU = {rep['ipus']} IPUs in {rep['processes']} process")
    print(f"trained {len(losses)} steps: loss {losses[0]:.2f} -> {losses[-1]:.2f} (mean of "
          f"the replicas' last micro-batch); accuracy on {len(y_test):,} held-out samples "
          f"{accuracy(model, x_test, y_test):.0%}")
    cycles = replicated.cycleEstimate()
    clock = report["target"]["clock_hz"]
    print(f"the gradient all-reduce: cycleEstimate()['collective'] = "
          f"{cycles['collective']:,.0f} cycles = {cycles['collective'] / clock * 1e6:.0f} us "
          f"of the {cycles['seconds'] * 1e3:.2f} ms call "
          f"({cycles['collective'] / cycles['total']:.0%})")
    print("poptorchsim.profiling.summary(report), 3 of its lines:")
    for line in summary(report).splitlines():
        if line.startswith(("Cycles per call", "Replication", "Estimated")):
            print("  | " + line)
    print(f"plain PyTorch on a copy, mean gradient of {ACCUMULATION} x {REPLICAS} "
          f"micro-batches per step: max weight difference "
          f"{max_weight_diff(model.state_dict(), reference.state_dict()):.1e}")
    written = write_report(report, os.path.join(out, "replicated"))
    print("write_report wrote " + saved_files(os.path.join(out, "replicated"), written))
    replicated_weights = copy.deepcopy(model.state_dict())
    memory_plain = replicated.memoryReport()
    cycles_plain = cycles
    replicated.destroy()

    # -----------------------------------------------------------------------
    header(2, "Replicated tensor sharding")
    # -----------------------------------------------------------------------
    threshold = 512
    sharded_model = MLP()
    sharded_model.load_state_dict(initial)             # the same start as section 1
    opts = replicated_options(
        poptorch.TensorLocationSettings().useReplicatedTensorSharding(True)
        .minElementsForReplicatedTensorSharding(threshold))
    loader = poptorch.DataLoader(opts, train_ds, batch_size=MICRO_BATCH)
    sharded, _ = train(sharded_model, opts, loader, steps)
    report = sharded.simulationReport()
    loc = report["tensor_locations"]
    rows = loc["variables"]
    n_state = 2 * len(list(sharded_model.parameters()))  # exp_avg and exp_avg_sq of each
    n_sharded = sum(r["shards"] > 1 for r in rows)
    small = [n for n, p in sharded_model.named_parameters() if p.numel() < threshold]
    print(f"minElementsForReplicatedTensorSharding({threshold}): {n_sharded} of Adam's "
          f"{n_state} state tensors sharded over {loc['replicas']} replicas"
          + (f"; {', '.join(small)}'s stay whole (fewer than {threshold} elements)"
             if small else ""))
    print(f"on chip, each replica saves {mib(loc['saved_bytes_per_replica'])} "
          f"(saved_bytes_per_replica), up to {kib(loc['saved_bytes_max_tile'])} on one "
          f"tile (saved_bytes_max_tile)")
    by_plain, by_sharded = memory_plain.by_tensor, sharded.memoryReport().by_tensor
    for name in ("exp_avg/fc1.weight", "exp_avg_sq/fc1.weight"):
        print(f"  memoryReport().by_tensor['{name}']: {kib(by_plain[name].sum())} -> "
              f"{kib(by_sharded[name].sum())} per replica")
    print("print(sharded.getIR()), the program:")
    print(textwrap.indent(program_text(sharded), "  | "))
    cycles = sharded.cycleEstimate()
    print(f"per call: collectives {cycles_plain['collective'] / clock * 1e6:.0f} -> "
          f"{cycles['collective'] / clock * 1e6:.0f} us, compute "
          f"{cycles_plain['compute'] / clock * 1e6:.0f} -> "
          f"{cycles['compute'] / clock * 1e6:.0f} us (each replica updates a quarter of "
          f"the weights); {PER_STEP / cycles_plain['seconds']:,.0f} -> "
          f"{PER_STEP / cycles['seconds']:,.0f} samples/s")
    print(f"trained {steps} steps from the same start: max weight difference from section 1 "
          f"{max_weight_diff(sharded_model.state_dict(), replicated_weights):.1e}")
    written = write_report(report, os.path.join(out, "sharded"))
    print("write_report wrote " + saved_files(os.path.join(out, "sharded"), written))
    sharded.destroy()

    # -----------------------------------------------------------------------
    header(3, "Optimizer state off chip")
    # -----------------------------------------------------------------------
    # The five cases of the remote-variables tutorial, compiled (not run)
    x = torch.randn(PER_STEP, 784)
    y = torch.randint(0, CLASSES, (PER_STEP,))
    table = []
    for name, case_threshold, on_chip, published in REMOTE_CASES:
        case_model = MLP()
        location = None if on_chip else state_location(case_threshold, on_chip=False)
        training_model = poptorch.trainingModel(case_model, replicated_options(location),
                                                adam(case_model))
        training_model.compile(x, y)
        cycles = training_model.cycleEstimate()
        loc = training_model.simulationReport()["tensor_locations"]
        table.append({"name": name, "threshold": case_threshold, "published": published,
                      "estimated": PER_STEP / cycles["seconds"],
                      "streaming_us": cycles["streaming"] / clock * 1e6,
                      "off_chip": loc.get("streaming_bytes_per_replica", 0)})
        training_model.destroy()
    print("the remote-variables tutorial's table (4 replicas, gradientAccumulation(8), "
          "micro-batch 8), compiled:")
    print(f"  {'case':34s} {'threshold':>9s} {'off chip':>10s} {'estimated':>10s} "
          f"{'published':>10s} {'ratio':>6s}")
    for r in table:
        threshold_text = ("-" if r["threshold"] is None else
                          "1e10" if r["threshold"] >= 1e10 else f"{r['threshold']:,}")
        print(f"  {r['name']:34s} {threshold_text:>9s} {kib(r['off_chip']):>10s} "
              f"{r['estimated']:10,.0f} {r['published']:10,.0f} "
              f"{r['estimated'] / r['published']:6.2f}")
    ranked = [r["name"] for r in sorted(table, key=lambda r: r["estimated"])]
    same = ranked == [r["name"] for r in sorted(table, key=lambda r: r["published"])]
    print(f"  samples/s; off chip: Adam's state in Streaming Memory, per replica. "
          f"Same ranking as published: {'yes' if same else 'NO'}")
    print(f"Streaming Memory transfers per call: {table[0]['streaming_us']:,.0f} us unsharded, "
          f"{table[3]['streaming_us']:,.0f} us all sharded (each replica moves a quarter)")
    chart = os.path.join(out, "remote_variables.png")
    try:
        bar_chart(table, chart)
    except ImportError:
        print("no chart: matplotlib is not installed (pip install matplotlib)")
    else:
        print(f"bar chart: {chart}")

    print("SmallClassifier 256 -> 512 -> 10 with Adam on the 4-tile test IPU "
          "(useIpuModelVersion('test')), 4 replicas; Adam's state:")
    cases = [("on chip", None),
             ("in Streaming Memory", state_location(None, on_chip=False)),
             ("on chip, sharded", state_location(1000, on_chip=True)),
             ("in Streaming Memory, sharded", state_location(1000, on_chip=False))]
    for label, location in cases:
        fits, error = on_test_ipu(location)
        if error is not None:
            print(f"  {label:29s} poptorch.OutOfMemoryError:")
            print(wrapped(str(error).splitlines()[0].split(". ")[0] + ".", indent="    "))
        else:
            peak, capacity = fits
            print(f"  {label:29s} fits: fullest tile {kib(peak)} of {kib(capacity)}")

    # -----------------------------------------------------------------------
    header(4, "Two processes with the launcher")
    # -----------------------------------------------------------------------
    two_processes(out, steps=4)

    print(f"\nDone in {time.perf_counter() - start:.1f} s.")
    return 0


def two_processes(out, steps):
    """Runs train_two_processes.py in 2 processes of 2 replicas with the
    launcher, and compares process 0's weights with one process of 4 replicas
    that saw the same micro-batches."""
    script = HERE / "train_two_processes.py"
    if importlib.util.find_spec("poptorchsim.run") is None:
        print("skipped: poptorchsim.run (the launcher) is not in this poptorchsim yet")
        return
    saved = os.path.join(out, "two_processes.pt")
    command = [sys.executable, "-m", "poptorchsim.run", "--num-instances", "2",
               "--num-replicas", "4", str(script.relative_to(ROOT)),
               "--steps", str(steps), "--save", saved]
    print("$ python " + " ".join(command[1:]))
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + ([env["PYTHONPATH"]]
                                                       if env.get("PYTHONPATH") else []))
    t0 = time.perf_counter()
    result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True,
                            timeout=600)
    lines = [line for line in result.stdout.splitlines() if line.strip()]
    for line in lines[-4:]:
        print("  | " + line)
    if result.returncode != 0:
        print(f"the launcher exited with {result.returncode}:")
        print(textwrap.indent(result.stderr.strip()[-2000:], "  | "))
        raise SystemExit(1)
    print(f"  (2 processes, {time.perf_counter() - t0:.1f} s)")

    print(f"the DataLoader gave process 0 samples 0-{steps * PER_STEP // 2 - 1} and process 1 "
          f"samples {steps * PER_STEP // 2}-{steps * PER_STEP - 1}, "
          f"{PER_STEP // 2} per call")
    # The same data in one process of 4 replicas.  PopTorch's DataLoader gives
    # process p the p-th contiguous half of the data set; each call of process
    # p holds [accumulation, 2 local replicas, micro-batch].  Replicas 0-1 are
    # process 0's, 2-3 process 1's.
    from mnist_mlp import training_set
    dataset = training_set(steps * PER_STEP)
    x, y = dataset.tensors
    half = len(y) // 2
    local = PER_STEP // 2

    def combined(t, step):
        parts = [t[p * half + step * local:p * half + (step + 1) * local]
                 .reshape(ACCUMULATION, REPLICAS // 2, MICRO_BATCH, *t.shape[1:])
                 for p in range(2)]
        return torch.cat(parts, dim=1).reshape(PER_STEP, *t.shape[1:])

    torch.manual_seed(0)
    one = MLP()
    training_model = poptorch.trainingModel(one, replicated_options(), adam(one))
    for step in range(steps):
        training_model(combined(x, step), combined(y, step))
    training_model.destroy()
    two = torch.load(saved)
    diff = max_weight_diff(two, one.state_dict())
    print(f"one process with replicationFactor(4) on the same micro-batches: max weight "
          f"difference {diff:.1e} ({'within' if diff <= 1e-5 else 'NOT within'} 1e-5)")


if __name__ == "__main__":
    sys.exit(main())
