"""The cost model and the reports follow precision (issue 12, item 5): half
partials change a matmul's cycles and temporary memory; the per-op table
carries each op's dtype, rounding and role (loss scaling, gradient unscale);
``memoryReport()`` and the HTML report show each tensor's dtype
(docs/precision.md, "In the reports")."""
import torch
from conftest import ClassifierWithLoss, classification_batch, quiet_options

import poptorchsim as poptorch
from poptorchsim.estimate.targets import MK1, MK2
from poptorchsim.profiling import op_table, write_report

HALF = torch.float16


class _Linear(torch.nn.Module):
    def __init__(self, k, n):
        super().__init__()
        self.fc = torch.nn.Linear(k, n, bias=False).half()

    def forward(self, x):
        return self.fc(x)


def _matmul_cost(x, k, n, partials):
    opts = quiet_options()
    opts.Precision.setPartialsType(partials)
    pm = poptorch.inferenceModel(_Linear(k, n), opts)
    pm.compile(x)
    graph = pm._compiled.program.graphs["inference_forward"]
    costs = pm._compiled.costs["inference_forward"]
    return next(c for op, c in zip(graph.ops, costs) if op.cost_class == "matmul")


def test_half_partials_double_the_amp_rate_on_mk2():
    # 256 x 1024 @ 1024 x 1024 in fp16: the output split fills the tiles, no
    # reduction split, so the compute is the AMP's multiply-accumulates
    x = torch.randn(256, 1024).half()
    fl = _matmul_cost(x, 1024, 1024, torch.float)
    half = _matmul_cost(x, 1024, 1024, torch.half)
    assert fl.macs == half.macs == 256 * 1024 * 1024
    # the AMP vertex runs 16 conv units with half partials, 8 with float
    # ones (getFp16InFp32OutConvUnitsPerTile): its core loop does twice the
    # work per pass; the vertex's fixed costs and the exchange are the same
    assert fl.plan.startswith("matmul: AMP") and half.plan.startswith("matmul: AMP")
    assert 1.5 < fl.compute / half.compute <= 2.0 * 1.05
    assert MK2.amp_macs_fp16 / MK2.amp_macs_fp16_float_partials == 2.0
    assert half.total < fl.total
    # Mk1's AMP runs fp16 at the same rate with either partials type
    assert MK1.amp_macs_fp16 == MK1.amp_macs_fp16_float_partials == 32


def test_half_partials_halve_temporary_partial_sums():
    # a long reduction (8192) over few outputs is split across tiles: each
    # tile keeps partial sums, 4 bytes each with float partials, 2 with half
    x = torch.randn(4, 8192).half()
    fl = _matmul_cost(x, 8192, 16, torch.float)
    half = _matmul_cost(x, 8192, 16, torch.half)
    # (each is planned on its own: the partitions, and so the exchange, may differ)
    assert half.temp_bytes.sum() < fl.temp_bytes.sum()
    # its few outputs leave the AMP idle: fixed costs, about equal either way
    assert half.total <= 1.05 * fl.total


def _train(half=True, sr=False, loss_scaling=None, partials=None, profile=None):
    torch.manual_seed(0)
    model = ClassifierWithLoss(in_features=16, hidden=32)
    if half:
        model = model.half()
    opts = quiet_options().randomSeed(1)
    opts.Precision.enableStochasticRounding(sr)
    if partials is not None:
        opts.Precision.setPartialsType(partials)
    if profile is not None:
        opts.enableProfiling(str(profile))
    kw = {} if loss_scaling is None else {"loss_scaling": loss_scaling}
    pm = poptorch.trainingModel(model, opts,
                                optimizer=poptorch.optim.SGD(model.parameters(), lr=0.1, **kw))
    x, y = classification_batch(8, in_features=16)
    pm.compile(x.half() if half else x, y)
    return pm


def _rows(pm, graph="training_step"):
    return [r for r in pm.simulationReport()["ops"] if r["graph"] == graph]


def test_ops_rounding_follows_stochastic_rounding():
    on = _rows(_train(sr=True))
    off = _rows(_train(sr=False))
    matmuls = [r for r in on if r["class"] == "matmul"]
    assert matmuls and all(r["rounding"] == "stochastic" and r["dtype"] == "float16"
                           for r in matmuls)
    assert {r["rounding"] for r in off} == {"nearest"}
    # only fp16 results round stochastically; views are left alone
    assert all(r["rounding"] == "nearest" for r in on
               if r["dtype"] != "float16" or r["class"] == "view")


def test_ops_marked_half_partials():
    rows = _rows(_train(partials=torch.half))
    mm = [r for r in rows if r["class"] == "matmul"]
    assert mm and all(r["rounding"] == "half partials" for r in mm)
    assert all(r["rounding"] == "nearest" for r in rows if r["class"] != "matmul")


def test_loss_scaling_ops_have_a_role():
    pm = _train(loss_scaling=128.0)
    step, update = _rows(pm), _rows(pm, "optimizer_update")
    scaling = [r for r in step if r["role"] == "loss scaling"]
    assert any(r["op"] == "aten.mul.Tensor" for r in scaling)
    unscale = [r for r in update if r["role"] == "gradient unscale"]
    assert len([r for r in unscale if r["op"] == "aten.mul.Tensor"]) == 4   # one per param
    table = op_table(pm.simulationReport())
    assert "loss scaling" in table and "gradient unscale" in table
    # without loss scaling, no loss-scaling role (the optimizer's host
    # scalars keep theirs, tests/test_host_scalars.py)
    plain = _train()
    assert not any(r["role"] not in ("", "host scalar")
                   for r in plain.simulationReport()["ops"])


def test_memory_report_lists_dtypes():
    pm = _train()
    mem = pm.memoryReport()
    tensors = {name: (dtype, nbytes) for name, dtype, nbytes in mem.tensors()}
    assert tensors["fc1.weight"] == ("float16", 32 * 16 * 2)
    assert tensors["input0"][0] == "float16"
    by_dtype = mem.bytes_by_dtype()
    assert by_dtype["float16"] >= sum(b for d, b in tensors.values() if d == "float16")
    assert sum(by_dtype.values()) == sum(b for _, b in tensors.values())
    on_peak = mem.tensors_on(mem.peak_tile, 10)
    assert on_peak and all(d for _, d, _ in on_peak)
    assert [(b, n) for n, _, b in on_peak] == mem.largest_on(mem.peak_tile, 10)
    # fp32 model: float32 variables
    assert _train(half=False).memoryReport().tensors()[0][1] == "float32"


def test_report_and_page_show_dtypes(tmp_path):
    pm = _train(sr=True, loss_scaling=64.0, profile=tmp_path)
    report = pm.simulationReport()
    mem = report["memory"]
    assert "float16" in mem["always_live_by_dtype"]
    assert all(r["dtype"] for r in mem["peak_tile_tensors"])
    html = (tmp_path / "training" / "index.html").read_text()
    assert "float16" in html and "Always-live variables by dtype" in html
    assert "stochastic" in html and "loss scaling" in html and "gradient unscale" in html
    written = write_report(report, str(tmp_path / "again"))
    assert "<th>dtype</th>" in open(written["html"]).read()
