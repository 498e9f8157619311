"""The host device (``poptorchsim/machine/host_device.py``): choosing it,
and the device state kept apart from the user's model with lazy copies
back (``runtime/state/lazy_weights.py``).

Without a GPU, the CUDA path's own bookkeeping runs on the CPU by keeping
the device state apart there too (``weights.separate_copy``): the same
copies, the same lazy reads, the same numbers as the CPU's in-place path.
The CUDA tests themselves skip without CUDA (``benchmarks/gpu_check.py``
runs them on a GPU)."""
import copy
import io
import subprocess
import sys

import pytest
import torch

import poptorchsim as poptorch
from poptorchsim.runtime.state import weights as device_weights

CUDA = torch.cuda.is_available()


@pytest.fixture(autouse=True)
def _cpu_unless_chosen(monkeypatch):
    """Each test starts on the default host device, the CPU, also when the
    GPU check runs this file with ``POPTORCHSIM_DEVICE=cuda``: the CUDA
    tests choose CUDA themselves."""
    monkeypatch.delenv("POPTORCHSIM_DEVICE", raising=False)
    poptorch.setHostDevice(None)
    yield
    poptorch.setHostDevice(None)


class _Net(torch.nn.Module):
    def __init__(self, dropout=0.0):
        super().__init__()
        self.fc = torch.nn.Linear(16, 32)
        self.bn = torch.nn.BatchNorm1d(32)
        self.drop = torch.nn.Dropout(dropout)
        self.out = torch.nn.Linear(32, 4)

    def forward(self, x, y):
        out = self.out(self.drop(torch.relu(self.bn(self.fc(x)))))
        return out, torch.nn.functional.cross_entropy(out.float(), y)


def _data(n=32, dtype=torch.float32):
    g = torch.Generator().manual_seed(1)
    return torch.randn(n, 16, generator=g).to(dtype), torch.randint(0, 4, (n,), generator=g)


def _train(apart, monkeypatch, calls=3, half=False, rounding=False, dropout=0.0, ga=4):
    """A model trained ``calls`` times (device state apart or in place);
    returns the model (not read yet), the executor and the losses."""
    monkeypatch.setattr(device_weights, "separate_copy", lambda device: apart)
    torch.manual_seed(0)
    model = _Net(dropout)
    if half:
        model = model.half()
    opts = poptorch.Options().randomSeed(5)
    opts.Training.gradientAccumulation(ga)
    opts.Precision.enableStochasticRounding(rounding)
    tm = poptorch.trainingModel(model, opts, poptorch.optim.SGD(model.parameters(), lr=0.05))
    x, y = _data(8 * ga, torch.half if half else torch.float32)
    losses = [tm(x, y)[1] for _ in range(calls)]
    return model, tm, losses


@pytest.mark.parametrize("kind", ["fp32", "fp16_dropout_sr"])
def test_device_state_apart_trains_as_in_place(monkeypatch, kind):
    half = kind != "fp32"
    kw = dict(half=half, rounding=half, dropout=0.2 if half else 0.0)
    m_in, tm_in, l_in = _train(False, monkeypatch, **kw)
    m_apart, tm_apart, l_apart = _train(True, monkeypatch, **kw)
    assert all(torch.equal(a, b) for a, b in zip(l_in, l_apart))
    assert tm_apart._weights.dirty and not tm_in._weights.dirty
    for (name, a), b in zip(m_in.state_dict().items(), m_apart.state_dict().values()):
        assert torch.equal(a, b), name
    tm_in.destroy()
    tm_apart.destroy()


