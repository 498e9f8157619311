"""Pipelining a model over several simulated IPUs: the README's walkthrough as one script.

Run it from the repository root:

    python tutorials/pipelining/pipelining.py          # trains 4 steps, 5 accumulation sizes
    python tutorials/pipelining/pipelining.py --small  # trains 2 steps, 3 sizes (CI)
    python tutorials/pipelining/pipelining.py --out reports   # keep the reports

Each numbered section below matches the section of README.md with the same
number.  A deep MLP trained with Adam does not fit one Mk1 IPU; the script
splits it over 4 IPUs with ``poptorch.BeginBlock``, runs into PopTorch's
pipelining rules, trains it pipelined (and checks it learns exactly what the
unsplit model learns), reads the schedule and its bubble, compares sharded
execution, and lets ``poptorch.suggest_split`` choose the split.  Compiling
is cheap (the model is traced with fake tensors); training does the real
arithmetic on the host CPU.
"""
import argparse
import logging
import os
import sys
import tempfile
import textwrap
import time

import torch
import torch.nn as nn

import poptorchsim as poptorch  # PopTorch programs say `import poptorch`

# ---------------------------------------------------------------------------
# The data and the model
# ---------------------------------------------------------------------------
WIDTH, DEPTH, CLASSES = 1536, 8, 10
MICRO_BATCH = 16
IPUS = 4
LR = 1e-4


class DeepMLP(nn.Module):
    """8 x (Linear 1536 -> 1536, ReLU), then a 10-way head.  With labels it
    returns (output, loss), as PopTorch wants."""

    def __init__(self):
        super().__init__()
        self.layers = nn.Sequential(*[nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.ReLU())
                                      for _ in range(DEPTH)])
        self.head = nn.Linear(WIDTH, CLASSES)
        self.loss = nn.CrossEntropyLoss()
        for layer in self.layers:      # He initialisation: 8 ReLU layers learn from step 1
            nn.init.kaiming_normal_(layer[0].weight, nonlinearity="relu")
            nn.init.zeros_(layer[0].bias)

    def forward(self, x, labels=None):
        out = self.head(self.layers(x))
        if labels is None:
            return out
        return out, self.loss(out, labels)


def split_over_4_ipus(model):
    """Two layers per IPU: each BeginBlock starts a block that lasts until the next."""
    for ipu in range(IPUS):
        poptorch.BeginBlock(model.layers[2 * ipu], f"block{ipu}", ipu_id=ipu)
    return model


class ScopedMLP(DeepMLP):
    """The same model, split with ``with poptorch.Block`` scopes in forward and
    a ``poptorch.BlockFunction`` for the head."""

    def forward(self, x, labels=None):
        for ipu in range(IPUS):
            with poptorch.Block(f"block{ipu}", ipu_id=ipu):
                x = self.layers[2 * ipu:2 * ipu + 2](x)
        return self.classify(x, labels)

    @poptorch.BlockFunction("head", ipu_id=3)
    def classify(self, x, labels):
        out = self.head(x)
        if labels is None:
            return out
        return out, self.loss(out, labels)


def make_blobs(n, seed):
    """``n`` samples of 10 Gaussian blobs in 1536 dimensions, one per class."""
    g = torch.Generator().manual_seed(seed)
    centres = torch.randn(CLASSES, WIDTH, generator=g)
    labels = torch.randint(0, CLASSES, (n,), generator=g)
    x = centres[labels] + torch.randn(n, WIDTH, generator=g)
    return torch.utils.data.TensorDataset(x, labels)


def header(number, title):
    print(f"\n== {number}. {title} ==")


def kib(nbytes):
    return f"{nbytes / 1024:.0f} KiB"


def first_line(error):
    return str(error).splitlines()[0]


def wrapped(text, indent="  "):
    return textwrap.fill(text, width=92, initial_indent=indent, subsequent_indent=indent)


def base_options():
    """Mk1 IPUs (1216 tiles x 256 KiB), no progress bar."""
    return poptorch.Options().useIpuModelVersion("ipu1").showCompilationProgressBar(False)


