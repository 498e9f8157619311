"""Memory and profiling on a simulated IPU: the README's walkthrough as one script.

Run it from the repository root:

    python tutorials/memory_profiling/memory_profiling.py          # trains 6 steps at the end
    python tutorials/memory_profiling/memory_profiling.py --small  # trains 2 steps (CI)
    python tutorials/memory_profiling/memory_profiling.py --out reports   # keep the reports

Each numbered section below matches the section of README.md with the same
number.  A wide MLP trained with Adam does not fit one Mk1 IPU at a
micro-batch of 4096; the script reads the out-of-memory error, profiles the
model anyway, then fixes it three ways.  Compiling is cheap (the model is
traced with fake tensors); the few training steps at the end do the real
arithmetic on the host CPU.
"""
import argparse
import os
import sys
import tempfile
import textwrap
import time

import torch
import torch.nn as nn

import poptorchsim as poptorch  # PopTorch programs say `import poptorch`
from poptorchsim.profiling import summary

# ---------------------------------------------------------------------------
# The data and the model
# ---------------------------------------------------------------------------
FEATURES, HIDDEN, CLASSES = 1024, 2048, 10
MICRO_BATCH = 4096          # too big for one Mk1 IPU with this model and Adam
LR = 1e-3


class WideMLP(nn.Module):
    """1024 -> 2048 -> 2048 -> 10.  With labels it returns (output, loss)."""

    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(FEATURES, HIDDEN), nn.ReLU(),
                                 nn.Linear(HIDDEN, HIDDEN), nn.ReLU(),
                                 nn.Linear(HIDDEN, CLASSES))
        self.loss = nn.CrossEntropyLoss()

    def forward(self, x, labels=None):
        out = self.net(x)
        if labels is None:
            return out
        return out, self.loss(out, labels)


def make_blobs(n, seed):
    """``n`` samples of 10 Gaussian blobs in 1024 dimensions, one per class."""
    g = torch.Generator().manual_seed(seed)
    centres = 0.2 * torch.randn(CLASSES, FEATURES, generator=g)
    labels = torch.randint(0, CLASSES, (n,), generator=g)
    x = centres[labels] + torch.randn(n, FEATURES, generator=g)
    return torch.utils.data.TensorDataset(x, labels)


def header(number, title):
    print(f"\n== {number}. {title} ==")


def kib(nbytes):
    return f"{nbytes / 1024:.0f} KiB"


def percent(nbytes, capacity):
    return f"{100.0 * nbytes / capacity:.0f}%"


def base_options(ipu="ipu1"):
    """Options shared by every model below: Mk1 unless told otherwise."""
    opts = poptorch.Options().useIpuModelVersion(ipu)
    return opts.showCompilationProgressBar(False)


def wrap(opts):
    """A fresh WideMLP, wrapped for training with Adam."""
    model = WideMLP()
    optimizer = poptorch.optim.Adam(model.parameters(), lr=LR)
    return model, poptorch.trainingModel(model, opts, optimizer)


def batch_for(opts, micro_batch):
    """One call's inputs: micro_batch x gradientAccumulation samples."""
    n = micro_batch * opts.Training.gradient_accumulation
    return torch.randn(n, FEATURES), torch.randint(0, CLASSES, (n,))


def measure(name, opts, micro_batch):
    """Compiles (does not run) and returns one row of the comparison table."""
    _, training_model = wrap(opts)
    x, y = batch_for(opts, micro_batch)
    training_model.compile(x, y)
    memory = training_model.memoryReport()
    cycles = training_model.cycleEstimate()
    tile = memory.peak_tile
    row = {"name": name, "fits": bool(memory.total.max() <= memory.capacity),
           "peak": int(memory.total[tile]), "capacity": memory.capacity,
           "not_always_live": int(memory.not_always_live.max()),
           "cycles": cycles["total"], "seconds": cycles["seconds"],
           "samples": x.shape[0]}
    training_model.destroy()
    return row


