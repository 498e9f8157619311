"""PopTorch's graph ops: custom ops, MultiConv, serializedMatMul,
dynamic_slice / dynamic_update, nop, NameScope, Attribute, module_repr."""
import copy
import pickle
import runpy
import sys

import numpy as np
import pytest
import torch
from conftest import quiet_options
from torch import nn

import poptorchsim as poptorch


def _sgd(model):
    return torch.optim.SGD(model.parameters(), lr=0.1)


def _train_vs_eager(model, *inputs):
    """One training step on the simulated IPU and in eager PyTorch."""
    reference = copy.deepcopy(model)
    pm = poptorch.trainingModel(model, quiet_options(), optimizer=_sgd(model))
    out, loss = pm(*inputs)
    opt = _sgd(reference)
    ref_out, ref_loss = reference(*inputs)
    ref_loss.backward()
    opt.step()
    torch.testing.assert_close(out, ref_out.detach())
    for a, b in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(a.detach(), b.detach())
    return pm


def _ops(pm):
    return {r["name"]: r for r in pm.simulationReport()["ops"]}


# ---------------------------------------------------------------------------
# custom ops
# ---------------------------------------------------------------------------
def _cube_bias(x, bias, scale=1.0):
    return x * x * x * scale, x + bias


CUBE_BIAS = poptorch.register_custom_op("CubeBias", _cube_bias, domain="test.graph_ops",
                                        cycles_per_element=5)


def _cube_bias_backward(grads, inputs, outputs, scale=1.0):
    (g_cube, g_sum), (x, _) = grads, inputs
    return g_cube * 3 * x * x * scale + g_sum, g_sum


poptorch.register_custom_op("CubeBiasGrad", _cube_bias, domain="test.graph_ops",
                            backward=_cube_bias_backward, cycles_per_element=5)


class _CustomModel(nn.Module):
    def __init__(self, name):
        super().__init__()
        self.name = name
        self.fc = nn.Linear(6, 6)
        self.bias = nn.Parameter(torch.randn(6))

    def forward(self, x, target):
        cube, shifted = poptorch.custom_op([self.fc(x), self.bias.expand(4, 6)], self.name,
                                           "test.graph_ops", 1, example_outputs=[x, x],
                                           attributes={"scale": 0.5})
        out = cube + shifted
        return out, nn.functional.mse_loss(out, target)


def test_custom_op_inference_matches_eager_and_passes_attributes():
    class Net(nn.Module):
        def forward(self, x, b):
            return poptorch.custom_op([x, b], "CubeBias", "test.graph_ops", 1,
                                      example_outputs=[x, x], attributes={"scale": 2.0})

    x, b = torch.randn(3, 8), torch.randn(3, 8)
    pm = poptorch.inferenceModel(Net(), quiet_options())
    cube, shifted = pm(x, b)
    torch.testing.assert_close(cube, x ** 3 * 2.0)
    torch.testing.assert_close(shifted, x + b)
    eager = CUBE_BIAS([x, b], example_outputs=[x, x], attributes={"scale": 2.0})
    torch.testing.assert_close(eager[0], cube)
    assert "custom" in str(pm.getIR())


@pytest.mark.parametrize("name", ["CubeBias", "CubeBiasGrad"])
def test_custom_op_training_matches_eager(name):
    """Gradients through the op: PyTorch's autograd of the forward, or the
    registered backward; both equal eager training."""
    torch.manual_seed(0)
    pm = _train_vs_eager(_CustomModel(name), torch.randn(4, 6), torch.randn(4, 6))
    classes = [r["class"] for r in pm.simulationReport()["ops"]
               if r["op"].startswith("poptorchsim_custom")]
    assert sorted(classes) == ["custom", "custom"]        # the op and its gradient op


def test_declared_cost_shows_in_op_cycles():
    def cycles(cpe):
        name = f"Scaled{cpe}"
        poptorch.register_custom_op(name, lambda x: x * 2, domain="test.cost",
                                    cycles_per_element=cpe,
                                    temp_bytes=lambda i, o: 4 * 4096)

        class Net(nn.Module):
            def forward(self, x):
                return poptorch.custom_op([x], name, "test.cost", 1, example_outputs=[x])

        pm = poptorch.inferenceModel(Net(), quiet_options())
        torch.testing.assert_close(pm(torch.ones(4096))[0], torch.full((4096,), 2.0))
        row = next(r for r in pm.simulationReport()["ops"] if r["class"] == "custom")
        graph = pm.getIR().graphs["inference_forward"]
        k = next(i for i, op in enumerate(graph.ops) if op.cost_class == "custom")
        temp = pm._compiled.costs["inference_forward"][k].temp_bytes
        return row["compute"], float(np.sum(temp))

    low, temp = cycles(1)
    high, _ = cycles(100)
    assert high > 50 * (low - 40)          # 100x the work per element
    assert temp == pytest.approx(4 * 4096)


