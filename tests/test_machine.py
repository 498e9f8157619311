"""The simulated IPU: targets, out of memory, cycles, latencies, available memory."""
import logging

import pytest
import torch
import torch.nn as nn
from conftest import LogRecords

import poptorchsim as poptorch
from poptorchsim.estimate.targets import BOW, MK1, MK2, TEST_IPU, default_target


def quiet():
    return poptorch.Options().showCompilationProgressBar(False)


class Regression(nn.Module):
    def __init__(self, n_in, n_out):
        super().__init__()
        self.fc = nn.Linear(n_in, n_out)

    def forward(self, x, y):
        out = self.fc(x)
        return out, nn.functional.mse_loss(out, y)


def test_targets_table_matches_the_hardware_figures():
    assert (MK2.tiles, MK2.bytes_per_tile, MK2.clock_hz) == (1472, 638_976, 1.33e9)
    assert (MK1.tiles, MK1.bytes_per_tile, MK1.clock_hz) == (1216, 262_144, 1.6e9)
    assert (BOW.tiles, BOW.bytes_per_tile, BOW.clock_hz) == (1472, 638_976, 1.85e9)
    assert TEST_IPU.tiles == 4
    assert MK2.amp_macs_fp16 == 64 and MK1.amp_macs_fp16 == 32


def test_target_chosen_by_environment_and_option(monkeypatch):
    monkeypatch.delenv("POPTORCHSIM_SMALL_IPU_MODEL", raising=False)
    monkeypatch.delenv("POPTORCHSIM_IPU_MODEL_VERSION", raising=False)
    assert default_target() is MK2
    monkeypatch.setenv("POPTORCHSIM_IPU_MODEL_VERSION", "ipu1")
    assert default_target() is MK1
    monkeypatch.setenv("POPTORCHSIM_SMALL_IPU_MODEL", "1")
    assert default_target() is TEST_IPU
    assert default_target("bow") is BOW          # the option wins
    monkeypatch.setenv("POPTORCHSIM_SMALL_IPU_MODEL", "0")
    monkeypatch.setenv("POPTORCHSIM_IPU_MODEL_VERSION", "ipu9")
    with pytest.raises(poptorch.Error, match="Unknown IPU model version"):
        default_target()
    with pytest.raises(poptorch.Error, match="Unknown IPU model version"):
        poptorch.Options().useIpuModelVersion("ipu3")


def _compile(model, opts, batch, optimizer=None):
    optimizer = optimizer or torch.optim.SGD(model.parameters(), lr=0.1)
    tm = poptorch.trainingModel(model, opts, optimizer)
    n_in, n_out = model.fc.in_features, model.fc.out_features
    tm.compile(torch.randn(batch, n_in), torch.randn(batch, n_out))
    return tm


def test_out_of_memory_over_an_ipu_and_not_under_it():
    # Adam: weights, gradients and two moments of a 4096x4096 layer = 268 MB,
    # plus the update's temporaries: over a Mk1's 304 MiB, under a Mk2's 897 MiB.
    model = Regression(4096, 4096)
    with pytest.raises(poptorch.OutOfMemoryError,
                       match=r"Out of memory on tile \d+: \d+ bytes used but tiles only "
                             r"have 262144 bytes of memory"):
        _compile(model, quiet().useIpuModelVersion("ipu1"), 8,
                 torch.optim.Adam(model.parameters()))
    model.destroy()
    tm = _compile(model, quiet().useIpuModelVersion("ipu2"), 8,
                  torch.optim.Adam(model.parameters()))
    mem = tm.memoryReport()
    assert mem.total.max() <= 638_976
    assert mem.always_live.sum() > 268e6


def test_out_of_memory_message_names_the_largest_tensors():
    model = Regression(6000, 6000)
    with pytest.raises(poptorch.OutOfMemoryError) as info:
        _compile(model, quiet().useIpuModelVersion("ipu1"), 8,
                 torch.optim.Adam(model.parameters()))
    import re
    assert re.search(r"Largest tensors there: [\w./]+ \(\d+ B\)", str(info.value))



def test_allow_out_of_memory_finishes_compilation():
    model = Regression(6000, 6000)
    opts = quiet().useIpuModelVersion("ipu1")
    opts._Popart.setEngineOptions({"debug.allowOutOfMemory": "true"})
    records = LogRecords()
    logger = logging.getLogger("poptorchsim")
    logger.addHandler(records)
    try:
        tm = _compile(model, opts, 8, torch.optim.Adam(model.parameters()))
    finally:
        logger.removeHandler(records)
    assert tm.memoryReport().total.max() > 262_144
    assert any("Out of memory on tile" in m for m in records.messages)


def _matmul_compute(n_out, batch=512, n_in=1024):
    model = nn.Linear(n_in, n_out)
    im = poptorch.inferenceModel(model, quiet())
    im.compile(torch.randn(batch, n_in))
    ops = [o for o in im.simulationReport()["ops"] if o["class"] == "matmul"]
    return ops[0]


