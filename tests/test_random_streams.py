"""Counter-based random streams (machine/streams.py): each micro-batch, replica
and op draws its own numbers, whatever order the micro-batches run in;
``RandomStreams.Eager`` keeps PyTorch's generator in eager order."""
import copy

import pytest
import torch
from conftest import quiet_options
from torch import nn

import poptorchsim as poptorch
from poptorchsim.errors import Error
from poptorchsim.machine import streams as S
from poptorchsim.machine.rounding import Rounding, stochastic_round


def _key(*where):
    return S.key_ints(S.derive_key(7, *where))


def test_the_tensor_hash_is_the_integer_hash():
    """mix32 on int32 tensors (wrapping products, masked shifts) gives the
    integers' hash bit for bit."""
    values = [0, 1, 2 ** 31 - 1, 2 ** 31, 2 ** 32 - 1] + \
        torch.randint(0, 2 ** 32, (1000,), dtype=torch.int64,
                      generator=torch.Generator().manual_seed(0)).tolist()
    as_int32 = torch.tensor([S._signed(v) for v in values], dtype=torch.int32)
    assert S.unsigned(S.mix32(as_int32)).tolist() == [S.mix32_int(v) for v in values]



def test_the_compiled_window_starts_are_the_integer_ones():
    """``sr_kernel.window_starts`` (numba: a batched call's rows at once)
    gives ``Streams.window_start`` of each row, from keys as ``tolist``
    gives them (signed int32 words) and as the key tensor's array (the
    batched rounding's path), for streams up to 2**32 and past."""
    sr_kernel = pytest.importorskip("poptorchsim.machine.sr_kernel")
    if not sr_kernel.available():
        pytest.skip("numba is not installed")
    g = torch.Generator().manual_seed(1)
    keys = torch.randint(-2 ** 31, 2 ** 31, (64, 2), dtype=torch.int64, generator=g)
    keys[0] = torch.tensor([-2 ** 31, 2 ** 31 - 1])
    rows = keys.to(torch.int32).tolist()
    for stream in (0, 1, 8 * 12345 + 3, 2 ** 32 - 1, 2 ** 35 + 17):
        want = [S.Streams.window_start((k0 & S.MASK32, k1 & S.MASK32), stream)
                for k0, k1 in rows]
        assert sr_kernel.window_starts(rows, stream).tolist() == want
        assert sr_kernel.window_starts(keys.to(torch.int32).numpy(), stream).tolist() == want

def test_uniform_numbers_are_uniform_and_keyed():
    u = S.uniform(_key(0), 3, (400_000,))
    assert u.dtype == torch.float32 and 0 <= u.min() and u.max() < 1
    assert abs(u.mean().item() - 0.5) < 3e-3 and abs(u.var().item() - 1 / 12) < 2e-3
    counts = torch.histc(u, bins=16, min=0, max=1)
    assert (counts / counts.mean() - 1).abs().max() < 0.03
    # neighbouring elements, streams and keys are not correlated
    assert abs(torch.corrcoef(torch.stack([u[:-1], u[1:]]))[0, 1]) < 0.01
    other_stream = S.uniform(_key(0), 4, (400_000,))
    other_key = S.uniform(_key(1), 3, (400_000,))
    for v in (other_stream, other_key):
        assert abs(torch.corrcoef(torch.stack([u, v]))[0, 1]) < 0.01
    assert torch.equal(u, S.uniform(_key(0), 3, (400_000,)))      # a function of its key


def test_normal_numbers_have_mean_zero_and_unit_variance():
    z = S.normal(_key(2), 9, (500_000,))
    assert abs(z.mean().item()) < 5e-3 and abs(z.std().item() - 1) < 5e-3
    assert abs((z.abs() < 1).float().mean().item() - 0.6827) < 3e-3
    assert torch.isfinite(z).all()


def test_a_batched_key_draws_each_rows_numbers():
    streams = S.Streams(seed=7)
    keys = torch.stack([streams.key_of("step", 0, g, 0) for g in range(5)])

    def one(key):
        streams.key, streams.batched = key, True
        return streams.draw(lambda words: S.uniform(words, 11, (3, 4)))
    batched = torch.func.vmap(one)(keys)
    streams.batched = False
    for g in range(5):
        streams.set("step", 0, g, 0)
        assert torch.equal(batched[g], S.uniform(streams.current, 11, (3, 4)))


