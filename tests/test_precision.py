"""Options.Precision: stochastic rounding, half partials, running statistics
in float32, halfFloatCasting (docs/precision.md)."""
import logging
import os
import subprocess
import sys

import pytest
import torch
from conftest import LogRecords

import poptorchsim as poptorch
from poptorchsim.machine.precision import stochastic_round
from poptorchsim.machine.rounding import RandomBits

HALF = torch.float16


class _Weights(torch.nn.Module):
    def __init__(self, n=1000):
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(n, dtype=HALF))

    def forward(self, x):
        return poptorch.identity_loss((self.w * x).sum(), reduction="sum")


def _train_small_updates(sr, seed=1, steps=10):
    """fp16 weights of 1.0, each step an SGD update of -1e-4 (below half
    an ulp of 1.0, 2**-11 / 2)."""
    torch.manual_seed(0)
    m = _Weights()
    opts = poptorch.Options().randomSeed(seed)
    opts.Precision.enableStochasticRounding(sr)
    pm = poptorch.trainingModel(m, opts, torch.optim.SGD(m.parameters(), lr=1e-4))
    x = torch.ones(1000, dtype=HALF)
    for _ in range(steps):
        pm(x)
    pm.copyWeightsToHost()
    return m.w.detach().clone()


def test_small_updates_move_weights_only_with_stochastic_rounding():
    plain = _train_small_updates(False)
    assert torch.equal(plain, torch.ones(1000, dtype=HALF))     # never move
    sr = _train_small_updates(True)
    assert sr.dtype == HALF
    assert (sr != 1).sum() > 500
    # in expectation: 1 - 10 * 1e-4
    assert abs(sr.double().mean().item() - 0.999) < 1e-4      # 5 sigma; off: 1e-3


def test_fp32_model_unchanged_by_stochastic_rounding():
    def train(sr):
        torch.manual_seed(0)
        m = torch.nn.Linear(4, 3)
        opts = poptorch.Options()
        opts.Precision.enableStochasticRounding(sr)
        pm = poptorch.trainingModel(_WithLoss(m), opts, torch.optim.SGD(m.parameters(), lr=0.1))
        for _ in range(3):
            pm(torch.ones(2, 4))
        pm.copyWeightsToHost()
        return m.weight.detach().clone()
    before = torch.nn.Linear(4, 3).weight
    a, b = train(False), train(True)
    assert torch.equal(a, b) and not torch.equal(a, before)


class _WithLoss(torch.nn.Module):
    def __init__(self, m):
        super().__init__()
        self.m = m

    def forward(self, x):
        return poptorch.identity_loss(self.m(x).sum(), reduction="sum")


def test_stochastic_rounding_reproducible_from_seed():
    a = _train_small_updates(True, seed=7, steps=3)
    b = _train_small_updates(True, seed=7, steps=3)
    c = _train_small_updates(True, seed=8, steps=3)
    assert torch.equal(a, b)
    assert not torch.equal(a, c)


def test_stochastic_round_unbiased_and_exact_on_fp16_values():
    g = RandomBits(0)
    for value in (1.0001, -3.14159, 1e-6, 70000.0 / 3):      # normal, negative, subnormal
        x = torch.full((200_000,), value, dtype=torch.float32)
        r = stochastic_round(x, g)
        assert r.dtype == HALF
        lo_hi = set(r.unique().float().tolist())
        assert len(lo_hi) == 2                                  # the two neighbours
        assert abs(r.double().mean().item() - x[0].item()) < 5e-3 * (max(lo_hi) - min(lo_hi))
        assert torch.equal(r.float(), r.float().clamp(min(lo_hi), max(lo_hi)))
    exact = torch.tensor([0.0, -0.0, 1.0, 65504.0, float("inf"), 2 ** -24], dtype=torch.float32)
    assert torch.equal(stochastic_round(exact, g).float(), exact)
    assert torch.isnan(stochastic_round(torch.tensor([float("nan")]), g)).all()
    # NaNs whose payload fills the mantissa: adding the random bits must not
    # carry into the sign and make them zero or finite
    payloads = torch.tensor([0x7FFFFFFF, -1, 0x7FC00001], dtype=torch.int32)
    assert torch.isnan(stochastic_round(payloads.view(torch.float32).repeat(1000), g)).all()


