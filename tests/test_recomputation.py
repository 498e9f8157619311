"""Recomputation: ``recomputationCheckpoint`` and PopART's ``autoRecomputation``
(``Options._Popart.set("autoRecomputation", n)``) change what the memory
planner keeps between forward and backward and add the recomputed ops'
cycles; numerics do not change."""
import logging

import numpy as np
import pytest
import torch
import torch.nn as nn
from conftest import LogRecords

import poptorchsim as poptorch
from poptorchsim.passes.liveness import graph_liveness_profile
from poptorchsim.passes.recompute import _decreasing_intervals

NONE, STANDARD, NORM_ONLY, PIPELINE, RECOMPUTE_ALL = range(5)
WIDTH, MICRO = 128, 2048


class Stack(nn.Module):
    """Linear+tanh layers, a checkpoint after every other layer; with
    ``stages`` > 1 the layers are split over that many IPUs."""

    def __init__(self, layers=6, checkpoints=True, stages=1, norm=False):
        super().__init__()
        self.checkpoints = checkpoints
        self.layers = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(layers))
        self.norms = nn.ModuleList(nn.LayerNorm(WIDTH) if norm else nn.Identity()
                                   for _ in range(layers))
        per = layers // stages
        if stages > 1:
            for i in range(0, layers, per):
                poptorch.BeginBlock(self.layers[i], user_id=f"s{i // per}", ipu_id=i // per)
        self.loss = nn.MSELoss()

    def forward(self, x, y):
        for i, (layer, norm) in enumerate(zip(self.layers, self.norms)):
            x = torch.tanh(norm(layer(x)))
            if self.checkpoints and i % 2 == 1:
                x = poptorch.recomputationCheckpoint(x)
        return x, self.loss(x, y)


def options(mode=None, ga=1):
    o = poptorch.Options().showCompilationProgressBar(False)
    o.Training.gradientAccumulation(ga)
    if mode is not None:
        o._Popart.set("autoRecomputation", mode)
    return o


def data(n=MICRO, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, WIDTH, generator=g), torch.randn(n, WIDTH, generator=g)


def compiled(mode=None, ga=1, **kw):
    torch.manual_seed(0)
    model = Stack(**kw)
    tm = poptorch.trainingModel(model, options(mode, ga),
                                torch.optim.SGD(model.parameters(), lr=0.01))
    tm.compile(*data(MICRO * ga))
    return tm


def activation_peak(tm):
    """Most activation bytes alive at once over the IPU (temporaries aside)."""
    return graph_liveness_profile(tm.getIR().graphs["training_step"], 1472).max()


def test_checkpoints_with_recompute_all_lower_the_peak_and_add_cycles():
    plain, recomputed = compiled(NONE), compiled(RECOMPUTE_ALL)
    m0, m1 = plain.memoryReport(), recomputed.memoryReport()
    c0, c1 = plain.cycleEstimate(), recomputed.cycleEstimate()
    activation = MICRO * WIDTH * 4
    # layers 0, 2, 4 are recomputed: their tanh outputs are not kept
    assert activation_peak(plain) - activation_peak(recomputed) >= 2 * activation
    assert m1.not_always_live.max() < m0.not_always_live.max()
    assert (m1.recomputation_saved_per_tile
            == m1.not_always_live_without_recomputation - m1.not_always_live).all()
    assert m1.recomputation_saved_per_tile.max() > 0
    np.testing.assert_array_equal(m1.not_always_live_without_recomputation,
                                  m0.not_always_live)
    assert m1.recomputation == "RecomputeAll" and m0.recomputation == "None"
    # op names carry their module's name scope ("0/addmm"): compare the ops' own names
    recomputed_names = {name.rsplit("/", 1)[-1] for name in m1.recomputed_ops}
    assert {"addmm", "tanh", "addmm_2", "tanh_2", "addmm_4", "tanh_4"} <= recomputed_names
    assert not {"tanh_1", "tanh_3", "tanh_5"} & recomputed_names   # checkpoints
    assert m0.recomputed_ops == [] and not m0.recomputation_saved_per_tile.any()
    # the recomputed ops run twice: their cycles are added, and shown
    assert c1["total"] > c0["total"] and c0["recompute"] == 0
    assert c1["recompute"] > 0
    assert c1["total"] - c0["total"] == pytest.approx(c1["recompute"], rel=0.05)
    ops = recomputed.getIR().graphs["training_step"].ops
    assert {op.name for op in ops if op.recompute} == set(m1.recomputed_ops)


def test_checkpoints_alone_change_nothing():
    """PopART keeps every result unless recomputation is on; a model without
    checkpoints under RecomputeAll keeps its last segment, i.e. everything."""
    base = compiled(NONE, checkpoints=False)
    for tm in (compiled(None), compiled(NONE), compiled(RECOMPUTE_ALL, checkpoints=False)):
        assert tm.memoryReport().recomputed_ops == []
        assert tm.cycleEstimate()["total"] == base.cycleEstimate()["total"]
        np.testing.assert_array_equal(tm.memoryReport().not_always_live,
                                      base.memoryReport().not_always_live)


class Hourglass(nn.Module):
    """Wide (4x) and narrow layers in turn: the narrow results are the
    cheapest to keep."""

    def __init__(self, blocks=4):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(WIDTH, 4 * WIDTH) if i % 2 == 0 else
                                    nn.Linear(4 * WIDTH, WIDTH) for i in range(2 * blocks))
        self.loss = nn.MSELoss()

    def forward(self, x, y):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x, self.loss(x, y)


