"""Pipelining and sharding: rules, numerics, per-IPU memory, schedule, auto-split."""
import copy
import logging

import pytest
import torch
import torch.nn as nn
from conftest import LogRecords

import poptorchsim as poptorch
from poptorchsim.estimate.schedule import schedule


class Chain(nn.Module):
    """Four equal layers, each optionally on its own IPU, and a loss."""

    def __init__(self, ipus=(0, 1, 2, 3), width=32, annotate=True):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(4))
        self.head = nn.Linear(width, 4)
        if annotate:
            for i, (layer, ipu) in enumerate(zip(self.layers, ipus)):
                poptorch.BeginBlock(layer, user_id=f"b{i}", ipu_id=ipu)
        self.loss = nn.CrossEntropyLoss()

    def forward(self, x, y=None):
        for layer in self.layers:
            x = torch.relu(layer(x))
        out = self.head(x)
        if y is None:
            return out
        return out, self.loss(out, y)


def opts(di=1, ga=1, rf=1, strategy=None):
    o = poptorch.Options().deviceIterations(di).replicationFactor(rf)
    o.showCompilationProgressBar(False)
    o.Training.gradientAccumulation(ga)
    if strategy is not None:
        o.setExecutionStrategy(strategy)
    return o


def batch(n, width=32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, width, generator=g), torch.randint(0, 4, (n,), generator=g)


# -- PopTorch's rules ----------------------------------------------------------------
def test_training_needs_gradient_accumulation_of_2n_minus_1():
    model = Chain()
    tm = poptorch.trainingModel(model, opts(ga=4), torch.optim.SGD(model.parameters(), lr=0.1))
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(poptorch.Error) as info:
        tm(*batch(16))
    msg = str(info.value)
    assert ("gradientAccumulation must be greater than or equal to the number of pipeline "
            "stages (7) when using poptorch.PipelinedExecution. Please note that a model "
            "with 4 pipeline stages in PopTorch will have an additional 3 stages when "
            "training.") in msg
    assert "stage 2 on IPU 2: blocks b2" in msg            # the stage map
    assert "gradientAccumulation(7)" in msg                 # the value that works
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k])


def test_inference_needs_device_iterations_of_n():
    im = poptorch.inferenceModel(Chain(), opts(di=2))
    with pytest.raises(poptorch.Error, match=r"deviceIterations must be greater than or "
                       r"equal to the number of pipeline stages \(4\) when using "
                       r"PopTorch.PipelinedExecution"):
        im(batch(8)[0])
    ok = poptorch.inferenceModel(Chain(), opts(di=4))
    assert ok(batch(8)[0]).shape == (8, 4)



def test_ipu_count_that_hardware_rounds_up_runs_with_a_warning():
    """PopTorch refuses 3 IPUs only on hardware (it reserves powers of 2);
    the IPU Model and offline targets compile them, as the simulator does,
    saying what hardware would need."""
    records = LogRecords()
    logging.getLogger("poptorchsim").addHandler(records)
    try:
        for rounding in (False, True):
            model = Chain(ipus=(0, 1, 2, 2))                 # 3 IPUs
            o = opts(ga=5).autoRoundNumIPUs(rounding)
            tm = poptorch.trainingModel(model, o,
                                        torch.optim.SGD(model.parameters(), lr=0.1))
            tm(*batch(10))
            assert tm.getIR().n_ipus == 3
    finally:
        logging.getLogger("poptorchsim").removeHandler(records)
    assert any("on IPU hardware PopTorch must reserve a minimum of 4" in m and
               "autoRoundNumIPUs(True)" in m for m in records.messages)
    assert any("Reserving 4 IPUs when the model specifies the use of only 3" in m
               for m in records.messages)