def test_stochastic_round_of_a_mostly_exact_tensor_rounds_the_others_only():
    """A tied embedding's gradient: the head's fp16 gradient plus the
    embedding's, non-zero in a few rows.  The rows fp16 holds stay exactly;
    the others round to their neighbours, unbiased."""
    g, values = RandomBits(0), torch.Generator().manual_seed(0)
    x = torch.randn(4096, 64, generator=values).half().float()
    x[::64] += 1e-4 * torch.rand(64, generator=values)
    r = stochastic_round(x, g).float()
    exact = x.half().float() == x
    assert exact.float().mean() > 0.9 and not exact.all()
    assert torch.equal(r[exact], x[exact])
    inexact = x[~exact]
    down = inexact.half().float()
    below = torch.nextafter(down.half(), torch.tensor(-1e9).half()).float()
    lo = torch.where(down <= inexact, down, below)
    step = torch.nextafter(lo.half(), torch.tensor(1e9).half()).float() - lo
    got = r[~exact]
    assert torch.all((got == lo) | (got == lo + step))
    # the rounding errors of the 4,096 values average out
    assert abs((got.double() - inexact.double()).mean().item()) < 0.2 * step.double().mean().item()


def _rounding_cases(n=1 << 13):
    """Values stochastic rounding must get right, as fp32 tensors: normal,
    subnormal (fp16 and fp32), huge, infinite, NaN (any payload), signed
    zeros (``n`` of each random kind), and a tensor mostly of fp16 values."""
    g = torch.Generator().manual_seed(0)
    values = [torch.randn(n, generator=g) * s for s in (1e-8, 1e-6, 1e-4, 1, 1e3, 6e4)]
    values.append(torch.randint(-2 ** 31, 2 ** 31 - 1, (n,), dtype=torch.int32,
                                generator=g).view(torch.float32))      # NaN payloads too
    values.append(torch.tensor([0.0, -0.0, float("inf"), -float("inf"), float("nan"),
                                65504.0, 65519.0, 65520.0, 2 ** -24, -2 ** -25, 2 ** -14,
                                1e-45, -1e-45, 2 ** -14 * 0.99999]).repeat(64))
    mostly = torch.randn(70_000, generator=g).half().float()
    mostly[::97] += 1e-4
    values.append(mostly)
    return values


