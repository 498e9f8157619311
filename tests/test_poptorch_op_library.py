"""``torch.ops.poptorch``: PopTorch's operator library, each operator doing
what the Python API call it stands for does.  Every test writes one model
twice, with the Python API and with the operator, and checks that both give
the same outputs, the same IR (``getIR()`` text: names, stages, attributes,
recomputation) and the same cycle estimate."""
import ast
import pathlib

import pytest
import torch
from conftest import quiet_options
from torch import nn

import poptorchsim as poptorch
from poptorchsim import popart

P = torch.ops.poptorch


def _compiled(model, inputs, training, options):
    if training:
        pm = poptorch.trainingModel(model, options,
                                    torch.optim.SGD(model.parameters(), lr=0.1))
    else:
        pm = poptorch.inferenceModel(model, options)
    return pm, pm(*inputs)


def same_as_api(make, *inputs, training=False, options=quiet_options):
    """``make(use_op)`` built with the API (False) and with the operator
    (True): same outputs, trained weights, IR text and cycles.  Returns the
    operator's executor."""
    runs = []
    for use_op in (False, True):
        torch.manual_seed(0)
        model = make(use_op)
        pm, out = _compiled(model, inputs, training, options())
        runs.append((pm, out, [p.detach().clone() for p in model.parameters()]))
    (api, api_out, api_w), (op, op_out, op_w) = runs
    torch.testing.assert_close(op_out, api_out, rtol=0, atol=0)
    for a, b in zip(op_w, api_w):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert str(op.getIR()) == str(api.getIR())
    assert op.cycleEstimate() == api.cycleEstimate()
    return op


class Layers(nn.Module):
    """Two linear layers; ``body(self, x)`` decides what happens between them."""

    def __init__(self, body, loss=True, width=8):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(width, width), nn.Linear(width, width)
        self.body = body
        self.loss = loss

    def forward(self, x, target=None):
        out = self.body(self, x)
        if target is None:
            return out
        return out, nn.functional.mse_loss(out, target)


X, Y = torch.randn(4, 8), torch.randn(4, 8)


# -- name scopes, attributes ---------------------------------------------------------------
def _scoped(use_op):
    def body(self, x):
        if use_op:
            P.push_name_scope("enc")
            x = self.fc1(x)
            P.push_name_scope("inner")
            x = torch.relu(x)
            P.pop_name_scope()
            P.pop_name_scope()
        else:
            with poptorch.NameScope("enc"):
                x = self.fc1(x)
                with poptorch.NameScope("inner"):
                    x = torch.relu(x)
        return self.fc2(x)
    return Layers(body)


@pytest.mark.parametrize("training", [False, True])
def test_push_and_pop_name_scope_name_ops_as_name_scope_does(training):
    pm = same_as_api(_scoped, X, *((Y,) if training else ()), training=training)
    text = str(pm.getIR())
    assert "%enc/fc1/addmm" in text and "%enc/inner/relu" in text


def test_the_cnn_benchmarks_name_scope_hooks_work():
    """vision/cnns/pytorch/models/models.py's ``name_scope_hook``: every
    module pushes its name before forward and pops it after (the lambda
    closes over the loop variable, so every scope is the last module's name)."""
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4))
    for name, m in model.named_modules():
        m.register_forward_pre_hook(
            lambda _m, _i: P.push_name_scope(name.split(".")[-1]))  # noqa: B023 - the pitfall

        m.register_forward_hook(lambda _m, _i, _o: P.pop_name_scope())
    expected = model(X)                                   # runs on the CPU too
    opts = quiet_options().disableModuleNamescope()
    pm = poptorch.inferenceModel(model, opts)
    torch.testing.assert_close(pm(X), expected)
    names = [op.name for op in pm.getIR().graphs["inference_forward"].ops]
    # the root's scope, then each module's (all named "2")
    assert names == ["2/2/t", "2/2/addmm", "2/2/relu", "2/2/t_1", "2/2/addmm_1"]


CNNS_MODELS = pathlib.Path("/work/examples/vision/cnns/pytorch/models/models.py")