def test_model_reads_trained_weights_lazily(monkeypatch):
    model, tm, _ = _train(True, monkeypatch, calls=1)
    held = model.__dict__["_modules"]["fc"].__dict__["_parameters"]["weight"]  # not a read
    before = held.clone()
    assert tm._weights.dirty                                # not copied after the call
    trained = tm._state.params[0].clone()
    assert not torch.equal(held, trained)
    assert torch.equal(model.fc.weight, trained)            # reading copies
    assert not tm._weights.dirty
    assert torch.equal(held, trained) and not torch.equal(held, before)  # in place
    assert tm.copyWeightsToHostIfNeeded() is False
    tm(*_data(32))
    assert tm.copyWeightsToHostIfNeeded() is True
    assert tm.copyWeightsToHostIfNeeded() is False
    tm(*_data(32))
    tm.detachFromDevice()                                   # the device goes: copied now
    assert not tm._weights.dirty and torch.equal(held, tm._state.params[0])
    tm.destroy()


def test_state_dict_pickle_and_destroy_give_trained_weights(monkeypatch):
    model, tm, _ = _train(True, monkeypatch, calls=2)
    trained = [t.clone() for t in tm._state.params]
    assert torch.equal(model.state_dict()["out.bias"], trained[-1])
    tm(*_data(32))
    trained = [t.clone() for t in tm._state.params]
    saved = io.BytesIO()
    torch.save(model, saved)                                # pickles as the model's class
    saved.seek(0)
    loaded = torch.load(saved, weights_only=False)
    assert type(loaded) is _Net
    assert torch.equal(loaded.out.bias, trained[-1])
    assert type(copy.deepcopy(model)) is _Net
    tm(*_data(32))
    trained = [t.clone() for t in tm._state.params]
    tm.destroy()
    assert type(model) is _Net and type(model.fc) is torch.nn.Linear
    assert torch.equal(model.out.bias, trained[-1])


def test_set_host_device_rejects_what_it_cannot_run_on():
    with pytest.raises(poptorch.Error, match="'cpu' or 'cuda', not 'meta'"):
        poptorch.setHostDevice("meta")
    with pytest.raises(poptorch.Error, match="not a device"):
        poptorch.setHostDevice("gpu0")
    assert poptorch.hostDevice() == torch.device("cpu")        # unchanged
    if not CUDA:
        with pytest.raises(poptorch.Error, match="sees none; install a CUDA build"):
            poptorch.setHostDevice("cuda")
    poptorch.setHostDevice("cpu")
    assert poptorch.hostDevice() == torch.device("cpu")
    poptorch.setHostDevice(None)


def test_environment_variable_chooses_and_is_checked(monkeypatch):
    monkeypatch.setenv("POPTORCHSIM_DEVICE", "cpu")
    assert poptorch.hostDevice() == torch.device("cpu")
    monkeypatch.setenv("POPTORCHSIM_DEVICE", "tpu")
    model = _Net()
    tm = poptorch.inferenceModel(model)
    with pytest.raises(poptorch.Error, match="POPTORCHSIM_DEVICE=tpu"):
        tm(*_data(8))


def test_launcher_device_flag_is_checked(tmp_path):
    script = tmp_path / "s.py"
    script.write_text("import os; print(os.environ['POPTORCHSIM_DEVICE'])\n")
    ok = subprocess.run([sys.executable, "-m", "poptorchsim.run", "--device", "cpu",
                         str(script)], capture_output=True, text=True, timeout=300)
    assert ok.returncode == 0 and ok.stdout.strip() == "cpu", ok.stderr



def test_launcher_refuses_a_bad_device_before_the_program_starts(tmp_path, capsys):
    from poptorchsim.run import parse
    script = tmp_path / "s.py"
    script.write_text("raise SystemExit('must not run')\n")
    with pytest.raises(SystemExit) as bad:
        parse(["--device", "meta", str(script)])
    assert bad.value.code == 2 and "'cpu' or 'cuda'" in capsys.readouterr().err