def print_rows(rows):
    print(f"  {'':34s}  {'fullest tile':26s} {'not-always-live':>15s} "
          f"{'cycles/step':>11s} {'samples/s':>10s}")
    for r in rows:
        tile = (f"{kib(r['peak'])} of {kib(r['capacity'])} "
                f"({percent(r['peak'], r['capacity'])})")
        print(f"  {r['name']:34s}  {tile:26s} {kib(r['not_always_live']):>15s} "
              f"{r['cycles']:>11,.0f} {r['samples'] / r['seconds']:>10,.0f}"
              + ("" if r["fits"] else "  does not fit"))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", action="store_true",
                        help="train 2 steps instead of 6 at the end (what CI runs)")
    parser.add_argument("--out", metavar="DIR",
                        help="where the reports go (default: a new temporary directory)")
    args = parser.parse_args()
    steps = 2 if args.small else 6
    out = args.out or tempfile.mkdtemp(prefix="poptorchsim-memory-")
    start = time.perf_counter()
    torch.manual_seed(0)
    n_params = sum(p.numel() for p in WideMLP().parameters())
    print(f"WideMLP {FEATURES} -> {HIDDEN} -> {HIDDEN} -> {CLASSES}: "
          f"{n_params / 1e6:.1f} M parameters, Adam, micro-batch {MICRO_BATCH}; "
          f"reports go to {out}")

    # -----------------------------------------------------------------------
    header(1, "A model that does not fit")
    # -----------------------------------------------------------------------
    opts = base_options("ipu1")                 # Mk1: 1216 tiles x 256 KiB
    model, training_model = wrap(opts)
    x, y = batch_for(opts, MICRO_BATCH)
    try:
        training_model.compile(x, y)            # training_model(x, y) fails the same way
    except poptorch.OutOfMemoryError as error:
        print("training_model.compile(x, y) raised poptorch.OutOfMemoryError:")
        print(textwrap.fill(str(error), width=88, initial_indent="  ",
                            subsequent_indent="  "))
    else:
        raise SystemExit("expected an OutOfMemoryError: the simulator's memory model changed")
    tiles = 1216
    per_tile = 4 * n_params * 4 / tiles         # 4 copies of every weight, 4 bytes each
    print(f"always-live, by hand: weights, gradients and Adam's 2 moments = "
          f"4 x {n_params / 1e6:.1f} M x 4 B = {4 * n_params * 4 / 2**20:.0f} MiB = "
          f"{kib(per_tile)} per tile, plus a few KiB of code and vertex state per tile")
    act = MICRO_BATCH * HIDDEN * 4
    print(f"not-always-live, by hand: each {MICRO_BATCH}x{HIDDEN} activation is "
          f"{act / 2**20:.0f} MiB = {kib(act / tiles)} per tile, "
          f"plus the matmuls' temporary buffers")

    # -----------------------------------------------------------------------
    header(2, "Profile it anyway")
    # -----------------------------------------------------------------------
    training_model.destroy()        # unwrap the model before wrapping it again
    profiled = opts.clone().enableProfiling(out).modelName("too_big")
    model, training_model = wrap(profiled)
    training_model.compile(x, y)    # logs the error as a warning (stderr) and goes on
    directory = os.path.join(out, "too_big")
    print(f"with enableProfiling the compilation finished (out of memory is only a "
          f"warning) and wrote {directory}:")
    for name in sorted(os.listdir(directory)):
        size = os.path.getsize(os.path.join(directory, name))
        print(f"  {name:16s} {f'{size / 1024:.0f} KB' if size >= 1024 else f'{size} B':>7s}")
    report = training_model.simulationReport()
    print(f"poptorch.profiling.summary(training_model.simulationReport()), the same "
          f"text as `python -m poptorchsim report {out}`:")
    print(textwrap.indent(summary(report), "  | "))
    mem = report["memory"]
    tile = mem["peak_tile"]
    print(f"the fullest tile, {tile}: always-live {kib(mem['always_live'][tile])} + "
          f"not-always-live {kib(mem['not_always_live'][tile])} = "
          f"{kib(mem['total'][tile])} of {kib(mem['capacity'])}")
    graphs = tuple(f"{g}/" for g in report["liveness"])
    print("largest tensors there (report['memory']['largest_on_peak_tile']):")
    for name, nbytes in mem["largest_on_peak_tile"][:6]:
        kind = "not-always-live" if name.startswith(graphs) else "always-live"
        print(f"  {name:28s} {nbytes / 1024:5.1f} KiB  {kind}")
    listed = sum(b for n, b in mem["largest_on_peak_tile"] if n.startswith(graphs))
    print(f"the not-always-live tensors of that list (10 long) add up to {kib(listed)} of "
          f"the {kib(mem['not_always_live'][tile])}: the rest is mostly the matmuls' "
          f"temporary memory, which no list names")
    training_model.destroy()

    # -----------------------------------------------------------------------
    header(3, "Fix it")
    # -----------------------------------------------------------------------
    # Poplar's debug.allowOutOfMemory: compile anyway, without writing a report
    too_big = base_options("ipu1")
    too_big._Popart.setEngineOptions({"debug.allowOutOfMemory": "true"})
    poptorch.setLogLevel("ERR")     # the warning of section 2 once is enough
    rows = [measure(f"micro-batch {MICRO_BATCH} (too big)", too_big, MICRO_BATCH)]
    poptorch.setLogLevel("WARN")
    # (a) a smaller micro-batch, and the same batch per weight update again
    rows.append(measure("(a) micro-batch 64", base_options("ipu1"), 64))
    accumulate = base_options("ipu1")
    accumulate.Training.gradientAccumulation(32)
    rows.append(measure("(a) micro-batch 64, accumulate 32", accumulate, 64))
    # (b) less memory for the matmuls' temporary buffers, the same micro-batch
    amp = base_options("ipu1").setAvailableMemoryProportion({"IPU0": 0.3})
    rows.append(measure("(b) availableMemoryProportion 0.3", amp, MICRO_BATCH))
    # (c) a bigger IPU
    rows.append(measure("(c) Mk2 IPU", base_options("ipu2"), MICRO_BATCH))
    print_rows(rows)
    too_big, fixed = rows[0], rows[3]
    print(f"(b) cut not-always-live memory by "
          f"{kib(too_big['not_always_live'] - fixed['not_always_live'])} for "
          f"{fixed['cycles'] - too_big['cycles']:,.0f} more cycles per step "
          f"(+{100 * (fixed['cycles'] / too_big['cycles'] - 1):.2f}%)")

    # Train the fix (b): Mk1, micro-batch 4096, proportion 0.3, profiled.
    fixed_opts = amp.clone().enableProfiling(out).modelName("fixed")
    train_ds = make_blobs(steps * MICRO_BATCH, seed=1)
    loader = poptorch.DataLoader(fixed_opts, train_ds, batch_size=MICRO_BATCH,
                                 shuffle=True)
    model, training_model = wrap(fixed_opts)
    t0 = time.perf_counter()
    losses = [training_model(x, y)[1].item() for x, y in loader]
    wall = (time.perf_counter() - t0) / len(losses)
    memory = training_model.memoryReport()
    assert memory.total.max() <= memory.capacity, "the fixed model should fit"
    cycles = training_model.cycleEstimate()
    print(f"fix (b) trained {len(losses)} steps of {MICRO_BATCH} samples on the "
          f"simulated Mk1: loss {' -> '.join(f'{l:.2f}' for l in losses)}")
    print(f"estimated {cycles['seconds'] * 1e3:.2f} ms per step = "
          f"{MICRO_BATCH / cycles['seconds']:,.0f} samples/s on the IPU "
          f"(simulating it took {wall:.1f} s per step on this CPU)")
    print(f"its report: {os.path.join(out, 'fixed', 'index.html')}")
    training_model.destroy()

    print(f"\nDone in {time.perf_counter() - start:.1f} s.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
