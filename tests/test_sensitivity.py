"""Sensitivity of the estimate to the cost model's constants (issue 13 part 4):
``executor.estimateSensitivity()`` varies each constant of
``estimate.constants`` by ±20 % on an already compiled model (costs only, no
tracing) and reports the relative change of the samples/s estimate; the
report written while profiling carries the rows and
``python -m poptorchsim report`` prints the top five."""
import subprocess
import sys

import pytest
import torch
from conftest import quiet_options
from test_profiling import ROOT, _env
from torch import nn

import poptorchsim
from poptorchsim.estimate import constants as K
from poptorchsim.estimate.cost import op_cost
from poptorchsim.profiling import summary


class SmallCNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(1, 4, 3)
        self.fc = nn.Linear(4 * 14 * 14, 10)
        self.loss = nn.CrossEntropyLoss()

    def forward(self, x, y):
        out = self.fc(torch.relu(self.conv(x)).flatten(1))
        return out, self.loss(out, y)


def _compiled(options=None, di=4):
    model = SmallCNN()
    opts = (options or quiet_options()).deviceIterations(di)
    tm = poptorchsim.trainingModel(model, opts,
                                   poptorchsim.optim.SGD(model.parameters(), lr=0.01))
    n = 8 * di
    tm.compile(torch.randn(n, 1, 16, 16), torch.randint(0, 10, (n,)))
    return tm


@pytest.fixture(scope="module")
def model():
    return _compiled()


@pytest.fixture(scope="module")
def rows(model):
    return model.estimateSensitivity()


def test_every_variable_constant_is_listed_with_its_source(rows):
    assert {r["name"] for r in rows} == set(K.VARIABLE)
    for r in rows:
        assert r["source"] and r["unit"] and r["kind"] in ("hardware", "poplibs",
                                                           "estimate", "fitted")


def test_the_listed_constants_move_the_estimate_and_the_top_one_most(rows):
    moving = [r for r in rows if r["swing"] > 1e-4]
    assert len(moving) >= 5
    swings = [r["swing"] for r in rows]
    assert swings == sorted(swings, reverse=True)
    assert rows[0]["swing"] == max(swings) > 0.01


def test_plus_minus_20_percent_brackets_the_estimate(rows):
    # a cost (cycles, seconds) made 20% larger slows the estimate, smaller
    # speeds it: opposite signs around today's figure
    by = {r["name"]: r for r in rows}
    for name in ("CALL_OVERHEAD_S", "VERTEX_OVERHEAD", "sync_cycles"):
        assert by[name]["low"] > 0 > by[name]["high"], name
    # a rate made larger speeds it up
    assert by["EXCHANGE_EFFICIENCY"]["high"] > 0 > by["EXCHANGE_EFFICIENCY"]["low"]


def test_sensitivity_leaves_the_compiled_model_untouched(model, rows):
    before = model.cycleEstimate()
    model.estimateSensitivity(top=3)
    assert model.cycleEstimate() == before
    assert len(model.estimateSensitivity(top=3)) == 3
    for name, c in K.REGISTRY.items():
        if name.isupper():
            assert getattr(K, name) == c.value


def test_overridden_changes_an_ops_cost_inside_the_block_only(model):
    c = model._compiled
    graph = c.program.graphs["training_step"]
    # an element-wise op (a convolution's plan reads AMP_COEFF_LOAD_BYTES)
    conv = next(op for op in graph.ops if op.cost_class == "elementwise" and not op.host_scalar)
    base = op_cost(conv, c.target).total
    with K.overridden(VERTEX_OVERHEAD=K.VERTEX_OVERHEAD * 10):
        assert op_cost(conv, c.target).total > base
    assert op_cost(conv, c.target).total == base
    with pytest.raises(KeyError):
        with K.overridden(sync_cycles=1):
            pass


def test_report_command_prints_the_top_constants(tmp_path):
    _compiled(quiet_options().enableProfiling(str(tmp_path)))
    out = subprocess.run([sys.executable, "-m", "poptorchsim", "report", str(tmp_path)],
                         capture_output=True, text=True, env=_env(), cwd=ROOT, check=True).stdout
    assert "Estimate depends most on" in out
    block = out[out.index("Estimate depends most on"):].splitlines()[1:6]
    assert len(block) == 5 and all("%" in line for line in block)


def test_summary_without_sensitivity_has_no_block(model):
    assert "depends most on" not in summary(model.simulationReport())
