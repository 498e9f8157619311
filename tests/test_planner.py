"""The planner and suggest_split: configurations compiled from the traced
graph (the model never runs), checked as trainingModel checks them."""
import json

import pytest
import torch
from torch import nn

import poptorchsim as poptorch
from poptorchsim.runtime.planning.planner import Configuration, Planner, UnitPlacement, stages_of


class Stack(nn.Module):
    """Eight equal layers and a loss: about 0.75 MiB of weights, gradients
    and momentum per layer, so the 4-tile test IPU (2.4 MiB) holds two or
    three layers."""

    def __init__(self, width=256, layers=8):
        super().__init__()
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(width, width), nn.ReLU())
                                    for _ in range(layers))
        self.loss = nn.CrossEntropyLoss()

    def forward(self, x, y):
        for layer in self.layers:
            x = layer(x)
        return x, self.loss(x, y)


def _inputs(n=2, width=256):
    g = torch.Generator().manual_seed(0)
    return torch.randn(n, width, generator=g), torch.randint(0, width, (n,), generator=g)


def _test_ipu():
    return poptorch.Options().useIpuModelVersion("test")


def _sgd(model):
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def test_unit_placement_numbers_stages_where_the_ipu_changes():
    spec = UnitPlacement({"a": 0, "b": 0, "c": 1, "d": 0})
    blocks = [("a", 0), ("b", 0), ("c", 0), ("d", 0), ("b", 0)]
    assert spec.assign(blocks) == {"a": (0, 0), "b": (0, 0), "c": (1, 1), "d": (2, 0)}
    assert stages_of((0, 0, 1, 1, 0)) == 3


def test_an_evaluation_equals_the_compile_of_that_configuration():
    """What the planner says of a configuration is what trainingModel's
    compile of the same configuration reports: every IPU's fullest tile and
    the cycles of one call."""
    torch.manual_seed(0)
    model = Stack()
    planner = Planner(model, _inputs(), _sgd(model), _test_ipu(), ipus=8,
                      max_ipus_per_replica=4)
    assert planner.units == [f"layers.{i}" for i in range(8)]
    split = (0, 0, 1, 1, 2, 2, 3, 3)
    got = planner.evaluate(Configuration(2, split, 2, 8, 0.45))
    planner.evaluate(Configuration(2, split, 1, 8, 0.6, "off chip"))
    again = planner.evaluate(Configuration(2, split, 2, 8, 0.45))     # from the kept trace
    assert (again.peak_tile, again.samples_per_second) == (got.peak_tile, got.samples_per_second)

    torch.manual_seed(0)
    twin = Stack()
    for i, ipu in enumerate(split):
        if i == 0 or split[i - 1] != ipu:
            twin.layers[i] = poptorch.BeginBlock(twin.layers[i], f"ipu{ipu}", ipu_id=ipu)
    opts = _test_ipu().replicationFactor(2).setAvailableMemoryProportion(
        {f"IPU{i}": 0.45 for i in range(4)})
    opts.Training.gradientAccumulation(8)
    opts._Popart.setEngineOptions({"debug.allowOutOfMemory": "true"})
    tm = poptorch.trainingModel(twin, opts, _sgd(twin))
    x, y = _inputs(2 * 2 * 8)
    tm.compile(x, y)
    reports = tm._compiled.memory.ipus
    assert got.peak_tile == [int(r.total.max()) for r in reports]
    assert got.fits == all(int(r.total.max()) <= r.capacity for r in reports)
    seconds = tm._compiled.cycles["seconds"]
    assert got.samples_per_second == pytest.approx(2 * 2 * 8 / seconds, rel=1e-9)


