"""A PopTorch program for the distributed tests: trains a small classifier
on a fixed dataset through poptorchsim.DataLoader with the replicas that
poprun (python -m poptorchsim.run) gives this process.

    python train_small.py OUT [die]

Process 0 saves the final state_dict to OUT.  With ``die``, process 1
exits abruptly (``os._exit(3)``) on its second step while process 0 waits
for its gradients.  ``TRAIN_SMALL_OPTIMIZER`` picks the optimizer
(``OPTIMIZERS``; Adam by default).
"""
import os
import sys
import time

import torch
from torch import nn

import poptorchsim as poptorch

SAMPLES, MICRO, DI, GA = 256, 3, 2, 2


class Small(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 4))
        self.loss = nn.CrossEntropyLoss()

    def forward(self, x, labels):
        out = self.net(x)
        return out, self.loss(out, labels)


OPTIMIZERS = {
    "adam": lambda p: torch.optim.Adam(p, lr=1e-2),
    # SGD1: the micro-batch gradients go straight into the velocity
    "sgd_combined": lambda p: poptorch.optim.SGD(p, lr=0.05, momentum=0.9, weight_decay=1e-3,
                                                 use_combined_accum=True, velocity_scaling=4.0,
                                                 loss_scaling=8.0),
    # a float16 gradient accumulator: a running mean in each process
    "adam_fp16_accum": lambda p: poptorch.optim.Adam(p, lr=1e-2, accum_type=torch.float16,
                                                     loss_scaling=16.0),
}


def make_optimizer(params):
    return OPTIMIZERS[os.environ.get("TRAIN_SMALL_OPTIMIZER", "adam")](params)


def dataset():
    g = torch.Generator().manual_seed(1)
    return torch.utils.data.TensorDataset(torch.randn(SAMPLES, 6, generator=g),
                                          torch.randint(0, 4, (SAMPLES,), generator=g))


def main():
    out, mode = sys.argv[1], (sys.argv[2] if len(sys.argv) > 2 else "train")
    torch.manual_seed(0)
    model = Small()
    replicas = int(os.environ.get("POPDIST_NUM_LOCAL_REPLICAS", "1"))
    opts = poptorch.Options().deviceIterations(DI).replicationFactor(replicas)
    opts.Training.gradientAccumulation(GA)
    opts.showCompilationProgressBar(False)
    loader = poptorch.DataLoader(opts, dataset(), batch_size=MICRO)
    tm = poptorch.trainingModel(model, opts, make_optimizer(model.parameters()))
    pid = opts.Distributed.processId
    for step, (x, labels) in enumerate(loader):
        if mode == "die" and pid == 1 and step == 1:
            time.sleep(0.5)     # process 0 is in the gradient all-reduce by now
            os._exit(3)
        _, loss = tm(x, labels)
    if pid == 0:
        torch.save(model.state_dict(), out)
    print(f"process {pid} of {opts.Distributed.numProcesses}: {len(loader)} steps, "
          f"last loss {float(loss.mean()):.4f}")


if __name__ == "__main__":
    main()