def training_options(accumulation, strategy=None):
    opts = base_options()
    opts.Training.gradientAccumulation(accumulation)
    if strategy is not None:
        opts.setExecutionStrategy(strategy)
    return opts


def one_ipu_anyway(accumulation):
    """The unsplit model on one IPU, which it does not fit: Poplar's
    debug.allowOutOfMemory compiles it anyway (a real IPU could not load it)."""
    opts = training_options(accumulation)
    opts._Popart.setEngineOptions({"debug.allowOutOfMemory": "true"})
    return opts


def adam(model):
    return poptorch.optim.Adam(model.parameters(), lr=LR)


def one_call(accumulation, seed=0):
    """The inputs of one training call: ``accumulation`` micro-batches."""
    x, y = make_blobs(accumulation * MICRO_BATCH, seed)[:]
    return x, y


def estimate(model, opts):
    """Compiles (does not run) and returns the pipeline report and samples/s."""
    training_model = poptorch.trainingModel(model, opts, adam(model))
    ga = opts.Training.gradient_accumulation
    training_model.compile(*one_call(ga))
    pipe = training_model.simulationReport()["pipeline"]
    seconds = training_model.cycleEstimate()["seconds"]
    training_model.destroy()
    return pipe, ga * MICRO_BATCH / seconds


def ideal_bubble(stages, micro_batches):
    """Balanced stages: (S - 1) idle slots of G + S - 1 on every IPU."""
    return (stages - 1) / (micro_batches + stages - 1)


def per_ipu_times(pipe):
    """{ipu: (forward, backward)} microseconds of micro-batch 0, from the timeline.
    Events are named "F<stage> mb<m>" and "B<stage> mb<m>"."""
    times = {}
    for e in pipe["events"]:
        if e["name"].endswith(" mb0"):
            fwd, bwd = times.get(e["ipu"], (0.0, 0.0))
            if e["name"].startswith("F"):
                fwd += e["duration_us"]
            else:
                bwd += e["duration_us"]
            times[e["ipu"]] = (fwd, bwd)
    return dict(sorted(times.items()))


def timeline_us(pipe):
    """How long one weight update (or inference call) keeps the IPUs busy:
    the end of the timeline's last event."""
    return max(e["start_us"] + e["duration_us"] for e in pipe["events"])


