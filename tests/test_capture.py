"""Capture accepts what PopTorch accepts: each program below once failed to
compile or ran wrongly; each now runs and matches eager PyTorch.

Training rows compare weights after two steps of SGD with momentum against
the same steps in eager PyTorch; inference rows compare outputs.
"""
import collections
import copy

import pytest
import torch
import torch.nn.functional as F
from conftest import assert_state_close, quiet_options
from torch import nn

import poptorchsim


class WithLoss(nn.Module):
    """``body(x)`` and an MSE loss against ``target``."""

    def __init__(self, body):
        super().__init__()
        self.body = body

    def forward(self, x, target):
        out = self.body(x)
        return out, F.mse_loss(out, target)


def train_both(model, inputs, steps=2, lr=0.05):
    """``steps`` training calls on the simulated IPU and in eager PyTorch;
    returns (sim model, eager model, sim outputs, eager outputs)."""
    ref = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=lr, momentum=0.9)
    sim = poptorchsim.trainingModel(model, quiet_options(), opt)
    got, want = [], []
    for _ in range(steps):
        got.append(sim(*[t.clone() for t in inputs]))
        ref_opt.zero_grad()
        out, loss = ref(*[t.clone() for t in inputs])
        loss.backward()
        ref_opt.step()
        want.append((out.detach(), loss.detach()))
    return model, ref, got, want


def check_training(body, x, target, **kw):
    model, ref, got, want = train_both(WithLoss(body), (x, target), **kw)
    assert_state_close(model, ref, rtol=1e-4, atol=1e-5)
    for (g_out, g_loss), (w_out, w_loss) in zip(got, want):
        torch.testing.assert_close(g_out, w_out, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(g_loss, w_loss, rtol=1e-4, atol=1e-5)


def check_inference(model, *inputs, **kwargs):
    model.eval()
    with torch.no_grad():
        want = model(*[t.clone() for t in inputs], **kwargs)
    got = poptorchsim.inferenceModel(copy.deepcopy(model), quiet_options())(*inputs, **kwargs)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    return got


# -- attention and recurrent layers --------------------------------------------------
class SelfAttention(nn.Module):
    def __init__(self, causal=False, mask=False):
        super().__init__()
        self.qkv = nn.Linear(8, 24)
        self.causal, self.mask = causal, mask

    def forward(self, x):
        q, k, v = self.qkv(x).view(x.shape[0], x.shape[1], 3, 2, 4).permute(2, 0, 3, 1, 4)
        mask = None
        if self.mask:
            mask = torch.ones(x.shape[1], x.shape[1], dtype=torch.bool).tril()
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=self.causal)
        return out.transpose(1, 2).flatten(2)


class MHA(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = nn.MultiheadAttention(8, 2, batch_first=True)

    def forward(self, x):
        return self.attn(x, x, x, need_weights=False)[0]


class Recurrent(nn.Module):
    def __init__(self, cls, **kw):
        super().__init__()
        self.rnn = cls(6, 5, **kw)

    def forward(self, x):
        return self.rnn(x)[0]


ATTENTION_AND_RNN = {
    "sdpa": lambda: SelfAttention(),
    "sdpa_causal": lambda: SelfAttention(causal=True),
    "sdpa_mask": lambda: SelfAttention(mask=True),
    "multihead_attention": MHA,
    "transformer_encoder": lambda: nn.TransformerEncoder(
        nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True), 2),
    "lstm": lambda: Recurrent(nn.LSTM, batch_first=True),
    "lstm_bidirectional_2_layers": lambda: Recurrent(nn.LSTM, num_layers=2,
                                                     bidirectional=True, batch_first=True),
    "lstm_no_bias_sequence_first": lambda: Recurrent(nn.LSTM, num_layers=2, bias=False),
    "lstm_projection": lambda: Recurrent(nn.LSTM, proj_size=3, batch_first=True),
    "gru_2_layers": lambda: Recurrent(nn.GRU, num_layers=2, batch_first=True),
    "gru_bidirectional": lambda: Recurrent(nn.GRU, bidirectional=True, batch_first=True),
    "rnn_tanh": lambda: Recurrent(nn.RNN, batch_first=True),
    "rnn_relu_bidirectional": lambda: Recurrent(nn.RNN, nonlinearity="relu",
                                                bidirectional=True, batch_first=True),
}


