"""A small model pipelined over four IPUs, for the report tests
(``test_report_ipus.py``, ``test_report_browser.py``): each block on its
own IPU, blocks of different widths so every IPU holds different bytes, and
the last block holds a matmul, a ReLU and the loss."""
import torch
from torch import nn

import poptorchsim

WIDTHS = (16, 48, 160, 32)          # in-features of blocks 0..3
DEVICE_ITERATIONS, ACCUMULATION, MICRO_BATCH = 2, 8, 4


class FourBlocks(nn.Module):
    def __init__(self, widths=WIDTHS):
        super().__init__()
        w = widths
        self.b0 = poptorchsim.BeginBlock(nn.Linear(w[0], w[1]), "b0", ipu_id=0)
        self.b1 = poptorchsim.BeginBlock(nn.Linear(w[1], w[2]), "b1", ipu_id=1)
        self.b2 = poptorchsim.BeginBlock(nn.Linear(w[2], w[3]), "b2", ipu_id=2)
        self.b3 = poptorchsim.BeginBlock(nn.Linear(w[3], 4), "b3", ipu_id=3)
        self.loss = nn.CrossEntropyLoss()

    def forward(self, x, y):
        x = torch.relu(self.b0(x))
        x = torch.relu(self.b1(x))
        x = torch.relu(self.b2(x))
        out = torch.relu(self.b3(x))          # block b3: matmul, ReLU and the loss
        return out, self.loss(out, y)


def batch(width=WIDTHS[0]):
    n = DEVICE_ITERATIONS * ACCUMULATION * MICRO_BATCH
    g = torch.Generator().manual_seed(0)
    return torch.randn(n, width, generator=g), torch.randint(0, 4, (n,), generator=g)


def compile_four_ipus(profile_dir, loss_scaling=128.0, widths=WIDTHS):
    """The training model, compiled with its report written to
    ``profile_dir`` (a loss scale, so the program unscales gradients)."""
    opts = poptorchsim.Options().deviceIterations(DEVICE_ITERATIONS)
    opts.showCompilationProgressBar(False)
    opts.Training.gradientAccumulation(ACCUMULATION)
    opts.setExecutionStrategy(poptorchsim.PipelinedExecution(
        poptorchsim.AutoStage.AutoIncrement))
    opts.enableProfiling(str(profile_dir))
    model = FourBlocks(widths)
    optimizer = poptorchsim.optim.SGD(model.parameters(), lr=0.1, loss_scaling=loss_scaling)
    training = poptorchsim.trainingModel(model, opts, optimizer=optimizer)
    training.compile(*batch(widths[0]))
    return training