@pytest.mark.skipif(not CNNS_MODELS.exists(), reason="Graphcore's examples are not here")
def test_the_cnn_benchmarks_own_name_scope_hook_runs():
    """``name_scope_hook`` as Graphcore wrote it, taken from its file (the
    module itself needs the benchmark's data pipeline to import)."""
    tree = ast.parse(CNNS_MODELS.read_text())
    hook = next(n for n in tree.body
                if isinstance(n, ast.FunctionDef) and n.name == "name_scope_hook")
    namespace = {"torch": torch}
    exec(compile(ast.Module([hook], []), str(CNNS_MODELS), "exec"), namespace)  # noqa: S102 - the application's code, as it runs
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(144, 5))
    namespace["name_scope_hook"](model)
    x = torch.randn(2, 3, 8, 8)
    expected = model(x)
    pm = poptorch.inferenceModel(model, quiet_options())
    torch.testing.assert_close(pm(x), expected)
    names = [op.name for op in pm.getIR().graphs["inference_forward"].ops]
    # one stack, as in PopTorch: the root's "3", the module's own push ("3", the
    # closure's last name), then poptorchsim's module name scope; each pop
    # closes the scope pushed last, whoever pushed it
    assert names == ["3/3/0/convolution", "3/3/1/relu", "3/3/2/view", "3/3/3/t",
                     "3/3/3/addmm"]


def _attributed(use_op):
    def body(self, x):
        if use_op:
            P.set_attribute("__outline", "layer", "enc")
            x = poptorch.nop(self.fc1(x))
            P.clear_attribute("__outline", "layer")
        else:
            with poptorch.Attribute(__outline={"layer": "enc"}):
                x = poptorch.nop(self.fc1(x))
        return self.fc2(x)
    return Layers(body)


def test_set_and_clear_attribute_mark_ops_as_attribute_does():
    pm = same_as_api(_attributed, X)
    ops = pm.getIR().graphs["inference_forward"].ops
    assert next(op for op in ops if op.name == "fc1/addmm").attrs["attributes"] == \
        {"__outline": {"layer": "enc"}}
    assert "attributes" not in next(op for op in ops if op.name == "fc2/addmm_1").attrs


# -- blocks ------------------------------------------------------------------------------
class Pipelined(nn.Module):
    def __init__(self, use_op):
        super().__init__()
        self.use_op = use_op
        self.fc1, self.fc2, self.fc3 = (nn.Linear(8, 8) for _ in range(3))
        if not use_op:
            poptorch.BeginBlock(self.fc2, user_id="1", ipu_id=1)

    def forward(self, x, target):
        x = torch.relu(self.fc1(x))
        if self.use_op:
            P.begin_ipu_block(1, 0, 1)
        x = self.fc3(torch.relu(self.fc2(x)))
        return x, nn.functional.mse_loss(x, target)


def _pipelined_options():
    o = quiet_options().deviceIterations(2)
    o.Training.gradientAccumulation(4)
    return o


def test_begin_ipu_block_pipelines_as_begin_block_does():
    xs, ys = torch.randn(32, 8), torch.randn(32, 8)
    pm = same_as_api(Pipelined, xs, ys, training=True, options=_pipelined_options)
    text = str(pm.getIR())
    assert "stage 1, ipu 1" in text and "stage 0, ipu 0" in text


def _block_scope(use_op):
    def body(self, x):
        x = self.fc1(x)
        if use_op:
            P.begin_ipu_block(1, 0, 1)
            x = self.fc2(x)
            P.end_ipu_block()
        else:
            with poptorch.Block("1", ipu_id=1):
                x = self.fc2(x)
        return x
    return Layers(body)


def test_end_ipu_block_ends_the_block_as_a_block_scope_does():
    pm = same_as_api(_block_scope, X, options=lambda: quiet_options().setExecutionStrategy(
        poptorch.ShardedExecution()))
    assert "stage 1, ipu 1" in str(pm.getIR())

    def after_end(self, x):
        P.begin_ipu_block(0, 0, 0)
        x = self.fc1(x)
        P.end_ipu_block()
        return self.fc2(x)                 # in no block, as PopTorch refuses
    with pytest.raises(poptorch.Error) as via_op:
        poptorch.inferenceModel(Layers(after_end), quiet_options())(X)

    def after_scope(self, x):
        with poptorch.Block("0", ipu_id=0):
            x = self.fc1(x)
        return self.fc2(x)
    with pytest.raises(poptorch.Error) as via_api:
        poptorch.inferenceModel(Layers(after_scope), quiet_options())(X)
    assert str(via_op.value) == str(via_api.value)