@pytest.mark.parametrize("name", list(ATTENTION_AND_RNN))
def test_attention_and_recurrent_layers_train_and_infer(name):
    body = ATTENTION_AND_RNN[name]()
    width = 6 if "rnn" in name or "lstm" in name or "gru" in name else 8
    x = torch.randn(3, 4, width)
    check_inference(copy.deepcopy(body), x)
    out_shape = body(x).shape
    check_training(body, x, torch.randn(out_shape))


def test_attention_is_costed_as_matmuls():
    model = poptorchsim.inferenceModel(SelfAttention(causal=True), quiet_options())
    model(torch.randn(2, 4, 8))
    classes = {op.cost_class for op in model.getIR().graphs["inference_forward"].ops}
    assert {"matmul", "softmax"} <= classes


def fused_layers(graph):
    return [op for op in graph.ops if op.cost_class == "rnn"]


def test_lstm_runs_fused_layers_as_eager_does():
    """An LSTM is traced as eager PyTorch runs it on the CPU: one oneDNN layer
    per layer and direction, and one fused backward each (not a trace of
    every time step), costed as the IPU's fused LSTM."""
    lstm = Recurrent(nn.LSTM, num_layers=2, bidirectional=True, batch_first=True)
    model = WithLoss(lstm)
    sim = poptorchsim.trainingModel(model, quiet_options(),
                                    torch.optim.SGD(model.parameters(), lr=0.1))
    sim(torch.randn(3, 4, 6), torch.randn(3, 4, 10))
    graph = sim.getIR().graphs["training_step"]
    names = [str(op.target) for op in fused_layers(graph)]
    assert names.count("aten.mkldnn_rnn_layer.default") == 4
    assert names.count("aten.mkldnn_rnn_layer_backward.default") == 4
    assert len(graph.ops) < 120


def rnn_cycles(steps):
    model = poptorchsim.inferenceModel(Recurrent(nn.LSTM, batch_first=True), quiet_options())
    model(torch.randn(2, steps, 6))
    report = model._compiled
    graph = report.program.graphs["inference_forward"]
    costs = report.costs["inference_forward"]
    fused = [c.total for op, c in zip(graph.ops, costs) if op.cost_class == "rnn"]
    workspace = fused_layers(graph)[0].outputs[3]
    return sum(fused), workspace


def test_lstm_cost_follows_the_time_steps():
    """The time steps of a fused LSTM run one after another: four times the
    sequence costs about four times the cycles, and the state kept for the
    backward (gates and cell state of every step) grows with it."""
    short, ws_short = rnn_cycles(4)
    long, ws_long = rnn_cycles(16)
    assert 3.0 < long / short < 4.5
    assert ws_short.nbytes == 4 * 2 * (4 * 5 + 5) * 4
    assert ws_long.nbytes == 4 * ws_short.nbytes


def test_backward_kernels_are_eagers():
    """The captured backward takes the kernels ``loss.backward()`` takes
    (grad mode off): fused backward ops, not their differentiable formulas."""
    body = nn.Sequential(nn.Linear(6, 8), nn.SiLU(), nn.GroupNorm(2, 8))
    model = WithLoss(body)
    sim = poptorchsim.trainingModel(model, quiet_options(),
                                    torch.optim.SGD(model.parameters(), lr=0.1))
    sim(torch.randn(3, 6), torch.randn(3, 8))
    names = {op.target.overloadpacket.__name__
             for op in sim.getIR().graphs["training_step"].ops}
    assert "silu_backward" in names
    assert "native_group_norm_backward" in names


