"""The micro-batches of one weight update run as one batched call where the
training step allows it, with the serial order's results (within fp32
rounding); programs that need the serial order keep it."""
import pytest
import torch
from conftest import quiet_options
from torch import nn

import poptorchsim as poptorch
from poptorchsim.machine.batching import serial_reason

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


def _train(batched, extra=None, calls=2, configure=None, dtype=torch.float32,
           optimizer=None):
    torch.manual_seed(0)
    net = Net(extra).to(dtype)
    opts = quiet_options().deviceIterations(DI).replicationFactor(RF)
    opts.Training.gradientAccumulation(GA)
    opts.outputMode(poptorch.OutputMode.All)
    if configure:
        configure(opts)
    make = optimizer or (lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9))
    tm = poptorch.trainingModel(net, opts, make(net.parameters()))
    n = DI * GA * RF * MICRO
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(n, 12, generator=g).to(dtype), torch.randint(0, 5, (n,), generator=g)
    tm.compile(x, y)
    if not batched:
        tm._engine.batch_fn = None
    calls_made = []
    if tm._engine.batch_fn is not None:
        fn = tm._engine.batch_fn

        def counted(*a):
            calls_made.append(len(a[1][0]))
            return fn(*a)
        counted.tail, counted.n_boundary = fn.tail, fn.n_boundary
        counted.wide_outputs = fn.wide_outputs
        tm._engine.batch_fn = counted
    outs = [tm(x, y) for _ in range(calls)]
    return tm, outs, [p.detach().clone() for p in net.parameters()], calls_made


class EvalNorm(nn.BatchNorm1d):
    """Batch norm normalising with its running statistics in training too,
    while still updating them: the step's outputs read its buffers."""

    def forward(self, x):
        out = nn.functional.batch_norm(x, self.running_mean.clone(), self.running_var.clone(),
                                       self.weight, self.bias, False, 0.0, self.eps)
        nn.functional.batch_norm(x.detach(), self.running_mean, self.running_var,
                                 None, None, True, self.momentum, self.eps)
        return out


@pytest.mark.parametrize("extra", [None, "batchnorm"])
def test_batched_equals_serial_within_fp32_rounding(extra):
    """Batch norm's running statistics (and its counter) are updated
    micro-batch by micro-batch in the serial order, per replica."""
    make = (lambda: nn.Sequential(nn.BatchNorm1d(16), nn.ReLU(), nn.BatchNorm1d(16))) \
        if extra else (lambda: None)
    _, serial_outs, serial_weights, none = _train(False, make())
    tm, outs, weights, calls = _train(True, make())
    assert none == [] and calls == [GA * RF] * (DI * 2)      # one call per weight update
    for a, b in zip(serial_outs, outs):
        for p, q in zip(a, b):
            assert p.shape == q.shape
            torch.testing.assert_close(q, p, rtol=1e-6, atol=1e-6)
    for p, q in zip(serial_weights, weights):
        torch.testing.assert_close(q, p, rtol=1e-6, atol=1e-7)
    if extra:
        serial_tm = _train(False, make())[0]
        assert tm._engine.batch_fn.tail is not None
        for r in range(RF):
            assert len(tm._state.buffers[r]) == 6
            for p, q in zip(serial_tm._state.buffers[r], tm._state.buffers[r]):
                torch.testing.assert_close(q, p, rtol=1e-6, atol=1e-7)
        # each replica's statistics are its own micro-batches'
        assert not torch.allclose(tm._state.buffers[0][0], tm._state.buffers[1][0])
        assert int(tm._state.buffers[1][2]) == 2 * DI * GA


@pytest.mark.parametrize("extra, configure, dtype, reason", [
    # dropout drawn from PyTorch's generator, in eager order
    (nn.Dropout(0.5), lambda o: o.randomStreams(poptorch.RandomStreams.Eager), torch.float32,
     "random"),
    (EvalNorm(16), None, torch.float32, "reads its buffers"),
])
def test_programs_that_need_the_serial_order_keep_it(extra, configure, dtype, reason):
    tm, _, _, calls = _train(True, extra, calls=1, configure=configure, dtype=dtype)
    step = tm.getIR().graphs["training_step"]
    assert reason in serial_reason(step)
    assert tm._engine.batch_fn is None and calls == []