def max_weight_diff(a, b):
    return max((p - q).abs().max().item() for p, q in zip(a.parameters(), b.parameters()))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", action="store_true",
                        help="train 2 steps instead of 4 and try 3 accumulation sizes "
                             "instead of 5 (what CI runs)")
    parser.add_argument("--out", metavar="DIR",
                        help="where the reports go (default: a new temporary directory)")
    args = parser.parse_args()
    steps = 2 if args.small else 4
    sizes = (7, 28, 112) if args.small else (7, 14, 28, 56, 112)
    out = args.out or tempfile.mkdtemp(prefix="poptorchsim-pipelining-")
    start = time.perf_counter()
    torch.manual_seed(0)
    model = DeepMLP()
    n_params = sum(p.numel() for p in model.parameters())
    print(f"DeepMLP: {DEPTH} x Linear({WIDTH}, {WIDTH}) + head, {n_params / 1e6:.1f} M "
          f"parameters, Adam, micro-batch {MICRO_BATCH}, Mk1 IPUs; reports go to {out}")

    # -----------------------------------------------------------------------
    header(1, "A model too big for one IPU, split over 4")
    # -----------------------------------------------------------------------
    training_model = poptorch.trainingModel(model, base_options(), adam(model))
    try:
        training_model.compile(*one_call(1))
    except poptorch.OutOfMemoryError as error:
        print("on one IPU, training_model.compile(x, y) raised poptorch.OutOfMemoryError:")
        print(wrapped(". ".join(str(error).split(". ")[:2]) + "."))    # 2 sentences of it
    else:
        raise SystemExit("expected an OutOfMemoryError: the simulator's memory model changed")
    training_model.destroy()
    print(f"by hand: weights, gradients and Adam's 2 moments = 4 x {n_params / 1e6:.1f} M x "
          f"4 B = {16 * n_params / 2**20:.0f} MiB,")
    print(f"  {16 * n_params / 1216 / 1024:.0f} KiB on each of 1216 tiles of 256 KiB: the "
          f"tiles are {16 * n_params / (1216 * 256 * 1024):.0%} full before any code, "
          f"activation or temporary buffer")

    split_over_4_ipus(model)        # BeginBlock(model.layers[2 * i], f"block{i}", ipu_id=i)
    print("poptorch.BeginBlock(model.layers[2 * i], f'block{i}', ipu_id=i) for i in 0..3:")
    for ipu in range(IPUS):
        last = "7, head and loss" if ipu == IPUS - 1 else str(2 * ipu + 1)
        print(f"  block{ipu} on IPU {ipu}: layers {2 * ipu}-{last}")

    # The same split written with scopes, run for inference (4 device iterations)
    scoped = ScopedMLP()
    scoped.load_state_dict(model.state_dict())
    inference_model = poptorch.inferenceModel(scoped, base_options().deviceIterations(4))
    x, _ = one_call(4, seed=9)
    out_ipu = inference_model(x)
    with torch.no_grad():
        out_cpu = scoped(x)
    report = inference_model.simulationReport()["pipeline"]
    print("the same split with `with poptorch.Block(...)` and "
          "@poptorch.BlockFunction('head', ipu_id=3) (ScopedMLP),")
    print(f"  inferenceModel with deviceIterations(4): {report['forward_stages']} stages on "
          f"{report['ipus']} IPUs, output {tuple(out_ipu.shape)}, max difference from the "
          f"CPU {(out_ipu - out_cpu).abs().max().item():.1e}")
    inference_model.destroy()

    # -----------------------------------------------------------------------
    header(2, "PopTorch's pipelining rules")
    # -----------------------------------------------------------------------
    # (a) training: gradientAccumulation >= 2N - 1
    training_model = poptorch.trainingModel(model, training_options(4), adam(model))
    try:
        training_model.compile(*one_call(4))
    except poptorch.Error as error:
        lines = str(error).splitlines()
        print("training with gradientAccumulation(4) raised poptorch.Error:")
        print(wrapped(lines[0]))
        print("  " + "\n  ".join(lines[1:]))
    else:
        raise SystemExit("expected the gradientAccumulation rule to fire")
    training_model.destroy()

    # (b) inference: deviceIterations >= N
    inference_model = poptorch.inferenceModel(scoped, base_options().deviceIterations(2))
    try:
        inference_model(one_call(2)[0])
    except poptorch.Error as error:
        print("inference with deviceIterations(2) raised poptorch.Error:")
        print(wrapped(first_line(error)))
    else:
        raise SystemExit("expected the deviceIterations rule to fire")

    # (c) a power of two IPUs on hardware: a warning here, an error there
    three = DeepMLP()
    for layer, ipu in ((0, 0), (3, 1), (6, 2)):
        poptorch.BeginBlock(three.layers[layer], f"block{ipu}", ipu_id=ipu)
    x = one_call(4)[0]
    said = []
    handler = logging.Handler()
    handler.emit = lambda record: said.append(record.getMessage())
    logging.getLogger("poptorchsim").addHandler(handler)
    try:
        odd = poptorch.inferenceModel(three, base_options().deviceIterations(4))
        odd(x)
    finally:
        logging.getLogger("poptorchsim").removeHandler(handler)
    warning = next((m for m in said if "3 IPUs" in m), None)
    if warning is None:
        raise SystemExit("expected the power-of-two warning")
    print(f"blocks on 3 IPUs compile and run on {odd.getIR().n_ipus} IPUs; the log says:")
    print(wrapped(warning))
    poptorch.setLogLevel("ERR")     # the rounding warning
    rounded = poptorch.inferenceModel(three, base_options().deviceIterations(4)
                                      .autoRoundNumIPUs(True))
    rounded(x)
    poptorch.setLogLevel("WARN")
    print(f"with autoRoundNumIPUs(True) it runs on {rounded.getIR().n_ipus} IPUs "
          f"(4 reserved on hardware, one idle)")
    del three, odd, rounded

    # -----------------------------------------------------------------------
    header(3, "Train it pipelined")
    # -----------------------------------------------------------------------
    G = 2 * IPUS - 1                                   # the smallest that is allowed
    unsplit = DeepMLP()                                # the reference: no blocks, one IPU
    unsplit.load_state_dict(model.state_dict())
    opts = training_options(G).enableProfiling(out).modelName("pipelined")
    pipelined = poptorch.trainingModel(model, opts, adam(model))
    reference = poptorch.trainingModel(unsplit, one_ipu_anyway(G), adam(unsplit))

    train_ds = make_blobs(steps * G * MICRO_BATCH, seed=1)
    loader = poptorch.DataLoader(opts, train_ds, batch_size=MICRO_BATCH)
    poptorch.setLogLevel("ERR")     # the reference does not fit one IPU: a warning
    losses, ref_losses, walls = [], [], []
    for x, y in loader:             # 7 micro-batches of 16 per call
        t0 = time.perf_counter()
        losses.append(pipelined(x, y)[1].item())
        walls.append(time.perf_counter() - t0)
        ref_losses.append(reference(x, y)[1].item())
    poptorch.setLogLevel("WARN")
    print(f"gradientAccumulation({G}): {len(losses)} weight updates of {G} x {MICRO_BATCH} "
          f"samples, loss {' -> '.join(f'{l:.2f}' for l in losses)}")
    print(f"the same weights trained unsplit on one IPU: loss "
          f"{' -> '.join(f'{l:.2f}' for l in ref_losses)}, max weight difference "
          f"{max_weight_diff(model, unsplit):.1e}")

    print("peak tile of each IPU (memoryReport().ipus):")
    for r in pipelined.memoryReport().ipus:
        print(f"  IPU {r.ipu}: {kib(r.total.max())} of {kib(r.capacity)} "
              f"({100 * r.total.max() / r.capacity:.0f}%)")
    single = reference.memoryReport()
    print(f"  unsplit, one IPU: {kib(single.total.max())} of {kib(single.capacity)} "
          f"({100 * single.total.max() / single.capacity:.0f}%): does not fit")

    pipe = pipelined.simulationReport()["pipeline"]
    n, s = pipe["forward_stages"], pipe["stages"]
    print(f"simulationReport()['pipeline']: {pipe['kind']}, {n} forward stages on IPUs "
          f"{pipe['ipu_of_stage']}, S = 2 x {n} - 1 = {s} stages in training, "
          f"G = {pipe['micro_batches']} micro-batches")
    print("  one micro-batch, from pipe['events'] (us):")
    notes = {0: "its input comes from the host; no gradient for the input",
             IPUS - 1: "also the head and the loss; receives no gradient"}
    for ipu, (fwd, bwd) in per_ipu_times(pipe).items():
        print(f"    IPU {ipu}: forward {fwd:5.1f}  backward {bwd:5.1f}  "
              f"total {fwd + bwd:5.1f}  {notes.get(ipu, '')}".rstrip())
    print(f"  bubble {pipe['bubble']:.1%}; balanced stages would give (S-1)/(G+S-1) = "
          f"{s - 1}/{G + s - 1} = {ideal_bubble(s, G):.1%}")
    totals = [f + b for f, b in per_ipu_times(pipe).values()]
    balance = sum(totals) / len(totals) / max(totals)
    print(f"  the IPUs wait for the slowest: mean/slowest = {balance:.1%}, and "
          f"1 - (1 - {ideal_bubble(s, G):.1%}) x {balance:.1%} = "
          f"{1 - (1 - ideal_bubble(s, G)) * balance:.1%}")
    seconds = pipelined.cycleEstimate()["seconds"]
    ref_seconds = reference.cycleEstimate()["seconds"]
    print(f"  cycleEstimate(): {seconds * 1e3:.2f} ms per call = "
          f"{G * MICRO_BATCH / seconds:,.0f} samples/s; one IPU, if the model fit: "
          f"{G * MICRO_BATCH / ref_seconds:,.0f} samples/s")
    print(f"  (simulating a call took {walls[-1]:.1f} s on this CPU)")
    directory = os.path.join(out, "pipelined")
    print(f"enableProfiling wrote {directory}:")
    for name in ("timeline.png", "timeline.json", "index.html"):
        size = os.path.getsize(os.path.join(directory, name))
        print(f"  {name:14s} {size / 1024:4.0f} KB")
    pipelined.destroy()
    reference.destroy()

    print("the bubble shrinks as gradientAccumulation grows (compiled, not run):")
    print(f"  {'G':>4s} {'bubble':>7s} {'(S-1)/(G+S-1)':>14s} {'update (us)':>12s} "
          f"{'samples/s':>10s} {'one IPU':>10s} {'speed-up':>9s}")
    pipelined_rate = {}
    for ga in sizes:
        pipe_g, rate = estimate(model, training_options(ga))
        poptorch.setLogLevel("ERR")
        _, one_rate = estimate(unsplit, one_ipu_anyway(ga))
        poptorch.setLogLevel("WARN")
        pipelined_rate[ga] = rate
        print(f"  {ga:4d} {pipe_g['bubble']:7.1%} {ideal_bubble(pipe_g['stages'], ga):14.1%} "
              f"{timeline_us(pipe_g):12,.0f} {rate:10,.0f} {one_rate:10,.0f} "
              f"{rate / one_rate:8.1f}x")

    # -----------------------------------------------------------------------
    header(4, "Sharded execution")
    # -----------------------------------------------------------------------
    sharded = poptorch.ShardedExecution()
    pipe_1, _ = estimate(model, training_options(1, sharded))
    print(f"ShardedExecution() with gradientAccumulation(1) compiles: no accumulation rule "
          f"({pipe_1['kind']}, {pipe_1['stages']} stages)")
    opts = training_options(G, sharded).enableProfiling(out).modelName("sharded")
    pipe_s, rate = estimate(model, opts)
    print(f"with gradientAccumulation({G}): bubble {pipe_s['bubble']:.1%} (one IPU of 4 "
          f"busy at a time)")
    sharded_us, pipelined_us = timeline_us(pipe_s), timeline_us(pipe)
    print(f"  one weight update on the device: {sharded_us:,.0f} us sharded, "
          f"{pipelined_us:,.0f} us pipelined ({sharded_us / pipelined_us:.1f}x)")
    print(f"  per call, with the host's share: {rate:,.0f} samples/s sharded, "
          f"{pipelined_rate[G]:,.0f} pipelined ({pipelined_rate[G] / rate:.1f}x)")
    print(f"its timeline: {os.path.join(out, 'sharded', 'timeline.png')}")

    # -----------------------------------------------------------------------
    header(5, "Beyond PopTorch: suggest_split")
    # -----------------------------------------------------------------------
    auto = DeepMLP()                                   # no BeginBlocks
    x, y = one_call(1)                                 # one micro-batch
    # options: the IPU model to plan for (Mk2 otherwise)
    plan = poptorch.suggest_split(auto, IPUS, x, y, optimizer=adam(auto),
                                  options=poptorch.Options().useIpuModelVersion("ipu1"))
    print(textwrap.indent(str(plan), "  | "))
    plan.apply(auto)
    training_model = poptorch.trainingModel(auto, training_options(G), adam(auto))
    losses = [training_model(x, y)[1].item() for x, y in loader]
    pipe_a = training_model.simulationReport()["pipeline"]
    rate = G * MICRO_BATCH / training_model.cycleEstimate()["seconds"]
    print(f"applied and trained: loss {' -> '.join(f'{l:.2f}' for l in losses)}; "
          f"bubble {pipe_a['bubble']:.1%}, {rate:,.0f} samples/s (split by hand: "
          f"{pipe['bubble']:.1%}, {pipelined_rate[G]:,.0f})")
    training_model.destroy()

    print(f"\nDone in {time.perf_counter() - start:.1f} s.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
