"""Observing and hooking a running model: ipu_print_tensor, anchors, tensor
names, CPU ops, compile hooks, the cycle counter, updatable buffers, the
hardware version and the log level (docs/observing.md)."""
import copy
import logging
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from conftest import ATOL, RTOL, ClassifierWithLoss, poptorchsim_log, quiet_options
from torch import nn

import poptorchsim as poptorch
from poptorchsim.capture.tensor_text import format_tensor


# -- ipu_print_tensor ------------------------------------------------------------------
class PrintModel(nn.Module):
    def __init__(self, **fmt):
        super().__init__()
        self.fc = nn.Linear(3, 2)
        self.fmt = fmt

    def forward(self, x, target=None):
        y = poptorch.ipu_print_tensor(self.fc(x), "y", **self.fmt)
        if target is None:
            return y * 2
        return y, nn.functional.mse_loss(y, target)


def test_print_tensor_prints_every_micro_batch_and_keeps_numerics(capsys):
    torch.manual_seed(0)
    model = PrintModel()
    x = torch.randn(6, 3)
    pm = poptorch.inferenceModel(model, quiet_options().deviceIterations(3))
    out = pm(x)
    err = capsys.readouterr().err
    assert err.count("y: (") == 3                    # one print per micro-batch
    with torch.no_grad():
        ref = model(x)
    capsys.readouterr()
    torch.testing.assert_close(out, ref, rtol=RTOL, atol=ATOL)
    assert format_tensor(ref[:2] / 2, "y") in err          # the first micro-batch
    pm(x)
    assert capsys.readouterr().err.count("y: (") == 3     # again on every run


def test_print_tensor_matches_poptorchs_layout(capsys):
    torch.manual_seed(0)
    x = torch.rand((2, 2))

    class Model(nn.Module):
        def forward(self, x):
            return poptorch.ipu_print_tensor(x + 1, "title", True, 500, 2, 15, 8,
                                             "scientific", ",", "[", "]")
    poptorch.inferenceModel(Model(), quiet_options())(x)
    assert ("title: [\n [1.4962566e+00,\n   1.7682219e+00]\n [1.0884774e+00,\n"
            "   1.1320305e+00]\n]") in capsys.readouterr().err


