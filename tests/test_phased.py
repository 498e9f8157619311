"""Phased execution compiled and run: numerics, memory per phase, Streaming
Memory cycles.  (The API itself is tested in test_phased_api.py.)"""
import copy

import pytest
import torch
from conftest import assert_state_close, quiet_options, reference_call
from torch import nn

import poptorchsim as poptorch

WIDTH, DEPTH, GA, MICRO = 512, 4, 2, 8


class Layers(nn.Module):
    """DEPTH linear layers, each in its own Block L0..L3, and a head in L3."""

    def __init__(self, width=WIDTH):
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(width, width) for _ in range(DEPTH)])
        self.head = nn.Linear(width, 10)
        self.loss = nn.CrossEntropyLoss()

    def forward(self, x, labels):
        for i, layer in enumerate(self.layers):
            with poptorch.Block(f"L{i}"):
                x = torch.relu(layer(x))
        with poptorch.Block(f"L{DEPTH - 1}"):      # every op in a Block, as PopTorch needs
            out = self.head(x)
            return out, self.loss(out, labels)


def serial(**liveness):
    s = poptorch.SerialPhasedExecution(*[poptorch.Phase(f"L{i}") for i in range(DEPTH)])
    if liveness:
        s.setTensorsLiveness(liveness["liveness"])
    return s


def parallel():
    return poptorch.ParallelPhasedExecution(*[poptorch.Phase(f"L{i}") for i in range(DEPTH)])


def one_ipu():
    return poptorch.ShardedExecution(*[poptorch.Stage(f"L{i}").ipu(0) for i in range(DEPTH)])


def build(strategy, version="ipu1", width=WIDTH, lr=1e-3):
    torch.manual_seed(0)
    model = Layers(width)
    opts = quiet_options().useIpuModelVersion(version).setExecutionStrategy(strategy)
    opts.Training.gradientAccumulation(GA)
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    return model, optimizer, poptorch.trainingModel(model, opts, optimizer)


def batch(seed=0, width=WIDTH):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(GA * MICRO, width, generator=g),
            torch.randint(0, 10, (GA * MICRO,), generator=g))


@pytest.mark.parametrize("strategy", [serial, parallel])
def test_phased_training_matches_pytorch(strategy):
    model, _, tm = build(strategy(), width=32)
    ref = copy.deepcopy(model)
    ref_opt = torch.optim.Adam(ref.parameters(), lr=1e-3)
    for seed in range(3):
        b = batch(seed, width=32)
        tm(*b)
        reference_call(ref, ref_opt, b, 1, GA, 1)
    assert_state_close(model, ref)


def compiled(strategy, version="ipu1"):
    _, _, tm = build(strategy, version)
    tm.compile(*batch())
    return tm


def test_a_phase_holds_only_its_own_weights():
    whole = compiled(one_ipu())
    phased = compiled(serial())
    assert phased.getIR().n_ipus == 1
    # weights, gradients and Adam's moments of 4 x (512 x 512): 16 MiB, of
    # which one phase's quarter is on the tiles at a time
    variables = 4 * (512 * 512 + 512) * 4 * 4
    m_whole, m_phased = whole.memoryReport(), phased.memoryReport()
    assert m_phased.streaming_bytes >= variables
    moved = int(m_whole.always_live.sum() - m_phased.always_live.sum())
    assert moved >= 0.9 * variables
    assert m_phased.total.sum() < m_whole.total.sum() - 0.5 * variables
    assert max(phased.simulationReport()["memory"]["saved_per_tile"]) > 0


def test_activations_off_chip_save_more_memory():
    def step_peak(model):        # activations live in the training step's graph
        return model.memoryReport().graphs["training_step"][0].max()

    live = step_peak(compiled(serial()))
    off = step_peak(compiled(serial(liveness=poptorch.Liveness.OffChipAfterFwd)))
    assert off < live


def test_phases_pay_for_streaming_and_parallel_hides_some():
    whole, ser, par = compiled(one_ipu()), compiled(serial()), compiled(parallel())
    assert whole.cycleEstimate()["streaming"] == 0
    assert ser.cycleEstimate()["streaming"] > 0
    assert par.getIR().n_ipus == 2
    assert par.cycleEstimate()["streaming"] < ser.cycleEstimate()["streaming"]


def test_serial_phases_make_a_model_fit_one_ipu():
    # 4 x (2560 x 2560) with Adam (420 MB) does not fit one Mk1 IPU (318 MB);
    # one phase at a time does
    with pytest.raises(poptorch.OutOfMemoryError):
        build(one_ipu(), width=2560)[2].compile(*batch(width=2560))
    _, _, tm = build(serial(), width=2560)
    tm.compile(*batch(width=2560))
    assert tm.simulationReport()["memory"]["fits"]


def test_parallel_phases_on_the_wrong_ipus_raise():
    strategy = parallel()
    strategy.phase(1).ipus(2)
    with pytest.raises(poptorch.Error, match="even phases must run on even IPUs"):
        compiled(strategy)


def test_stages_of_one_phase_may_run_out_of_order():
    # PopTorch's 2x2 layout: phase 0 = stages (L0, L1), phase 1 = (L2, L3)
    strategy = poptorch.ParallelPhasedExecution(
        poptorch.Phase(poptorch.Stage("L0"), poptorch.Stage("L1")).ipus(0, 2),
        poptorch.Phase(poptorch.Stage("L2"), poptorch.Stage("L3")).ipus(1, 3))
    tm = compiled(strategy)
    assert tm.getIR().n_ipus == 4