def test_too_many_ipus():
    model = Chain()
    tm = poptorch.trainingModel(model, opts(ga=7, rf=32),
                                torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(poptorch.Error, match=r"Too many IPUs requested \(128\)"):
        tm(*batch(7 * 32))


def test_sharded_execution_has_no_accumulation_rule():
    model = Chain()
    tm = poptorch.trainingModel(model, opts(strategy=poptorch.ShardedExecution()),
                                torch.optim.SGD(model.parameters(), lr=0.1))
    tm(*batch(4))
    assert tm.simulationReport()["pipeline"]["kind"] == "sharded"


# -- numerics equal to the unsharded model --------------------------------------------
@pytest.mark.parametrize("strategy,di,ga,rf", [
    ("pipelined", 1, 7, 1), ("pipelined", 2, 7, 2), ("sharded", 3, 1, 1), ("sharded", 2, 2, 2)])
def test_pipelined_and_sharded_training_equal_unsharded(strategy, di, ga, rf):
    torch.manual_seed(0)
    plain = Chain(annotate=False)
    split = Chain(annotate=True)
    split.load_state_dict(plain.state_dict())
    s = poptorch.PipelinedExecution() if strategy == "pipelined" else poptorch.ShardedExecution()
    a = poptorch.trainingModel(split, opts(di, ga, rf, s),
                               torch.optim.SGD(split.parameters(), lr=0.1, momentum=0.9))
    b = poptorch.trainingModel(plain, opts(di, ga, rf),
                               torch.optim.SGD(plain.parameters(), lr=0.1, momentum=0.9))
    for call in range(3):
        x, y = batch(4 * di * ga * rf, seed=call)
        a(x, y)
        b(x, y)
    assert a.getIR().n_ipus == 4 and b.getIR().n_ipus == 1
    for (name, p), q in zip(split.named_parameters(), plain.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=name)


# -- the machine: per-IPU memory and the schedule --------------------------------------
def test_memory_is_per_ipu_and_out_of_memory_names_the_ipu():
    class Lopsided(Chain):
        def __init__(self):
            super().__init__(width=32)
            self.layers[3] = poptorch.BeginBlock(nn.Linear(32, 32), "b3", 3)
            self.big = nn.Linear(32, 32)

    model = Chain(width=256)
    tm = poptorch.trainingModel(model, opts(ga=7), torch.optim.SGD(model.parameters(), lr=0.1))
    tm(*batch(28, width=256))
    reports = tm.memoryReport().ipus
    assert [r.ipu for r in reports] == [0, 1, 2, 3]
    for r in reports:                                  # each IPU holds its own layer
        assert any(k.startswith(f"layers.{r.ipu}.") for k in r.by_tensor)
        assert not any(k.startswith(f"layers.{(r.ipu + 1) % 4}.weight") for k in r.by_tensor)

    # 4 x 4096^2 weights with momentum: too much for one Mk1, fine split over 4
    big = Chain(width=4096, ipus=(0, 1, 1, 1))
    o = opts(ga=3).useIpuModelVersion("ipu1")
    tm = poptorch.trainingModel(big, o, torch.optim.SGD(big.parameters(), lr=0.1, momentum=0.9))
    with pytest.raises(poptorch.OutOfMemoryError, match=r"\(IPU \d, tile \d+\)"):
        tm.compile(*batch(3, width=4096))


def test_inter_ipu_copies_cost_link_cycles():
    model = Chain()
    tm = poptorch.trainingModel(model, opts(ga=7), torch.optim.SGD(model.parameters(), lr=0.1))
    tm.compile(*batch(28))
    one = Chain(annotate=False)
    tm1 = poptorch.trainingModel(one, opts(ga=7), torch.optim.SGD(one.parameters(), lr=0.1))
    tm1.compile(*batch(28))
    pipe = tm.simulationReport()["pipeline"]
    assert pipe["stages"] == 7 and pipe["ipus"] == 4 and pipe["kind"] == "pipelined"
    # G micro-batches x (4 forward + 4 backward stages; the last two fused in time)
    assert len(pipe["events"]) == 7 * 8
    # the pipelined step pays for copies between IPUs that the single IPU does not
    assert pipe["cycles"] > 0 and tm1.simulationReport()["pipeline"]["kind"] == "single"


@pytest.mark.parametrize("stages,g", [(4, 7), (2, 8), (3, 16)])
def test_bubble_matches_formula_for_balanced_stages(stages, g):
    fwd, bwd = [100.0] * stages, [100.0] * stages
    s = schedule(fwd, bwd, list(range(stages)), g, pipelined=True, training=True)
    depth = 2 * stages - 1
    assert s.n_stages == depth
    assert s.bubble == pytest.approx((depth - 1) / (g + depth - 1))
    inf = schedule(fwd, bwd, list(range(stages)), g, pipelined=True, training=False)
    assert inf.bubble == pytest.approx((stages - 1) / (g + stages - 1))
    # a step lasts as long as its slowest stage
    slow = schedule([100.0, 300.0] + [100.0] * (stages - 2), bwd, list(range(stages)), g,
                    pipelined=True, training=True)
    assert slow.cycles == pytest.approx((g + depth - 1) * 400.0)


def test_sharded_runs_one_ipu_at_a_time():
    s = schedule([100.0] * 4, [50.0] * 4, [0, 1, 2, 3], 3, pipelined=False, training=True)
    assert s.cycles == pytest.approx(3 * 4 * 150.0)
    ends = sorted((start, start + dur) for _, _, start, dur in s.events)
    assert all(a[1] <= b[0] + 1e-9 for a, b in zip(ends, ends[1:]))   # never overlap
    assert s.bubble == pytest.approx(0.75)


def test_model_level_bubble_shrinks_with_accumulation_as_the_formula_says():
    def bubble(ga):
        model = Chain(width=256)
        tm = poptorch.trainingModel(model, opts(ga=ga),
                                    torch.optim.SGD(model.parameters(), lr=0.1))
        tm.compile(*batch(4 * ga, width=256))
        return tm.simulationReport()["pipeline"]["bubble"]
    b7, b28 = bubble(7), bubble(28)
    # the head and the loss make stage 3 the slowest: never better than balanced
    assert b7 >= 6 / (7 + 6) and b28 >= 6 / (28 + 6)
    assert b28 < b7


def test_profiling_writes_the_timeline(tmp_path):
    model = Chain()
    o = opts(ga=7).enableProfiling(str(tmp_path))
    tm = poptorch.trainingModel(model, o, torch.optim.SGD(model.parameters(), lr=0.1))
    tm(*batch(28))
    import json
    trace = json.loads((tmp_path / "training" / "timeline.json").read_text())
    names = {e["name"] for e in trace["traceEvents"] if e["ph"] == "X"}
    assert "F0 mb0" in names and "B3 mb6" in names
    assert (tmp_path / "training" / "timeline.png").stat().st_size > 5000


# -- beyond PopTorch: the auto-split ------------------------------------------------------
def test_suggest_split_balances_and_applies_in_one_line():
    model = Chain(annotate=False, width=64)
    x, y = batch(8, width=64)
    plan = poptorch.suggest_split(model, 2, x, y)
    text = plan.explain()
    assert "IPU 0" in text and "IPU 1" in text and "plan.apply(model)" in text
    assert len(plan.groups) == 2 and all(plan.groups)
    plan.apply(model)
    tm = poptorch.trainingModel(model, opts(ga=3), torch.optim.SGD(model.parameters(), lr=0.1))
    tm(*batch(24, width=64))
    assert tm.getIR().n_ipus == 2
    # balanced: neither IPU does more than two thirds of the work
    shares = [sum(plan.layers[i].cycles for i in g) for g in plan.groups]
    assert max(shares) / sum(shares) < 2 / 3


def test_stage_ids_must_ascend_in_execution_order():
    model = Chain(ipus=(0, 1, 0, 1))
    tm = poptorch.trainingModel(model, opts(ga=7), torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(poptorch.Error, match="(?s)stage 0 runs after stage 1.*AutoIncrement"):
        tm(*batch(28))
    model = Chain(ipus=(0, 1, 0, 1))
    o = opts(ga=7, strategy=poptorch.PipelinedExecution(poptorch.AutoStage.AutoIncrement))
    tm = poptorch.trainingModel(model, o, torch.optim.SGD(model.parameters(), lr=0.1))
    tm(*batch(28))
    assert tm.simulationReport()["pipeline"]["forward_stages"] == 4


def test_pipelined_training_stashes_activations_of_early_stages():
    from poptorchsim.passes.liveness import graph_liveness_profile
    width, micro = 64, 1024
    activation = micro * width * 4          # one layer's output, stored for backward

    def live_bytes(strategy):
        """Most activation bytes live at once on IPU 0 (temporaries aside)."""
        model = Chain(width=width)
        o = opts(ga=7, strategy=strategy)
        tm = poptorch.trainingModel(model, o, torch.optim.SGD(model.parameters(), lr=0.1))
        tm.compile(*batch(7 * micro, width=width))
        graph = tm.getIR().graphs["training_step"]
        return graph_liveness_profile(graph, 1472).max()
    # stage 0 keeps 2(N-1-0)+1 = 7 micro-batches in flight; sharded keeps one
    extra = live_bytes(poptorch.PipelinedExecution()) - live_bytes(poptorch.ShardedExecution())
    assert extra >= 0.9 * 6 * activation


def test_block_scopes_place_backward_ops_with_their_forward_ops():
    """``with Block(...)`` passes no inputs: capture follows the tensors that
    cross blocks, so each layer's gradients are computed on its own IPU."""
    class Scoped(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1, self.fc2 = nn.Linear(8, 8), nn.Linear(8, 4)
            self.loss = nn.CrossEntropyLoss()

        def forward(self, x, y):
            with poptorch.Block("A", ipu_id=0):
                h = torch.relu(self.fc1(x))
            with poptorch.Block("B", ipu_id=1):
                out = self.fc2(h)
                return out, self.loss(out, y)

    model = Scoped()
    tm = poptorch.trainingModel(model, opts(ga=3), torch.optim.SGD(model.parameters(), lr=0.1))
    tm.compile(torch.randn(6, 8), torch.randint(0, 4, (6,)))
    graph = tm.getIR().graphs["training_step"]
    grads = dict(zip([t.name for t in tm.getIR().graphs["optimizer_update"].inputs
                      if t.role == "accumulator"], graph.outputs[2:6]))
    stage = {t.name: op.stage for op in graph.ops for t in op.outputs if t is not None}
    assert stage[grads["grad/fc2.weight"].name] == 1
    assert stage[grads["grad/fc1.weight"].name] == 0
    relu_backward = [op for op in graph.ops if op.backward and "threshold" in op.name]
    assert [op.stage for op in relu_backward] == [0]


def test_inference_with_accumulation_points_to_device_iterations():
    with pytest.raises(poptorch.Error, match="when running a poptorch.inferenceModel\\(\\). Use "
                       "poptorch.Options\\(\\).deviceIterations to process a sufficient number "
                       "of batches each run for pipelined execution instead."):
        poptorch.inferenceModel(Chain(), opts(ga=2))
    with pytest.raises(poptorch.Error) as info:
        poptorch.inferenceModel(Chain(), opts(ga=2, strategy=poptorch.ShardedExecution()))
    assert "pipelined execution" not in str(info.value)


def test_ops_after_a_closed_block_scope_raise_no_active_block():
    """After a ``with Block`` scope closes no IPU is active until the next
    block begins (PopTorch's pipelining_test.py::test_missing_block)."""
    class Model(nn.Module):
        def forward(self, x):
            poptorch.Block.useAutoId()
            with poptorch.Block(ipu_id=0):
                x = x * 4
            return x * 4

    o = poptorch.Options().showCompilationProgressBar(False).deviceIterations(2)
    o.setExecutionStrategy(poptorch.PipelinedExecution(poptorch.AutoStage.AutoIncrement))
    m = poptorch.inferenceModel(Model(), o)
    with pytest.raises(poptorch.Error, match="No active Block, all the ops must belong to a "
                       r"Block: aten.mul.Tensor .*test_pipelining.py.* Move it into a Block"):
        m.compile(torch.randn(2, 5))
    # ops before the first block run on IPU 0, as in PopTorch
    class Late(nn.Module):
        def forward(self, x):
            x = x * 2
            with poptorch.Block("B", ipu_id=0):
                return x + 1
    out = poptorch.inferenceModel(Late(), poptorch.Options().showCompilationProgressBar(False))
    torch.testing.assert_close(out(torch.ones(2)), torch.full((2,), 3.0))