def test_compiled_stochastic_round_equals_the_pytorch_form(monkeypatch):
    """``sr_kernel.py`` (numba, one pass) gives the PyTorch form's values bit
    for bit: normal, subnormal (fp16 and fp32), huge, infinite, NaN (any
    payload) and signed-zero values, in one window and in batched windows
    (rows), with the shortcut for mostly exact tensors taken or not; large
    results on numba's threads too (chunks across rows and the pool's end)."""
    sr_kernel = pytest.importorskip("poptorchsim.machine.sr_kernel")
    if not sr_kernel.available():
        pytest.skip("numba is not installed")
    from poptorchsim.machine.streams import POOL, Window, Windows, draw_pool
    values = _rounding_cases(1 << 15)
    big = torch.cat(values[:7])[:4 * sr_kernel._CHUNK + 12]     # rows of 65,539 values
    values.append(big[torch.randperm(big.numel(), generator=torch.Generator().manual_seed(1))])
    pool = draw_pool(3)
    for x in values:
        for bits in (Window(pool, POOL - 100),                     # wraps around the pool
                     Windows(pool, [5, POOL - 7, 12345], x.numel() // 4)):
            x_ = x[:x.numel() // 4 * 3] if isinstance(bits, Windows) else x
            monkeypatch.setenv("POPTORCHSIM_NUMBA", "1")
            fast = stochastic_round(x_, bits)
            monkeypatch.setenv("POPTORCHSIM_NUMBA", "0")
            plain = stochastic_round(x_, bits)
            assert torch.equal(fast.view(torch.int16), plain.view(torch.int16))


def _round_in_child(x, pool, queue):
    import torch as t

    from poptorchsim.machine import sr_kernel
    t.set_num_threads(2)                # numba's threads would be wanted here too
    queue.put(sr_kernel.round_rows(x, pool, [7], x.numel()).view(t.int16).numpy().tobytes())


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no fork on this platform")
def test_a_forked_child_rounds_after_the_parent_used_numbas_threads():
    """GNU OpenMP terminates a forked child that starts its threads again
    ("fork() called from a process already using GNU OpenMP"): the child
    (a data loader's worker, a forked program) rounds on one thread, to the
    same bits."""
    sr_kernel = pytest.importorskip("poptorchsim.machine.sr_kernel")
    if not sr_kernel.available():
        pytest.skip("numba is not installed")
    import multiprocessing

    from poptorchsim.machine.streams import draw_pool
    pool = draw_pool(0)
    x = torch.randn(4 * sr_kernel._CHUNK, generator=torch.Generator().manual_seed(0))
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        here = sr_kernel.round_rows(x, pool, [7], x.numel()).view(torch.int16)
        ctx = multiprocessing.get_context("fork")
        queue = ctx.Queue()
        child = ctx.Process(target=_round_in_child, args=(x, pool, queue))
        child.start()
        try:
            there = queue.get(timeout=30)           # (before join: the pipe is small)
        except Exception:  # noqa: BLE001 - the child died: its exit code says how
            there = None
        child.join(60)
    finally:
        torch.set_num_threads(threads)
    assert child.exitcode == 0 and here.numpy().tobytes() == there


_TRITON_CHECK = """
import torch
from poptorchsim.machine import sr_triton
from poptorchsim.machine.rounding import stochastic_round
from poptorchsim.machine.streams import POOL, Window, Windows, draw_pool
import test_precision as t
assert sr_triton.available(torch.device("cpu"))
pool = draw_pool(3)
checked = 0
for x in t._rounding_cases():
    rows = x.numel() // 4
    for bits, x_ in ((Window(pool, POOL - 100), x),              # wraps around the pool
                     (Windows(pool, [5, POOL - 7, 12345], rows), x[:rows * 3])):
        plain = stochastic_round(x_, bits)                       # the PyTorch form
        starts = bits.starts if isinstance(bits, Windows) else bits.start
        fast = sr_triton.round_rows(x_, pool, starts, rows if isinstance(bits, Windows) else None)
        # NaNs as NaNs: a cast writes its own NaN bits (numpy's keep the payload)
        nan = plain.isnan()
        assert torch.equal(fast.isnan(), nan)
        assert torch.equal(fast[~nan].view(torch.int16), plain[~nan].view(torch.int16)), x_[:8]
        checked += x_.numel()
print("checked", checked)
"""


def test_triton_stochastic_round_equals_the_pytorch_form():
    """``sr_triton.py`` (the GPU's one-kernel rounding), run in Triton's
    interpreter on the CPU, gives the PyTorch form's values bit for bit (a
    NaN a NaN), in one window and in batched windows (rows)."""
    pytest.importorskip("triton")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, TRITON_INTERPRET="1", POPTORCHSIM_NUMBA="0",
               PYTHONPATH=os.pathsep.join([root, os.path.join(root, "tests"),
                                           os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run([sys.executable, "-c", _TRITON_CHECK], cwd=root, env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "checked" in done.stdout


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_triton_stochastic_round_on_cuda_equals_the_cpus():
    """On a GPU: the Triton kernel's values are the CPU's PyTorch form's
    (NaNs as NaNs: a GPU's cast writes its own NaN bits)."""
    from poptorchsim.machine.streams import POOL, Window, Windows, draw_pool
    pool = draw_pool(3)
    for x in _rounding_cases():
        rows = x.numel() // 4
        for bits, x_ in ((Window(pool, POOL - 100), x),
                         (Windows(pool, [5, POOL - 7, 12345], rows), x[:rows * 3])):
            plain = stochastic_round(x_, bits)
            on_gpu = (Window(pool.cuda(), bits.start) if isinstance(bits, Window)
                      else Windows(pool.cuda(), [w.start for w in bits.rows], rows))
            fast = stochastic_round(x_.cuda(), on_gpu).cpu()
            nan = plain.isnan()
            assert torch.equal(fast.isnan(), nan)
            assert torch.equal(fast[~nan].view(torch.int16), plain[~nan].view(torch.int16))


class _Scale(torch.nn.Module):
    def forward(self, x):
        return x * 1.0001


def _infer(model, x, *, sr=False, partials=None, rf=1, seed=3):
    opts = poptorch.Options().randomSeed(seed).replicationFactor(rf)
    opts.Precision.enableStochasticRounding(sr)
    if partials is not None:
        opts.Precision.setPartialsType(partials)
    pm = poptorch.inferenceModel(model, opts)
    return pm(x), pm


def test_op_outputs_rounded_stochastically_and_per_replica():
    x = torch.ones(2, 20_000, dtype=HALF)
    plain, _ = _infer(_Scale(), x)
    assert torch.equal(plain, _Scale()(x))                     # off: PyTorch's fp16
    out, _ = _infer(_Scale(), x, sr=True, rf=2)
    assert set(out.unique().tolist()) == {1.0, 1.0009765625}
    assert abs(out.double().mean().item() - 1.0001) < 2e-5     # unbiased
    assert not torch.equal(out[0], out[1])                     # replicas differ


class _Dot(torch.nn.Module):
    def __init__(self, w):
        super().__init__()
        self.w = torch.nn.Parameter(w)

    def forward(self, x):
        return x @ self.w


def _long_reduction():
    g = torch.Generator().manual_seed(0)
    x = (torch.rand(4, 8192, generator=g) + 0.5).to(HALF)
    w = (torch.rand(8192, 16, generator=g) + 0.5).to(HALF)
    return x, w


def test_half_partials_long_reduction():
    x, w = _long_reduction()
    exact = x.double() @ w.double()
    fl, _ = _infer(_Dot(w.clone()), x)
    half, _ = _infer(_Dot(w.clone()), x, partials=torch.half)
    assert torch.equal(fl, x @ w)                              # float partials: PyTorch's
    assert not torch.equal(half, fl)
    err_float = (fl.double() - exact).abs().mean()
    err_half = (half.double() - exact).abs().mean()
    assert err_half > 1.5 * err_float    # a slice's running fp16 sum loses more


def _mm_cost(pm):
    costs = pm._compiled.costs["inference_forward"]
    ops = pm._compiled.program.graphs["inference_forward"].ops
    return next(c for op, c in zip(ops, costs) if op.cost_class == "matmul")


def test_half_partials_cost_less_memory_and_cycles():
    x, w = _long_reduction()
    _, pf = _infer(_Dot(w.clone()), x)
    _, ph = _infer(_Dot(w.clone()), x, partials=torch.half)
    cf, ch = _mm_cost(pf), _mm_cost(ph)
    assert ch.temp_bytes.sum() < cf.temp_bytes.sum()
    assert ch.exchange + ch.compute < cf.exchange + cf.compute



def test_half_float_casting_as_poptorch():
    assert [(m.name, m.value) for m in poptorch.HalfFloatCastingBehavior] == [
        ("FloatDowncastToHalf", 0), ("HalfUpcastToFloat", 1), ("Default", 2)]
    opts = poptorch.Options()
    records = LogRecords()
    logging.getLogger("poptorchsim").addHandler(records)
    try:
        assert opts.Precision.halfFloatCasting(
            poptorch.HalfFloatCastingBehavior.HalfUpcastToFloat) is opts.Precision
    finally:
        logging.getLogger("poptorchsim").removeHandler(records)
    assert "HalfUpcastToFloat is now the only supported option" in records.text
    with pytest.raises(ValueError, match="runningStatisticsAlwaysFloat needs to be set to a bool"):
        opts.Precision.runningStatisticsAlwaysFloat(1)


class _BN(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)
        self.bn = torch.nn.BatchNorm1d(8)

    def forward(self, x, y):
        out = self.bn(self.lin(x))
        return out, torch.nn.functional.mse_loss(out, y)


def _bn_stats(always_float):
    torch.manual_seed(0)
    m = _BN()
    ref = _BN()
    ref.load_state_dict(m.state_dict())
    m.half()
    opts = poptorch.Options()
    opts.Precision.runningStatisticsAlwaysFloat(always_float)
    pm = poptorch.trainingModel(m, opts, torch.optim.SGD(m.parameters(), lr=0.0))
    g = torch.Generator().manual_seed(1)
    x = torch.randn(16, 8, generator=g) * 3 + 100
    y = torch.zeros(16, 8)
    for _ in range(5):
        pm(x.half(), y.half())
        ref(x.half().float(), y)
    pm.copyWeightsToHost()
    return m.bn, ref.bn


def test_running_statistics_always_float():
    half_bn, ref = _bn_stats(False)
    float_bn, _ = _bn_stats(True)
    assert half_bn.running_mean.dtype == HALF
    assert float_bn.running_mean.dtype == float_bn.running_var.dtype == torch.float32
    assert not torch.equal(float_bn.running_mean, half_bn.running_mean.float())
    err_f = (float_bn.running_mean - ref.running_mean).abs().max()
    err_h = (half_bn.running_mean.float() - ref.running_mean).abs().max()
    assert err_f < err_h
    assert int(float_bn.num_batches_tracked) == 5


class _ConvNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 8, 3)
        self.fc = torch.nn.Linear(8 * 6 * 6, 4)

    def forward(self, x, y):
        out = self.fc(torch.tanh(self.conv(x)).flatten(1))
        return out, torch.nn.functional.cross_entropy(out.float(), y)


def _conv_training(ga=1):
    torch.manual_seed(0)
    net = _ConvNet().half()
    opts = poptorch.Options().showCompilationProgressBar(False)
    opts.Training.gradientAccumulation(ga)
    tm = poptorch.trainingModel(net, opts, poptorch.optim.SGD(net.parameters(), lr=0.1,
                                                                loss_scaling=64.0))
    g = torch.Generator().manual_seed(3)
    x = torch.randn(4, 3, 8, 8, generator=g).half().repeat(ga, 1, 1, 1)
    y = torch.randint(0, 4, (4,), generator=g).repeat(ga)
    return tm, net, x, y


def test_fp16_backward_convolution_is_fp32_rounded_once():
    """The backward pass's fp16 convolution runs as its fp32 kernel rounded
    to fp16 (PyTorch's CPU fp16 kernel is 96x slower): the weight gradient
    is that rounding of the fp32 one."""
    tm, _, x, y = _conv_training()
    tm.compile(x, y)
    step = tm.getIR().graphs["training_step"]
    op = next(o for o in step.ops if "convolution_backward" in str(o.target))
    assert op.watched
    aten = torch.ops.aten
    torch.manual_seed(0)
    a = torch.randn(4, 8, 6, 6).half()
    b = torch.randn(4, 3, 8, 8).half()
    w = torch.randn(8, 3, 3, 3).half()
    from poptorchsim.machine.precision import host_kernel
    seen = []

    def spy(*args):
        seen.extend(t.dtype for t in args if isinstance(t, torch.Tensor))
        return aten.convolution_backward.default(*args)
    call = (a, b, w, [8], [1, 1], [0, 0], [1, 1], False, [0, 0], 1, [False, True, True])
    result = host_kernel(op, spy)(*call)
    assert seen == [torch.float32] * 3                       # the fp32 kernel ran
    wide = aten.convolution_backward.default(*[t.float() if isinstance(t, torch.Tensor)
                                               else t for t in call])
    assert result[1].dtype == torch.float16 and torch.equal(result[1], wide[1].half())


def test_gradient_watch_counts_the_first_micro_batch_of_a_call():
    """Every micro-batch of a call computes the same way; the watch counts
    the first: the same micro-batch repeated four times counts as once."""
    counts = []
    for ga in (1, 4):
        tm, _, x, y = _conv_training(ga)
        tm(x, y)
        counts.append(tm.precisionReport()["gradients"]["values"])
    assert counts[0] == counts[1] > 0


def test_gradient_watch_counts_one_micro_batch_in_16_and_after_a_scale_change():
    """Calls of one micro-batch: the watch counts the first call, then the
    call 16 micro-batches on, and the first call after the loss scale
    changed; the report names the call it counted."""
    tm, net, x, y = _conv_training(1)
    counted = []
    for _ in range(18):
        tm(x, y)
        counted.append(tm.precisionReport()["gradients"]["counted_call"])
    assert counted == [1] * 16 + [17, 17]
    assert tm.precisionReport()["gradients"]["calls"] == 18
    tm.setOptimizer(poptorch.optim.SGD(net.parameters(), lr=0.1, loss_scaling=32.0))
    tm(x, y)
    report = tm.precisionReport()
    assert report["loss_scale"] == 32.0 and report["gradients"]["counted_call"] == 19


def test_stochastic_round_of_a_mostly_zero_tensor_rounds_its_non_zeros_only():
    """An embedding's gradient: 200,000 values, 1% of them 1.0001, the rest
    zeros of either sign; the zeros stay (with their sign), the others take
    the two neighbours of 1.0001 with its mean."""
    g = RandomBits(0)
    x = torch.zeros(200_000)
    x[1::2] = -0.0
    x[::100] = 1.0001
    r = stochastic_round(x, g)
    zeros = x == 0
    assert torch.equal(torch.signbit(r[zeros]), torch.signbit(x[zeros]))
    assert not r[zeros].any()
    assert set(r[~zeros].unique().tolist()) == {1.0, 1.0009765625}
    assert abs(r[~zeros].double().mean().item() - 1.0001) < 2e-2 * 2 ** -10


class _MovesAndScales(torch.nn.Module):
    def forward(self, x):
        moved = torch.relu(torch.cat([x, -x], dim=1))
        return moved * 1.0001


def test_ops_that_only_move_fp16_values_do_not_round_stochastically():
    """With stochastic rounding on, cat, neg and relu of fp16 values keep
    their values (nothing to round); the multiplication rounds."""
    x = torch.randn(2, 64).half()
    _, pm = _infer(_MovesAndScales(), x, sr=True)
    rows = {row["op"].split(".")[1]: row["rounding"]
            for row in pm.simulationReport()["ops"] if row.get("dtype") == "float16"}
    assert rows["cat"] == rows["neg"] == rows["relu"] == "nearest", rows
    assert rows["mul"] == "stochastic", rows


def test_fp16_argmax_runs_on_the_widened_values():
    """The engine computes an fp16 model's argmax (a masked-LM accuracy over
    a vocabulary of logits) with the fp32 kernel on widened values (3x
    faster than PyTorch's CPU fp16 one), which gives the same index."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(8, 50)).half()

    class Top(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.net = net

        def forward(self, x):
            return self.net(x).argmax(-1)
    x = torch.randn(6, 8).half()
    pm = poptorch.inferenceModel(Top().eval(), poptorch.Options())
    assert torch.equal(pm(x), net(x).argmax(-1))
    graph = pm.getIR().graphs["inference_forward"]
    op = next(o for o in graph.ops if "argmax" in str(o.target))
    from poptorchsim.machine.precision import host_kernel
    seen = []

    def spy(*args, **kwargs):
        seen.extend(t.dtype for t in args if isinstance(t, torch.Tensor))
        return op.target(*args, **kwargs)
    logits = (torch.randn(6, 50) * 4).round().half()       # many ties
    assert torch.equal(host_kernel(op, spy)(logits, -1), logits.argmax(-1))
    assert seen == [torch.float32]
