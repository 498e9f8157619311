"""docs/architecture.md follows one convolution from ``trainingModel()`` to its
cycle count: its figures are this compile's."""
import pathlib
import re

import torch
from conftest import quiet_options
from torch import nn

import poptorchsim

DOC = pathlib.Path(__file__).resolve().parents[1] / "docs" / "architecture.md"


class Net(nn.Module):
    """The doc's model: a convolution, a ReLU, a linear head, cross-entropy."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(1, 8, 3)
        self.fc = nn.Linear(8 * 26 * 26, 10)
        self.loss = nn.CrossEntropyLoss()

    def forward(self, x, y):
        out = self.fc(torch.relu(self.conv(x)).flatten(1))
        return out, self.loss(out, y)


def _n(value):
    return f"{round(value):,}"


def test_the_walkthrough_s_figures_are_the_compile_s():
    torch.manual_seed(0)
    net = Net()
    model = poptorchsim.trainingModel(net, quiet_options(),
                                      torch.optim.SGD(net.parameters(), lr=0.01))
    model.compile(torch.randn(16, 1, 28, 28), torch.randint(0, 10, (16,)))
    section = DOC.read_text().split("## One convolution", 1)[1].split("\n## ", 1)[0]
    text = " ".join(section.split())          # line breaks of the prose ignored
    ir = str(model.getIR())
    report = model.simulationReport()
    forward, backward = (next(o for o in report["ops"] if o["name"] == name)
                         for name in ("conv/convolution", "convolution_backward"))
    cycles = model.cycleEstimate()
    expected = [
        f"{_n(forward['macs'])} multiply-accumulates",
        f"{_n(forward['compute'])} compute cycles, {_n(forward['exchange'])} exchange cycles "
        f"and {_n(forward['sync'])} sync cycles",
        f"{_n(backward['compute'])} + {_n(backward['exchange'])} + {_n(backward['sync'])}",
        f"one stage here: {_n(report['pipeline']['cycles'])} cycles",
        f"compute {_n(cycles['compute'])}, exchange {_n(cycles['exchange'])}, "
        f"sync {_n(cycles['sync'])} cycles, host {_n(cycles['host'])}",
    ]
    missing = [e for e in expected if e not in text]
    assert not missing, f"docs/architecture.md does not say: {missing}"
    # the IR and the control program, as the doc prints them
    blocks = re.findall(r"```\n(.*?)```", section, re.S)
    conv_line = blocks[0].strip()
    head, tail = conv_line.split("...)")
    assert any(line.strip().startswith(head) and tail.strip() in line
               for line in ir.splitlines()), conv_line
    for line in blocks[1].strip().splitlines():
        assert line.strip() in ir, line
