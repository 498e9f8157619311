"""Overlapped host IO: OverlapMode, set_overlap_for_input/_output, numIOTiles.

IO tiles are taken from the compute tiles (the graph is mapped on fewer
tiles); an overlapped stream's host time is hidden behind compute in the
cycle estimate; numerics are those of eager PyTorch either way.
"""
import copy

import pytest
import torch
from conftest import quiet_options
from torch import nn

import poptorchsim as poptorch

OM = poptorch.OverlapMode


class Streaming(nn.Module):
    """An IO-bound layer: wide inputs and outputs, one small matmul."""

    def __init__(self, mode=OM.NoOverlap, width=512):
        super().__init__()
        self.fc = nn.Linear(width, width)
        self.mode = mode

    def forward(self, x, target=None):
        x = poptorch.set_overlap_for_input(x, self.mode)
        out = poptorch.set_overlap_for_output(torch.relu(self.fc(x)), self.mode)
        if target is None:
            return out
        return out, nn.functional.mse_loss(out, target)


def sharded(io_tiles=0, di=1, ga=1):
    o = quiet_options().deviceIterations(di).setExecutionStrategy(poptorch.ShardedExecution())
    o.Training.gradientAccumulation(ga)
    if io_tiles:
        o.TensorLocations.numIOTiles(io_tiles)
    return o


def test_overlap_mode_values_are_poptorchs():
    assert [m.value for m in OM] == ["no_overlap", "overlap_accumulation_loop",
                                     "overlap_device_iteration_loop"]


def test_annotations_are_identity_on_nested_structures_outside_tracing():
    xs = {"a": torch.ones(2), "b": [torch.zeros(3), 4]}
    assert poptorch.set_overlap_for_input(xs, OM.OverlapAccumulationLoop) is xs
    t = torch.ones(2)
    assert poptorch.set_overlap_for_output(t, OM.OverlapDeviceIterationLoop) is t
    with pytest.raises(poptorch.Error, match="expects a poptorch.OverlapMode"):
        poptorch.set_overlap_for_input(t, "overlap_accumulation_loop")


@pytest.mark.parametrize("bad", [30, 33, 194, 31])
def test_num_io_tiles_validation(bad):
    o = quiet_options()
    with pytest.raises(AssertionError, match="numIOTiles must be an even number between 32 "
                                             "and 192."):
        o.TensorLocations.numIOTiles(bad)
    assert o.TensorLocations.num_io_tiles == 0


def test_io_tiles_are_taken_from_compute_tiles():
    x = torch.randn(8, 512)
    reports = {}
    for io in (0, 32):
        torch.manual_seed(0)
        model = Streaming()
        pm = poptorch.inferenceModel(model, sharded(io))
        torch.testing.assert_close(pm(x), model(x), rtol=0, atol=0)
        memory = pm.memoryReport()
        reports[io] = (len(memory.total), int(memory.total.max()))
    assert reports[0][0] == 1472 and reports[32][0] == 1440
    # the same bytes on fewer tiles: more on the busiest tile
    assert reports[32][1] > reports[0][1]


def test_io_tiles_must_leave_compute_tiles():
    o = sharded(32).useIpuModelVersion("test")
    pm = poptorch.inferenceModel(Streaming(width=8), o)
    with pytest.raises(poptorch.Error, match=r"numIOTiles\(32\) leaves no compute tiles"):
        pm(torch.randn(2, 8))