# -- identity-like annotations --------------------------------------------------------------
def _annotated(annotation):
    def make(use_op):
        def body(self, x):
            h = torch.tanh(self.fc1(x))
            h = annotation(use_op, h)
            return self.fc2(h)
        return Layers(body)
    return make


@pytest.mark.parametrize("name, annotation", [
    ("nop", lambda op, h: P.nop(h) if op else poptorch.nop(h)),
    ("recomputation_checkpoint",
     lambda op, h: P.recomputation_checkpoint(h) if op else poptorch.recomputationCheckpoint(h)),
    ("set_available_memory",
     lambda op, h: P.set_available_memory(h, 0.2) if op else
     poptorch.set_available_memory(h, 0.2)),
])
def test_identity_like_annotations_match_the_api(name, annotation):
    def options():
        o = quiet_options()
        o._Popart.set("autoRecomputation", popart.RecomputationType.RecomputeAll)
        return o
    pm = same_as_api(_annotated(annotation), X, Y, training=True, options=options)
    graph = pm.getIR().graphs["training_step"]
    if name == "recomputation_checkpoint":
        assert graph.recompute.checkpoints == 1
    elif name == "nop":
        assert any(op.name == "nop" for op in graph.ops)


def test_set_available_memory_reaches_the_matmul():
    def make(use_op):
        def body(self, x):
            h = self.fc1(x)
            h = P.set_available_memory(h, 0.1) if use_op else \
                poptorch.set_available_memory(h, 0.1)
            return self.fc2(h)
        return Layers(body)
    pm = same_as_api(make, X)
    ops = pm.getIR().graphs["inference_forward"].ops
    assert next(op for op in ops if op.name == "fc1/addmm").available_memory == 0.1


def test_set_matmul_serialization_matches_serialized_matmul():
    mode = poptorch.MatMulSerializationMode.OutputChannels

    def make(use_op):
        def body(self, x):
            if use_op:
                return P.set_matmul_serialization(x @ self.fc1.weight, mode.value, 2, False)
            return poptorch.serializedMatMul(x, self.fc1.weight, mode, 2)
        return Layers(body)
    pm = same_as_api(make, X)
    assert "serialization=('output_channels', 2, False)" in str(pm.getIR())


def test_ipu_print_tensor_prints_as_the_api(capfd):
    def make(use_op):
        def body(self, x):
            h = self.fc1(x)
            if use_op:
                h = P.ipu_print_tensor(h, "h", 0, 1000, 3, 80, 4, 1, ", ", "(", ")")
            else:
                h = poptorch.ipu_print_tensor(h, "h", print_gradient=False,
                                              float_format="fixed")
            return self.fc2(h)
        return Layers(body)
    same_as_api(make, X)
    printed = capfd.readouterr().err
    prints = [line for line in printed.splitlines() if line.startswith("h:")]
    assert len(prints) == 2 and prints[0] == prints[1]


def test_set_overlap_for_input_and_output_match_the_api():
    mode = poptorch.OverlapMode.OverlapAccumulationLoop

    def make(use_op):
        def body(self, x):
            x = P.set_overlap_for_input(x, mode.value) if use_op else \
                poptorch.set_overlap_for_input(x, mode)
            out = torch.relu(self.fc1(x))
            return P.set_overlap_for_output(out, mode.value) if use_op else \
                poptorch.set_overlap_for_output(out, mode)
        return Layers(body, width=256)

    def options():
        o = quiet_options().setExecutionStrategy(poptorch.ShardedExecution())
        o.TensorLocations.numIOTiles(32)
        return o
    same_as_api(make, torch.randn(16, 256), options=options)


