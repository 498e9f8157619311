#!/usr/bin/env python3
"""Model zoo: compile time, host speed against PyTorch eager, simulated Mk2 throughput and memory.

The models are those of ``tests/test_model_zoo.py`` (torchvision CNNs and a
small ViT, nn.Transformer(Encoder), LSTM, GRU, EmbeddingBag, a GPT block,
a tiny Hugging Face BERT when ``transformers`` is installed) plus
ResNet-50/101/152, all trained with SGD (lr 0.01, momentum 0.9) at batch 2,
CNNs on 64x64 images.  For each model, one row:

* compile: seconds to compile the training model (``compile_seconds``);
* host step: median seconds of one poptorchsim training call (one SGD step
  of the whole batch) after a warm-up, and the ratio eager / poptorchsim of
  the same step in plain PyTorch, timed interleaved in the same run
  (>= 1.0: the simulator is at least as fast as eager);
* simulated samples/s on one Mk2 IPU (``cycleEstimate()['seconds']``);
* the fullest tile's memory (``memoryReport()``) and whether the program
  fits: models compile with Poplar's ``debug.allowOutOfMemory`` so those that
  do not fit still report.

A second section fits compile time of ResNet-18/50/101/152 training against
the number of fx nodes of the traced training step (least squares, R^2) and
says whether ResNet-50 training compiles in under 5 s.

    python benchmarks/model_zoo.py [--quick] [--models resnet18,gru] [--steps 5]
                                   [--threads N] [--json PATH] [--no-plot]
"""
import argparse
import copy
import dataclasses
import json
import logging
import os
import platform
import statistics
import sys
import time

import numpy as np
import torch
from tqdm.auto import tqdm

import poptorchsim
from poptorchsim.testing import quiet_options, zoo

HERE = os.path.dirname(os.path.abspath(__file__))

BATCH = 2
IMAGE = 64
FIVE_SECONDS = 5.0
SCALING = ["resnet18", "resnet50", "resnet101", "resnet152"]
QUICK = ["resnet18", "mobilenet_v3_small", "transformer_encoder", "lstm_bidirectional",
         "embedding_bag_mean", "gpt_block"]
QUICK_SCALING = ["resnet18", "resnet34", "resnet50"]
EXTRA = {n: zoo.Case(n, zoo.tv(n), zoo.images(), "ce")
         for n in ("resnet34", "resnet50", "resnet101", "resnet152")}
CASES = {c.name: c for c in zoo.ZOO}
CASES.update((n, EXTRA[n]) for n in ("resnet50", "resnet101", "resnet152"))
KNOWN = {**CASES, "resnet34": EXTRA["resnet34"]}


def cpu_count():
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def bench_case(case):
    """Batch 2; CNN images 64x64 (a model built for one image size keeps it)."""
    model = zoo.build(case, case.seed)
    inputs = case.inputs
    if getattr(inputs, "image_size", None) is not None and \
            getattr(model, "image_size", None) is None:
        inputs = zoo.images(IMAGE)
    return dataclasses.replace(case, batch=BATCH, inputs=inputs), model


def training_model(wrapped):
    opts = quiet_options()
    opts._Popart.setEngineOptions({"debug.allowOutOfMemory": "true"})
    return poptorchsim.trainingModel(wrapped, opts,
                                     optimizer=zoo.optimizer_for(wrapped.parameters()))


def node_counts(tm):
    c = tm._compiled
    return (len(c.capture.graph.graph.nodes),
            sum(len(g.ops) for g in c.program.graphs.values()))


