#!/usr/bin/env python3
"""Compiling a model without weights: seconds and peak host memory.

A model built on PyTorch's ``meta`` device (``with torch.device("meta"):
model = GPT2LMHeadModel(config)``) has shapes but no values; poptorchsim
compiles it to the memory report and cycle estimate of the same model with
weights (docs/sizing.md).  This prints, for Hugging Face GPT-2 medium (355M
parameters) and GPT-2 XL (1.56B, embeddings untied) built on meta, the
compile seconds and the peak resident memory (``ru_maxrss``) of a fresh
process that builds, wraps and compiles the model; with ``--real``, also
GPT-2 medium with its weights on the CPU, for comparison.

The configuration is a Pod16-style training run: AdamW, the 24 or 48
transformer layers pipelined over 8 IPUs (``BeginBlock``), replication
factor 2, gradient accumulation 16, fp16 weights, micro-batch 1 x 1024
tokens, compiled with ``debug.allowOutOfMemory`` (the report says what
does not fit).

    python benchmarks/meta_compile.py [--models medium,xl] [--real] [--seq 1024]
"""
import argparse
import subprocess
import sys

SIZES = {   # n_layer, n_embd, n_head
    "medium": (24, 1024, 16),
    "xl": (48, 1600, 25),
}

TEMPLATE = """
import gc, resource, time
import torch
import transformers
import poptorchsim
transformers.logging.set_verbosity_error()


def current_rss_mb():
    # resident memory now (Linux), else the peak
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * resource.getpagesize() / 2**20
    except OSError:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


N_LAYER, N_EMBD, N_HEAD, SEQ, IPUS = {n_layer}, {n_embd}, {n_head}, {seq}, 8
config = transformers.GPT2Config(n_layer=N_LAYER, n_embd=N_EMBD, n_head=N_HEAD,
                                 n_positions=1024, vocab_size=50257,
                                 tie_word_embeddings=False, use_cache=False)


class GPT2WithLoss(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lm = transformers.GPT2LMHeadModel(config)
        per_ipu = N_LAYER // IPUS
        for ipu in range(1, IPUS):
            layers = self.lm.transformer.h
            layers[ipu * per_ipu] = poptorchsim.BeginBlock(layers[ipu * per_ipu], ipu_id=ipu)

    def forward(self, ids, labels):
        return self.lm(input_ids=ids, labels=labels).loss


start = time.perf_counter()
with torch.device("{device}"):
    model = GPT2WithLoss().half()
build = time.perf_counter() - start
opts = poptorchsim.Options().showCompilationProgressBar(False)
opts.replicationFactor(2)
opts.Training.gradientAccumulation(16)
opts.setExecutionStrategy(poptorchsim.PipelinedExecution())
opts._Popart.setEngineOptions({{"debug.allowOutOfMemory": "true"}})
pm = poptorchsim.trainingModel(model, opts, torch.optim.AdamW(model.parameters(), lr=1e-4))
ids = torch.randint(0, 50257, (2 * 16, SEQ))
start = time.perf_counter()
pm.compile(ids, ids)
seconds = time.perf_counter() - start
rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
params = sum(p.numel() for p in model.parameters())
ipus = pm.memoryReport().ipus
always_live = ipus[0].always_live.sum() / 2**20
cycles = pm.cycleEstimate()['total']
del ipus
before = current_rss_mb()
pm.destroy()
gc.collect()
print(f"RESULT params={{params}} build_s={{build:.1f}} compile_s={{seconds:.1f}} "
      f"peak_rss_mb={{rss:.0f}} ipus=8 ipu0_always_live_mb={{always_live:.0f}} "
      f"cycles={{cycles:.4g}} rss_before_destroy_mb={{before:.0f}} "
      f"rss_after_destroy_mb={{current_rss_mb():.0f}}")
"""


def script(size, device="meta", seq=1024):
    n_layer, n_embd, n_head = SIZES[size]
    return TEMPLATE.format(n_layer=n_layer, n_embd=n_embd, n_head=n_head, seq=seq,
                           device=device)


#: tests/test_meta_models.py runs this in a fresh process (peak RSS < 1.5 GB)
GPT2_XL_SCRIPT = script("xl")


def run(size, device, seq):
    """The RESULT fields of one fresh process, as a dict of strings."""
    out = subprocess.run([sys.executable, "-c", script(size, device, seq)],
                         capture_output=True, text=True)
    if out.returncode:
        sys.stderr.write(out.stderr[-3000:])
        raise SystemExit(f"{size} on {device} failed")
    line = next(ln for ln in out.stdout.splitlines() if ln.startswith("RESULT"))
    return dict(kv.split("=") for kv in line.split()[1:])


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="medium,xl")
    parser.add_argument("--real", action="store_true",
                        help="also GPT-2 medium with its weights on the CPU")
    parser.add_argument("--seq", type=int, default=1024)
    a = parser.parse_args()
    cases = [(m, "meta") for m in a.models.split(",")]
    if a.real:
        cases.append(("medium", "cpu"))
    print(f"{'model':8} {'weights':7} {'params':>13} {'compile s':>9} {'peak RSS MB':>11} "
          f"{'RSS before/after destroy MB':>27} {'IPU0 always-live MB':>19} {'cycles':>10}")
    for size, device in cases:
        r = run(size, device, a.seq)
        destroy = f"{r['rss_before_destroy_mb']} / {r['rss_after_destroy_mb']}"
        print(f"{size:8} {device:7} {int(r['params']):>13,} {r['compile_s']:>9} "
              f"{r['peak_rss_mb']:>11} {destroy:>27} {r['ipu0_always_live_mb']:>19} "
              f"{r['cycles']:>10}", flush=True)


if __name__ == "__main__":
    main()