def _identical(a, b):
    return all(torch.equal(p, q) for p, q in zip(a, b))


def test_dropout_batches_with_the_serial_order_masks():
    """Each micro-batch draws its dropout mask from its own stream (seed,
    replica, micro-batch, op): batched and serial runs drop the same units,
    so they agree within fp32 rounding, and the masks differ between
    micro-batches and replicas."""
    _, serial_outs, serial_weights, none = _train(False, nn.Dropout(0.5))
    tm, outs, weights, calls = _train(True, nn.Dropout(0.5))
    assert serial_reason(tm.getIR().graphs["training_step"]) is None
    assert none == [] and calls == [GA * RF] * (DI * 2) and tm._engine.batch_fn is not None
    for a, b in zip(serial_outs, outs):
        for p, q in zip(a, b):
            torch.testing.assert_close(q, p, rtol=1e-6, atol=1e-6)
            if p.dtype.is_floating_point and p.dim() > 1:
                # the dropped units are zero alike
                assert torch.equal((p == 0), (q == 0))
    for p, q in zip(serial_weights, weights):
        torch.testing.assert_close(q, p, rtol=1e-6, atol=1e-7)
    # the per-micro-batch outputs: half of the hidden units dropped, and in
    # another pattern in every micro-batch
    logits = outs[0][0].reshape(DI * GA * RF, MICRO, 5)
    assert not torch.equal(logits[0], logits[1])


@pytest.mark.parametrize("accumulators", [None, torch.float16])
def test_fp16_with_dropout_and_stochastic_rounding_batches_bit_for_bit(accumulators):
    """An fp16 program with dropout and stochastic rounding: its micro-batches
    batch, and give the serial order's results bit for bit (every random
    number is keyed by micro-batch and op, not drawn in order).  The call
    the gradient watch counts batches too (the watch counts its first row),
    with the serial order's numbers.  With fp32 gradient accumulators (the
    default for fp16 weights), the batched call returns the fp16 gradients
    it holds in fp32 as they are (wide values), where the serial order
    casts them to fp32; with fp16 ones, as fp16."""
    sr = lambda o: o.Precision.enableStochasticRounding(True)     # noqa: E731 - a one-line helper
    make = None if accumulators is None else (lambda params: poptorch.optim.SGD(
        params, lr=0.1, momentum=0.9, accum_type=accumulators))
    serial, serial_outs, serial_weights, _ = _train(False, nn.Dropout(0.3), configure=sr,
                                                    dtype=torch.float16, optimizer=make)
    tm, outs, weights, calls = _train(True, nn.Dropout(0.3), configure=sr, dtype=torch.float16,
                                      optimizer=make)
    assert len(tm._engine.batch_fn.wide_outputs) == (4 if accumulators is None else 0)
    assert serial_reason(tm.getIR().graphs["training_step"]) is None
    assert calls == [GA * RF] * (DI * 2)           # every micro-batch batched, counted too
    assert tm._engine.batch_fn is not None          # no fallback to the serial order
    for a, b in zip(serial_outs, outs):
        assert _identical(a, b)
    assert _identical(serial_weights, weights)
    s_watch, b_watch = serial._compiled.watch, tm._compiled.watch
    assert b_watch.values == s_watch.values > 0
    assert b_watch.per_op == s_watch.per_op