def test_custom_op_errors():
    x = torch.ones(2)
    with pytest.raises(poptorch.Error, match="is not registered.*register_custom_op"):
        poptorch.custom_op([x], "Missing", "com.acme", 1, example_outputs=[x])
    with pytest.raises(poptorch.Error, match="already registered"):
        poptorch.register_custom_op("CubeBias", _cube_bias, domain="test.graph_ops",
                                    cycles_per_element=1)
    with pytest.raises(poptorch.Error, match="exactly one of cycles_per_element"):
        poptorch.register_custom_op("NoCost", _cube_bias, domain="test.graph_ops")
    with pytest.raises(ValueError, match="All attribute keys must be strings."):
        poptorch.custom_op([x, x], "CubeBias", "test.graph_ops", 1, [x, x], {1: 2})
    with pytest.raises(ValueError, match="must all be the same"):
        poptorch.custom_op([x, x], "CubeBias", "test.graph_ops", 1, [x, x], {"a": [1, "b"]})
    with pytest.raises(ValueError, match="contains non-ASCII characters"):
        poptorch.custom_op([x, x], "CubeBias", "test.graph_ops", 1, [x, x], {"a": "é"})
    with pytest.raises(poptorch.Error, match="example_outputs declare"):
        poptorch.custom_op([x, x], "CubeBias", "test.graph_ops", 1, [x, torch.ones(3)])


def test_adder_vertex_tutorial(capsys, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["custom_op.py"])
    runpy.run_path("tutorials/custom_op/custom_op.py", run_name="__main__")
    out = capsys.readouterr().out
    assert "matches PyTorch" in out and "largest weight difference" in out


# ---------------------------------------------------------------------------
# MultiConv
# ---------------------------------------------------------------------------
class _Convs(nn.Module):
    def __init__(self, n=4, multiconv=None):
        super().__init__()
        self.convs = nn.ModuleList(nn.Conv2d(4, 8, 3) for _ in range(n))
        self.multiconv = multiconv

    def forward(self, *xs):
        if self.multiconv is None:
            return [c(x) for c, x in zip(self.convs, xs)]
        with self.multiconv():
            return [c(x) for c, x in zip(self.convs, xs)]


def _conv_costs(multiconv):
    torch.manual_seed(0)
    model = _Convs(multiconv=multiconv)
    xs = [torch.randn(2, 4, 16, 16) for _ in range(4)]
    pm = poptorch.inferenceModel(model, quiet_options())
    outs = pm(*xs)
    for out, ref in zip(outs, model(*xs)):
        torch.testing.assert_close(out, ref)
    graph = pm.getIR().graphs["inference_forward"]
    return [c for op, c in zip(graph.ops, pm._compiled.costs["inference_forward"])
            if op.cost_class == "conv"]


def test_multiconv_parallel_is_cheaper_and_numerics_unchanged():
    alone = sum(c.total for c in _conv_costs(None))
    parallel = sum(c.total for c in _conv_costs(poptorch.MultiConv))
    serial = sum(c.total for c in _conv_costs(
        lambda: poptorch.MultiConv().planType(poptorch.MultiConvPlanType.Serial)))
    assert parallel < 0.6 * alone
    assert serial == pytest.approx(alone, rel=0.15)


def test_multiconv_available_memory_per_conv():
    """A tiny proportion for the first convolution forces its plan into
    serial chunks: less temporary memory, more syncs; the others keep theirs."""
    costs = _conv_costs(lambda: poptorch.MultiConv().availableMemoryProportions(
        [0.0001, 0.6, 0.6, 0.6]).planType(poptorch.MultiConvPlanType.Serial))
    default = _conv_costs(lambda: poptorch.MultiConv().planType(
        poptorch.MultiConvPlanType.Serial))
    assert costs[0].sync > default[0].sync
    assert np.max(costs[0].temp_bytes) < np.max(default[0].temp_bytes)
    assert costs[1].sync == default[1].sync