def test_the_search_ranks_fitting_configurations_and_says_why_others_fail(tmp_path):
    torch.manual_seed(0)
    model = Stack()
    theirs = Configuration(2, (0, 0, 1, 1, 2, 2, 3, 3), 2, 8, 0.6)
    result = poptorch.plan(model, _inputs(), ipus=8, optimizer=_sgd(model), options=_test_ipu(),
                           micro_batches=(2, 64), global_batch=32, amps=(0.6, 0.3),
                           optimizer_states=("on chip", "off chip"), include=[theirs],
                           progress=False)
    fitting = result.fitting
    assert fitting and result.best is fitting[0]
    rates = [r.samples_per_second for r in fitting]
    assert rates == sorted(rates, reverse=True)
    assert all(max(r.peak_tile) <= r.capacity for r in fitting)
    # one IPU cannot hold the eight layers with their gradients and momentum
    one = [r for r in result.results if r.config.ipus_per_replica == 1]
    assert one and not any(r.fits for r in one)
    assert all("out of memory: peak tile" in r.reason for r in one)
    assert result.find(theirs) is not None
    assert result.best.samples_per_second >= result.find(theirs).samples_per_second
    for r in result.results:          # the global batch asked for, or what a pipeline needs
        stages = stages_of(r.config.ipu_of_unit)
        assert r.config.global_batch >= 32 and (stages == 1 or r.config.accumulation >= 2 * stages)
    text = result.table()
    assert "fit" in text and "rejected" in text and "layers [" in text
    png = result.plot(tmp_path / "plan.png")
    assert png.stat().st_size > 10_000
    json.dumps(result.to_json())


def test_suggest_split_names_the_ipus_needed_without_running_the_model():
    torch.manual_seed(0)
    model = Stack()
    ran = []
    model.layers[0].register_forward_hook(lambda *a: ran.append(a[2]))
    x, y = _inputs()
    plan = poptorch.suggest_split(model, 1, x, y, optimizer=_sgd(model), options=_test_ipu())
    assert not plan.fits and plan.ipus_needed in (2, 4, 8)
    assert "does not fit" in plan.explain() and f"{plan.ipus_needed} IPUs fit" in plan.explain()
    needed = poptorch.suggest_split(model, None, x, y, optimizer=_sgd(model),
                                    options=_test_ipu())
    assert needed.fits and needed.num_ipus == plan.ipus_needed
    assert sum(needed.layers_per_ipu) == 8 and len(needed.peak_tile) == needed.num_ipus
    assert all(p <= needed.capacity for p in needed.peak_tile)
    # traced with fake tensors: no layer computed a real value
    assert ran and all(torch._subclasses.fake_tensor.is_fake(t) for t in ran)


def test_cli_plan_runs_a_script(tmp_path, capsys):
    from poptorchsim.__main__ import main
    script = tmp_path / "model.py"
    script.write_text(
        "import torch, poptorchsim as poptorch\n"
        "from torch import nn\n"
        "model = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))\n"
        "class WithLoss(nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__(); self.m = model\n"
        "    def forward(self, x, y):\n"
        "        out = self.m(x); return out, nn.functional.cross_entropy(out, y)\n"
        "model = WithLoss()\n"
        "example_inputs = (torch.randn(2, 32), torch.zeros(2, dtype=torch.long))\n")
    rc = main(["plan", "--ipus", "2", "--micro-batches", "2,4", "--amps", "0.6",
               "--out", str(tmp_path / "out"), str(script)])
    out = capsys.readouterr().out
    assert rc == 0 and "samples/s" in out and "configurations of 2" in out
    data = json.loads((tmp_path / "out" / "plan.json").read_text())
    assert data["results"] and (tmp_path / "out" / "plan.png").exists()
    bad = tmp_path / "empty.py"
    bad.write_text("x = 1\n")
    assert main(["plan", str(bad)]) == 2
    assert "must define model and example_inputs" in capsys.readouterr().err


def test_a_model_already_split_is_refused_with_the_fix():
    model = Stack()
    model.layers[2] = poptorch.BeginBlock(model.layers[2], "b", ipu_id=1)
    with pytest.raises(poptorch.Error, match="already places its layers.*removeBlocks"):
        poptorch.plan(model, _inputs(), ipus=2, progress=False)
    poptorch.removeBlocks(model)
    assert Planner(model, _inputs(), ipus=2).units


class TiedLM(nn.Module):
    """Embedding, four layers, and a head tied to the embedding."""

    def __init__(self, vocab=64, width=32):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(width, width), nn.Tanh())
                                    for _ in range(4))
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids):
        x = self.embed(ids)
        for layer in self.layers:
            x = layer(x)
        return poptorch.identity_loss(nn.functional.cross_entropy(
            self.head(x).flatten(0, 1), ids.flatten()), "none")


