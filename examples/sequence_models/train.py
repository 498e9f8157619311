#!/usr/bin/env python3
"""Train attention and recurrent classifiers on a simulated IPU.

Three PopTorch programs, unchanged but for ``import poptorchsim as poptorch``:
a Transformer encoder (``nn.TransformerEncoder``), a GPT-style causal block
(``F.scaled_dot_product_attention``) and a bidirectional LSTM, each trained on
the same synthetic task: which of four token kinds is most frequent in a
sequence of 24 tokens.  For each model it prints the test accuracy, the
estimated throughput and memory on one Mk2 IPU, and the cost classes its
operations fall into (``python -m poptorchsim ops`` lists them one by one).
"""
import argparse
from collections import Counter

import torch
import torch.nn.functional as F
from torch import nn
from tqdm import tqdm

import poptorchsim as poptorch

VOCAB, LENGTH, CLASSES, WIDTH = 12, 24, 4, 32


def make_data(n, seed):
    """Tokens 0-11; token t is of kind t % 4; label: the most frequent kind."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (n, LENGTH), generator=g)
    counts = F.one_hot(tokens % CLASSES, CLASSES).sum(1)
    return tokens, counts.argmax(1)


class EncoderClassifier(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.position = nn.Parameter(torch.zeros(LENGTH, WIDTH))
        layer = nn.TransformerEncoderLayer(WIDTH, 4, 2 * WIDTH, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2)
        self.head = nn.Linear(WIDTH, CLASSES)

    def forward(self, tokens):
        return self.head(self.encoder(self.embed(tokens) + self.position).mean(1))


class CausalBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.qkv = nn.Linear(WIDTH, 3 * WIDTH)
        self.proj = nn.Linear(WIDTH, WIDTH)
        self.norm = nn.LayerNorm(WIDTH)
        self.mlp = nn.Sequential(nn.Linear(WIDTH, 2 * WIDTH), nn.GELU(),
                                 nn.Linear(2 * WIDTH, WIDTH))
        self.head = nn.Linear(WIDTH, CLASSES)

    def forward(self, tokens):
        x = self.embed(tokens)
        b, t, _ = x.shape
        q, k, v = self.qkv(self.norm(x)).view(b, t, 3, 4, WIDTH // 4).permute(2, 0, 3, 1, 4)
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, WIDTH))
        x = x + self.mlp(self.norm(x))
        return self.head(x[:, -1])            # the last token has seen them all


class LSTMClassifier(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.lstm = nn.LSTM(WIDTH, WIDTH, batch_first=True, bidirectional=True)
        self.head = nn.Linear(2 * WIDTH, CLASSES)

    def forward(self, tokens):
        return self.head(self.lstm(self.embed(tokens))[0].mean(1))


class WithLoss(nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model
        self.loss = nn.CrossEntropyLoss()

    def forward(self, tokens, labels=None):
        out = self.model(tokens)
        if labels is None:
            return out
        return out, self.loss(out, labels)


MODELS = {"transformer_encoder": EncoderClassifier, "causal_attention": CausalBlock,
          "lstm": LSTMClassifier}


def train(name, args):
    torch.manual_seed(0)
    model = WithLoss(MODELS[name]())
    opts = poptorch.Options().deviceIterations(args.device_iterations)
    opts.showCompilationProgressBar(False)
    train_set = torch.utils.data.TensorDataset(*make_data(args.train_samples, seed=1))
    loader = poptorch.DataLoader(opts, train_set, batch_size=args.batch_size, shuffle=True,
                                 drop_last=True)
    optimizer = poptorch.optim.AdamW(model.parameters(), lr=args.lr)
    training = poptorch.trainingModel(model, opts, optimizer)
    for _ in tqdm(range(args.epochs), desc=f"{name}: epochs", leave=False):
        for tokens, labels in loader:
            training(tokens, labels)
    estimate = training.simulationReport()
    training.detachFromDevice()

    tokens, labels = make_data(args.test_samples, seed=2)
    inference = poptorch.inferenceModel(model.model, poptorch.Options()
                                        .showCompilationProgressBar(False))
    accuracy = (inference(tokens).argmax(1) == labels).float().mean().item()
    classes = Counter()
    for op in estimate["ops"]:
        classes[op["class"]] += op["cycles_per_call"]
    total = sum(classes.values()) or 1.0
    top = ", ".join(f"{c} {100 * v / total:.0f}%" for c, v in classes.most_common(4))
    mem = estimate["memory"]
    print(f"{name:>20}: test accuracy {100 * accuracy:5.1f}%  |  Mk2 estimate "
          f"{estimate['cycles']['samples_per_second']:,.0f} samples/s, busiest tile "
          f"{mem['peak_bytes'] / 1024:.1f} KiB ({'fits' if mem['fits'] else 'DOES NOT FIT'})"
          f"  |  cycles by class: {top}")
    return accuracy


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default=",".join(MODELS))
    p.add_argument("--epochs", type=int, default=6)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--device-iterations", type=int, default=10)
    p.add_argument("--train-samples", type=int, default=3200)
    p.add_argument("--test-samples", type=int, default=1000)
    p.add_argument("--lr", type=float, default=3e-3)
    args = p.parse_args(argv)
    return {name: train(name, args) for name in args.models.split(",")}


if __name__ == "__main__":
    main()