def test_stochastic_rounding_reads_the_same_bits_batched_and_serial():
    """A result rounded in a batched call (the whole tensor at once, out of
    place) and serially (block by block, or only the rows fp16 does not
    hold) reads the same bits for the same values: the same fp16 values."""
    streams = S.Streams(seed=5)
    g = torch.Generator().manual_seed(0)
    xs = torch.randn(3, 300_000, generator=g)
    xs[1] = xs[1].half().float()                    # mostly exact: the rows shortcut
    xs[1, ::97] += 1e-4
    keys = torch.stack([streams.key_of("step", 0, k, 0) for k in range(3)])
    streams.pool(None)

    rounding = Rounding(streams)

    def one(x, key):
        streams.key, streams.batched = key, True
        return rounding.round(x, 21)
    batched = torch.func.vmap(one)(xs, keys)
    streams.batched = False
    for k in range(3):
        streams.set("step", 0, k, 0)
        serial = rounding.round(xs[k], 21)
        assert torch.equal(serial, batched[k])
        assert torch.equal(serial, stochastic_round(xs[k], streams.window(21)))
    # unbiased
    x = torch.full((200_000,), 1.0001)
    streams.set("step", 1, 0, 0)
    r = stochastic_round(x, streams.window(3)).double()
    assert abs(r.mean().item() - 1.0001) < 5e-3 * 2 ** -10


class DropoutNet(nn.Module):
    def __init__(self, p=0.5, extra=None):
        super().__init__()
        self.a, self.b = nn.Linear(8, 64), nn.Linear(64, 3)
        self.drop = nn.Dropout(p)
        self.extra = extra

    def forward(self, x, y):
        h = self.drop(torch.relu(self.a(x)))
        if self.extra == "rand":
            h = h + 0.1 * torch.rand_like(h) + 0.01 * torch.randn_like(h)
        out = self.b(h)
        return out, nn.functional.cross_entropy(out, y)


def _one_step(mode, net, x, y, seed=5):
    net = copy.deepcopy(net)
    opts = quiet_options()
    if mode:
        opts.randomStreams(mode)
    tm = poptorch.trainingModel(net, opts, torch.optim.SGD(net.parameters(), lr=0.1))
    tm.compile(x, y)
    torch.manual_seed(seed)
    return tm(x, y)


def test_eager_streams_match_plain_pytorch_bit_for_bit():
    torch.manual_seed(0)
    net = DropoutNet()
    x, y = torch.randn(16, 8), torch.randint(0, 3, (16,))
    out, loss = _one_step(poptorch.RandomStreams.Eager, net, x, y)
    torch.manual_seed(5)
    ref_out, ref_loss = copy.deepcopy(net)(x, y)
    assert torch.equal(out, ref_out) and torch.equal(loss, ref_loss)
    # the default draws per micro-batch: other units dropped, at the same rate
    out, _ = _one_step(None, net, x, y)
    assert not torch.equal(out, ref_out)


def test_dropout_drops_its_share_of_units():
    torch.manual_seed(0)
    net = DropoutNet(p=0.25)
    x, y = torch.randn(512, 8), torch.randint(0, 3, (512,))
    tm = poptorch.trainingModel(net, quiet_options(),
                                torch.optim.SGD(net.parameters(), lr=0.0))
    tm.compile(x, y)
    ir = tm.getIR().graphs["training_step"]
    (draw,) = [op for op in ir.ops if op.cost_class == "random"]   # dropout's mask
    streams = ir.streams
    assert streams.handles(draw)
    masks = []
    for g in range(3):
        streams.set("step", 0, g, 0)
        like = torch.zeros(draw.args[0].shape)          # the IR's operand, as a tensor
        masks.append(S.random_kernel(draw, streams)(like, *draw.args[1:]))
    for m in masks:
        assert m.shape == (512, 64) and set(m.unique().tolist()) == {0.0, 1.0}
        assert abs(m.mean().item() - 0.75) < 0.01
    assert not torch.equal(masks[0], masks[1])