def test_lstm_packed_sequence_says_how_to_fix():
    class Packed(nn.Module):
        def __init__(self):
            super().__init__()
            self.lstm = nn.LSTM(6, 5, batch_first=True)

        def forward(self, x):
            packed = nn.utils.rnn.pack_padded_sequence(x, [4, 3, 2], batch_first=True)
            out, _ = self.lstm(packed)
            return nn.utils.rnn.pad_packed_sequence(out, batch_first=True)[0]

    with pytest.raises(poptorchsim.Error, match="PackedSequence.*padded tensor"):
        poptorchsim.inferenceModel(Packed(), quiet_options())(torch.randn(3, 4, 6))


# -- tensor constants, views, in-place ----------------------------------------------
class ConstantAttribute(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.offset = torch.randn(4)          # a plain attribute, not a buffer

    def forward(self, x):
        return self.fc(x) + self.offset


CLOSURE = torch.randn(4)


class ConstantClosure(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        return self.fc(x) * CLOSURE + torch.tensor([1.0, 2.0, 3.0, 4.0])


class InPlaceOnViews(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        h = self.fc(x)
        h[:, 0] += 1
        h[:, 1:3].clamp_(min=0)
        return h


class ChannelsLastNorms(nn.Module):
    """LayerNorm on channels, Conv2d, GroupNorm, flatten (strides differ
    between the trace's meta kernels and the real ones)."""

    def __init__(self):
        super().__init__()
        self.ln = nn.LayerNorm(4)
        self.conv = nn.Conv2d(4, 8, 3)
        self.gn = nn.GroupNorm(2, 8)

    def forward(self, x):
        h = self.ln(x.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)
        return self.gn(self.conv(h)).flatten(1)


class CopyInto(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        out = torch.empty(x.shape[0], 4)
        out.copy_(self.fc(x) * 2)
        return out


ROWS = {
    "constant_attribute": (ConstantAttribute, (2, 4)),
    "constant_closure": (ConstantClosure, (2, 4)),
    "inplace_on_views": (InPlaceOnViews, (2, 4)),
    "layernorm_conv_groupnorm_flatten": (ChannelsLastNorms, (2, 4, 6, 6)),
    "copy_into_new_tensor": (CopyInto, (2, 4)),
}


@pytest.mark.parametrize("name", list(ROWS))
def test_capture_rows_train_and_infer(name):
    cls, shape = ROWS[name]
    body = cls()
    x = torch.randn(shape)
    check_inference(copy.deepcopy(body), x)
    check_training(body, x, torch.randn(body(x).shape))


def test_constants_are_always_live_graph_constants():
    model = poptorchsim.inferenceModel(ConstantAttribute(), quiet_options())
    model(torch.randn(2, 4))
    graph = model.getIR().graphs["inference_forward"]
    consts = [t for t in graph.tensors if t.role == "const"]
    assert any(t.shape == (4,) for t in consts)
    by_tensor = model.memoryReport().by_tensor
    assert sum(int(v.sum()) for k, v in by_tensor.items()
               if k.startswith("inference_forward/")) >= 16


def test_one_input_linear():
    lin = nn.Linear(1, 1)
    check_inference(lin, torch.zeros(1))


def test_zero_dim_input():
    class Scale(nn.Module):
        def forward(self, x, a):
            return x * a

    got = check_inference(Scale(), torch.ones(2), torch.tensor(3.0))
    assert got.tolist() == [3.0, 3.0]


class OutArgument(nn.Module):
    def __init__(self, use_out=True):
        super().__init__()
        self.w = nn.Parameter(torch.randn(4, 4))
        self.use_out = use_out

    def forward(self, x):
        if not self.use_out:
            return torch.matmul(x, self.w)
        c = torch.empty(x.shape[0], 4)
        torch.matmul(x, self.w, out=c)
        return c


def test_out_argument():
    check_inference(OutArgument(), torch.randn(2, 4))
    # eager PyTorch refuses out= on a tensor that needs a gradient; on the IPU
    # the program is traced, so training works and equals the plain form
    with pytest.raises(RuntimeError, match="out="):
        OutArgument()(torch.randn(2, 4))
    body = OutArgument()
    plain = OutArgument(use_out=False)
    plain.load_state_dict(body.state_dict())
    x, target = torch.randn(2, 4), torch.randn(2, 4)
    model = WithLoss(body)
    sim = poptorchsim.trainingModel(model, quiet_options(),
                                    torch.optim.SGD(model.parameters(), lr=0.05))
    ref = WithLoss(plain)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05)
    for _ in range(2):
        _, loss = sim(x, target)
        ref_opt.zero_grad()
        ref_loss = ref(x, target)[1]
        ref_loss.backward()
        ref_opt.step()
        torch.testing.assert_close(loss, ref_loss.detach())
    assert_state_close(model, ref)


# -- inputs ------------------------------------------------------------------------------
class AddOne(nn.Module):
    def forward(self, x):
        x += 1
        return x * 2


def test_input_mutation_written_back():
    x = torch.zeros(4, 3)
    out = poptorchsim.inferenceModel(AddOne(), quiet_options())(x)
    assert torch.equal(x, torch.ones(4, 3))
    assert torch.equal(out, torch.full((4, 3), 2.0))


def test_input_mutation_written_back_per_micro_batch():
    opts = quiet_options().deviceIterations(2)
    x = torch.arange(8.0).reshape(4, 2)
    poptorchsim.inferenceModel(AddOne(), opts)(x)
    assert torch.equal(x, torch.arange(8.0).reshape(4, 2) + 1)


def test_input_mutation_written_back_in_training():
    class Mutating(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(3, 3)

        def forward(self, x, target):
            x.mul_(2)
            out = self.fc(x)
            return out, F.mse_loss(out, target)

    model = Mutating()
    x, y = torch.ones(2, 3), torch.randn(2, 3)
    poptorchsim.trainingModel(model, quiet_options(),
                              torch.optim.SGD(model.parameters(), lr=0.1))(x, y)
    assert torch.equal(x, torch.full((2, 3), 2.0))


class DictInputs(nn.Module):
    def forward(self, a, b, scale=None):
        return (a["p"] - a["q"]) * b + (0 if scale is None else scale)


def test_dict_and_keyword_inputs_in_any_order():
    model = poptorchsim.inferenceModel(DictInputs(), quiet_options())
    p, q, b = torch.randn(2, 3), torch.randn(2, 3), torch.randn(2, 3)
    first = model({"p": p, "q": q}, b=b)
    second = model(b=b, a={"q": q, "p": p})
    torch.testing.assert_close(first, (p - q) * b)
    torch.testing.assert_close(second, first)


def test_dict_inputs_with_other_keys_name_the_inputs():
    model = poptorchsim.inferenceModel(DictInputs(), quiet_options())
    b = torch.randn(2, 3)
    model({"p": b, "q": b}, b=b)
    # PopTorch's text: the input and the keys
    with pytest.raises(poptorchsim.Error,
                       match="Keys mismatch for a: Unexpected arguments: r. Missing arguments: q."):
        model({"p": b, "r": b}, b=b)
    with pytest.raises(poptorchsim.Error, match="Keys mismatch for a: Missing arguments: q."):
        model({"p": b}, b=b)


def test_dict_subclass_inputs_and_outputs_need_no_parser():
    # PopTorch's inputs_test.py: OrderedDict subclasses are dicts (they were
    # compiled in as constants, and returned holding traced tensors)
    class Arg(collections.OrderedDict):
        pass

    class Out(collections.OrderedDict):
        pass

    class Net(nn.Module):
        def forward(self, args):
            out = Out()
            out["sum"] = args["a"] * 2 + args["b"]
            return out

    model = poptorchsim.inferenceModel(Net(), quiet_options())
    for _ in range(2):
        args = Arg(b=torch.randn(2, 2), a=torch.randn(2, 2))
        out = model(args)
        assert isinstance(out, Out)
        torch.testing.assert_close(out["sum"], Net()(args)["sum"])


def test_none_for_a_compiled_tensor_input_is_a_type_mismatch():
    class Net(nn.Module):
        def forward(self, a, z=None):
            return a if z is None else a + z

    model = poptorchsim.inferenceModel(Net(), quiet_options())
    model(torch.ones(2), z=torch.ones(2))
    with pytest.raises(poptorchsim.Error,
                       match="Type mismatch for z: expected .*Tensor.* but got .*None"):
        model(torch.ones(2))


def test_named_arguments_positional_count_and_constants_are_checked_as_popTorch_does():
    """``**kwargs`` entries missing or added ("Keys mismatch for named
    arguments"), a different number of positional arguments (``*args``
    counted as given), and a non-tensor argument with another value than
    the one compiled in: each refused with PopTorch's text, the model
    unchanged (the compiled call still runs)."""
    class Net(nn.Module):
        def forward(self, a, *rest, u=3, **named):
            out = a * u
            for t in list(rest) + list(named.values()):
                out = out + t
            return out

    model = poptorchsim.inferenceModel(Net(), quiet_options())
    x = torch.ones(2)
    expected = model(x, x, u=5, m=x)
    with pytest.raises(poptorchsim.Error, match="Keys mismatch for named arguments: "
                                                "Missing arguments: m."):
        model(x, x, u=5)
    with pytest.raises(poptorchsim.Error, match="Keys mismatch for named arguments: "
                                                "Unexpected arguments: q."):
        model(x, x, u=5, m=x, q=x)
    with pytest.raises(poptorchsim.Error, match="Number of positional arguments mismatch: "
                                                "expected 2 arguments but got 3."):
        model(x, x, x, u=5, m=x)
    with pytest.raises(poptorchsim.Error, match="Value mismatch for u: expected 5 but got 3."):
        model(x, x, u=3, m=x)
    torch.testing.assert_close(model(x, x, u=5, m=x), expected)


def test_none_scalar_and_nested_outputs():
    class Nested(nn.Module):
        def forward(self, x, scale=2.0, extra=None):
            y = x * scale
            return {"y": y, "pair": (y + 1, [y - 1])}

    x = torch.randn(2, 3)
    got = poptorchsim.inferenceModel(Nested(), quiet_options())(x, 3.0)
    torch.testing.assert_close(got["y"], x * 3)
    torch.testing.assert_close(got["pair"][1][0], x * 3 - 1)


def test_one_hot_with_class_count_trains():
    class OneHot(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 10)

        def forward(self, x, y):
            out = self.fc(x)
            return out, F.mse_loss(out, F.one_hot(y, 10).float())

    model = OneHot()
    ref = copy.deepcopy(model)
    x, y = torch.randn(3, 4), torch.tensor([1, 3, 9])
    sim = poptorchsim.trainingModel(model, quiet_options(),
                                    torch.optim.SGD(model.parameters(), lr=0.1))
    sim(x, y)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    ref(x, y)[1].backward()
    ref_opt.step()
    assert_state_close(model, ref)


def test_one_hot_without_class_count_says_how_to_fix():
    class OneHot(nn.Module):
        def forward(self, y):
            return F.one_hot(y)

    with pytest.raises(poptorchsim.DataDependentError,
                       match="^OneHot num classes must be specified and must be constant. "
                             ".*num_classes=N"):
        poptorchsim.inferenceModel(OneHot(), quiet_options())(torch.tensor([1, 2]))


def test_slice_bounds_from_constant_tensors_are_compiled_in():
    # PopTorch's slice_test.py (twice sliced): bounds held in closure tensors
    # are known at compile time; only values computed from inputs are refused.
    start_row, start_col = torch.tensor([1]), torch.tensor([0])

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(8, 8)

        def forward(self, t, y=None):
            out = self.lin(t)[start_row:start_row + 2:2, start_col:start_col + 4:2]
            return out if y is None else (out, F.mse_loss(out, y))

    t = torch.randn(4, 8)
    model = Net()
    torch.testing.assert_close(poptorchsim.inferenceModel(model, quiet_options())(t), model(t))
    out, _ = poptorchsim.trainingModel(model, quiet_options(),
                                       torch.optim.SGD(model.parameters(), lr=0.1))(
        t, torch.zeros(1, 2))
    assert out.shape == (1, 2)

    class FromInput(nn.Module):
        def forward(self, t, start):
            return t[start:start + 2]

    with pytest.raises(poptorchsim.DataDependentError):
        poptorchsim.inferenceModel(FromInput(), quiet_options())(t, torch.tensor([1]))


def test_mixed_half_and_float_follows_type_promotion():
    class Mixed(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4).half()

        def forward(self, x):
            return self.fc(x.half()) + x           # half + float -> float

    model = Mixed()
    x = torch.randn(2, 4)
    got = poptorchsim.inferenceModel(copy.deepcopy(model), quiet_options())(x)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, model(x), rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("conv", [False, True])
def test_layer_weights_follow_their_input_dtype_as_in_poptorch(conv):
    """PyTorch rejects an fp32 input to an fp16 layer (and the reverse) on the
    CPU; PopTorch casts the layer's weight and bias to the input's type
    (its castWeightAndBias; PopTorch's half_float_test)."""
    torch.manual_seed(0)
    layer = nn.Conv1d(4, 5, 2) if conv else nn.Linear(4, 5)
    x = torch.randn(2, 4, 6) if conv else torch.randn(2, 4)
    for model_dtype, input_dtype in [(torch.half, torch.float), (torch.float, torch.half)]:
        model = copy.deepcopy(layer).to(model_dtype)
        with pytest.raises(RuntimeError):
            model(x.to(input_dtype))                          # eager PyTorch
        got = poptorchsim.inferenceModel(model, quiet_options())(x.to(input_dtype))
        assert got.dtype == input_dtype
        expected = copy.deepcopy(model).to(input_dtype)(x.to(input_dtype))
        torch.testing.assert_close(got, expected)


def test_fp32_master_weights_train_an_fp16_model():
    """PopTorch's test_master_weight_training: float32 weights, fp16 inputs;
    the gradient flows back through the cast into the float32 weights."""
    torch.manual_seed(0)

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = nn.Linear(10, 10)
            self.loss = nn.MSELoss()

        def forward(self, x, target):
            out = self.linear(x)
            return out, self.loss(out, target)

    model = Model()
    tm = poptorchsim.trainingModel(model, quiet_options(),
                                   torch.optim.SGD(model.parameters(), lr=0.1))
    x, target = torch.randn(10).half(), torch.randn(10).half()
    out, first = tm(x, target)
    assert out.dtype == torch.half and model.linear.weight.dtype == torch.float32
    for _ in range(200):
        out, loss = tm(x, target)
    assert float(loss) < 0.01 * float(first)


# -- library paths that read tensor values only to pick a kernel ----------------------
class Seq2Seq(nn.Module):
    """PyTorch's tutorial usage: a generated causal mask, no ``tgt_is_causal``."""

    def __init__(self):
        super().__init__()
        self.transformer = nn.Transformer(16, 2, 1, 1, 32, dropout=0.0, batch_first=True)

    def forward(self, x):
        src, tgt = x[:, :5], x[:, 5:]
        mask = nn.Transformer.generate_square_subsequent_mask(tgt.shape[1])
        return self.transformer(src, tgt, tgt_mask=mask)


def test_transformer_with_a_generated_causal_mask():
    body = Seq2Seq()
    x = torch.randn(2, 9, 16)
    check_inference(copy.deepcopy(body), x)
    check_training(body, x, torch.randn(2, 4, 16))


def test_hugging_face_bert_with_a_padding_mask():
    transformers = pytest.importorskip("transformers")
    config = transformers.BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=1,
                                     num_attention_heads=2, intermediate_size=64)
    torch.manual_seed(0)
    bert = transformers.BertModel(config).eval()

    class Encoder(nn.Module):
        def __init__(self):
            super().__init__()
            self.bert = bert

        def forward(self, ids, mask):
            return self.bert(input_ids=ids, attention_mask=mask).last_hidden_state

    ids = torch.randint(0, 100, (2, 8))
    mask = torch.ones(2, 8, dtype=torch.long)
    mask[1, 5:] = 0                          # the second sequence is padded
    check_inference(Encoder(), ids, mask)


def test_ipu_device_and_distributions_inside_forward():
    """PopTorch programs create tensors on ``device="ipu"`` while traced
    (``poptorch._impl.isDispatchTracing()``) and sample torch.distributions,
    whose argument validation PopTorch switches off."""
    class Model(nn.Module):
        def forward(self, x):
            device = "ipu" if poptorchsim._impl.isDispatchTracing() else None
            ones = torch.ones((2, 3), dtype=x.dtype, device=device)
            noise = torch.distributions.Normal(x, 1.0).sample((2,))
            return ones + x, noise

    x = torch.tensor([1.0, 2.0, 3.0])
    assert not poptorchsim._impl.isDispatchTracing()
    out, noise = poptorchsim.inferenceModel(Model(), quiet_options())(x)
    torch.testing.assert_close(out, torch.ones(2, 3) + x)
    assert noise.shape == (2, 3) and noise.device.type == "cpu"
    assert torch.distributions.Distribution._validate_args     # restored


# -- tensors held as plain attributes: constants, traced once ----------------------

class _Counter(nn.Module):
    """PopTorch's user guide (``buffers.py``): a plain tensor attribute
    changed in forward() is a constant of the program."""

    def __init__(self, as_buffer=False):
        super().__init__()
        if as_buffer:
            self.register_buffer("i", torch.tensor([0.0]))
        else:
            self.i = torch.tensor([0.0])

    def forward(self):
        self.i += 1
        return self.i


def test_a_plain_tensor_attribute_is_a_constant_traced_once():
    model = _Counter()
    pm = poptorchsim.inferenceModel(model, quiet_options())
    assert torch.equal(pm(), torch.tensor([1.0]))
    assert torch.equal(pm(), torch.tensor([1.0]))          # each run starts from 0
    assert torch.equal(model.i, torch.tensor([1.0]))        # the trace ran forward() once


def test_a_buffer_keeps_its_value_from_run_to_run():
    model = _Counter(as_buffer=True)
    pm = poptorchsim.inferenceModel(model, quiet_options())
    assert torch.equal(pm(), torch.tensor([1.0]))
    assert torch.equal(pm(), torch.tensor([2.0]))
    pm.copyWeightsToHost()
    assert torch.equal(model.i, torch.tensor([2.0]))


class _Doubler(nn.Module):
    def __init__(self):
        super().__init__()
        self.k = torch.tensor([1.0, 2.0])

    def forward(self, x):
        held = self.k           # the same tensor: it sees the update below
        self.k.mul_(2)
        return x + held + self.k


def test_reads_of_a_constant_after_its_in_place_update_see_the_new_value():
    x = torch.tensor([10.0, 20.0])
    eager = _Doubler()(x)                       # 10 + 2 + 2, 20 + 4 + 4
    model = _Doubler()
    pm = poptorchsim.inferenceModel(model, quiet_options())
    assert torch.equal(pm(x), eager) and torch.equal(pm(x), eager)
    assert torch.equal(model.k, torch.tensor([2.0, 4.0]))
