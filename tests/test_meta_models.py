"""Models without weights (parameters on the ``meta`` device) compile to the
same memory report and cycle estimate as the same models with weights,
refuse to run with ``NoWeightsError`` (the executor unchanged), and an
executor frees what it holds on ``destroy()``."""
import gc
import weakref

import numpy as np
import pytest
import torch
from conftest import quiet_options
from torch import nn

import poptorchsim


class SmallCNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.conv2 = nn.Conv2d(8, 16, 3, padding=1)
        self.fc = nn.Linear(16 * 8 * 8, 10)

    def forward(self, x, y=None):
        h = torch.relu(self.bn(self.conv1(x)))
        h = nn.functional.max_pool2d(torch.relu(self.conv2(h)), 2)
        out = self.fc(h.flatten(1))
        if y is None:
            return out
        return out, nn.functional.cross_entropy(out, y)


def _cnn(device):
    torch.manual_seed(0)
    with torch.device(device):
        return SmallCNN()


X = torch.randn(8, 3, 16, 16)
Y = torch.randint(0, 10, (8,))


def _estimates(pm):
    """What sizing reads: every IPU's memory per tile and the cycle estimate."""
    report = pm.memoryReport()
    memory = [(r.ipu, r.always_live.tolist(), r.not_always_live.tolist(),
               {k: v.tolist() for k, v in r.by_tensor.items()}) for r in report.ipus]
    return memory, pm.cycleEstimate(), str(pm.getIR())


def _training(model, options=None, optimizer=torch.optim.Adam):
    opts = options or quiet_options()
    return poptorchsim.trainingModel(model, opts, optimizer(model.parameters(), lr=1e-3))


@pytest.mark.parametrize("training", [True, False])
def test_meta_cnn_compiles_to_the_estimates_of_the_real_one(training):
    pms = []
    for device in ("cpu", "meta"):
        model = _cnn(device)
        pm = _training(model) if training else poptorchsim.inferenceModel(
            model, quiet_options())
        pm.compile(X, Y) if training else pm.compile(X)
        pms.append(pm)
    real, meta = (_estimates(pm) for pm in pms)
    assert real[0] == meta[0]
    assert real[1] == meta[1]
    assert real[2] == meta[2]
    assert meta[1]["total"] > 0
    assert all(p.device.type == "meta" for p in pms[1].model.parameters())