class _Factories(torch.nn.Module):
    """Convolution, batch norm, attention, and tensors the forward creates
    (``arange``, ``ones``): factory ops trace with ``device=cpu``."""

    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 8, 3)
        self.bn = torch.nn.BatchNorm2d(8)
        self.attn = torch.nn.MultiheadAttention(8, 2, batch_first=True)
        self.fc = torch.nn.Linear(8, 4)

    def forward(self, x, y):
        h = torch.relu(self.bn(self.conv(x)))
        seq = h.flatten(2).transpose(1, 2)
        a, _ = self.attn(seq, seq, seq)
        causal = torch.ones(a.shape[1], a.shape[1], dtype=torch.bool).tril()[0]
        out = self.fc(a.mean(1) + torch.arange(a.shape[-1]).float() + causal.float().sum())
        return out, torch.nn.functional.cross_entropy(out, y)


@pytest.mark.parametrize("optimizer", ["SGD", "LAMB"])
def test_graphs_compiled_for_cuda_place_their_constants_there(monkeypatch, optimizer):
    """Without a GPU, fake CUDA tensors (``FakeTensorMode``, which checks
    every op's devices as CUDA would): a training step and its update
    (LAMB's copies of its rule as calls of shared functions, which take
    their constants as arguments), compiled for a CUDA host device, run on
    CUDA inputs with every traced device and constant on CUDA; compiled for
    the CPU, the same step mixes devices."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from poptorchsim.machine import codegen, host_device
    model = _Factories()
    tm = poptorch.trainingModel(model, poptorch.Options(),
                                getattr(poptorch.optim, optimizer)(model.parameters(), lr=0.1))
    tm.compile(torch.randn(4, 3, 8, 8), torch.randint(0, 4, (4,)))
    graphs = tm._compiled.program.graphs
    cuda = torch.device("cuda")
    with FakeTensorMode(allow_non_fake_inputs=True):
        monkeypatch.setattr(host_device, "current", lambda: cuda)
        for name in ("training_step", "optimizer_update"):
            graph = graphs[name]
            fn = codegen.compile_graph(graph)
            assert ("\ndef _s" in fn.source) == (name == "optimizer_update"
                                                 and optimizer == "LAMB"), name
            outs = fn([torch.empty(t.shape, dtype=t.dtype, device=cuda) for t in graph.inputs])
            assert {o.device.type for o in outs} == {"cuda"}, name
        monkeypatch.setattr(host_device, "current", lambda: torch.device("cpu"))
        step = graphs["training_step"]
        with pytest.raises(Exception, match="device"):
            codegen.compile_graph(step)(
                [torch.empty(t.shape, dtype=t.dtype, device=cuda) for t in step.inputs])
    tm.destroy()


# -- on a GPU ----------------------------------------------------------------------------

@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_cuda_training_equals_eager_cuda_and_ir_is_the_same():
    x, y = _data(32)
    torch.manual_seed(0)
    model = _Net()
    eager = copy.deepcopy(model).cuda()
    opt = torch.optim.SGD(eager.parameters(), lr=0.05)
    on_cpu = copy.deepcopy(model)
    cpu_ir = poptorch.trainingModel(on_cpu, poptorch.Options(),
                                    poptorch.optim.SGD(on_cpu.parameters(), lr=0.05))
    cpu_ir.compile(x, y)
    poptorch.setHostDevice("cuda")
    try:
        tm = poptorch.trainingModel(model, poptorch.Options(),
                                    poptorch.optim.SGD(model.parameters(), lr=0.05))
        for _ in range(3):
            out, loss = tm(x, y)
            opt.zero_grad()
            ref_out, ref_loss = eager(x.cuda(), y.cuda())
            ref_loss.backward()
            opt.step()
            assert out.device.type == "cpu"
            torch.testing.assert_close(loss, ref_loss.cpu(), rtol=1e-5, atol=1e-6)
        for (name, a), b in zip(model.state_dict().items(), eager.state_dict().values()):
            torch.testing.assert_close(a, b.cpu(), rtol=1e-5, atol=1e-6, msg=name)
        assert tm._debugGetPopartIR() == cpu_ir._debugGetPopartIR()
        tm.destroy()
    finally:
        poptorch.setHostDevice(None)