def measure(name, steps, warmup):
    case, model = bench_case(KNOWN[name])
    model.train()
    batches = zoo.make_batches(case, model, warmup + steps, seed=1)
    sim = zoo.WithLoss(model, case.loss)
    eager = copy.deepcopy(sim)
    eager_opt = zoo.optimizer_for(eager.parameters())
    tm = training_model(sim)
    t0 = time.perf_counter()
    tm.compile(*batches[0])
    compile_wall = time.perf_counter() - t0

    def eager_step(batch):
        eager_opt.zero_grad()
        _, loss = eager(*batch)
        loss.backward()
        eager_opt.step()

    sim_s, eager_s = [], []
    for k, batch in enumerate(batches):          # interleaved, warm-up first
        t0 = time.perf_counter()
        tm(*batch)
        t1 = time.perf_counter()
        eager_step(batch)
        t2 = time.perf_counter()
        if k >= warmup:
            sim_s.append(t1 - t0)
            eager_s.append(t2 - t1)
    cycles = tm.cycleEstimate()
    memory = tm.memoryReport()
    peak = int(memory.total.max())
    fx_nodes, ir_ops = node_counts(tm)
    weight_diff = max((a - b).abs().max().item()
                      for a, b in zip(sim.parameters(), eager.parameters()))
    sim_med, eager_med = statistics.median(sim_s), statistics.median(eager_s)
    return {
        "model": name, "batch": case.batch,
        "params": sum(p.numel() for p in model.parameters()),
        "compile_s": tm._compiled.compile_seconds, "compile_wall_s": compile_wall,
        "sim_step_s": sim_s, "eager_step_s": eager_s,
        "sim_step_median_s": sim_med, "eager_step_median_s": eager_med,
        "ratio_eager_over_sim": eager_med / sim_med,
        "simulated_s_per_step": cycles["seconds"],
        "simulated_samples_per_s": case.batch / cycles["seconds"],
        "peak_tile_bytes": peak, "tile_capacity_bytes": int(memory.capacity),
        "fits": peak <= memory.capacity,
        "tiles_over": int((memory.total > memory.capacity).sum()),
        "fx_nodes": fx_nodes, "ir_ops": ir_ops,
        "max_weight_diff_vs_eager": weight_diff,
    }


def compile_only(name):
    """Compile seconds and node counts of one training model (no run)."""
    case, model = bench_case(KNOWN[name])
    model.train()
    batch, = zoo.make_batches(case, model, 1, seed=1)
    tm = training_model(zoo.WithLoss(model, case.loss))
    tm.compile(*batch)
    fx_nodes, ir_ops = node_counts(tm)
    return {"model": name, "compile_s": tm._compiled.compile_seconds,
            "fx_nodes": fx_nodes, "ir_ops": ir_ops}


def linear_fit(x, y):
    """(slope, intercept, R^2) of the least-squares line y = slope x + intercept."""
    x, y = np.asarray(x, float), np.asarray(y, float)
    slope, intercept = np.polyfit(x, y, 1)
    residual = y - (slope * x + intercept)
    total = ((y - y.mean()) ** 2).sum()
    r2 = 1.0 - (residual ** 2).sum() / total if total > 0 else 1.0
    return float(slope), float(intercept), float(r2)


def print_table(rows, errors):
    head = (f"{'model':<20} {'params':>8} {'fx nodes':>8} {'compile s':>9} "
            f"{'sim ms/step':>11} {'eager ms/step':>13} {'eager/sim':>9} "
            f"{'Mk2 samples/s':>13} {'peak tile KiB':>13} {'fits':>4}")
    print(head)
    print("-" * len(head))
    for r in rows:
        print(f"{r['model']:<20} {r['params'] / 1e6:>7.2f}M {r['fx_nodes']:>8} "
              f"{r['compile_s']:>9.2f} {r['sim_step_median_s'] * 1e3:>11.1f} "
              f"{r['eager_step_median_s'] * 1e3:>13.1f} {r['ratio_eager_over_sim']:>9.2f} "
              f"{r['simulated_samples_per_s']:>13,.0f} {r['peak_tile_bytes'] / 1024:>13.1f} "
              f"{'yes' if r['fits'] else 'no':>4}")
    for name, why in errors.items():
        print(f"{name:<20} {why}")


def scaling_section(points, plot_path):
    print(f"\ncompile time of training vs traced graph size (batch {BATCH}, {IMAGE}x{IMAGE}):")
    print(f"{'model':<12} {'fx nodes':>8} {'IR ops':>7} {'compile s':>9}")
    for p in points:
        print(f"{p['model']:<12} {p['fx_nodes']:>8} {p['ir_ops']:>7} {p['compile_s']:>9.2f}")
    fit = None
    if len(points) >= 2:
        slope, intercept, r2 = linear_fit([p["fx_nodes"] for p in points],
                                          [p["compile_s"] for p in points])
        fit = {"slope_s_per_node": slope, "intercept_s": intercept, "r2": r2}
        print(f"least squares: compile_s = {slope * 1e3:.3f} ms x fx_nodes "
              f"{'+' if intercept >= 0 else '-'} {abs(intercept):.2f} s, R^2 = {r2:.4f}")
    r50 = next((p for p in points if p["model"] == "resnet50"), None)
    if r50 is not None:
        verdict = "yes" if r50["compile_s"] < FIVE_SECONDS else "no"
        print(f"ResNet-50 training compiles in under {FIVE_SECONDS:.0f} s: {verdict} "
              f"({r50['compile_s']:.2f} s)")
    if plot_path and len(points) >= 2:
        write_plot(points, fit, plot_path)
    return fit


