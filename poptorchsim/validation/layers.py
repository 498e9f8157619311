"""Poplar's benchmark layers rebuilt as one-layer PopTorch programs.

Each row of ``poplar_layers.json`` names a poplibs tool and its command line
(``tests/CMakeLists.txt`` at poplibs 8dcde1ec).  ``build`` turns it into a
module, its inputs and the ops that belong to the layer, with the tool's
defaults (docs/poplar_tools.md): half data and float partials, no bias;
convolutions and fully-connected layers train (forward, input gradient,
weight update by plain SGD with learning rate 1); gemm and reductions run
forward only; pooling runs forward and input gradient; LSTM and GRU run
forward, and their ``--phase all`` rows also the backward pass without a
weight update, each as popnn's cell (a GRU resetting before its candidate
product, an LSTM without precomputed input products), not as ``nn.GRU`` or
``nn.LSTM``; embeddings gather rows and scatter-add gradients into them.

The input gradient is asked for the way a model in front of the layer
would ask for it: the input is multiplied by a one-element parameter first.
That product, the loss and its seed are the harness's, not the layer's;
``measure.layer_cycles`` leaves them out.
"""
import re
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


def parse_params(text):
    """A tool's command line as {option: value} (``--a b`` and ``--a=b``;
    braces kept, see ``shape``)."""
    out, tokens = {}, text.split()
    i = 0
    while i < len(tokens):
        tok = tokens[i]
        if not tok.startswith("--"):
            i += 1
            continue
        if "=" in tok:
            key, value = tok[2:].split("=", 1)
        elif i + 1 < len(tokens) and not tokens[i + 1].startswith("--"):
            key, value = tok[2:], tokens[i + 1]
            i += 1
        else:
            key, value = tok[2:], ""
        out[key] = value
        i += 1
    return out


def shape(value, dims=2):
    """A poplibs ShapeOption: ``{a,b}`` per dimension, or one number for all."""
    nums = [int(v) for v in re.findall(r"-?\d+", value)]
    return nums if len(nums) > 1 else nums * dims


def names(values):
    return [v.strip() for v in value_list(values)]


def value_list(value):
    return value.strip("{}").split(",") if value else []


@dataclass
class Layer:
    """One reference row as a PopTorch program."""
    name: str
    kind: str
    module: nn.Module
    inputs: tuple
    training: bool
    note: str = ""


class _InputGrad(nn.Module):
    """``layer(x * s)`` with ``s`` a one-element parameter: the layer's input
    gradient is then computed, as Poplar's bwd pass computes it."""

    def __init__(self, layer):
        super().__init__()
        self.s = nn.Parameter(torch.ones(()))
        self.layer = layer

    def forward(self, x):
        from .. import identity_loss
        y = self.layer(x * self.s)
        if isinstance(y, tuple):
            y = y[0]
        return identity_loss(y, reduction="sum")


class _PadConv(nn.Module):
    """A convolution padded on the low side only (``--padding-lower``)."""

    def __init__(self, pad, conv):
        super().__init__()
        self.pad, self.conv = pad, conv

    def forward(self, x):
        return self.conv(F.pad(x, self.pad))


class _MaxPool(nn.Module):
    def __init__(self, kernel, stride, padding):
        super().__init__()
        self.kernel, self.stride, self.padding = kernel, stride, padding

    def forward(self, x):
        return F.max_pool2d(x, self.kernel, self.stride, self.padding)


class _Gemm(nn.Module):
    def forward(self, a, b, c):
        return c + a @ b


class _Reduce(nn.Module):
    def __init__(self, op, dims):
        super().__init__()
        self.op, self.dims = op, dims

    def forward(self, x):
        if self.op == "MAX":
            return x.amax(dim=self.dims)
        if self.op == "SQUARE_ADD":
            return (x * x).sum(dim=self.dims)
        return x.sum(dim=self.dims)


class _Grouped(nn.Module):
    """``--num-groups`` G: G matmuls [B, I] x [I, O] as one bmm."""

    def __init__(self, groups, i, o):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(groups, i, o))

    def forward(self, x):
        return torch.bmm(x, self.weight)


class _Embedding(nn.Module):
    def __init__(self, rows, width):
        super().__init__()
        self.embedding = nn.Embedding(rows, width)

    def forward(self, idx):
        from .. import identity_loss
        return identity_loss(self.embedding(idx), reduction="sum")


class _GRUResetBefore(nn.Module):
    """popnn's GRU as ``gru_layer`` runs it (``resetAfter`` false, its
    default): per step one product of ``[x, h]`` for the reset and update
    gates, then a second of ``[x, r * h]`` for the candidate.  PyTorch's
    ``nn.GRU`` is the reset-after variant (one product of ``h`` for all three
    gates, the reset applied after it), a different and cheaper cell."""

    def __init__(self, inputs, outputs):
        super().__init__()
        self.gates = nn.Linear(inputs + outputs, 2 * outputs)
        self.candidate = nn.Linear(inputs + outputs, outputs)
        self.outputs = outputs

    def forward(self, x):
        h = x.new_zeros(x.shape[1], self.outputs)
        out = []
        for x_t in x.unbind(0):
            reset, update = torch.sigmoid(self.gates(torch.cat([x_t, h], 1))).chunk(2, 1)
            c = torch.tanh(self.candidate(torch.cat([x_t, reset * h], 1)))
            h = c + update * (h - c)
            out.append(h)
        return torch.stack(out)