def test_print_tensor_gradient_in_training(capsys):
    torch.manual_seed(0)
    model = PrintModel(digits=6, float_format="fixed")
    ref = copy.deepcopy(model)
    x, t = torch.randn(4, 3), torch.randn(4, 2)
    pm = poptorch.trainingModel(model, quiet_options())
    out, loss = pm(x, t)
    err = capsys.readouterr().err
    assert err.count("y: (") == 1 and err.count("y_gradient: (") == 1
    assert err.index("y: (") < err.index("y_gradient: (")
    y = ref.fc(x)
    (grad,) = torch.autograd.grad(nn.functional.mse_loss(y, t), y)
    printed = err[err.index("y_gradient: ("):].splitlines()[1]
    assert f"{grad[0, 0].item():.5f}" in printed             # 6 digits, fixed
    # numerics unchanged: the trained weights match plain PyTorch
    torch.optim.SGD(ref.parameters(), lr=0.01).zero_grad()
    nn.functional.mse_loss(ref.fc(x), t).backward()
    with torch.no_grad():
        for p in ref.parameters():
            p -= 0.01 * p.grad
    torch.testing.assert_close(model.fc.weight, ref.fc.weight, rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(loss, nn.functional.mse_loss(y, t).detach(),
                               rtol=RTOL, atol=ATOL)


def test_print_tensor_without_gradient_and_summarised(capsys):
    model = PrintModel(print_gradient=False, summarise_threshold=4, edge_items=1)
    pm = poptorch.trainingModel(model, quiet_options())
    pm(torch.randn(4, 3), torch.randn(4, 2))
    err = capsys.readouterr().err
    assert "y_gradient" not in err and "..." in err


def test_print_tensor_costs_a_host_transfer():
    def compiled(print_it):
        class Model(nn.Module):
            def forward(self, x):
                return (poptorch.ipu_print_tensor(x) if print_it else x) * 2
        pm = poptorch.inferenceModel(Model(), quiet_options())
        pm.compile(torch.randn(1000, 100))
        return pm
    plain, printed = compiled(False), compiled(True)
    extra = printed.cycleEstimate()["host"] - plain.cycleEstimate()["host"]
    target = printed._compiled.target
    expected = (400_000 / target.host_bytes_per_s + target.host_latency_s) * target.clock_hz
    assert extra == pytest.approx(expected, rel=0.01)
    row = next(r for r in printed.simulationReport()["ops"] if r["class"] == "host")
    assert row["host"] == pytest.approx(expected)


def test_print_tensor_bad_arguments():
    with pytest.raises(poptorch.Error, match="must take a torch.tensor argument"):
        poptorch.ipu_print_tensor([1, 2])
    with pytest.raises(ValueError, match="float_format must be one of"):
        poptorch.ipu_print_tensor(torch.ones(2), float_format="engineering")
    with pytest.raises(ValueError, match="digits must be a non-negative integer"):
        poptorch.ipu_print_tensor(torch.ones(2), digits=-1)


# -- tensor names and anchors ------------------------------------------------------------
def _classifier_run(opts, calls=1, di=1):
    torch.manual_seed(0)
    model = ClassifierWithLoss()
    ref = copy.deepcopy(model)
    pm = poptorch.trainingModel(model, opts.deviceIterations(di))
    batches = [(torch.randn(4 * di, 6), torch.randint(0, 4, (4 * di,)))
               for _ in range(calls)]
    for x, t in batches:
        pm(x, t)
    return pm, ref, batches


def test_tensor_names_follow_the_ir():
    model = poptorch.trainingModel(ClassifierWithLoss(), quiet_options())
    with pytest.raises(AssertionError, match="must be compiled"):
        model.getTensorNames()
    model(torch.randn(4, 6), torch.randint(0, 4, (4,)))
    names = model.getTensorNames()
    ir = str(model.getIR())
    assert {"fc1.weight", "input0", "fc1/addmm", "act/relu"} <= set(names)   # module name scopes
    assert all(f"%{n}" in ir for n in names if "___" not in n and n != "lossScaling_FLOAT")
    assert "Gradient___fc2.bias" in names and "UpdatedVar___fc2.weight" in names
    # the optimizer's tensors, as PopART names them (those of state_dict()["ipu_param"])
    assert "scaledLearningRate0___specific___fc2.weight" in names
    assert "lossScaling_FLOAT" in names


def test_an_optimizer_tensor_cannot_be_anchored():
    opts = quiet_options()
    opts.anchorTensor("lr", "scaledLearningRate0___specific___fc2.weight")
    model = poptorch.trainingModel(ClassifierWithLoss(), opts)
    with pytest.raises(poptorch.Error, match="the optimizer's tensors cannot be anchored "
                                             "here; read their values with "
                                             r"optimizer.state_dict\(\)\['ipu_param'\]"):
        model(torch.randn(4, 6), torch.randint(0, 4, (4,)))


def test_anchors_are_logged_as_popTorch_lowers_them():
    """PopTorch's debug line per anchor: ``  anchor ( <tensor> <MODE>/<period> )``."""
    opts = quiet_options()
    opts.anchorTensor("g", "Gradient___fc2.bias", poptorch.OutputMode.EveryN, 2)
    opts.anchorTensor("u", "UpdatedVar___fc2.weight", poptorch.OutputMode.Sum)
    opts.deviceIterations(2)
    model = poptorch.trainingModel(ClassifierWithLoss(), opts)
    with poptorchsim_log() as records:
        model(torch.randn(8, 6), torch.randint(0, 4, (8,)))
    lines = records.messages
    assert "  anchor ( Gradient___fc2.bias EVERYN/2 )" in lines
    assert "  anchor ( UpdatedVar___fc2.weight Sum/1 )" in lines
    assert lines.index("  anchor ( UpdatedVar___fc2.weight Sum/1 )") < lines.index("}")


def test_anchored_gradient_activation_and_update_match_pytorch():
    opts = quiet_options()
    assert opts.anchorTensor("grad_bias", "Gradient___fc2.bias") is None
    opts.anchorTensor("hidden", "act/relu")
    opts.anchorTensor("update_weight", "UpdatedVar___fc2.weight")
    pm, ref, [(x, t)] = _classifier_run(opts)
    out = ref.fc2(ref.act(ref.fc1(x)))
    nn.functional.cross_entropy(out, t).backward()
    torch.testing.assert_close(pm.getAnchoredTensor("grad_bias"), ref.fc2.bias.grad,
                               rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(pm.getAnchoredTensor("hidden"),
                               ref.act(ref.fc1(x)).detach(), rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(pm.getAnchoredTensor("update_weight"),
                               ref.fc2.weight.detach() - 0.01 * ref.fc2.weight.grad,
                               rtol=RTOL, atol=ATOL)
    with pytest.raises(AssertionError, match="No tensor with name nothing found."):
        pm.getAnchoredTensor("nothing")


def test_anchor_output_modes():
    opts = quiet_options()
    opts.anchorTensor("all", "input0", poptorch.OutputMode.All)
    opts.anchorTensor("every2", "input0", poptorch.OutputMode.EveryN, 2)
    opts.anchorTensor("final", "input0")                  # the model's mode: Final
    opts.anchorTensor("sum", "input0", poptorch.OutputMode.Sum)
    opts.anchorTensor("steps", "UpdatedVar___fc2.bias", poptorch.OutputMode.All)
    pm, _, [(x, _)] = _classifier_run(opts, di=4)
    micro = x.reshape(4, 4, 6)
    torch.testing.assert_close(pm.getAnchoredTensor("all"), x)
    torch.testing.assert_close(pm.getAnchoredTensor("every2"), torch.cat([micro[1], micro[3]]))
    torch.testing.assert_close(pm.getAnchoredTensor("final"), micro[3])
    torch.testing.assert_close(pm.getAnchoredTensor("sum"), micro.sum(0))
    steps = pm.getAnchoredTensor("steps")
    assert steps.shape == (16,)
    torch.testing.assert_close(steps[-4:], pm.model.fc2.bias.detach())


def test_anchor_of_an_unknown_tensor_fails_at_compile():
    opts = quiet_options()
    opts.anchorTensor("x", "Gradient___no_such.weight")
    model = poptorch.trainingModel(ClassifierWithLoss(), opts)
    with pytest.raises(poptorch.Error, match="no tensor named 'Gradient___no_such.weight'"):
        model(torch.randn(4, 6), torch.randint(0, 4, (4,)))
    with pytest.raises(AssertionError, match="EveryN anchor must have"):
        quiet_options().anchorTensor("a", "b", poptorch.OutputMode.EveryN, 0)


# -- CPU ops ----------------------------------------------------------------------------
class HostModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(5, 5)
        self.cpu = poptorch.CPU(self.on_host, "NumpyOp")

    @staticmethod
    def on_host(x, y):
        a = x.numpy()
        return torch.from_numpy(np.sort(a, axis=1) * 2), torch.from_numpy(a.sum(1) + y.numpy())

    def forward(self, x, y):
        sorted_, sums = self.cpu(self.fc(x), y)
        return sorted_ + 1, sums


def test_cpu_op_runs_on_the_host_with_real_values():
    torch.manual_seed(0)
    model = HostModel()
    pm = poptorch.inferenceModel(model, quiet_options().deviceIterations(2))
    for _ in range(2):
        x, y = torch.randn(8, 5), torch.randn(8)
        out = pm(x, y)
        with torch.no_grad():
            ref = model(x, y)
        for a, b in zip(out, ref):
            torch.testing.assert_close(a, b, rtol=RTOL, atol=ATOL)
    # the round trip: 4x5 floats and 4 floats out, 4x5 and 4 back, 4 copies
    target = pm._compiled.target
    row = next(r for r in pm.simulationReport()["ops"] if r["class"] == "host")
    nbytes = 2 * (4 * 5 * 4 + 4 * 4)
    expected = (nbytes / target.host_bytes_per_s + 4 * target.host_latency_s) * target.clock_hz
    assert row["host"] == pytest.approx(expected)


def test_cpu_op_in_training_is_an_error():
    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(2, 2)
            self.cpu = poptorch.CPU(lambda x: x * 2, "Double")

        def forward(self, x):
            return poptorch.identity_loss(self.cpu(self.fc(x)).sum(), "sum")
    model = poptorch.trainingModel(Model(), quiet_options())
    with pytest.raises(poptorch.Error, match="CPU ops are only supported in inference"):
        model(torch.randn(2, 2))


# -- compile hooks --------------------------------------------------------------------------
def test_compile_hooks_run_in_order_and_can_be_removed():
    calls = []
    handles = [poptorch.registerPreCompileHook(lambda: calls.append("pre1")),
               poptorch.registerPreCompileHook(lambda: calls.append("pre2")),
               poptorch.registerPostCompileHook(lambda: calls.append("post"))]
    removed = poptorch.registerPostCompileHook(lambda: calls.append("removed"))
    removed.remove()
    try:
        pm = poptorch.inferenceModel(nn.Linear(2, 2), quiet_options())
        pm(torch.randn(2, 2))
        pm(torch.randn(2, 2))                     # compiled already: no hooks
    finally:
        for h in handles:
            h.remove()
    assert calls == ["pre1", "pre2", "post"]
    with pytest.raises(RuntimeError, match="Pre-compile hook must be callable"):
        poptorch.registerPreCompileHook(2)
    with pytest.raises(RuntimeError, match="Post-compile hook must be callable"):
        poptorch.registerPostCompileHook(False)


# -- cycle counter ---------------------------------------------------------------------------
def test_cycle_count():
    pm = poptorch.inferenceModel(nn.Linear(4, 4), quiet_options())
    with pytest.raises(poptorch.Error, match="Cycle count logging is disabled"):
        pm.cycleCount()
    pm = poptorch.inferenceModel(nn.Linear(4, 4), quiet_options().logCycleCount(True))
    with pytest.raises(poptorch.Error, match="run the model at least once"):
        pm.cycleCount()
    pm.compile(torch.randn(2, 4))
    with pytest.raises(poptorch.Error, match="run the model at least once"):
        pm.cycleCount()
    pm(torch.randn(2, 4))
    est, target = pm.cycleEstimate(), pm._compiled.target
    assert pm.cycleCount() == round(est["total"] - target.call_overhead_s * target.clock_hz)
    assert 0 < pm.cycleCount() < est["total"]


# -- updatable buffers ------------------------------------------------------------------------
class Buffers(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("buffer_1", torch.ones(1))
        self.register_buffer("buffer_2", torch.ones(1))

    def forward(self, x):
        return torch.sum(x + self.buffer_1 + self.buffer_2)


def test_copy_named_buffers_to_device_copies_only_those():
    pm = poptorch.inferenceModel(Buffers(), quiet_options().updatableNamedBuffers(["buffer_1"]))
    x = torch.ones(3)
    assert pm(x) == 9
    pm.buffer_1.copy_(pm.buffer_1 + 1)
    pm.buffer_2.copy_(pm.buffer_2 + 1)
    assert pm(x) == 9                              # the device keeps its copy
    pm.copyNamedBuffersToDevice()
    assert pm(x) == 12                             # buffer_1 only


def test_copy_named_buffers_errors():
    pm = poptorch.inferenceModel(Buffers(), quiet_options())
    with pytest.raises(poptorch.Error, match="has not been compiled"):
        pm.copyNamedBuffersToDevice()
    pm(torch.ones(3))
    with pytest.raises(poptorch.Error, match="No named buffers marked as updatable"):
        pm.copyNamedBuffersToDevice()
    bad = poptorch.inferenceModel(
        Buffers(), quiet_options().updatableNamedBuffers(["non_existing_buffer"]))
    with pytest.raises(poptorch.Error, match="no buffer named 'non_existing_buffer'"):
        bad(torch.ones(3))
    assert not bad.isCompiled()


# -- hardware version, log level ------------------------------------------------------------------
def test_hardware_version_is_the_simulated_targets(monkeypatch):
    assert poptorch.ipuHardwareIsAvailable() is False
    monkeypatch.delenv("POPTORCHSIM_SMALL_IPU_MODEL", raising=False)
    monkeypatch.setenv("POPTORCHSIM_IPU_MODEL_VERSION", "ipu21")
    assert poptorch.ipuHardwareVersion() == 21
    monkeypatch.setenv("POPTORCHSIM_IPU_MODEL_VERSION", "ipu2")
    assert poptorch.ipuHardwareVersion() == 2


def _import_with_log_level(level, code="pass"):
    env = dict(os.environ, POPTORCH_LOG_LEVEL=level)
    return subprocess.run([sys.executable, "-c", f"import poptorchsim as p; {code}"],
                          env=env, capture_output=True, text=True, timeout=120)


def test_log_level_from_the_environment():
    code = "p.logger.debug('a debug line'); p.logger.info('an info line')"
    debug = _import_with_log_level("DEBUG", code)
    assert "[poptorch::python] [debug] a debug line" in debug.stderr
    assert "an info line" in debug.stderr
    if "POPTORCH_LOG_LEVEL" not in os.environ:          # this process: the default, WARN
        assert poptorch.logger.getEffectiveLevel() == logging.WARNING
    bad = _import_with_log_level("LOUD")
    assert bad.returncode != 0 and "Unknown log level: LOUD" in bad.stderr


def test_updated_weight_anchor_follows_a_new_optimizer():
    opts = quiet_options()
    opts.anchorTensor("w", "UpdatedVar___fc2.weight")
    pm, _, [(x, t)] = _classifier_run(opts)
    # a new optimizer object (another type is refused, as PopART refuses it)
    pm.setOptimizer(poptorch.optim.SGD(pm.model.parameters(), lr=0.1))
    pm(x, t)
    torch.testing.assert_close(pm.getAnchoredTensor("w"), pm.model.fc2.weight.detach())