def test_standard_keeps_the_cheapest_live_sets():
    """PopART's Standard: in each of its decreasing intervals of forward ops
    it keeps the results alive at the cheapest moment and recomputes the
    rest, so the wide layers are recomputed."""
    def build(mode):
        torch.manual_seed(0)
        model = Hourglass()
        tm = poptorch.trainingModel(model, options(mode),
                                    torch.optim.SGD(model.parameters(), lr=0.01))
        tm.compile(*data())
        return tm
    plain, standard = build(NONE), build(STANDARD)
    report = standard.memoryReport()
    assert report.recomputation == "Standard" and report.recomputed_ops
    ops = {op.name: op for op in standard.getIR().graphs["training_step"].ops}
    assert all(ops[name].outputs[0].numel == MICRO * 4 * WIDTH for name in report.recomputed_ops)
    wide = MICRO * 4 * WIDTH * 4
    assert activation_peak(plain) - activation_peak(standard) >= wide
    assert standard.cycleEstimate()["total"] > plain.cycleEstimate()["total"]
    assert standard.cycleEstimate()["recompute"] > 0


def test_decreasing_intervals_are_poparts():
    assert _decreasing_intervals(1) == [(0, 1)]
    # sqrt(2*40) = 8 -> 7 -> 5 (x0.75): 5+4+3+2+1 = 15, then single ops
    intervals = _decreasing_intervals(40)
    assert [b - a for a, b in intervals][:6] == [5, 4, 3, 2, 1, 1] and intervals[-1] == (39, 40)
    assert len(intervals) == 5 + 25


def test_norm_only_recomputes_the_normalisations():
    tm = compiled(NORM_ONLY, checkpoints=False, norm=True)
    ops = tm.getIR().graphs["training_step"].ops
    recomputed = [op for op in ops if op.recompute]
    assert recomputed and all(op.cost_class == "norm" for op in recomputed)
    assert tm.cycleEstimate()["recompute"] > 0
    assert compiled(NONE, checkpoints=False, norm=True).cycleEstimate()["total"] < \
        tm.cycleEstimate()["total"]


def test_pipelined_training_recomputes_early_stages_by_default():
    """PopTorch sets autoRecomputation to Pipeline for a pipeline over
    several IPUs: stage 0 stashes only what crosses to stage 1 (and its
    checkpoints) and recomputes the rest before its backward."""
    kw = dict(checkpoints=False, stages=2, ga=3)
    default, pipeline, none = compiled(None, **kw), compiled(PIPELINE, **kw), compiled(NONE, **kw)
    assert default.memoryReport().recomputation == "Pipeline"
    assert default.memoryReport().recomputed_ops == pipeline.memoryReport().recomputed_ops
    ops = default.getIR().graphs["training_step"].ops
    recomputed = [op for op in ops if op.recompute]
    assert recomputed and {op.stage for op in recomputed} == {0}
    assert "tanh_2" not in {op.name for op in recomputed}    # stage 1's input: stashed
    ipu0 = [r.not_always_live.max() for r in (default.memoryReport().ipus[0],
                                              none.memoryReport().ipus[0])]
    activation = MICRO * WIDTH * 4 / 1472
    # stage 0 had tanh and tanh_1 stashed for 3 micro-batches; now one of each
    assert ipu0[1] - ipu0[0] >= 0.9 * 2 * 2 * activation
    assert default.cycleEstimate()["recompute"] > 0
    assert none.memoryReport().recomputed_ops == []


def test_pipeline_mode_without_a_pipeline_recomputes_nothing():
    records = LogRecords()
    logger = logging.getLogger("poptorchsim")
    logger.addHandler(records)
    try:
        tm = compiled(PIPELINE)
    finally:
        logger.removeHandler(records)
    assert tm.memoryReport().recomputed_ops == []
    assert "not pipelined" in records.text and "WARNING" in records.levels