def test_multiconv_builder_validation():
    mc = poptorch.MultiConv()
    with pytest.raises(AssertionError, match="Invalid available memory proportion!"):
        mc.availableMemoryProportions(1)
    with pytest.raises(ValueError, match="Invalid partials types"):
        mc.partialsTypes(torch.int32)
    with pytest.raises(ValueError, match="value must be bool or list of bools"):
        mc.enableConvDithering([True, 1])
    with pytest.raises(AssertionError, match="Invalid plan type!"):
        mc.planType(1)
    with pytest.raises(AssertionError):
        mc.perConvReservedTiles(1.5)
    with pytest.raises(AssertionError):
        mc.cycleBackOff(1)
    assert mc.partialsTypes([torch.half, torch.float]).cycleBackOff(0.2) is mc
    with pytest.raises(poptorch.Error, match="3 values of available_memory for 4"):
        _conv_costs(lambda: poptorch.MultiConv().availableMemoryProportions([0.5] * 3))


def test_multiconv_nested_or_without_convolution_is_refused():
    # PopTorch's multiconv_test.py texts; outside tracing MultiConv does nothing
    class Nested(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(1, 2, 3)

        def forward(self, x):
            with poptorch.MultiConv():
                with poptorch.MultiConv():
                    return self.conv(x)

    class Empty(nn.Module):
        def forward(self, x):
            with poptorch.MultiConv():
                return torch.pow(x, 2)

    x = torch.randn(1, 1, 8, 8)
    Nested()(x), Empty()(x)
    with pytest.raises(poptorch.Error, match="Nested poptorch.MultiConv is not supported"):
        poptorch.inferenceModel(Nested(), quiet_options())(x)
    with pytest.raises(poptorch.Error, match="Unexpected end_multi_conv"):
        poptorch.inferenceModel(Empty(), quiet_options())(x)


# ---------------------------------------------------------------------------
# serializedMatMul
# ---------------------------------------------------------------------------
def _matmul_cost(mode, factor):
    class Net(nn.Module):
        def forward(self, a, b):
            return poptorch.serializedMatMul(a, b, mode, factor)

    a, b = torch.randn(2, 64, 256), torch.randn(256, 1024)      # the weights stay put
    pm = poptorch.inferenceModel(Net(), quiet_options())
    torch.testing.assert_close(pm(a, b), a @ b, rtol=1e-4, atol=1e-4)
    graph = pm.getIR().graphs["inference_forward"]
    return next(c for op, c in zip(graph.ops, pm._compiled.costs["inference_forward"])
                if op.cost_class == "matmul")


@pytest.mark.parametrize("mode", [poptorch.MatMulSerializationMode.InputChannels,
                                  poptorch.MatMulSerializationMode.ReducingDim])
def test_serialized_matmul_trades_memory_for_supersteps(mode):
    plain = _matmul_cost(poptorch.MatMulSerializationMode.Disabled, 0)
    split = _matmul_cost(mode, 4)
    assert np.max(split.temp_bytes) < np.max(plain.temp_bytes)
    assert split.sync >= 4 * plain.sync
    assert split.macs == plain.macs


def test_serialized_matmul_validation():
    a, b = torch.randn(10, 6), torch.randn(6, 4)
    mode = poptorch.MatMulSerializationMode.OutputChannels
    with pytest.raises(AssertionError):
        poptorch.serializedMatMul(a, b, "output_channels", 2)
    with pytest.raises(AssertionError):
        poptorch.serializedMatMul(a, b, mode, 2.0)
    with pytest.raises(AssertionError):
        poptorch.serializedMatMul(a, b, mode, 2, keep_precision=1)
    with pytest.raises(poptorch.Error, match=r"factor \(3\) must divide the output_channels"):
        poptorch.serializedMatMul(a, b, mode, 3)
    with pytest.raises(poptorch.Error, match="at least 1"):
        poptorch.serializedMatMul(a, b, mode)


# ---------------------------------------------------------------------------
# dynamic_slice / dynamic_update
# ---------------------------------------------------------------------------
def test_dynamic_slice_reads_start_on_device():
    class Net(nn.Module):
        def forward(self, t, start):
            return poptorch.dynamic_slice(t, 1, start, 4, 2)

    t = torch.arange(16.0).reshape(2, 8)
    pm = poptorch.inferenceModel(Net(), quiet_options())
    pm.compile(torch.randn(2, 8), torch.tensor([3]))       # compiled with another start
    for s in (0, 1, 4):
        torch.testing.assert_close(pm(t, torch.tensor([s])), t[:, s:s + 4:2])


def test_dynamic_update_and_training_through_both():
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.randn(8, 3))
            self.src = nn.Parameter(torch.randn(2, 3))

        def forward(self, start, target):
            part = poptorch.dynamic_slice(self.w, 0, start, 4, 1)
            out = poptorch.dynamic_update(self.w * 2, self.src, 0, start + 1, 2)
            loss = nn.functional.mse_loss(out, target) + part.pow(2).mean()
            return out, poptorch.identity_loss(loss, "none")

    torch.manual_seed(0)
    _train_vs_eager(Net(), torch.tensor([3], dtype=torch.int32), torch.randn(8, 3))