class LM(nn.Module):
    """A Hugging Face GPT-2 with its loss, pipelined over two IPUs."""

    def __init__(self, config):
        super().__init__()
        import transformers
        self.lm = transformers.GPT2LMHeadModel(config)
        blocks = self.lm.transformer.h
        blocks[len(blocks) // 2] = poptorchsim.BeginBlock(blocks[len(blocks) // 2], ipu_id=1)

    def forward(self, ids, labels):
        return self.lm(input_ids=ids, labels=labels).loss


def _gpt2_config():
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    return transformers.GPT2Config(vocab_size=128, n_positions=32, n_embd=32, n_layer=2,
                                   n_head=2, bos_token_id=0, eos_token_id=0,
                                   tie_word_embeddings=False)   # one IPU per weight


@pytest.mark.parametrize("training", [True, False])
def test_meta_gpt2_compiles_to_the_estimates_of_the_real_one(training):
    config = _gpt2_config()
    ids = torch.randint(0, 128, (2 * 4 * 2, 16), generator=torch.Generator().manual_seed(0))
    pms = []
    for device in ("cpu", "meta"):
        torch.manual_seed(0)
        with torch.device(device):
            model = LM(config)
        opts = quiet_options().replicationFactor(2)
        opts.setExecutionStrategy(poptorchsim.PipelinedExecution())
        if training:
            opts.Training.gradientAccumulation(4)
            pm = _training(model, opts, torch.optim.AdamW)
        else:
            opts.deviceIterations(4)
            pm = poptorchsim.inferenceModel(model, opts)
        pm.compile(ids, ids)
        pms.append(pm)
    real, meta = (_estimates(pm) for pm in pms)
    assert len(real[0]) == 2                    # two IPUs, both compared
    assert real[0] == meta[0]
    assert real[1] == meta[1]
    assert real[2] == meta[2]
    for report in pms[1].memoryReport().ipus:   # pipelined: stashes, recomputation
        _check_peaks(report)


@pytest.mark.parametrize("training", [True, False])
def test_a_model_without_weights_cannot_run(training):
    model = _cnn("meta")
    pm = _training(model) if training else poptorchsim.inferenceModel(model, quiet_options())
    inputs = (X, Y) if training else (X,)
    # before compiling: the call refuses, nothing is compiled
    with pytest.raises(poptorchsim.NoWeightsError,
                       match=r"Cannot run the model: the model was built without weights "
                             r"\(\d+ of its parameters and buffers are on the meta device: "
                             r"conv1.weight"):
        pm(*inputs)
    assert not pm.isCompiled()
    pm.compile(*inputs)
    before = pm.cycleEstimate()
    for call, what in [(lambda: pm(*inputs), "run the model"),
                       (pm.copyWeightsToHost, "copy the weights to the host"),
                       (pm.copyWeightsToDevice, "copy the weights to the device"),
                       (pm.attachToDevice, "attach to the device"),
                       (pm.state_dict, "read the weights")]:
        with pytest.raises(poptorchsim.NoWeightsError) as info:
            call()
        text = str(info.value)
        assert text.startswith(f"Cannot {what}")
        for needed in ("meta device", "model.compile(*inputs)", "memoryReport()", "getIR()",
                       "to_empty(device='cpu')", "load_state_dict"):
            assert needed in text
        assert isinstance(info.value, poptorchsim.Error)
    # unchanged: still compiled, same estimates, weights still on meta, not attached
    assert pm.isCompiled() and not pm.isAttachedToDevice()
    assert pm.cycleEstimate() == before
    assert all(p.device.type == "meta" for p in model.parameters())
    if training:
        assert pm._state.params is None and pm._state.opt_state is None


def test_meta_weights_mixed_with_meta_inputs_keep_the_input_error():
    pm = _training(_cnn("meta"))
    with pytest.raises(poptorchsim.InputError, match="Input x is a tensor on the meta device"):
        pm.compile(X.to("meta"), Y)
    assert not pm.isCompiled()


def test_optimizer_state_dict_of_a_meta_model_reads_no_device_state():
    model = _cnn("meta")
    optimizer = poptorchsim.optim.Adam(model.parameters(), lr=1e-3)
    pm = poptorchsim.trainingModel(model, quiet_options(), optimizer)
    pm.compile(X, Y)
    state = optimizer.state_dict()
    assert state["ipu_state"] is None
    assert state["state"] == {}
    # a new optimizer object is taken without reading or writing device state
    pm.setOptimizer(poptorchsim.optim.Adam(model.parameters(), lr=1e-2))
    pm.destroy()


def test_materialised_model_runs_when_wrapped_again():
    model = _cnn("meta")
    pm = _training(model)
    pm.compile(X, Y)
    estimate = pm.cycleEstimate()
    pm.destroy()
    model.to_empty(device="cpu")
    for m in model.modules():
        if hasattr(m, "reset_parameters"):
            m.reset_parameters()
    model.bn.reset_running_stats()
    pm = _training(model)
    out, loss = pm(X, Y)
    assert torch.isfinite(loss).all() and out.shape == (8, 10)
    assert pm.cycleEstimate() == estimate


@pytest.mark.parametrize("weights", ["cpu", "meta"])
def test_destroy_frees_the_compiled_program(weights):
    model = _cnn(weights)
    pm = _training(model)
    pm.compile(X, Y)
    program = weakref.ref(pm.getIR())
    step_graph = weakref.ref(pm._compiled.capture.graph)
    state = weakref.ref(pm._state)
    engine = weakref.ref(pm._engine)
    pm.destroy()
    gc.collect()
    assert program() is None, "the IR program outlives destroy()"
    assert step_graph() is None, "the traced graph outlives destroy()"
    assert engine() is None, "the engine outlives destroy()"
    assert state() is None, "the device state outlives destroy()"
    assert not pm.isCompiled()
    with pytest.raises(poptorchsim.Error, match="not been compiled or has been destroyed"):
        pm.getIR()


def _peak_rss_mb(code):
    """Peak resident memory (MB) of a fresh Python running ``code``."""
    import subprocess
    import sys
    script = code + ("\nimport resource\n"
                     "print('PEAK', resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)\n")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         check=True, timeout=600).stdout
    kb = int(next(line for line in out.splitlines() if line.startswith("PEAK")).split()[1])
    return kb / 1024