def test_half_partials_batch_bit_for_bit():
    """fp16 partial sums (their kernels write into buffers of their own, so
    they carry a vmap rule: the micro-batches as a leading dimension) with
    dropout and stochastic rounding: batched equals serial bit for bit, and
    the gradient watch counts the same (the fp32 products it compares the
    fp16 partial sums with made for the counted micro-batch alone)."""
    def configure(o):
        o.Precision.enableStochasticRounding(True)
        o.Precision.setPartialsType(torch.half)
    serial, serial_outs, serial_weights, _ = _train(False, nn.Dropout(0.3), configure=configure,
                                                    dtype=torch.float16)
    tm, outs, weights, calls = _train(True, nn.Dropout(0.3), configure=configure,
                                      dtype=torch.float16)
    step = tm.getIR().graphs["training_step"]
    assert any(op.partials == "half" for op in step.ops) and calls
    assert tm._engine.batch_fn is not None          # no fallback to the serial order
    for a, b in zip(serial_outs, outs):
        assert _identical(a, b)
    assert _identical(serial_weights, weights)
    s_watch, b_watch = serial._compiled.watch, tm._compiled.watch
    half = {op.name for op in step.ops if op.partials == "half" and op.watched}
    assert half & set(b_watch.per_op) and b_watch.values == s_watch.values > 0
    assert b_watch.per_op == s_watch.per_op


def test_random_streams_repeat_from_the_seed_and_differ_between_seeds():
    seeded = lambda s: (lambda o: o.randomSeed(s))     # noqa: E731 - a one-line helper
    a = _train(True, nn.Dropout(0.5), configure=seeded(3))[2]
    b = _train(True, nn.Dropout(0.5), configure=seeded(3))[2]
    c = _train(True, nn.Dropout(0.5), configure=seeded(4))[2]
    assert _identical(a, b) and not _identical(a, c)


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


class ConvNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                                  nn.Conv2d(8, 8, 3, stride=2, bias=False), nn.BatchNorm2d(8),
                                  nn.ReLU(), nn.Flatten(), nn.Linear(8 * 3 * 3, 5))
        self.loss = nn.CrossEntropyLoss()

    def forward(self, x, y):
        out = self.body(x)
        return out, self.loss(out, y)


def _train_conv(batched, calls=2, dtype=torch.float32):
    torch.manual_seed(0)
    net = ConvNet().to(dtype)
    opts = quiet_options().deviceIterations(DI).replicationFactor(RF)
    opts.Training.gradientAccumulation(GA)
    opts.outputMode(poptorch.OutputMode.All)
    scaling = {"loss_scaling": 64.0} if dtype == torch.float16 else {}
    tm = poptorch.trainingModel(net, opts, poptorch.optim.SGD(net.parameters(), lr=0.1,
                                                              momentum=0.9, **scaling))
    n = DI * GA * RF * MICRO
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(n, 3, 8, 8, generator=g).to(dtype), torch.randint(0, 5, (n,), generator=g)
    tm.compile(x, y)
    if not batched:
        tm._engine.batch_fn = None
    outs = [tm(x, y) for _ in range(calls)]
    return tm, outs, [p.detach().clone() for p in net.parameters()]


