"""The planner against Graphcore's own choices (docs/sizing.md).

For each model Graphcore published a Bow Pod16 configuration for (the ones
``benchmarks/fidelity.py`` rebuilds, and GPT-2 medium from
nlp/gpt2/pytorch/run/pretraining_medium.sh), the model is built without a
split and planned with ``poptorchsim.plan`` on 16 Bow IPUs at Graphcore's
global batch, Graphcore's configuration included in the search.  Prints,
per model: Graphcore's configuration (fits? estimated samples/s), the
planner's best, configurations considered and host seconds per
configuration; ``--json`` writes it all, ``--out DIR`` the plots.

    python benchmarks/planner.py [--only bert-base] [--json out.json]
"""
import argparse
import json
import logging
import math
import os
import sys
import time

import torch
import torch.nn.functional as F  # noqa: F401 - fidelity's modules use it

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import fidelity  # noqa: E402 - after the sys.path insert above

import poptorchsim as poptorch  # noqa: E402 - after the sys.path insert above
from poptorchsim.runtime.planning.planner import Configuration, Planner  # noqa: E402 - after the sys.path insert above


def _options(**precision):
    opts = poptorch.Options().useIpuModelVersion("ipu21")
    opts.enableSyntheticData(True)
    opts.Training.accumulationAndReplicationReductionType(poptorch.ReductionType.Mean)
    opts.outputMode(poptorch.OutputMode.Sum)
    if precision.get("stochastic_rounding"):
        opts.Precision.enableStochasticRounding(True)
    return opts


def resnet50():
    """vision/cnns resnet50: micro-batch 18, 16 replicas, accumulation 57,
    AMP 0.16, half partials, RecomputeAll with the examples' checkpoints."""
    import torchvision
    model = fidelity.ImageClassifierWithLoss(fidelity.with_recomputation_checkpoints(
        torchvision.models.resnet50(), fidelity.RESNET50_CHECKPOINTS).half())
    optimizer = poptorch.optim.SGD(model.parameters(), lr=2.0, momentum=0.9, loss_scaling=128,
                                   velocity_scaling=128, use_combined_accum=True)
    inputs = (torch.zeros(1, 3, 224, 224, dtype=torch.uint8), torch.zeros(1, dtype=torch.long))
    graphcore = lambda units: Configuration(18, (0,) * len(units), 16, 57, 0.16, "on chip",  # noqa: E731 - a one-line helper
                                            "half", "all")
    search = dict(micro_batches=(8, 16, 18, 24, 32), ipus_per_replica=(1, 2),
                  amps=(0.6, 0.3, 0.16), optimizer_states=("on chip",), partials=("half",),
                  recomputations=("default", "all"), global_batch=18 * 16 * 57)
    return model, optimizer, _options(stochastic_rounding=True), inputs, graphcore, search, 2


def _bert(size, serialization):
    import transformers
    transformers.logging.set_verbosity_error()
    config = transformers.BertConfig(vocab_size=30522, layer_norm_eps=0.001,
                                     attention_probs_dropout_prob=0.0,
                                     attn_implementation="eager", **size)
    model = fidelity.PipelinedBertForPretraining(config, None, serialization,
                                                 blocks=False).half().train()
    groups = [{"params": [], "weight_decay": 0, "max_weight_norm": 0},
              {"params": [], "weight_decay": 0}, {"params": [], "weight_decay": 0.01}]
    for name, p in model.named_parameters():
        groups[0 if "bias" in name else 1 if p.dim() == 1 else 2]["params"].append(p)
    optimizer = poptorch.optim.LAMB(
        groups, lr=0.006, weight_decay=0, eps=1e-6, loss_scaling=4096.0, max_weight_norm=None,
        accum_type=torch.float16, first_order_momentum_accum_type=torch.float32,
        second_order_momentum_accum_type=torch.float32)
    inputs = (*[torch.zeros(1, 128, dtype=torch.long)] * 3,
              *[torch.zeros(1, 20, dtype=torch.long)] * 2, torch.zeros(1, 1, dtype=torch.long))
    return model, optimizer, inputs


def _layout(units, layers_per_ipu, layer_marker, ipu_of_end=lambda unit: 0):
    """Graphcore's layout of a model with embeddings and a tied head: the
    repeated layers (units holding ``layer_marker``) by ``layers_per_ipu``,
    the other units on ``ipu_of_end(unit)`` (IPU 0: embeddings, heads)."""
    ipu_of = iter([ipu for ipu, n in enumerate(layers_per_ipu) for _ in range(n)])
    return tuple(next(ipu_of) if layer_marker in u else ipu_of_end(u) for u in units)


def _bert_split(units, layers_per_ipu):
    """Graphcore's BERT layout: embeddings, pooler and heads on IPU 0, the
    encoder layers by ``layers_per_ipu``."""
    return _layout(units, layers_per_ipu, ".layer.")


def bert_base():
    """nlp/bert phase 1 SL128 Bow Pod16: [0, 4, 4, 4], micro-batch 32,
    4 replicas, accumulation 512, AMP 0.25, LAMB state off chip, sharded."""
    model, optimizer, inputs = _bert(fidelity.BERT_BASE, 1)
    graphcore = lambda units: Configuration(  # noqa: E731 - a one-line helper
        32, _bert_split(units, [0, 4, 4, 4]), 4, 512, 0.25, "sharded", "half")
    search = dict(micro_batches=(8, 16, 32), ipus_per_replica=(2, 4),
                  amps=(0.6, 0.4, 0.25, 0.15), optimizer_states=("on chip", "sharded"),
                  partials=("half",), global_batch=32 * 4 * 512)
    return model, optimizer, _options(stochastic_rounding=True), inputs, graphcore, search, 4