MID_SIZE = """
import torch, poptorchsim
from torch import nn
class Big(nn.Module):
    def __init__(self):
        super().__init__()
        # 16 x 4096 x 4096 fp32: 1 GiB of weights, 3 GiB with Adam's state
        self.layers = nn.ModuleList(nn.Linear(4096, 4096, bias=False) for _ in range(16))
    def forward(self, x):
        for i, layer in enumerate(self.layers):
            if i == 8:
                poptorchsim.Block.start("second", ipu_id=1)
            x = layer(x)
        return poptorchsim.identity_loss(x.square().mean(), reduction="mean")
with torch.device("meta"):
    model = Big()
opts = poptorchsim.Options().showCompilationProgressBar(False)
opts.Training.gradientAccumulation(4)
opts._Popart.setEngineOptions({"debug.allowOutOfMemory": "true"})    # it does not fit
pm = poptorchsim.trainingModel(model, opts, torch.optim.Adam(model.parameters()))
pm.compile(torch.randn(4, 4096))
assert pm.memoryReport().ipus[0].always_live.sum() > 2**30 / 2
"""


def test_compiling_without_weights_keeps_host_memory_small():
    """A 1 GiB model (3 GiB with Adam's state and its gradient accumulators
    more) compiles in a process that never holds its weights."""
    peak = _peak_rss_mb(MID_SIZE)
    imports = _peak_rss_mb("import torch, poptorchsim")
    # measured: about 170 MB over the imports (with the weights on the CPU: 3.2 GB)
    assert peak - imports < 400, (
        f"compiling a 1 GiB model without weights took {peak - imports:.0f} MB over "
        f"the imports ({peak:.0f} MB peak)")


@pytest.mark.slow
def test_gpt2_xl_without_weights_compiles_in_little_host_memory():
    pytest.importorskip("transformers")
    import os
    import sys
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path.insert(0, os.path.join(here, "..", "benchmarks"))
    from meta_compile import GPT2_XL_SCRIPT
    peak = _peak_rss_mb(GPT2_XL_SCRIPT)
    assert peak < 1536, f"GPT-2 XL without weights peaked at {peak:.0f} MB"


def test_memory_report_keeps_each_graphs_peak_not_its_matrix():
    """The report keeps per graph the peak bytes of every tile and the op
    where it is reached; the (ops x tiles) matrix, swept again on demand,
    agrees with them (a large model's matrices would hold gigabytes)."""
    opts = quiet_options()
    opts.Training.gradientAccumulation(2)
    pm = _training(_cnn("meta"), opts)
    pm.compile(torch.cat([X, X]), torch.cat([Y, Y]))
    _check_peaks(pm.memoryReport())


def _check_peaks(report):
    for name, (usage, _, _) in report.graphs.items():
        dense = np.asarray(usage)
        assert dense.shape == usage.shape and dense.shape[0] > 0
        assert np.array_equal(usage.max(axis=0), dense.max(axis=0)), name
        assert np.array_equal(usage.peak_op, dense.argmax(axis=0)), name
        assert not any(isinstance(v, np.ndarray) and v.ndim == 2 for v in vars(usage).values())


def test_destroy_of_a_model_never_run_makes_no_optimizer_state():
    """A compile-only training model's destroy() copies no optimizer state to
    the host (the device holds the initial state it was given; copying it
    back allocated Adam's two moments, 2x the weights, for GPT-2 medium);
    once a call has run, destroy() copies the state back as before."""
    model = _cnn("cpu")
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    pm = poptorchsim.trainingModel(model, quiet_options(), optimizer)
    pm.compile(X, Y)
    pm.destroy()
    assert optimizer.state == {}
    pm = poptorchsim.trainingModel(model, quiet_options(), optimizer)
    pm(X, Y)
    pm.destroy()
    assert len(optimizer.state) == len(list(model.parameters()))
    assert all(float(s["step"]) == 1 for s in optimizer.state.values())


def test_a_meta_tensor_held_as_a_constant_gets_a_typed_error():
    class Scaled(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4)
            self.scale = torch.ones(4)          # neither a parameter nor a buffer

        def forward(self, x):
            return self.fc(x) * self.scale

    with torch.device("meta"):
        model = Scaled()
    pm = poptorchsim.inferenceModel(model, quiet_options())
    with pytest.raises(poptorchsim.NoWeightsError,
                       match=r"holds scale, a tensor on the meta device that is neither a "
                             r"parameter nor a buffer.*register_buffer\('scale'"):
        pm.compile(torch.randn(2, 4))
    assert not pm.isCompiled()
    # as a buffer it compiles from its shape
    with torch.device("meta"):
        model = Scaled()
    model.register_buffer("scale", model.__dict__.pop("scale"), persistent=False)
    pm = poptorchsim.inferenceModel(model, quiet_options())
    pm.compile(torch.randn(2, 4))
    assert pm.cycleEstimate()["total"] > 0
