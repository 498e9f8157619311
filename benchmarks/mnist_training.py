"""Training throughput: the Graphcore MNIST tutorial network, poptorchsim vs PyTorch eager.

The network is the one of Graphcore's PopTorch MNIST tutorial (two conv
blocks, two linear layers, softmax, cross-entropy), dropout off.  Each round
runs one poptorchsim call (batch 8 x deviceIterations 50 = 400 samples, 50
weight updates) and then the same 50 micro-batches through plain PyTorch
eager (zero_grad, forward, backward, step each), so both see the same
machine state.  Throughputs are medians over the rounds.

    python benchmarks/mnist_training.py [--rounds 5] [--json results.json]

It also reports the compile time and what poptorchsim's cost model estimates
for one call on a simulated Mk2 IPU.
"""
import argparse
import json
import os
import platform
import statistics
import sys
import time

import torch

import poptorchsim as poptorch

# The network and its loss wrapper are the MNIST example's.
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples", "mnist"))
from train import Network, TrainingModelWithLoss

BATCH = 8
DEVICE_ITERATIONS = 50
LR = 0.05


def cpu_count():
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def machine():
    return {"processor": platform.processor() or platform.machine(),
            "platform": platform.platform(),
            "cpu_count": os.cpu_count(),
            "usable_cpus": cpu_count(),
            "torch_threads": torch.get_num_threads(),
            "python": platform.python_version(),
            "torch": torch.__version__,
            "poptorchsim": poptorch.__version__}


def eager_steps(model, optimizer, x, y):
    """The same work as one poptorchsim call: one SGD step per micro-batch."""
    for xb, yb in zip(x.split(BATCH), y.split(BATCH)):
        optimizer.zero_grad()
        _, loss = model(xb, yb)
        loss.backward()
        optimizer.step()


def run(rounds, seed=0):
    torch.manual_seed(seed)
    per_call = BATCH * DEVICE_ITERATIONS
    g = torch.Generator().manual_seed(seed)
    batches = [(torch.rand(per_call, 1, 28, 28, generator=g),
                torch.randint(0, 10, (per_call,), generator=g))
               for _ in range(rounds + 1)]

    sim_model = TrainingModelWithLoss(Network(dropout=0.0))
    eager_model = TrainingModelWithLoss(Network(dropout=0.0))
    eager_model.load_state_dict(sim_model.state_dict())
    eager_model.train()

    # compilationTime() needs the compilation progress bar, as in PopTorch
    opts = poptorch.Options().deviceIterations(DEVICE_ITERATIONS)
    training_model = poptorch.trainingModel(
        sim_model, opts, poptorch.optim.SGD(sim_model.parameters(), lr=LR))
    eager_opt = torch.optim.SGD(eager_model.parameters(), lr=LR)

    # warm-up: the first poptorchsim call compiles; eager gets the same batch
    x, y = batches[0]
    t0 = time.perf_counter()
    training_model(x, y)
    first_call_s = time.perf_counter() - t0
    compile_s = training_model.compilationTime().total_seconds()
    t0 = time.perf_counter()
    eager_steps(eager_model, eager_opt, x, y)
    eager_first_s = time.perf_counter() - t0

    sim_s, eager_s = [], []
    for x, y in batches[1:]:
        t0 = time.perf_counter()
        training_model(x, y)
        sim_s.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        eager_steps(eager_model, eager_opt, x, y)
        eager_s.append(time.perf_counter() - t0)

    # both trained on the same batches from the same weights
    weight_diff = max((a - b).abs().max().item() for a, b in
                      zip(sim_model.parameters(), eager_model.parameters()))
    cycles = training_model.cycleEstimate()
    memory = training_model.memoryReport()
    sim_med, eager_med = statistics.median(sim_s), statistics.median(eager_s)
    return {
        "network": "Graphcore PopTorch MNIST tutorial (dropout off)",
        "batch_size": BATCH, "device_iterations": DEVICE_ITERATIONS,
        "samples_per_call": per_call, "rounds": rounds, "lr": LR,
        "poptorchsim_call_s": sim_s, "eager_call_s": eager_s,
        "poptorchsim_samples_per_s": per_call / sim_med,
        "eager_samples_per_s": per_call / eager_med,
        "ratio_poptorchsim_over_eager": eager_med / sim_med,
        "compile_s": compile_s,
        "first_call_s": first_call_s,
        "first_call_minus_normal_s": first_call_s - sim_med,
        "eager_first_call_s": eager_first_s,
        "max_weight_diff_vs_eager": weight_diff,
        "simulated_cycles_per_call": cycles["total"],
        "simulated_cycles": {k: cycles[k] for k in ("compute", "exchange", "sync", "host")},
        "simulated_s_per_call": cycles["seconds"],
        "simulated_samples_per_s": per_call / cycles["seconds"],
        "simulated_busiest_tile_bytes": int(memory.total.max()),
        "simulated_tile_capacity_bytes": int(memory.capacity),
        "machine": machine(),
    }


def report(r):
    m = r["machine"]
    print(f"machine: {m['processor']}, {m['cpu_count']} CPUs ({m['usable_cpus']} usable), "
          f"torch {m['torch']} with {m['torch_threads']} threads, python {m['python']}")
    print(f"workload: {r['network']}, batch {r['batch_size']} x deviceIterations "
          f"{r['device_iterations']} = {r['samples_per_call']} samples "
          f"({r['device_iterations']} SGD steps) per call, {r['rounds']} rounds")
    print(f"compile: {r['compile_s']:.2f} s by compilationTime(); the first call took "
          f"{r['first_call_s']:.2f} s, {r['first_call_minus_normal_s']:.2f} s more than "
          "a normal call")
    print(f"poptorchsim:   {r['poptorchsim_samples_per_s']:8,.0f} samples/s "
          f"(median {statistics.median(r['poptorchsim_call_s']) * 1e3:.0f} ms per call)")
    print(f"PyTorch eager: {r['eager_samples_per_s']:8,.0f} samples/s "
          f"(median {statistics.median(r['eager_call_s']) * 1e3:.0f} ms per 50 steps)")
    print(f"ratio poptorchsim / eager: {r['ratio_poptorchsim_over_eager']:.2f}x "
          f"(weights agree to {r['max_weight_diff_vs_eager']:.1e})")
    c = r["simulated_cycles"]
    total = r["simulated_cycles_per_call"]
    split = ", ".join(f"{k} {100 * v / total:.0f}%" for k, v in c.items())
    print(f"simulated Mk2 IPU: {total:,.0f} cycles = {r['simulated_s_per_call'] * 1e3:.3f} ms "
          f"per call, {r['simulated_samples_per_s']:,.0f} samples/s ({split})")
    print(f"simulated memory: busiest tile {r['simulated_busiest_tile_bytes'] / 1024:.1f} "
          f"KiB of {r['simulated_tile_capacity_bytes'] / 1024:.0f} KiB")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5,
                        help="interleaved poptorchsim/eager rounds (default 5)")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads (default: the CPUs this process may use)")
    parser.add_argument("--json", metavar="PATH", help="also write the numbers as JSON")
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    torch.set_num_threads(args.threads or cpu_count())
    t0 = time.perf_counter()
    results = run(args.rounds)
    results["benchmark_wall_s"] = time.perf_counter() - t0
    report(results)
    print(f"benchmark wall time: {results['benchmark_wall_s']:.1f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