def bert_large():
    """nlp/bert phase 1 SL128 packed Bow Pod16: [3, 7, 7, 7], micro-batch 8,
    4 replicas, accumulation ceil(2048 / 1.17), AMP [0.15, 0.25, 0.25, 0.25]."""
    model, optimizer, inputs = _bert(fidelity.BERT_LARGE, 2)
    ga = math.ceil(2048 / fidelity.PACKING_FACTOR_128)
    graphcore = lambda units: Configuration(  # noqa: E731 - a one-line helper
        8, _bert_split(units, [3, 7, 7, 7]), 4, ga, (0.15, 0.25, 0.25, 0.25), "sharded", "half")
    search = dict(micro_batches=(4, 8), ipus_per_replica=(4,), amps=(0.4, 0.25, 0.15),
                  optimizer_states=("sharded",), partials=("half",), global_batch=8 * 4 * ga)
    return model, optimizer, _options(stochastic_rounding=True), inputs, graphcore, search, 4


def gpt2_medium():
    """nlp/gpt2 pretraining_medium.sh: 8 IPUs x 2 replicas, layers
    [0, 3, 3, 3, 3, 4, 4, 4] (embeddings and the tied LM head on IPU 0),
    micro-batch 1 x 1024 tokens, accumulation 4096, AMP [0.3, 0.15 x 7],
    half partials, AdamW state sharded (replicated tensor sharding)."""
    import transformers
    transformers.logging.set_verbosity_error()
    cfg = transformers.GPT2Config(n_layer=24, n_embd=1024, n_head=16, n_positions=1024,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)

    class LM(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.model = transformers.GPT2LMHeadModel(cfg)
            for layer in self.model.transformer.h:
                layer.register_forward_hook(fidelity._checkpoint_outputs)

        def forward(self, ids):
            return poptorch.identity_loss(self.model(input_ids=ids, labels=ids).loss, "none")
    model = LM().half().train()
    optimizer = poptorch.optim.AdamW(model.parameters(), lr=1.5e-4, loss_scaling=1024,
                                     accum_type=torch.float16)

    def graphcore(units):           # the final layer norm on the last IPU, as the examples
        split = _layout(units, [0, 3, 3, 3, 3, 4, 4, 4], ".h.",
                        lambda u: 7 if u.endswith("ln_f") else 0)
        return Configuration(1, split, 2, 4096, (0.3,) + (0.15,) * 7, "sharded", "half")
    search = dict(micro_batches=(1, 2), ipus_per_replica=(8,), amps=(0.3, 0.15),
                  optimizer_states=("sharded",), partials=("half",), global_batch=8192)
    inputs = (torch.zeros(1, 1024, dtype=torch.long),)
    return model, optimizer, _options(), inputs, graphcore, search, 8


MODELS = {"resnet50": resnet50, "bert-base": bert_base, "bert-large": bert_large,
          "gpt2-medium": gpt2_medium}


def run(name, out_dir=None):
    model, optimizer, options, inputs, graphcore, search, max_k = MODELS[name]()
    start = time.perf_counter()
    planner = Planner(model, inputs, optimizer, options, ipus=16, max_ipus_per_replica=max_k)
    theirs = graphcore(planner.units)
    result = planner.search(include=[theirs], **search)
    seconds = time.perf_counter() - start
    gc, best = result.find(theirs), result.best
    row = {"model": name, "configurations": len(result.results), "seconds": seconds,
           "seconds_per_configuration": seconds / len(result.results),
           "graphcore": theirs.describe(result.repeated, result.units), "graphcore_fits": gc.fits,
           "graphcore_samples_per_s": gc.samples_per_second, "graphcore_reason": gc.reason,
           "graphcore_peak_kib": [p // 1024 for p in gc.peak_tile],
           "best": best.config.describe(result.repeated, result.units) if best else None,
           "best_samples_per_s": best.samples_per_second if best else 0.0,
           "best_peak_kib": [p // 1024 for p in best.peak_tile] if best else [],
           "fitting": len(result.fitting)}
    print(f"\n== {name}")
    print(result.table(limit=8, rejected=4))
    print(f"Graphcore's: {row['graphcore']}: "
          f"{'fits' if gc.fits else 'does not fit (' + gc.reason + ')'}, "
          f"{gc.samples_per_second:.0f} samples/s estimated")
    print(f"planner's best: {row['best']}: {row['best_samples_per_s']:.0f} samples/s "
          f"({row['best_samples_per_s'] / max(gc.samples_per_second, 1e-9):.2f}x Graphcore's)")
    print(f"{len(result.results)} configurations in {seconds:.0f} s "
          f"({row['seconds_per_configuration']:.1f} s each, traces included)", flush=True)
    if out_dir:
        os.makedirs(out_dir, exist_ok=True)
        result.plot(os.path.join(out_dir, f"plan_{name}.png"))
    return row


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", action="append", choices=list(MODELS))
    parser.add_argument("--json")
    parser.add_argument("--out", default=os.path.join(HERE, "out"))
    args = parser.parse_args(argv)
    logging.getLogger("poptorchsim").setLevel(logging.ERROR)
    rows = [run(name, args.out) for name in (args.only or MODELS)]
    print("\n| model | Graphcore's configuration | fits | est. samples/s | planner's best "
          "| est. samples/s | configs | s/config |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['model']} | {r['graphcore']} | {'yes' if r['graphcore_fits'] else 'no'} | "
              f"{r['graphcore_samples_per_s']:.0f} | {r['best']} | {r['best_samples_per_s']:.0f} "
              f"| {r['configurations']} | {r['seconds_per_configuration']:.1f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