def test_doubling_a_matmul_output_doubles_its_compute():
    small, big = _matmul_compute(2048), _matmul_compute(4096)
    assert big["macs"] == 2 * small["macs"]
    assert 1.7 < big["compute"] / small["compute"] < 2.3


def test_lower_available_memory_uses_less_temporary_memory_and_more_supersteps():
    def build(amp):
        class Big(nn.Module):
            def __init__(self):
                super().__init__()
                self.fc = nn.Linear(4096, 4096)

            def forward(self, x):
                return poptorch.set_available_memory(self.fc(x), amp)
        im = poptorch.inferenceModel(Big(), quiet())
        im.compile(torch.randn(256, 4096))
        return im
    generous, tight = build(0.6), build(0.01)
    def op(im):
        return next(o for o in im.simulationReport()["ops"] if o["class"] == "matmul")
    assert op(tight)["sync"] > op(generous)["sync"]
    tight_live = tight.memoryReport().not_always_live.max()
    assert tight_live < generous.memoryReport().not_always_live.max()


def test_options_available_memory_proportion_applies_to_ipu0():
    def peak(amp):
        opts = quiet().setAvailableMemoryProportion({"IPU0": amp})
        im = poptorch.inferenceModel(nn.Linear(4096, 4096), opts)
        im.compile(torch.randn(256, 4096))
        return im.memoryReport().not_always_live.max()
    assert peak(0.01) < peak(0.6)
    with pytest.raises(AssertionError, match="IPU"):
        quiet().setAvailableMemoryProportion({"0": 0.5})


def test_perf_counters_and_latencies_follow_the_output_mode():
    model = Regression(16, 4)
    opts = quiet().deviceIterations(4)
    opts.Training.gradientAccumulation(2)
    tm = poptorch.trainingModel(model, opts, torch.optim.SGD(model.parameters(), lr=0.1))
    assert tm.getPerfCounters()["input"] == [[]]
    assert tm.getComputeLatency() == (0.0, 0.0, 0.0)
    tm(torch.randn(32, 16), torch.randn(32, 4))
    pc = tm.getPerfCounters()
    assert len(pc["input"]) == 2 and len(pc["input"][0]) == 4 * 2    # di * ga
    assert len(pc["output"][0]) == 1                                  # Final: rf
    lo, hi, avg = tm.getComputeLatency()
    assert 0 < lo <= avg <= hi
    assert tm.getLatency()[2] > tm.getComputeLatency()[2]
    first_end = pc["output_complete"][0][-1]
    tm(torch.randn(32, 16), torch.randn(32, 4))
    assert tm.getPerfCounters()["input"][0][0] >= first_end           # the clock runs on


def test_synthetic_data_drops_host_streams():
    def estimate(synthetic):
        opts = quiet().deviceIterations(10).enableSyntheticData(synthetic)
        im = poptorch.inferenceModel(nn.Linear(512, 512), opts)
        im(torch.randn(640, 512))
        return im
    real, synthetic = estimate(False), estimate(True)
    assert synthetic.cycleEstimate()["host"] < real.cycleEstimate()["host"]
    assert synthetic.getPerfCounters()["input"] == [[]]


def test_estimate_does_not_depend_on_running():
    model = Regression(64, 8)
    tm = _compile(model, quiet().deviceIterations(2), 16)
    before = tm.cycleEstimate()
    tm(torch.randn(16, 64), torch.randn(16, 8))
    assert tm.cycleEstimate() == before


def test_as_strided_reads_the_traced_layout_when_the_real_one_differs():
    """A real kernel may lay a tensor out otherwise than the trace's meta
    kernel did; as_strided then reads the elements the trace meant."""
    from poptorchsim.machine.kernels import as_strided as _as_strided
    logical = torch.arange(12.0).reshape(3, 4)
    traced = ((3, 4), (4, 1), 0)                     # contiguous in the trace
    real = logical.t().contiguous().t()              # same values, column-major
    want = torch.as_strided(logical, (2, 2), (4, 1), 1)
    assert torch.equal(_as_strided(real, (2, 2), (4, 1), 1, traced=traced), want)
    assert torch.equal(_as_strided(logical, (2, 2), (4, 1), 1, traced=traced), want)


