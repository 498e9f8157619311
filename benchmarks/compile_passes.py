#!/usr/bin/env python3
"""Compile time, pass by pass: where the seconds of ``trainingModel(...).compile()`` go.

The compiler is an ordered list of passes (``passes/compile.py``, docs/
architecture.md); each compile records the seconds every pass took
(``Compiled.pass_seconds``).  For the models of ``benchmarks/model_zoo.py``
(training with SGD, batch 2, CNNs at 64x64, compiled with
``debug.allowOutOfMemory`` so that models that do not fit still compile) this
prints one row per model: the total, the seconds of each pass, and the
milliseconds per fx node of the traced training step, then the passes'
share over all models, and writes a stacked-bar plot
(``benchmarks/out/compile_passes.png``).

    python benchmarks/compile_passes.py [--quick] [--models resnet50,gru]
                                        [--json PATH] [--no-plot]
"""
import argparse
import json
import logging
import os
import sys

import torch
from tqdm.auto import tqdm

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import model_zoo  # noqa: E402 - after the sys.path insert above; the model table and its batch/image settings

QUICK = ["resnet18", "resnet50", "mobilenet_v3_small", "transformer_encoder", "gpt_block"]


def cold_fake_cache():
    """Empties PyTorch's fake-tensor dispatch cache before a timed trace.

    The cache is class-wide (``FakeTensorMode.cache``): a trace reuses the
    entries of every earlier trace in the process for the same op on the
    same shapes, so whichever of two traces of one model runs second is
    faster (``make_fx`` of DenseNet-121's step here: 6.3 s cold, 3.8 s after
    poptorchsim's trace).  Each timed trace, poptorchsim's and ``make_fx``'s,
    starts from it empty, as the first compile in a fresh process does."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    clear = getattr(FakeTensorMode, "cache_clear", None)
    if clear is not None:
        clear()


def cold_plan_caches():
    """Empties poptorchsim's caches kept per shape (matmul and convolution
    plans, tile spreads), so that a compile of a model compiled before in
    the process plans again, as its first compile did."""
    from poptorchsim.estimate import conv_plan
    from poptorchsim.passes import tile_mapping
    for cached in (conv_plan.plan, tile_mapping._spread, tile_mapping._most):
        cached.cache_clear()


def make_fx_seconds(module, batch):
    """Seconds PyTorch's own tracing takes for ``module``'s training step,
    the floor of any trace-based compile: ``make_fx`` (fake tensors) of the
    functionalized ``torch.func.grad_and_value`` of its loss, no
    decompositions, no modes, nothing of poptorchsim (timed from an empty
    fake-tensor cache: ``cold_fake_cache``)."""
    import time

    from torch.func import functional_call, functionalize, grad_and_value
    from torch.fx.experimental.proxy_tensor import make_fx
    params = {k: v.detach() for k, v in module.named_parameters()}
    buffers = {k: v.detach() for k, v in module.named_buffers()}

    def step(p, b, *inputs):
        return grad_and_value(lambda p, b: functional_call(module, {**p, **b}, inputs)[1])(p, b)
    start = time.perf_counter()
    make_fx(functionalize(step, remove="mutations"), tracing_mode="fake")(params, buffers,
                                                                         *batch)
    return time.perf_counter() - start


def compile_passes(name, floor=False):
    """{model, fx_nodes, ir_ops, total_s, passes: {pass: seconds}} of one
    model; ``floor``: also ``make_fx_s`` (``make_fx_seconds``)."""
    case, model = model_zoo.bench_case(model_zoo.KNOWN[name])
    model.train()
    batch, = model_zoo.zoo.make_batches(case, model, 1, seed=1)
    module = model_zoo.zoo.WithLoss(model, case.loss)
    tm = model_zoo.training_model(module)
    cold_fake_cache()
    tm.compile(*batch)
    fx_nodes, ir_ops = model_zoo.node_counts(tm)
    c = tm._compiled
    row = {"model": name, "fx_nodes": fx_nodes, "ir_ops": ir_ops,
           "total_s": c.compile_seconds, "passes": dict(c.pass_seconds)}
    if floor:
        cold_fake_cache()
        row["make_fx_s"] = make_fx_seconds(module, batch)
    return row


def print_table(rows):
    passes = list(dict.fromkeys(p for r in rows for p in r["passes"]))
    short = {p: p.replace("optimizer update", "update").replace("generate code", "codegen")
             .replace("control program", "main").replace("watch gradients", "watch")
             .replace("place stages", "place").replace("place update", "pl.upd")
             for p in passes}
    head = f"{'model':<22} {'fx nodes':>8} {'total s':>8} {'ms/node':>7} " + " ".join(
        f"{short[p]:>8}" for p in passes)
    print(head)
    print("-" * len(head))
    for r in rows:
        print(f"{r['model']:<22} {r['fx_nodes']:>8} {r['total_s']:>8.2f} "
              f"{1e3 * r['total_s'] / max(r['fx_nodes'], 1):>7.2f} "
              + " ".join(f"{r['passes'].get(p, 0.0):>8.3f}" for p in passes))
    total = sum(r["total_s"] for r in rows) or 1.0
    share = {p: sum(r["passes"].get(p, 0.0) for r in rows) / total for p in passes}
    print("\nshare of all compile time: " + ", ".join(
        f"{p} {100 * v:.1f}%" for p, v in sorted(share.items(), key=lambda kv: -kv[1])))
    return passes


def write_plot(rows, passes, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(11, 0.45 * len(rows) + 2.2))
    left = [0.0] * len(rows)
    cmap = plt.get_cmap("tab20")
    for k, p in enumerate(passes):
        widths = [r["passes"].get(p, 0.0) for r in rows]
        ax.barh([r["model"] for r in rows], widths, left=left, color=cmap(k % 20), label=p)
        left = [a + b for a, b in zip(left, widths)]
    ax.set_xlabel("compile seconds (training, this machine)")
    ax.set_title("Compile time by pass")
    ax.invert_yaxis()
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
    fig.tight_layout()
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    print(f"wrote {path}")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help=f"only {', '.join(QUICK)}")
    parser.add_argument("--models", help="comma-separated models; known: "
                        + ", ".join(model_zoo.KNOWN))
    parser.add_argument("--json", metavar="PATH", help="also write the rows as JSON")
    parser.add_argument("--no-plot", action="store_true")
    parser.add_argument("--plot", default=os.path.join(HERE, "out", "compile_passes.png"))
    args = parser.parse_args(argv)
    if args.models:
        names = [n.strip() for n in args.models.split(",") if n.strip()]
        unknown = [n for n in names if n not in model_zoo.KNOWN]
        if unknown:
            parser.error(f"unknown model(s): {', '.join(unknown)}")
    else:
        names = QUICK if args.quick else list(model_zoo.CASES)
    torch.set_num_threads(model_zoo.cpu_count())
    logging.getLogger("poptorchsim").setLevel(logging.ERROR)
    model_zoo.compile_only(names[0])          # warm-up: imports, first trace
    rows = []
    for name in tqdm(names, desc="models", leave=False):
        try:
            rows.append(compile_passes(name))
        except Exception as exc:  # noqa: BLE001 - a model that cannot compile is reported
            print(f"{name}: {type(exc).__name__}: {str(exc).splitlines()[0][:120]}")
    passes = print_table(rows)
    if not args.no_plot and rows:
        write_plot(rows, passes, args.plot)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