def test_dynamic_slice_errors():
    t, s = torch.arange(8.0), torch.tensor([1])
    cases = [(lambda: poptorch.dynamic_slice(t, 0, s, 0, 1),
              "The start and end of a slice must be different."),
             (lambda: poptorch.dynamic_slice(t, 0, s, -2, 1),
              "end less than the start is not supported"),
             (lambda: poptorch.dynamic_slice(t, 0, s, 7, 1),
              r"The size of the slice \(7\) must be a factor of the slicing dimension \(8\)"),
             (lambda: poptorch.dynamic_slice(t, 0, 1, 2, 1), "must be a torch.tensor"),
             (lambda: poptorch.dynamic_slice(t, 0, s, 2.0, 1), "Size must be an integer."),
             (lambda: poptorch.dynamic_slice(t, 0, torch.tensor([1.0]), 2, 1),
              "Expected integer typed start tensor"),
             (lambda: poptorch.dynamic_update(t.reshape(2, 4), t, 0, s, 1),
              r"input and src tensors must have same dimensionality. \(2\) vs \(1\)"),
             (lambda: poptorch.dynamic_update(t, t.int(), 0, s, 1),
              "input and src tensor must have same dtype"),
             # named as the IPU holds them (PopTorch's text): int64 is int32 there
             (lambda: poptorch.dynamic_update(t, t.long(), 0, s, 1),
              r"same dtype\. \(torch\.float32 vs torch\.int32\)")]
    for call, message in cases:
        with pytest.raises(poptorch.Error, match=message):
            call()


# ---------------------------------------------------------------------------
# nop, NameScope, Attribute, module_repr
# ---------------------------------------------------------------------------
class _Scoped(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x):
        with poptorch.NameScope("enc"), poptorch.Attribute(__outline={"layer": "enc"}):
            with poptorch.NameScope("fc1"):
                x = poptorch.nop(self.fc1(x))
        return self.fc2(x)


def test_nop_name_scope_and_attributes_reach_the_ir():
    x = torch.randn(2, 4)
    model = _Scoped()
    pm = poptorch.inferenceModel(model, quiet_options())
    torch.testing.assert_close(pm(x), model(x))
    text = str(pm.getIR())
    assert "%enc/fc1/nop" in text and "poptorchsim.nop.default" in text
    ops = pm.getIR().graphs["inference_forward"].ops
    nop = next(op for op in ops if op.name == "enc/fc1/nop")
    assert nop.cost_class == "copy" and _ops(pm)["enc/fc1/nop"]["cycles"] > 0
    assert nop.attrs["attributes"] == {"__outline": {"layer": "enc"}}
    outside = [op for op in ops if not op.name.startswith("enc/")]
    assert outside and all("attributes" not in op.attrs for op in outside)


def test_scope_errors():
    with pytest.raises(AssertionError, match="Parameter to NameScope must be a string"):
        poptorch.NameScope(3)
    with pytest.raises(RuntimeError, match="Expected a value of type 'str'"):
        poptorch.Attribute(__outline={"layer": 1})
    with pytest.raises(RuntimeError, match="must be a dict"):
        poptorch.Attribute(__outline="layer")
    with pytest.raises(poptorch.Error, match="nop must take a torch.tensor argument"):
        poptorch.nop(3)


def test_module_repr_shows_blocks_and_begin_block_modules_pickle(capsys):
    model = nn.Sequential(nn.Linear(2, 2), nn.ReLU())
    plain = repr(model)
    poptorch.BeginBlock(model[0], "first", ipu_id=1)
    assert repr(model) == plain                     # printed as the wrapped module
    text = poptorch.module_repr(model)
    assert "BeginBlock(user_id=first, ipu_id=1) Linear(in_features=2" in text
    poptorch.print(model)
    assert "BeginBlock(user_id=first" in capsys.readouterr().out
    copied = pickle.loads(pickle.dumps(model))
    assert "BeginBlock(user_id=first, ipu_id=1)" in poptorch.module_repr(copied)