def test_optimizer_update_writes_weights_in_place():
    """The update graph writes each weight into its own memory (as the IPU
    does) rather than allocating a new tensor per step."""
    from conftest import ClassifierWithLoss, classification_batch, quiet_options
    model = ClassifierWithLoss()
    sim = poptorch.trainingModel(model, quiet_options(),
                                    torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    batch = classification_batch(4)
    sim(*batch)
    before = [p.data_ptr() for p in sim._state.params]
    sim(*batch)
    assert [p.data_ptr() for p in sim._state.params] == before


def _ir(name, shape, dtype=torch.float32):
    from poptorchsim.ir.graph import Tensor
    return Tensor(id=hash(name) % 10_000, name=name, shape=shape, dtype=dtype)


@pytest.mark.parametrize("target, args, kwargs, binding", [
    (torch.ops.aten.mm.default, ("a", "b"), {}, torch.mm),
    (torch.ops.aten.add_.Tensor, ("a", "a"), {"alpha": 2.0}, torch.Tensor.add_),
    (torch.ops.aten.mul.Tensor, ("a", "b"), {}, torch.mul),
    (torch.ops.aten.t.default, ("a",), {}, torch.t),
    (torch.ops.aten.sum.dim_IntList, ("a", [1], True), {}, torch.sum),
    # torch.split is a Python wrapper; Tensor.split too: the overload's own entry
    (torch.ops.aten.split.Tensor, ("a", 2), {}, None),
    # torch.add / torch.mul wrap a Python number into a tensor: they reach
    # add.Tensor, not add.Scalar
    (torch.ops.aten.add.Scalar, ("a", 2.0), {}, None),
    (torch.ops.aten.mul.Scalar, ("a", 3.0), {}, None),
])
def test_ops_run_through_the_public_binding_only_when_it_reaches_the_same_overload(
        target, args, kwargs, binding):
    from poptorchsim.machine.kernels import kernel_for
    ir_args = [_ir(a, (4, 4)) if a in ("a", "b") else a for a in args]
    chosen = kernel_for(target, ir_args, kwargs)
    if binding is None:
        assert chosen is target._op
    else:
        assert chosen is binding
    real = [torch.randn(4, 4) if a in ("a", "b") else a for a in args]
    want = target(*[x.clone() if isinstance(x, torch.Tensor) else x for x in real], **kwargs)
    got = chosen(*[x.clone() if isinstance(x, torch.Tensor) else x for x in real], **kwargs)
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_the_same_view_of_the_same_tensor_is_made_once():
    """A GRU transposes each weight at every time step; the engine makes
    each such view once (the IR keeps every op: views cost nothing)."""
    gru = nn.GRU(4, 8, batch_first=True)
    model = poptorch.inferenceModel(gru, quiet())
    x = torch.randn(2, 6, 4)
    out, _ = model(x)
    torch.testing.assert_close(out, gru(x)[0])
    graph, = model._compiled.program.graphs.values()
    transposes = [op.args[0].id for op in graph.ops if str(op.target) == "aten.t.default"]
    assert len(transposes) >= 6 and len(set(transposes)) == 2      # w_ih, w_hh
    lines = model._engine.step_fn.source.count("= _op")
    assert lines == len(graph.ops) - len(transposes) + 2


def test_host_malloc_policy_is_applied_once_and_can_be_left_alone(monkeypatch):
    """Programs allocate the same tensors every step: on glibc the first run
    keeps freed memory in the heap (no page faults per step);
    POPTORCHSIM_HOST_MALLOC=system leaves malloc alone, anything else warns."""
    import platform

    from poptorchsim.runtime.state import host_memory
    monkeypatch.setitem(host_memory._state, "applied", None)
    monkeypatch.setenv("POPTORCHSIM_HOST_MALLOC", "system")
    assert host_memory.keep_freed_memory() is False
    monkeypatch.setenv("POPTORCHSIM_HOST_MALLOC", "keep")
    assert host_memory.keep_freed_memory() is False        # decided once per process
    monkeypatch.setitem(host_memory._state, "applied", None)
    applied = host_memory.keep_freed_memory()
    glibc = platform.system() == "Linux" and platform.libc_ver()[0] == "glibc"
    assert applied is glibc
    monkeypatch.setitem(host_memory._state, "applied", None)
    monkeypatch.setenv("POPTORCHSIM_HOST_MALLOC", "jemalloc")
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logger = logging.getLogger("poptorchsim")
    logger.addHandler(handler)
    try:
        assert host_memory.keep_freed_memory() is False
    finally:
        logger.removeHandler(handler)
    assert any("POPTORCHSIM_HOST_MALLOC" in r.getMessage() for r in records)


def test_generated_step_releases_each_intermediate_after_its_last_use():
    """Every value an op makes that the step does not return is deleted right
    after the last line that reads it (as autograd frees activations), so a
    step's peak host memory is its live set, not everything it computed."""
    import re
    net = Regression(16, 4)
    model = poptorch.trainingModel(net, quiet(), torch.optim.SGD(net.parameters(), lr=0.1))
    model(torch.randn(8, 16), torch.randn(8, 4))
    source = model._engine.step_fn.source.splitlines()
    returned = set(re.findall(r"v\d+", source[-1]))
    inputs = set(re.findall(r"v\d+", source[1]))
    made = {}
    for i, line in enumerate(source[2:-1], start=2):
        if not line.lstrip().startswith("del "):
            for name in re.findall(r"(v\d+)\s*,|(v\d+)\s*=", line.split("=")[0] + "="):
                made[name[0] or name[1]] = i
    freed = {}
    for i, line in enumerate(source):
        if line.lstrip().startswith("del "):
            for name in line.split("del ", 1)[1].split(", "):
                freed[name] = i
    assert made and set(made) - returned - inputs == set(freed)
    for name, at in freed.items():
        last_read = max(i for i, line in enumerate(source[:at])
                        if re.search(rf"\b{name}\b", line))
        assert at == last_read + 1
