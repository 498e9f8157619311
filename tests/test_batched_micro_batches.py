"""The micro-batches of one weight update run as one batched call where the
training step allows it, with the serial order's results (within fp32
rounding); programs that need the serial order keep it."""
import pytest
import torch
from torch import nn

import poptorchsim as poptorch
from poptorchsim.machine.codegen import serial_reason
from conftest import quiet_options

DI, GA, RF, MICRO = 2, 3, 2, 4


class Net(nn.Module):
    def __init__(self, extra=None):
        super().__init__()
        self.a, self.b = nn.Linear(12, 16), nn.Linear(16, 5)
        self.extra = extra or nn.Identity()
        self.loss = nn.CrossEntropyLoss()

    def forward(self, x, y):
        out = self.b(self.extra(torch.relu(self.a(x))))
        return out, self.loss(out, y)


def _train(batched, extra=None, calls=2, configure=None, dtype=torch.float32):
    torch.manual_seed(0)
    net = Net(extra).to(dtype)
    opts = quiet_options().deviceIterations(DI).replicationFactor(RF)
    opts.Training.gradientAccumulation(GA)
    opts.outputMode(poptorch.OutputMode.All)
    if configure:
        configure(opts)
    tm = poptorch.trainingModel(net, opts, torch.optim.SGD(net.parameters(), lr=0.1,
                                                           momentum=0.9))
    n = DI * GA * RF * MICRO
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(n, 12, generator=g).to(dtype), torch.randint(0, 5, (n,), generator=g)
    tm.compile(x, y)
    if not batched:
        tm._engine.batch_fn = None
    calls_made = []
    if tm._engine.batch_fn is not None:
        fn = tm._engine.batch_fn
        tm._engine.batch_fn = lambda *a: calls_made.append(len(a[1][0])) or fn(*a)
    outs = [tm(x, y) for _ in range(calls)]
    return tm, outs, [p.detach().clone() for p in net.parameters()], calls_made


def test_batched_equals_serial_within_fp32_rounding():
    _, serial_outs, serial_weights, none = _train(False)
    tm, outs, weights, calls = _train(True)
    assert none == [] and calls == [GA * RF] * (DI * 2)      # one call per weight update
    for a, b in zip(serial_outs, outs):
        for p, q in zip(a, b):
            assert p.shape == q.shape
            torch.testing.assert_close(q, p, rtol=1e-6, atol=1e-6)
    for p, q in zip(serial_weights, weights):
        torch.testing.assert_close(q, p, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("extra, configure, dtype, reason", [
    (nn.Dropout(0.5), None, torch.float32, "random"),
    (nn.BatchNorm1d(16), None, torch.float32, "buffers the step writes"),
    (None, None, torch.float16, "fp16"),
])
def test_programs_that_need_the_serial_order_keep_it(extra, configure, dtype, reason):
    tm, _, _, calls = _train(True, extra, calls=1, configure=configure, dtype=dtype)
    step = tm.getIR().graphs["training_step"]
    assert reason in serial_reason(step)
    assert tm._engine.batch_fn is None and calls == []


def test_anchored_steps_run_serially():
    tm, _, _, calls = _train(True, calls=1, configure=lambda o: o.anchorTensor(
        "grad_a", "Gradient___a.weight"))
    assert tm._engine.batch_fn is None and calls == []


def test_a_step_vmap_cannot_batch_falls_back_to_serial():
    _, serial_outs, serial_weights, _ = _train(False, calls=1)
    torch.manual_seed(0)
    tm, _, _, _ = _train(True, calls=0)

    def refuse(*args):
        raise RuntimeError("vmap: no batching rule")
    tm._engine.batch_fn = refuse
    n = DI * GA * RF * MICRO
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(n, 12, generator=g), torch.randint(0, 5, (n,), generator=g)
    out = tm(x, y)
    assert tm._engine.batch_fn is None
    for p, q in zip(serial_outs[0], out):
        torch.testing.assert_close(q, p, rtol=0, atol=0)
