#!/usr/bin/env python3
"""A Hugging Face GPT-2 language model, pipelined over 4 IPUs and replicated,
trained on the simulated IPU and checked against plain PyTorch.

The model is ``transformers.GPT2LMHeadModel`` built from a config (random
weights, no download) with its LM head tied to the token embedding, as every
Hugging Face language model is.  It is placed as Graphcore's GPT-2 examples
place it:

* the embeddings have no block: PopTorch runs them on IPU 0, in stage 0;
* ``BeginBlock`` puts decoder layers 1, 2 and 3 on IPUs 1, 2 and 3;
* the LM head, whose weight is the embedding's, goes back to IPU 0 in a
  last stage (``PipelinedExecution(AutoStage.AutoIncrement)``): layers that
  share weights must be on the same IPU.

Five stages in training need ``gradientAccumulation`` >= 9 (2 x 5 - 1); two
replicas double the batch.  The text is character-level: this project's own
documentation, so nothing is downloaded.  After training it prints the loss
before and after, the largest difference between the simulated weights and
the same training in plain PyTorch on the same combined batches, and the
estimated step time and fullest tile of each IPU; ``--plot DIR`` writes the
pipeline timeline as a PNG.

    python examples/language_model/train.py [--steps 8] [--plot DIR]
"""
import argparse
import copy
import glob
import os

import torch
from torch import nn
from tqdm import tqdm

import poptorchsim as poptorch

HERE = os.path.dirname(os.path.abspath(__file__))
CONTEXT = 32


def corpus():
    """Characters of the project's documentation, as token ids."""
    text = "".join(open(p, encoding="utf-8").read()
                   for p in sorted(glob.glob(os.path.join(HERE, "..", "..", "docs", "*.md"))))
    chars = sorted(set(text))
    index = {c: i for i, c in enumerate(chars)}
    return torch.tensor([index[c] for c in text]), len(chars)


class LanguageModel(nn.Module):
    """GPT-2 with its loss, returning (logits, loss) as a trainingModel needs."""

    def __init__(self, lm):
        super().__init__()
        self.lm = lm

    def forward(self, ids):
        out = self.lm(input_ids=ids, labels=ids)
        return out.logits, out.loss


def build(vocab, layers=4):
    import transformers
    config = transformers.GPT2Config(vocab_size=vocab, n_positions=CONTEXT, n_embd=64,
                                     n_layer=layers, n_head=4, resid_pdrop=0.0,
                                     embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0,
                                     eos_token_id=0)
    torch.manual_seed(0)
    return LanguageModel(transformers.GPT2LMHeadModel(config))


def pipeline(model):
    """Graphcore's placement: embeddings (no block) on IPU 0, layer i on IPU i,
    the tied LM head back on IPU 0."""
    blocks = model.lm.transformer.h
    for i in range(1, len(blocks)):
        blocks[i] = poptorch.BeginBlock(blocks[i], f"layer{i}", ipu_id=i)
    model.lm.lm_head = poptorch.BeginBlock(model.lm.lm_head, "lm_head", ipu_id=0)
    return model


def batches(tokens, steps, per_step, seed=0):
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        starts = torch.randint(0, len(tokens) - CONTEXT, (per_step,), generator=g)
        yield torch.stack([tokens[s:s + CONTEXT] for s in starts])


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--accumulation", type=int, default=10)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--plot", metavar="DIR", help="write the pipeline timeline PNG here")
    args = parser.parse_args(argv)

    tokens, vocab = corpus()
    model = pipeline(build(vocab))
    reference = copy.deepcopy(model)             # the same weights, trained in PyTorch
    assert model.lm.lm_head.weight is model.lm.transformer.wte.weight

    opts = poptorch.Options().replicationFactor(args.replicas)
    opts.Training.gradientAccumulation(args.accumulation)
    opts.setExecutionStrategy(poptorch.PipelinedExecution(poptorch.AutoStage.AutoIncrement))
    opts.showCompilationProgressBar(False)
    optimizer = poptorch.optim.AdamW(model.parameters(), lr=args.lr)
    training = poptorch.trainingModel(model, opts, optimizer)
    ref_optimizer = torch.optim.AdamW(reference.parameters(), lr=args.lr)

    per_step = args.replicas * args.accumulation
    losses = []
    for ids in tqdm(list(batches(tokens, args.steps, per_step)), desc="training steps"):
        _, loss = training(ids)
        losses.append(float(loss.mean()))
        ref_optimizer.zero_grad()
        for micro in ids.split(1):               # the mean over the combined batch
            (reference(micro)[1] / per_step).backward()
        ref_optimizer.step()
    training.copyWeightsToHost()

    diff = max((a - b).abs().max().item() for a, b in
               zip(model.state_dict().values(), reference.state_dict().values()))
    program = training._compiled.program
    cycles = training.cycleEstimate()
    memory = training.memoryReport()
    print(f"GPT-2 ({sum(p.numel() for p in model.parameters()):,} parameters, LM head tied "
          f"to the embedding: {model.lm.lm_head.weight is model.lm.transformer.wte.weight})")
    print(f"stages {program.n_stages} on IPUs {program.ipu_of_stage}, {args.replicas} "
          f"replicas, gradient accumulation {args.accumulation}")
    print(f"loss {losses[0]:.3f} -> {losses[-1]:.3f} over {args.steps} steps")
    print(f"largest weight difference from PyTorch: {diff:.2e}")
    print(f"estimated {cycles['seconds'] * 1e3:.2f} ms per step on Mk2 IPUs; fullest tile "
          + ", ".join(f"IPU {i}: {r.total.max() / 1024:.0f} KiB"
                      for i, r in enumerate(memory.ipus)))
    if args.plot:
        from poptorchsim.profiling import write_report
        written = write_report(training.simulationReport(), args.plot)
        print("wrote", ", ".join(sorted(os.path.basename(w) for w in written
                                        if str(w).endswith(".png"))))
    training.destroy()
    return diff


if __name__ == "__main__":
    main()