def write_plot(points, fit, path):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("(matplotlib not installed: no plot)")
        return
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    x = np.array([p["fx_nodes"] for p in points], float)
    y = np.array([p["compile_s"] for p in points], float)
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.scatter(x, y)
    for p in points:
        ax.annotate(p["model"], (p["fx_nodes"], p["compile_s"]),
                    textcoords="offset points", xytext=(4, -10))
    if fit is not None:
        xs = np.linspace(0, x.max() * 1.05, 50)
        ax.plot(xs, fit["slope_s_per_node"] * xs + fit["intercept_s"], "--",
                label=f"least squares, R$^2$ = {fit['r2']:.3f}")
        ax.legend()
    ax.set_xlabel("fx nodes of the traced training step")
    ax.set_ylabel("compile seconds (training)")
    ax.set_title(f"poptorchsim compile time, batch {BATCH}, {IMAGE}x{IMAGE} images")
    ax.set_xlim(left=0)
    ax.set_ylim(bottom=0)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    print(f"wrote {path}")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help=f"only {', '.join(QUICK)}; scaling over "
                        f"{', '.join(QUICK_SCALING)}")
    parser.add_argument("--models", help="comma-separated models (default: all); known: "
                        + ", ".join(KNOWN))
    parser.add_argument("--steps", type=int, default=5,
                        help="timed training steps per model after the warm-up (default 5)")
    parser.add_argument("--warmup", type=int, default=1, help="warm-up steps (default 1)")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads (default: the CPUs this process may use)")
    parser.add_argument("--no-scaling", action="store_true",
                        help="skip the compile time vs graph size section")
    parser.add_argument("--no-plot", action="store_true", help="write no PNG")
    parser.add_argument("--plot", default=os.path.join(HERE, "out", "model_zoo_compile.png"),
                        help="where the compile-time plot goes (default benchmarks/out/)")
    parser.add_argument("--json", metavar="PATH", help="also write the numbers as JSON")
    args = parser.parse_args(argv)
    if args.steps < 1 or args.warmup < 0:
        parser.error("--steps must be at least 1 and --warmup at least 0")
    if args.models:
        names = [n.strip() for n in args.models.split(",") if n.strip()]
        unknown = [n for n in names if n not in KNOWN]
        if unknown:
            parser.error(f"unknown model(s) {', '.join(unknown)}; known: {', '.join(KNOWN)}")
    else:
        names = QUICK if args.quick else list(CASES)
    scaling = [] if args.no_scaling else (QUICK_SCALING if args.quick else SCALING)

    torch.set_num_threads(args.threads or cpu_count())
    logging.getLogger("poptorchsim").setLevel(logging.ERROR)   # out-of-memory warnings
    load0 = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"machine: {platform.processor() or platform.machine()}, {cpu_count()} usable CPUs, "
          f"torch {torch.__version__} with {torch.get_num_threads()} threads, "
          f"poptorchsim {poptorchsim.__version__}, load average {load0:.2f}")
    print(f"training with SGD(lr=0.01, momentum=0.9), batch {BATCH}, CNN images "
          f"{IMAGE}x{IMAGE}; host times are medians of {args.steps} steps after "
          f"{args.warmup} warm-up\n")

    t_start = time.perf_counter()
    rows, errors = [], {}
    for name in tqdm(names, desc="models", leave=False):
        try:
            rows.append(measure(name, args.steps, args.warmup))
        except BaseException as exc:  # pytest.skip's is a BaseException
            if isinstance(exc, KeyboardInterrupt):
                raise
            msg = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
            errors[name] = f"{type(exc).__name__}: {msg[:150]}"
    print_table(rows, errors)

    fit, points = None, []
    if scaling:
        done = {r["model"]: r for r in rows}
        for name in tqdm(scaling, desc="compile scaling", leave=False):
            points.append(done[name] if name in done else compile_only(name))
        fit = scaling_section(points, None if args.no_plot else args.plot)

    wall = time.perf_counter() - t_start
    load1 = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"\nbenchmark wall time: {wall:.1f} s (load average {load1:.2f} at the end)")
    if args.json:
        keys = ("model", "compile_s", "fx_nodes", "ir_ops")
        with open(args.json, "w") as f:
            json.dump({"rows": rows, "errors": errors,
                       "scaling": [{k: p[k] for k in keys} for p in points],
                       "fit": fit, "threads": torch.get_num_threads(),
                       "wall_s": wall}, f, indent=2)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