class _LSTMCellLoop(nn.Module):
    """popnn's LSTM as ``lstm_layer`` runs it (``preCalcWeights`` false, its
    default): per step one product of ``[x, h]`` for the four gates.
    PyTorch's ``nn.LSTM`` instead multiplies the whole input sequence by the
    input weights first, one large product whose temporary buffers popnn
    never allocates."""

    def __init__(self, inputs, outputs):
        super().__init__()
        self.gates = nn.Linear(inputs + outputs, 4 * outputs)
        self.outputs = outputs

    def forward(self, x):
        h = x.new_zeros(x.shape[1], self.outputs)
        c = h
        out = []
        for x_t in x.unbind(0):
            i, f, g, o = self.gates(torch.cat([x_t, h], 1)).chunk(4, 1)
            c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
            h = torch.sigmoid(o) * torch.tanh(c)
            out.append(h)
        return torch.stack(out)


def _dtype(params, default="half"):
    value = params.get("data-type", params.get("type", default))
    return torch.float32 if value == "float" else torch.float16


def build(row):
    """The ``Layer`` of a reference row (built on the meta device: shapes,
    no weights)."""
    p, kind = parse_params(row["params"]), row["kind"]
    dtype = _dtype(p)
    with torch.device("meta"):
        layer = _BUILDERS[kind](p, dtype)
    layer.name, layer.kind = row["name"], kind
    layer.module = layer.module.to(dtype)
    return layer


def _conv(p, dtype):
    h, w = shape(p["field"])
    kh, kw = shape(p.get("kernel-size", "1"))
    groups = int(p.get("conv-groups", 1))
    cin, cout = groups * int(p["input-channels"]), groups * int(p["output-channels"])
    batch, stride = int(p.get("batch-size", 1)), int(p.get("stride", 1))
    conv = nn.Conv2d(cin, cout, (kh, kw), stride=stride, groups=groups, bias=False)
    if "padding-lower" in p:
        lo = shape(p["padding-lower"])
        hi = shape(p.get("padding-upper", "0"))
        body = _PadConv((lo[1], hi[1], lo[0], hi[0]), conv)
    else:
        conv.padding = tuple(shape(p.get("padding", "0")))
        body = conv
    x = torch.zeros(batch, cin, h, w, dtype=dtype, device="cpu")
    return Layer("", "conv", _InputGrad(body), (x,), True)


def _fc(p, dtype):
    i, o = int(p["input-size"]), int(p["output-size"])
    batch, groups = int(p.get("batch-size", 1)), int(p.get("num-groups", 1))
    if groups > 1:
        body = _Grouped(groups, i, o)
        x = torch.zeros(groups, batch, i, dtype=dtype, device="cpu")
    else:
        body = nn.Linear(i, o, bias=False)
        x = torch.zeros(batch, i, dtype=dtype, device="cpu")
    return Layer("", "fc", _InputGrad(body), (x,), True)


def _gemm(p, dtype):
    m, k, n = int(p["m"]), int(p["k"]), int(p["n"])
    z = lambda *s: torch.zeros(*s, dtype=dtype, device="cpu")   # noqa: E731 - a one-line helper
    return Layer("", "gemm", _Gemm(), (z(m, k), z(k, n), z(m, n)), False)


def _pool(p, dtype):
    h, w = shape(p["field"])
    kernel = shape(p.get("kernel-size", p.get("kernel", "1")))
    stride = int(p.get("stride", 1))
    lo, hi = shape(p.get("padding-lower", "0")), shape(p.get("padding-upper", "0"))
    note = ""
    if lo != hi:
        note = "asymmetric padding rounded to PyTorch's symmetric padding"
    body = _MaxPool(tuple(kernel), stride, tuple(max(a, b) for a, b in zip(lo, hi)))
    x = torch.zeros(int(p.get("batch-size", 1)), int(p["channels"]), h, w, dtype=dtype,
                    device="cpu")
    return Layer("", "pool", _InputGrad(body), (x,), True, note=note)


def _reduce(p, dtype):
    dims = tuple(int(v) for v in value_list(p["dims"]))
    sizes = [int(v) for v in value_list(p["shape"])]
    x = torch.zeros(*sizes, dtype=dtype, device="cpu")
    note = "Poplar ran it on 1024 tiles (--tiles-per-ipu), ours on 1472" \
        if "tiles-per-ipu" in p else ""
    return Layer("", "reduce", _Reduce(p.get("operation", "ADD"), dims), (x,), False, note=note)


def _recurrent(cell, kind):
    """A builder of ``cell`` (popnn's LSTM or GRU cell loop) rows."""
    def make(p, dtype):
        steps, batch = int(p["sequence-size"]), int(p.get("batch-size", 1))
        i, o = int(p["input-size"]), int(p["output-size"])
        body = cell(i, o)
        x = torch.zeros(steps, batch, i, dtype=dtype, device="cpu")
        train = p.get("phase", "fwd") == "all"
        module = _InputGrad(body) if train else body
        return Layer("", kind, module, (x,), train)
    return make


def _embedding(p, dtype):
    rows, width = shape(p["shape"])
    n = int(p["num-indices"])
    idx = torch.zeros(n, dtype=torch.long, device="cpu")
    return Layer("", "embedding", _Embedding(rows, width), (idx,), True)


_BUILDERS = {"conv": _conv, "fc": _fc, "gemm": _gemm, "pool": _pool, "reduce": _reduce,
             "lstm": _recurrent(_LSTMCellLoop, "lstm"), "gru": _recurrent(_GRUResetBefore, "gru"),
             "embedding": _embedding}