def test_numerics_do_not_change():
    def weights(mode):
        torch.manual_seed(0)
        model = Stack()
        tm = poptorch.trainingModel(model, options(mode),
                                    torch.optim.SGD(model.parameters(), lr=0.01))
        for step in range(3):
            tm(*data(seed=step))
        tm.copyWeightsToHost()
        return {k: v.clone() for k, v in model.state_dict().items()}
    plain, recomputed = weights(NONE), weights(RECOMPUTE_ALL)
    assert plain.keys() == recomputed.keys()
    for k in plain:
        assert torch.equal(plain[k], recomputed[k]), k


def test_inference_ignores_recomputation():
    def inference(mode):
        torch.manual_seed(0)
        model = Stack()
        im = poptorch.inferenceModel(model, options(mode))
        im.compile(*data())
        return im
    plain, asked = inference(NONE), inference(RECOMPUTE_ALL)
    assert asked.memoryReport().recomputed_ops == []
    assert asked.cycleEstimate()["recompute"] == 0
    assert asked.cycleEstimate()["total"] == plain.cycleEstimate()["total"]


@pytest.mark.parametrize("value, text", [
    (5, "Value for RecomputationType out of range"),
    (-1, "Value for RecomputationType out of range"),
    (True, "Unknown bool option autoRecomputation"),
    (3.0, "Unknown floating point option autoRecomputation"),
    ("Pipeline", "Unknown string option autoRecomputation"),
])
@pytest.mark.parametrize("training", [True, False])
def test_bad_values_raise_popart_errors_when_compiling(value, text, training):
    model = Stack()
    o = options(value)          # accepted when set, as PopTorch accepts any value
    if training:
        tm = poptorch.trainingModel(model, o, torch.optim.SGD(model.parameters(), lr=0.01))
    else:
        tm = poptorch.inferenceModel(model, o)
    with pytest.raises(poptorch.Error, match=text):
        tm.compile(*data(8))


class Encoder(nn.Module):
    """Transformer encoder layers, each output a checkpoint (a layer norm's
    result: one output of a multi-output op)."""

    def __init__(self, layers=2, d=64):
        super().__init__()
        self.layers = nn.ModuleList(nn.TransformerEncoderLayer(d, 4, 4 * d, dropout=0.0,
                                                               batch_first=True)
                                    for _ in range(layers))
        self.loss = nn.MSELoss()

    def forward(self, x, y):
        for layer in self.layers:
            x = poptorch.recomputationCheckpoint(layer(x))
        return x, self.loss(x, y)


def test_transformer_layers_recompute_between_checkpoints():
    """Views of recomputed results (attention's reshapes) do not keep them
    alive, and a checkpoint on a layer norm's output keeps the layer norm."""
    def build(mode):
        torch.manual_seed(0)
        model = Encoder()
        tm = poptorch.trainingModel(model, options(mode),
                                    torch.optim.SGD(model.parameters(), lr=0.01))
        tm.compile(torch.randn(8, 32, 64), torch.randn(8, 32, 64))
        return tm
    plain, recomputed = build(NONE), build(RECOMPUTE_ALL)
    ops = recomputed.getIR().graphs["training_step"].ops
    norms = [op for op in ops if op.cost_class == "norm" and not op.backward]
    assert norms[-1].attrs.get("recomputation_checkpoint") and not norms[-1].attrs.get("recompute")
    assert any(op.recompute and op.name.rsplit("/", 1)[-1].startswith("bmm")
               for op in ops)
    assert activation_peak(recomputed) < 0.75 * activation_peak(plain)
    report = recomputed.memoryReport()
    assert report.not_always_live.max() < plain.memoryReport().not_always_live.max()
    assert recomputed.cycleEstimate()["total"] > plain.cycleEstimate()["total"]


def test_reports_show_what_recomputation_saves_and_costs(tmp_path):
    from poptorchsim.profiling import write_report
    from poptorchsim.profiling.text import summary
    tm = compiled(4)
    report = tm.simulationReport()
    rec = report["memory"]["recomputation"]
    assert rec["mode"] == "RecomputeAll" and rec["recomputed_ops"] > 0
    assert rec["peak_not_always_live_bytes"] < rec["peak_not_always_live_bytes_without"]
    assert rec["cycles_per_call"] == tm.cycleEstimate()["recompute"] > 0
    assert "recomputation RecomputeAll:" in summary(report)
    write_report(report, tmp_path)
    assert "Recomputation RecomputeAll:" in next(tmp_path.rglob("*.html")).read_text()
    assert compiled(None).simulationReport()["memory"]["recomputation"] is None