def test_convolutions_with_batch_norm_batch_like_the_serial_order():
    """A CNN with batch norm: the convolutions' weight gradients come from
    one convolution backward over all micro-batches (summed), batch norm
    runs row by row, its running statistics are updated in the serial
    order per replica; all within fp32 rounding of the serial order."""
    serial, serial_outs, serial_weights = _train_conv(False)
    tm, outs, weights = _train_conv(True)
    fn = tm._engine.batch_fn
    assert fn is not None and fn.tail is not None and fn.deferred == 2
    for a, b in zip(serial_outs, outs):
        for p, q in zip(a, b):
            torch.testing.assert_close(q, p, rtol=1e-5, atol=1e-6)
    for p, q in zip(serial_weights, weights):
        torch.testing.assert_close(q, p, rtol=1e-5, atol=1e-6)
    for r in range(RF):
        for p, q in zip(serial._state.buffers[r], tm._state.buffers[r]):
            torch.testing.assert_close(q, p, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("stride, padding, dilation, kernel", [
    ([1, 1], [1, 1], [1, 1], 3), ([2, 2], [0, 0], [1, 1], 3), ([1, 2], [2, 1], [2, 1], 3),
    ([1, 1], [0, 0], [1, 1], 1)])
def test_the_unfolded_weight_gradient_equals_atens(stride, padding, dilation, kernel):
    """The im2col form of a summed convolution weight gradient (the batched
    path may choose it where it runs faster) against ATen's."""
    from poptorchsim.machine.batching import _unfolded
    g = torch.Generator().manual_seed(0)
    x = torch.randn(6, 5, 9, 7, generator=g)
    w = torch.randn(4, 5, kernel, kernel, generator=g)
    out = torch.nn.functional.conv2d(x, w, stride=stride, padding=padding, dilation=dilation)
    grad = torch.randn(out.shape, generator=g)
    ref = torch.ops.aten.convolution_backward(grad, x, w, None, stride, padding, dilation,
                                              False, [0, 0], 1, [False, True, False])[1]
    torch.testing.assert_close(_unfolded(grad, x, w, stride, padding, dilation), ref,
                               rtol=1e-5, atol=1e-5)


def test_fp16_steps_batch_like_the_serial_order():
    """An fp16 CNN with batch norm and fp32 gradient accumulators batches:
    each micro-batch's fp16 gradient is rounded on its own and added to the
    accumulator in the serial order (the convolutions' weight gradients made
    per micro-batch by one product after the batched call); the gradient
    watch counts the first micro-batch of its calls, run on its own, with
    the serial order's numbers."""
    serial, serial_outs, serial_weights = _train_conv(False, calls=3, dtype=torch.float16)
    tm, outs, weights = _train_conv(True, calls=3, dtype=torch.float16)
    fn = tm._engine.batch_fn
    assert fn is not None and fn.tail is not None and fn.deferred == 2
    assert tm._engine.accumulation is not None          # fp32 accumulators
    for a, b in zip(serial_outs, outs):
        for p, q in zip(a, b):
            assert q.dtype == p.dtype
            torch.testing.assert_close(q, p, rtol=2e-3, atol=1e-3)
    for p, q in zip(serial_weights, weights):
        assert q.dtype == torch.float16
        torch.testing.assert_close(q, p, rtol=2e-3, atol=1e-4)
    for r in range(RF):
        for p, q in zip(serial._state.buffers[r], tm._state.buffers[r]):
            torch.testing.assert_close(q, p, rtol=2e-3, atol=1e-4)
    s_watch, b_watch = serial._compiled.watch, tm._compiled.watch
    assert b_watch.values == s_watch.values > 0
    assert (b_watch.underflowed, b_watch.nonzero) == (s_watch.underflowed, s_watch.nonzero)


def test_batched_runs_repeat_bit_for_bit():
    """The summed weight gradients' form (ATen's or im2col) follows from the
    shapes alone, never from a timing: two runs give the same bits."""
    weights = [_train_conv(True)[2] for _ in range(2)]
    for p, q in zip(*weights):
        assert torch.equal(p, q)


@pytest.mark.parametrize("configure, optimizer", [
    (lambda o: o.Training.setMeanAccumulationAndReplicationReductionStrategy(
        poptorch.MeanReductionStrategy.Running), None),
    (None, lambda params: poptorch.optim.SGD(params, lr=0.1, momentum=0.9,
                                             use_combined_accum=True)),
], ids=["running-mean", "sgd-combined"])
def test_accumulators_of_their_own_batch_in_the_serial_order(configure, optimizer):
    """A running mean of the gradients, or SGD's combined variant (the
    gradients added into the velocity), batches too: the rows are added
    one by one through the accumulators, as in the serial order."""
    _, serial_outs, serial_weights, _ = _train(False, configure=configure, optimizer=optimizer)
    tm, outs, weights, calls = _train(True, configure=configure, optimizer=optimizer)
    assert tm._engine.accumulation is not None and calls == [GA * RF] * (DI * 2)
    for a, b in zip(serial_outs, outs):
        for p, q in zip(a, b):
            torch.testing.assert_close(q, p, rtol=1e-6, atol=1e-6)
    for p, q in zip(serial_weights, weights):
        torch.testing.assert_close(q, p, rtol=1e-6, atol=1e-7)