def test_random_ops_in_the_model_draw_per_micro_batch():
    """torch.rand_like and torch.randn_like in forward: serial and batched
    runs of several micro-batches agree; each micro-batch draws its own."""
    torch.manual_seed(0)
    net = DropoutNet(extra="rand")
    x, y = torch.randn(4 * 6, 8), torch.randint(0, 3, (4 * 6,))

    def run(batched):
        torch.manual_seed(0)
        n = copy.deepcopy(net)
        opts = quiet_options().deviceIterations(2).randomSeed(9)
        opts.Training.gradientAccumulation(3)
        opts.outputMode(poptorch.OutputMode.All)
        tm = poptorch.trainingModel(n, opts, torch.optim.SGD(n.parameters(), lr=0.1))
        tm.compile(x, y)
        if not batched:
            tm._engine.batch_fn = None
        else:
            assert tm._engine.batch_fn is not None
        return tm(x, y)[0], [p.detach().clone() for p in n.parameters()]
    (a, wa), (b, wb) = run(False), run(True)
    torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-6)
    for p, q in zip(wa, wb):
        torch.testing.assert_close(q, p, rtol=1e-6, atol=1e-7)
    rows = a.reshape(6, 4, 3)
    assert not torch.allclose(rows[0], rows[1])


def test_each_call_draws_afresh():
    torch.manual_seed(0)
    net = DropoutNet()
    x, y = torch.randn(16, 8), torch.randint(0, 3, (16,))

    def model():
        n = copy.deepcopy(net)
        return poptorch.trainingModel(n, quiet_options().randomSeed(1),
                                      torch.optim.SGD(n.parameters(), lr=0.0))
    tm = model()
    first, second = tm(x, y)[0], tm(x, y)[0]
    assert not torch.equal(first, second)
    assert torch.equal(model()(x, y)[0], first)         # from the seed again


def test_the_environment_variable_chooses_eager_streams(monkeypatch):
    torch.manual_seed(0)
    net = DropoutNet()
    x, y = torch.randn(16, 8), torch.randint(0, 3, (16,))
    monkeypatch.setenv("POPTORCHSIM_RANDOM_STREAMS", "eager")
    out, _ = _one_step(None, net, x, y)
    torch.manual_seed(5)
    assert torch.equal(out, copy.deepcopy(net)(x, y)[0])
    monkeypatch.setenv("POPTORCHSIM_RANDOM_STREAMS", "sometimes")
    with pytest.raises(Error, match="POPTORCHSIM_RANDOM_STREAMS='sometimes'"):
        _one_step(None, net, x, y)


def test_a_bad_mode_is_a_clear_error():
    opts = poptorch.Options()
    with pytest.raises(ValueError, match="not a poptorchsim.RandomStreams"):
        opts.randomStreams(3)
    assert not opts.exists("random_streams")
    opts.randomStreams("eager")
    assert opts.random_streams == "eager"


class Shuffles(nn.Module):
    """randperm, randint, normal and uniform in forward."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 3)

    def forward(self, x, y):
        x = x[torch.randperm(x.shape[0])]
        x = x + torch.randint(0, 4, x.shape).float() * 0.01
        x = x + torch.normal(torch.zeros_like(x), 0.1)
        x = x + torch.empty_like(x).uniform_(-0.01, 0.01)
        out = self.lin(x)
        return out, nn.functional.cross_entropy(out, y)


def test_randperm_randint_normal_and_uniform_draw_from_the_streams():
    torch.manual_seed(0)
    net = Shuffles()
    x, y = torch.randn(4 * 6, 8), torch.randint(0, 3, (4 * 6,))
    opts = quiet_options().randomSeed(2)
    opts.Training.gradientAccumulation(6)
    tm = poptorch.trainingModel(net, opts, torch.optim.SGD(net.parameters(), lr=0.0))
    tm.compile(x, y)
    ir = tm.getIR().graphs["training_step"]
    drawn = {op.target.overloadpacket.__name__ for op in ir.ops
             if op.cost_class == "random" and ir.streams.handles(op)}
    assert {"randperm", "randint", "normal", "uniform"} <= drawn
    streams = ir.streams
    streams.set("step", 0, 0, 0)
    for op in ir.ops:
        name = op.target.overloadpacket.__name__
        if name == "randperm":
            perm = S.random_kernel(op, streams)(4)
            assert sorted(perm.tolist()) == [0, 1, 2, 3]
        if name == "randint":
            values = S.random_kernel(op, streams)(0, 4, [4000])
            assert set(values.unique().tolist()) == {0, 1, 2, 3}
        if name == "uniform":
            values = S.random_kernel(op, streams)(torch.zeros(op.outputs[0].shape), -0.01, 0.01)
            assert -0.01 <= values.min() and values.max() < 0.01 and values.std() > 0.005
    assert tm._engine.batch_fn is not None
    tm(x, y)
