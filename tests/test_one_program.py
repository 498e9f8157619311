"""One program, printed, executed and costed.

``getIR()`` prints ``Program.main``; the engine runs a call by walking it;
the cycle estimate charges it by walking it again.  Each case below records
the control steps the printer formats, the engine runs and the estimate
charges, and checks that all three are exactly the step objects of the
compiled program (by identity), the engine running each one as often as the
loops around it say, for training and inference, pipelined, replicated with
sharded optimizer state, with variables in Streaming Memory and phased.
"""
import collections
import dataclasses

import pytest
import torch
from conftest import quiet_options
from torch import nn

import poptorchsim as poptorch
from poptorchsim.estimate import program_cost
from poptorchsim.ir import graph as ir
from poptorchsim.ir import printer
from poptorchsim.machine import engine as engine_module

WIDTH = 16


class Net(nn.Module):
    """Two blocks of linear layers and a loss (a second IPU when pipelined)."""

    def __init__(self, blocks=False):
        super().__init__()
        self.blocks = blocks
        self.a, self.b = nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, 4)
        self.loss = nn.CrossEntropyLoss()

    def forward(self, x, labels=None):
        if self.blocks:
            with poptorch.Block("L0", ipu_id=0):
                x = torch.relu(self.a(x))
            with poptorch.Block("L1", ipu_id=1):
                out = self.b(x)
                return out if labels is None else (out, self.loss(out, labels))
        out = self.b(torch.relu(self.a(x)))
        return out if labels is None else (out, self.loss(out, labels))


def off_chip(rts=False):
    s = poptorch.TensorLocationSettings().useOnChipStorage(False)
    return s.useReplicatedTensorSharding(rts).minElementsForReplicatedTensorSharding(1)


def sharded():
    return poptorch.TensorLocationSettings().useReplicatedTensorSharding(True) \
        .minElementsForReplicatedTensorSharding(1)


def _options(di=2, ga=1, rf=1, configure=None):
    o = quiet_options().deviceIterations(di).replicationFactor(rf)
    if ga > 1:
        o.Training.gradientAccumulation(ga)
    if configure:
        configure(o)
    return o


CASES = {
    "training": dict(training=True, ga=3),
    "inference": dict(training=False),
    "pipelined": dict(training=True, ga=4, blocks=True),
    "pipelined inference": dict(training=False, blocks=True),
    "replicated, sharded state": dict(
        training=True, ga=2, rf=2,
        configure=lambda o: o.TensorLocations.setOptimizerLocation(sharded())),
    "Streaming Memory": dict(
        training=True, ga=2, configure=lambda o: (
            o.TensorLocations.setWeightLocation(off_chip()),
            o.TensorLocations.setOptimizerLocation(off_chip()),
            o.TensorLocations.setAccumulatorLocation(off_chip()))),
    "inference, weights off chip and sharded": dict(
        training=False, rf=2,
        configure=lambda o: o.TensorLocations.setWeightLocation(off_chip(rts=True))),
    "phased": dict(
        training=True, ga=2, blocks=True, configure=lambda o: o.setExecutionStrategy(
            poptorch.SerialPhasedExecution(poptorch.Phase("L0"), poptorch.Phase("L1")))),
}


def _model(case):
    torch.manual_seed(0)
    spec = CASES[case]
    di, ga, rf = 2, spec.get("ga", 1), spec.get("rf", 1)
    opts = _options(di, ga, rf, spec.get("configure"))
    net = Net(spec.get("blocks", False))
    n = di * ga * rf * 2
    x = torch.randn(n, WIDTH)
    if spec["training"]:
        model = poptorch.trainingModel(net, opts, torch.optim.SGD(net.parameters(), lr=0.1,
                                                                   momentum=0.9))
        return model, (x, torch.randint(0, 4, (n,)))
    return poptorch.inferenceModel(net, opts), (x,)


def _steps(step, found=None):
    """Every control step of a tree (Sequences included), depth first."""
    found = [] if found is None else found
    found.append(step)
    if isinstance(step, ir.Sequence):
        for s in step.steps:
            _steps(s, found)
    elif isinstance(step, ir.Repeat):
        _steps(step.body, found)
    return found


