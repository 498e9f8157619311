"""Wide values: with stochastic rounding, fp16 results of ops computed in
fp32 stay in fp32 (their fp16 values exactly) for the next ops that
compute in fp32 anyway, and the numerics do not change by a bit."""
import pytest
import torch
from conftest import quiet_options
from torch import nn

import poptorchsim as poptorch
from poptorchsim.machine import codegen, precision, rounding
from poptorchsim.machine.streams import POOL, Window, Windows, draw_pool

aten = torch.ops.aten


def _values(n):
    """Normal, fp16-subnormal, fp32-subnormal, huge, infinite, NaN and signed
    zero values, and values around fp16's overflow."""
    g = torch.Generator().manual_seed(0)
    parts = [torch.randn(n, generator=g) * torch.logspace(-12, 6, n),
             torch.rand(n, generator=g) * 2.0 ** -14 * torch.sign(torch.randn(n, generator=g)),
             torch.tensor([0.0, -0.0, float("inf"), -float("inf"), float("nan"), 65504.0,
                           65519.0, 65520.0, -65535.0, 65536.0, 1e-45, -1e-40, 2.0 ** -24,
                           3.0 * 2.0 ** -25, 1e30])]
    return torch.cat(parts)


@pytest.mark.parametrize("numba", ["1", "0"])
def test_a_wide_rounding_is_the_fp16_rounding_widened(monkeypatch, numba):
    """The compiled kernel's fp32 results (and the PyTorch form's) are the
    fp16 results' ``.float()`` bit for bit, in one window and in rows."""
    monkeypatch.setenv("POPTORCHSIM_NUMBA", numba)
    x = _values(1 << 14)
    pool = draw_pool(3)
    for bits in (Window(pool, POOL - 100), Windows(pool, [5, POOL - 7, 12345], x.numel() // 3)):
        x_ = x[:x.numel() // 3 * 3] if isinstance(bits, Windows) else x
        half = rounding.stochastic_round(x_, bits)
        wide = rounding.stochastic_round(x_, bits, wide=True)
        assert half.dtype == torch.float16 and wide.dtype == torch.float32
        assert torch.equal(wide.view(torch.int32), half.float().view(torch.int32))


class Block(nn.Module):
    """Layer norm, a tanh GELU, dropout, a softmax computed in fp32 from fp16
    and a pad: ops that round stochastically, views, ops that only move
    values, ops with an fp32 result and random ops, fed by each other."""

    def __init__(self):
        super().__init__()
        self.norm, self.up, self.down = nn.LayerNorm(16), nn.Linear(16, 32), nn.Linear(32, 16)
        self.drop, self.head = nn.Dropout(0.2), nn.Linear(18, 5)
        self.loss = nn.CrossEntropyLoss()

    def forward(self, x, y):
        h = self.drop(nn.functional.gelu(self.up(self.norm(x)), approximate="tanh"))
        h = x + self.down(h)
        h = h * torch.softmax(h, -1, dtype=torch.float32).half()   # fp16 in, fp32 out
        h = nn.functional.pad(h, (1, 1), value=0.1)          # 0.1: not an fp16 value
        out = self.head(torch.relu(h).reshape(h.shape[0], -1))
        return out, self.loss(out.float(), y)


def _train(wide, batched):
    torch.manual_seed(0)
    net = Block().half()
    opts = quiet_options().replicationFactor(2)
    opts.Training.gradientAccumulation(3)
    opts.Precision.enableStochasticRounding(True)
    opts.outputMode(poptorch.OutputMode.All)
    tm = poptorch.trainingModel(net, opts, poptorch.optim.SGD(net.parameters(), lr=0.05,
                                                               loss_scaling=64.0))
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(24, 16, generator=g).half(), torch.randint(0, 5, (24,), generator=g)
    takes_wide = codegen.takes_wide
    codegen.takes_wide = takes_wide if wide else (lambda op: False)
    try:
        tm.compile(x, y)
    finally:
        codegen.takes_wide = takes_wide
    if not batched:
        tm._engine.batch_fn = None
    assert (tm._engine.batch_fn is not None) == batched
    outs = [tm(x, y) for _ in range(2)]
    tm.copyWeightsToHost()
    return tm, outs, [p.detach().clone() for p in net.parameters()]


@pytest.mark.parametrize("batched", [True, False])
def test_wide_values_change_no_bit(monkeypatch, batched):
    """The same program with and without wide values: the same outputs,
    weights and gradient-watch counts, bit for bit, micro-batches batched
    or serial (the serial order also writes results into operands)."""
    made = []
    round_ = rounding.Rounding.round

    def recorded(self, x, stream=0, wide=False):
        made.append(wide)
        return round_(self, x, stream, wide)
    monkeypatch.setattr(rounding.Rounding, "round", recorded)
    tm, outs, weights = _train(True, batched)
    assert any(made) and not all(made)      # wide results, and fp16 ones (the weights' update)
    step_source = tm._compiled.step_fn.source
    assert "_narrow(" in step_source        # the random ops and the outputs take fp16
    made.clear()
    tm2, outs2, weights2 = _train(False, batched)
    assert not any(made)
    for a, b in zip(outs, outs2):
        for p, q in zip(a, b):
            assert p.dtype == q.dtype and torch.equal(p, q)
    for p, q in zip(weights, weights2):
        assert p.dtype == torch.float16 and torch.equal(p, q)
    assert tm._compiled.watch.per_op == tm2._compiled.watch.per_op
    assert tm._compiled.watch.values > 0


def _op(target, args, out_dtypes, cost_class="elementwise", inplace=False):
    """An IR op of ``target`` on fp16 tensors (for ``takes_wide``)."""
    from poptorchsim.ir.graph import Op, Tensor
    ins = [Tensor(id=k, name=f"t{k}", shape=(4,), dtype=torch.float16) if a == "t" else a
           for k, a in enumerate(args)]
    outs = [Tensor(id=100 + k, name=f"o{k}", shape=(4,), dtype=d)
            for k, d in enumerate(out_dtypes)]
    return Op(id=1, name="op", target=target, args=tuple(ins), kwargs={}, outputs=outs,
              cost_class=cost_class, inplace=inplace)


def test_which_ops_take_wide_values():
    """Ops computed in fp32 with an fp16 result, views and value-moving ops
    do (a cast to fp32 too); a pad with a scalar fp16 does not hold, a view
    reading bytes as another dtype, an op computing an fp32 result from fp16
    (softmax's ``half_to_float``), random and in-place ops do not."""
    half, f32 = torch.float16, torch.float32
    assert precision.takes_wide(_op(aten.mul.Tensor, ["t", "t"], [half]))
    assert precision.takes_wide(_op(aten.view.default, ["t", [2, 2]], [half], "view"))
    assert precision.takes_wide(_op(aten.constant_pad_nd.default, ["t", [1, 1], 0.5], [half],
                                    "copy"))
    assert not precision.takes_wide(_op(aten.constant_pad_nd.default, ["t", [1, 1], 0.1],
                                        [half], "copy"))
    assert not precision.takes_wide(_op(aten.view.dtype, ["t", torch.int16], [torch.int16],
                                        "view"))
    assert precision.takes_wide(_op(aten._to_copy.default, ["t"], [f32], "copy"))
    assert not precision.takes_wide(_op(aten._softmax.default, ["t", 0, True], [f32]))
    assert not precision.takes_wide(_op(aten.mul_.Tensor, ["t", "t"], [half], inplace=True))
    assert not precision.takes_wide(_op(aten.bernoulli.p, ["t", 0.5], [half], "random"))


def test_fp16_statistics_round_as_the_ir_says():
    """In the step (traced with its run-time dtypes) an fp16 layer norm's mean
    and inverse standard deviation are fp16, as the IR (and PopART's group
    norm) has them; where the graph was traced dtype-blind (the optimizer
    update) the kernel's own dtypes (on meta tensors) decide."""
    from poptorchsim.machine.streams import Streams
    x = torch.randn(4, 8).half()
    w, b = torch.ones(8).half(), torch.zeros(8).half()
    streams = Streams(seed=1)
    rounds = precision.Rounding(streams)
    ln = aten.native_layer_norm.default
    traced = [torch.float16] * 3
    from_ir = rounding.with_stochastic_rounding(ln, traced, rounds, traced=True)(x, [8], w, b,
                                                                                 1e-5)
    from_meta = rounding.with_stochastic_rounding(ln, traced, rounds)(x, [8], w, b, 1e-5)
    assert [t.dtype for t in from_ir] == traced
    assert [t.dtype for t in from_meta] == [torch.float16, torch.float32, torch.float32]