@pytest.mark.parametrize("mode", [OM.OverlapAccumulationLoop, OM.OverlapDeviceIterationLoop])
def test_overlap_hides_host_transfers_in_training(mode):
    """IO-bound training: with overlap the per-call estimate drops; weights,
    outputs and losses are those of the model without overlap."""
    x, y = torch.randn(32, 512), torch.randn(32, 512)
    results = {}
    for m in (OM.NoOverlap, mode):
        torch.manual_seed(0)
        model = Streaming(m)
        pm = poptorch.trainingModel(model, sharded(32, di=2, ga=4),
                                    poptorch.optim.SGD(model.parameters(), lr=0.1))
        out, loss = pm(x, y)
        results[m] = (pm.cycleEstimate(), out, loss, copy.deepcopy(model.state_dict()))
    plain, ov = results[OM.NoOverlap], results[mode]
    assert ov[0]["host"] < plain[0]["host"]
    assert ov[0]["total"] < plain[0]["total"]
    assert ov[0]["compute"] == plain[0]["compute"]
    for a, b in zip(ov[1:3], plain[1:3]):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    for k in plain[3]:
        torch.testing.assert_close(ov[3][k], plain[3][k], rtol=0, atol=0)


def test_accumulation_loop_overlap_needs_an_accumulation_loop():
    """Inference has no accumulation loop: OverlapAccumulationLoop hides
    nothing there, OverlapDeviceIterationLoop hides the transfers of all but
    the first device iteration."""
    x = torch.randn(64, 512)
    host = {}
    for m in OM:
        torch.manual_seed(0)
        model = Streaming(m)
        pm = poptorch.inferenceModel(model, sharded(32, di=8))
        # the device runs micro-batches of 8 rows, eager all 64 at once: the
        # matmul kernel may block them differently (float32 rounding)
        torch.testing.assert_close(pm(x), model(x))
        host[m] = pm.cycleEstimate()["host"]
    assert host[OM.OverlapAccumulationLoop] == host[OM.NoOverlap]
    assert host[OM.OverlapDeviceIterationLoop] < host[OM.NoOverlap]


def test_overlap_needs_io_tiles_and_sharded_execution():
    model = Streaming(OM.OverlapAccumulationLoop, width=8)
    pipelined = quiet_options()                   # PipelinedExecution by default
    pipelined.TensorLocations.numIOTiles(32)
    with pytest.raises(poptorch.Error, match="Overlapped IO is not supported with "
                                             "poptorch.PipelinedExecution"):
        poptorch.inferenceModel(model, pipelined)(torch.randn(2, 8))
    with pytest.raises(poptorch.Error, match=r"No IO tiles allocated. You must allocate at "
                                             r"least 32 IO tiles using poptorch.Options\(\)"):
        poptorch.inferenceModel(model, sharded())(torch.randn(2, 8))


class UsedBeforeMarked(nn.Module):
    def forward(self, x):
        y = x + 1
        return y, poptorch.set_overlap_for_input(x, OM.OverlapAccumulationLoop)


class MarksAnIntermediate(nn.Module):
    def forward(self, x):
        x = poptorch.set_overlap_for_input(x, OM.OverlapAccumulationLoop)
        y = x + 1
        return y, poptorch.set_overlap_for_input(y, OM.OverlapAccumulationLoop)


class MarksANonOutput(nn.Module):
    def forward(self, x):
        x = poptorch.set_overlap_for_output(x + 1, OM.OverlapAccumulationLoop)
        return torch.mean(x)


class ReturnsTwice(nn.Module):
    def forward(self, x):
        y = poptorch.set_overlap_for_output(x + 1, OM.OverlapAccumulationLoop)
        return y, (y,)


@pytest.mark.parametrize("model, message", [
    (UsedBeforeMarked(), "must be the only op applied to an input. This is not the case "
                         "for input 0 to the model."),
    (MarksAnIntermediate(), "set_overlap_for_input applied on a node which is not a tensor "
                            "input to the model."),
    (MarksANonOutput(), "set_overlap_for_output applied on a node which is not a tensor "
                        "output to the model."),
    (ReturnsTwice(), "cannot be used with a tensor that is returned twice"),
])
def test_misplaced_marks_are_errors(model, message):
    pm = poptorch.inferenceModel(model, sharded(32))
    with pytest.raises(poptorch.Error, match=message):
        pm(torch.tensor([1.0]))
    assert not pm.isCompiled()