# -- losses, casts, slices --------------------------------------------------------------------
@pytest.mark.parametrize("code, reduction", [(0, "sum"), (1, "mean"), (2, "none")])
def test_identity_loss_codes_match_the_reductions(code, reduction):
    def make(use_op):
        def body(self, x):
            out = self.fc2(torch.relu(self.fc1(x)))
            loss = (out - 1.0) ** 2
            loss = P.identity_loss(loss, code) if use_op else \
                poptorch.identity_loss(loss, reduction)
            return out, loss
        return Layers(body)
    same_as_api(make, X, training=True)


def test_internal_cast_casts_as_the_dino_gelu_does():
    """vision/dino/pytorch/core/gelu.py: an fp16 model computes GELU in fp32."""
    def make(use_op):
        def body(self, x):
            h = self.fc1(x)
            wide = P.internal_cast(h, "FLOAT") if use_op else h.float()
            out = wide * 0.5 * (1.0 + torch.erf(wide / 2.0 ** 0.5))
            out = P.internal_cast(out, "FLOAT16") if use_op else out.half()
            return self.fc2(out)
        return Layers(body).half()
    pm = same_as_api(make, X.half())
    ops = {op.name: op for op in pm.getIR().graphs["inference_forward"].ops}
    assert ops["erf"].outputs[0].dtype == torch.float32
    assert ops["fc2/addmm_1"].outputs[0].dtype == torch.float16
    assert poptorch._impl.internal_cast(X, torch.half).dtype == torch.float16


def test_dynamic_slice_and_update_match_the_api():
    def make(use_op):
        def body(self, x):
            start = torch.tensor([2])
            piece = P.dynamic_slice(x, 1, start, 4, 1) if use_op else \
                poptorch.dynamic_slice(x, 1, start, 4, 1)
            piece = piece * 2
            return P.dynamic_update(x, piece, 1, start, 4) if use_op else \
                poptorch.dynamic_update(x, piece, 1, start, 4)
        return Layers(body)
    same_as_api(make, X)


CUBE = poptorch.register_custom_op("OpLibraryCube", lambda x, scale=1.0: x * x * x * scale,
                                   domain="test.op_library", cycles_per_element=4)


def test_custom_operation_runs_the_registered_custom_op():
    def make(use_op):
        def body(self, x):
            h = self.fc1(x)
            if use_op:
                out, = P.custom_operation([h], "OpLibraryCube", "test.op_library", 1, 1, [h],
                                          '{"scale": 0.5}')
            else:
                out, = poptorch.custom_op([h], "OpLibraryCube", "test.op_library", 1, [h],
                                          attributes={"scale": 0.5})
            return self.fc2(out)
        return Layers(body)
    same_as_api(make, X, Y, training=True)


def _conv_model(use_op):
    class Convs(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Conv2d(4, 8, 3), nn.Conv2d(4, 8, 3)

        def forward(self, x):
            if use_op:
                P.begin_multi_conv()
                y, z = self.a(x), self.b(x)
                P.end_multi_conv([0.3, 0.4], [0, 1], 1, 20, 0.2, [1, 0])
            else:
                with poptorch.MultiConv().availableMemoryProportions([0.3, 0.4]) \
                        .partialsTypes([torch.float, torch.half]) \
                        .planType(poptorch.MultiConvPlanType.Serial) \
                        .perConvReservedTiles(20).cycleBackOff(0.2) \
                        .enableConvDithering([True, False]):
                    y, z = self.a(x), self.b(x)
            return y + z
    return Convs()


def test_begin_and_end_multi_conv_match_multi_conv():
    pm = same_as_api(_conv_model, torch.randn(2, 4, 8, 8))
    convs = [op for op in pm.getIR().graphs["inference_forward"].ops
             if op.cost_class == "conv"]
    assert len(convs) == 2


def test_ctc_beam_search_decoder_matches_the_api():
    def make(use_op):
        def body(self, x):
            probs = torch.log_softmax(x.reshape(4, 2, 4), -1)
            lengths = torch.tensor([4, 3], dtype=torch.int32)
            if use_op:
                return P.ctc_beam_search_decoder(probs, lengths, 0, 3, 2)
            return poptorch.ctc_beam_search_decoder(probs, lengths, 0, 3, 2)
        return Layers(body)
    same_as_api(make, X)