def test_suggest_split_keeps_tied_weights_on_one_ipu_and_applies_with_auto_increment():
    """The contiguous split would use the tied weight on two IPUs (refused);
    the plan puts the head back on IPU 0 with the embedding, and applying it
    with AutoIncrement stages trains."""
    torch.manual_seed(0)
    model = TiedLM()
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    plan = poptorch.suggest_split(model, 2, ids, optimizer=_sgd(model))
    assert plan.fits and plan.boundaries[0] == ("embed", 0) and plan.boundaries[-1] == ("head", 0)
    assert plan.needs_auto_increment and "AutoIncrement" in plan.explain()
    plan.apply(model)
    opts = poptorch.Options().setExecutionStrategy(
        poptorch.PipelinedExecution(poptorch.AutoStage.AutoIncrement))
    opts.Training.gradientAccumulation(6)
    tm = poptorch.trainingModel(model, opts, _sgd(model))
    loss = tm(ids.repeat(6, 1))
    assert torch.isfinite(loss).all() and tm.getIR().n_ipus == 2


def test_a_model_built_without_weights_is_planned(tmp_path):
    """Sizing without the weights on the host: a meta-device model plans
    like its twin with weights; a split that cannot compile (the tied
    weight on two IPUs) is tried once, not once per setting."""
    def build():
        torch.manual_seed(0)
        return TiedLM()
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    with torch.device("meta"):
        meta = build()
    real = build()
    search = dict(micro_batches=(2,), amps=(0.6,), progress=False)
    got = poptorch.plan(meta, (ids,), ipus=2, optimizer=_sgd(meta), **search)
    want = poptorch.plan(real, (ids,), ipus=2, optimizer=_sgd(real), **search)
    assert [(r.config, r.peak_tile, r.samples_per_second) for r in got.results] == \
        [(r.config, r.peak_tile, r.samples_per_second) for r in want.results]
    broken = [r for r in got.results if not r.peak_tile]
    assert broken and all("share weights" in r.reason for r in broken)
    assert len({r.config.ipu_of_unit for r in broken}) == len(broken)


def test_each_searched_setting_reaches_the_compile():
    """Recomputation, partials, IPUs per replica and the accumulation are
    each compiled as asked, not accepted and ignored."""
    torch.manual_seed(0)
    model = Stack()
    planner = Planner(model, _inputs(), _sgd(model), _test_ipu(), ipus=4, max_ipus_per_replica=4)
    split = (0, 0, 1, 1, 2, 2, 3, 3)
    kept, recomputed = (planner.evaluate(Configuration(64, split, 1, 8, 0.6, recomputation=r))
                        for r in ("none", "pipeline"))
    assert max(recomputed.peak_tile) < max(kept.peak_tile)
    # recomputing never speeds a step up; the pipeline's slowest stage (the
    # last, which recomputes nothing) may bound both
    assert recomputed.samples_per_second <= kept.samples_per_second
    half = Stack().half()
    x, y = _inputs()
    planner = Planner(half, (x.half(), y), _sgd(half), _test_ipu(), ipus=4,
                      max_ipus_per_replica=4)
    speeds = {p: planner.evaluate(Configuration(2, split, 1, 8, 0.6, partials=p))
              .samples_per_second for p in ("float", "half")}
    assert speeds["half"] > speeds["float"]       # the AMP's fp16-partials rate
    result = planner.search(micro_batches=(2,), ipus_per_replica=(2,), accumulation=5,
                            amps=(0.6,), optimizer_states=("on chip",), progress=False)
    assert result.results and all(r.config.ipus_per_replica == 2 for r in result.results)
    assert all(r.config.accumulation == max(5, 2 * stages_of(r.config.ipu_of_unit))
               for r in result.results)


def test_suggest_split_plans_training_programs_only():
    model = Stack()
    with pytest.raises(poptorch.Error, match="pass training=True"):
        poptorch.suggest_split(model, 2, *_inputs(), training=False)


def test_a_configuration_names_where_the_units_outside_the_layers_sit():
    """``layers [..]`` counts the repeated layers only: two splits that put
    the head on different IPUs must not print alike."""
    units = [f"layers.{i}" for i in range(4)] + ["head"]
    repeated = {0, 1, 2, 3}
    last, first = (Configuration(4, (0, 0, 1, 1, ipu), 2, 8) for ipu in (1, 0))
    assert last.describe(repeated, units) != first.describe(repeated, units)
    assert "layers [2, 2], head on IPU 1," in last.describe(repeated, units)
    assert "layers [2, 2], head on IPU 0," in first.describe(repeated, units)
    assert "head" not in last.describe(repeated)          # no names, no mention