def _expected_runs(step, times=1, runs=None):
    """How often the engine must run each step in one call."""
    runs = collections.Counter() if runs is None else runs
    runs[id(step)] += times
    if isinstance(step, ir.Sequence):
        for s in step.steps:
            _expected_runs(s, times, runs)
    elif isinstance(step, ir.Repeat):
        _expected_runs(step.body, times * step.count, runs)
    return runs


@pytest.mark.parametrize("case", list(CASES))
def test_printed_executed_and_costed_program_are_one(case, monkeypatch):
    model, batch = _model(case)
    model.compile(*batch)
    program = model.getIR()
    tree = _steps(program.main)

    printed, costed, executed = [], [], collections.Counter()
    format_step = printer.format_step
    monkeypatch.setattr(printer, "format_step", lambda s: printed.append(s) or format_step(s))
    text = str(program)
    walk_step = program_cost._Walk.step
    monkeypatch.setattr(program_cost._Walk, "step",
                        lambda self, s, times: costed.append(s) or walk_step(self, s, times))
    compiled = model._compiled
    cycles, _ = program_cost.estimate(program, compiled.costs, compiled.target)
    assert cycles == model.cycleEstimate()        # what compiling charged: the same walk
    engine_walk = engine_module.Engine._walk
    monkeypatch.setattr(engine_module.Engine, "_walk",
                        lambda self, s: executed.update([id(s)]) or engine_walk(self, s))
    model(*batch)

    frames = [s for s in tree if not isinstance(s, ir.Sequence)]
    assert [id(s) for s in printed] == [id(s) for s in frames]
    assert {id(s) for s in costed} == {id(s) for s in tree}
    assert executed == _expected_runs(program.main)
    for s in frames:
        assert printer.format_step(s) in text
    assert cycles["total"] > 0
    # every attribute of the compiled executable is a declared field
    assert set(vars(compiled)) == {f.name for f in dataclasses.fields(compiled)}


def _kinds(program):
    return collections.Counter(type(s).__name__ for s in _steps(program.main))


def test_inference_program_holds_its_streaming_memory_loads_and_gathers():
    """The inference estimate charges off-chip and sharded weights; the
    printed program now says so (it used to show neither)."""
    model, batch = _model("inference, weights off chip and sharded")
    model.compile(*batch)
    kinds = _kinds(model.getIR())
    assert kinds["RemoteLoad"] == 1 and kinds["AllGather"] == 1
    assert "load from Streaming Memory" in str(model.getIR())
    assert model.cycleEstimate()["streaming"] > 0
    assert model.cycleEstimate()["collective"] > 0


def test_off_chip_accumulators_are_loaded_and_stored_every_micro_batch():
    model, batch = _model("Streaming Memory")
    model.compile(*batch)
    main = model.getIR().main
    loop = next(s for s in _steps(main) if isinstance(s, ir.Repeat)
                and s.counter == "accumulation")
    inner = loop.body.steps
    loads = [s for s in inner if isinstance(s, ir.RemoteLoad)]
    stores = [s for s in inner if isinstance(s, ir.RemoteStore)]
    assert any(all(n.startswith(("grad/", "velocity/")) for n in s.names) for s in loads)
    assert any(all(n.startswith(("grad/", "velocity/")) for n in s.names) for s in stores)


def test_a_step_removed_from_main_is_no_longer_charged():
    """The estimate reads the tree: take the all-reduce out and its cycles go."""
    model, batch = _model("replicated, sharded state")
    model.compile(*batch)
    compiled = model._compiled
    program = compiled.program
    before, _ = program_cost.estimate(program, compiled.costs, compiled.target)
    body = program.main.body.steps
    collectives = [s for s in body if isinstance(s, (ir.AllReduce, ir.ReduceScatter,
                                                      ir.AllGather))]
    assert collectives
    program.main.body.steps = [s for s in body if s not in collectives]
    after, _ = program_cost.estimate(program, compiled.costs, compiled.target)
    assert before["collective"] > 0 and after["collective"] == 0
    assert after["total"] < before["total"]
