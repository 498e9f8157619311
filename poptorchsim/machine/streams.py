"""Counter-based random streams: the numbers a random op draws are a
function of (seed, micro-batch, op), not of the order ops run in.

The IPU seeds its random number generators from ``Options.randomSeed``; each
replica and micro-batch then draws its own numbers, whatever else runs.  The
host does the same here.  Every micro-batch (and every optimizer update, and
every inference call) gets a *key*, two 32-bit words derived from the seed,
the call, the device iteration, the accumulation step and the replica
(``Streams.key_of``).  An op draws from the stream of its key and its own id:
element ``j`` of its draw is a keyed hash of ``j`` (``words``, two rounds of
a 32-bit integer mix, in int32 tensor arithmetic over ``j``; the key's words
are mixed as Python integers).  So

* a micro-batch draws the same numbers whether the micro-batches run one
  after another or as one ``torch.func.vmap`` call (the key is then one row
  of a batched tensor; a draw's vmap rule, ``_Rows``, draws each row from
  its own key): programs with dropout and stochastic rounding batch their
  micro-batches as others do (``batching.serial_reason``);
* the numbers are the same on every device (integer arithmetic; the CPU and
  a GPU compute the same hash);
* a run repeats bit for bit from its seed.

``RandomStreams.Eager`` keeps PyTorch's own generator, drawn in eager order
(micro-batches then run one after another): the same dropout masks as plain
PyTorch under the same ``torch.manual_seed``, which is what tests comparing
with eager PyTorch bit for bit want.  Stochastic rounding always reads its
bits from the counter-based streams (it has no eager counterpart).

Stochastic rounding needs a 13-bit integer per value rounded, for every fp16
result: hashing each would cost more than the rounding itself, so its bits
are windows into a pool of integers drawn once from the seed, each window
starting at a keyed hash of the op (``Streams.window``): value ``j`` of an
op's result reads ``pool[(start + j) mod POOL]``, the same in a serial and a
batched run.
"""
import functools
import hashlib
import math

import torch

from ..ir.interfaces import RandomStreams
from . import vmap_rules

MASK32 = 0xFFFFFFFF
POOL = 1 << 22              # stochastic rounding's pool of random integers
DROPPED = 1 << 13           # bits below fp16's mantissa in an fp32 (rounding.py)


def _signed(c):
    """The int32 with the bits of the 32-bit unsigned ``c``."""
    c &= MASK32
    return c - (1 << 32) if c >= 1 << 31 else c


def mix32(x):
    """A bijective 32-bit integer hash (Wellons' ``lowbias32``: xor-shifts and
    two odd multipliers) of an int32 tensor holding 32-bit unsigned values
    as their bits: int32 products wrap modulo 2**32 and the shifts are made
    logical by masking, so that it computes ``mix32_int`` bit for bit
    (``tests/test_random_streams.py`` checks it against the integers)."""
    x = x ^ ((x >> 16) & 0xFFFF)
    x = x * 0x7FEB352D
    x = x ^ ((x >> 15) & 0x1FFFF)
    x = x * _signed(0x846CA68B)
    return x ^ ((x >> 16) & 0xFFFF)


def mix32_int(x):
    """``mix32`` of a Python integer in [0, 2**32)."""
    x ^= x >> 16
    x = (x * 0x7FEB352D) & MASK32
    x ^= x >> 15
    x = (x * 0x846CA68B) & MASK32
    return x ^ (x >> 16)


def _splitmix(x):
    """SplitMix64's output function, on a Python integer (host-side keys)."""
    x = (x + 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return x ^ (x >> 31)


def derive_key(*parts):
    """Two 32-bit words from integers (seed, kind, call, ...), as an int32
    tensor of shape [2] (their bits)."""
    h = 0
    for p in parts:
        h = _splitmix(h ^ (int(p) & 0xFFFFFFFFFFFFFFFF))
    return torch.tensor([_signed(h), _signed(h >> 32)], dtype=torch.int32)


def _op_key(key, stream):
    """The key of one op's stream: the micro-batch's key (two integers in
    [0, 2**32)) mixed with the op's id."""
    s = int(stream) & MASK32
    return (mix32_int(key[0] ^ ((s * 0x9E3779B1) & MASK32)),
            mix32_int(key[1] ^ mix32_int(s ^ 0x5BD1E995)))


def words(key, stream, n, device=None):
    """``n`` uniform 32-bit integers of ``stream`` under ``key`` (two
    integers), as an int32 tensor of their bits: element ``j`` is
    ``mix32(mix32(j ^ k0) ^ k1)`` for the op's key words."""
    k0, k1 = _op_key(key, stream)
    j = torch.arange(n, dtype=torch.int32, device=device)
    return mix32(mix32(j ^ _signed(k0)) ^ _signed(k1))


def unsigned(w):
    """int32 bits as the unsigned values (int64)."""
    return w.to(torch.int64) & MASK32


def draw_pool(seed):
    """Stochastic rounding's pool: ``POOL`` uniform integers in [0, 2**13)
    drawn from ``seed``, held as int16 (a rounding reads fewer bytes)."""
    g = torch.Generator().manual_seed(int(seed))
    return torch.randint(0, DROPPED, (POOL,), dtype=torch.int32, generator=g).to(torch.int16)


def uniform(key, stream, shape, device=None):
    """float32 values in [0, 1) on a 2**-24 grid, of ``shape``."""
    w = words(key, stream, math.prod(shape), device)
    return (((w >> 8) & 0xFFFFFF).to(torch.float32) * (1.0 / (1 << 24))).reshape(tuple(shape))


def normal(key, stream, shape, device=None):
    """Standard normal float32 values (Box-Muller on two uniform streams)."""
    u1 = uniform(key, stream, shape, device)
    u2 = uniform(key, int(stream) ^ 0x2545F491, shape, device)
    radius = torch.sqrt(-2.0 * torch.log1p(-u1))        # 1 - u1 in (0, 1]
    return radius * torch.cos((2 * torch.pi) * u2)


def key_ints(key):
    """A key tensor's two words as integers in [0, 2**32)."""
    return int(key[0]) & MASK32, int(key[1]) & MASK32


def loop_key(key, k):
    """The key of iteration ``k`` of a loop run under ``key`` (a tensor)."""
    k0, k1 = key_ints(key)
    step = int(k) & MASK32
    return torch.tensor([_signed(mix32_int(k0 ^ mix32_int(step))), _signed(mix32_int(k1 ^ step))],
                        dtype=torch.int32)


class _Rows(torch.autograd.Function):
    """``fn(key words)``, a tensor drawn under ``key``; under ``vmap``
    (micro-batches run as one call, ``key`` one row per micro-batch), ``fn``
    once per row with that row's words, stacked: what each row draws
    serially, with the keys hashed as integers rather than as batched
    tensors (whose many tiny operations cost more than the draw)."""

    @staticmethod
    def forward(key, fn):
        return fn(key_ints(key))

    @staticmethod
    def setup_context(ctx, inputs, output):
        pass

    @staticmethod
    def vmap(info, in_dims, key, fn):
        if in_dims[0] is None:
            row = fn(key_ints(key))
            return row.expand((info.batch_size,) + row.shape), 0
        keys = key.movedim(in_dims[0], 0).tolist()
        return torch.stack([fn((k0 & MASK32, k1 & MASK32)) for k0, k1 in keys]), 0


# random-class ops that draw nothing (their results follow from their operands)
_DRAW_NOTHING = ("native_dropout_backward",)


def draws(op):
    """Does ``op`` (a "random"-class IR op) draw random numbers?"""
    name = getattr(getattr(op.target, "overloadpacket", None), "__name__", "")
    return op.cost_class == "random" and name not in _DRAW_NOTHING


class Window:
    """Stochastic rounding's bits for one result: value ``j`` reads
    ``pool[(start + j) mod POOL]``."""

    def __init__(self, pool, start):
        self.pool, self.start = pool, int(start)

    def range(self, first, n):
        """The bits of values ``first`` .. ``first + n - 1``, int32."""
        begin = (self.start + first) % POOL
        if begin + n <= POOL:
            return self.pool[begin:begin + n]
        return self.pool[(begin + torch.arange(n, device=self.pool.device)) % POOL]

    def at(self, positions):
        """The bits of the values at ``positions`` (an int64 tensor)."""
        return self.pool[(self.start + positions) % POOL]


class Windows:
    """The bits of ``len(starts)`` results of ``n`` values each, stacked
    (one per micro-batch of a batched call): value ``j`` of result ``i``
    reads ``Window(pool, starts[i])``'s bit ``j``.  Rounding the stacked
    results with these gives each the values it gets alone."""

    def __init__(self, pool, starts, n):
        self.first = [int(s) for s in starts]          # each row's start, as integers
        self.rows = [Window(pool, s) for s in self.first]
        self.pool, self.n = pool, int(n)

    @functools.cached_property
    def starts(self):
        """The rows' starts as an int64 tensor on the pool's device, made at
        first use (a CPU rounding reads ``first``), sent without waiting for
        the device (a GPU's queue runs on)."""
        return torch.tensor(self.first, dtype=torch.int64).to(self.pool.device,
                                                               non_blocking=True)

    def range(self, first, count):
        parts, pos, end = [], first, first + count
        while pos < end:
            i, j = divmod(pos, self.n)
            take = min(self.n - j, end - pos)
            parts.append(self.rows[i].range(j, take))
            pos += take
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def at(self, positions):
        i, j = positions // self.n, positions % self.n
        return self.pool[(self.starts[i] + j) % POOL]


class Streams:
    """The random streams of one executable: its seed, the key of the
    micro-batch (or update, or inference call) running now, and
    stochastic rounding's pool.

    ``mode``: "counter" (random ops draw from the streams) or "eager"
    (random ops use PyTorch's generator in eager order; stochastic rounding
    still reads the streams)."""

    def __init__(self, seed=None, process_id=0, mode="counter"):
        if seed is None:
            # no randomSeed: PyTorch's generator decides (torch.manual_seed,
            # and what was drawn since), its state read without drawing
            # from it, so that the eager order is kept
            state = hashlib.blake2b(torch.random.get_rng_state().numpy().tobytes(),
                                    digest_size=8).digest()
            seed = int.from_bytes(state, "little") >> 2
        self.seed = (int(seed) * 1_000_003 + int(process_id)) % (2 ** 63)
        self.mode = mode
        self.calls = 0                          # calls run (each gives fresh keys)
        self.key = derive_key(self.seed)        # the key in force (set per micro-batch)
        self.batched = False                    # ``key`` is a row of a vmapped call
        self._ints = (None, None)               # (key, its two words as integers)
        self._pools = {}

    def __getstate__(self):
        return {"seed": self.seed, "mode": self.mode, "calls": self.calls}

    def __setstate__(self, state):
        Streams.__init__(self, 0, 0, state["mode"])
        self.seed, self.calls = state["seed"], state["calls"]
        self.key = derive_key(self.seed)

    # -- keys -----------------------------------------------------------------------
    KINDS = {"step": 0, "update": 1, "forward": 2}

    def key_of(self, kind, *where):
        """The key of a micro-batch (``kind`` "step": device iteration,
        accumulation step, replica), an optimizer update ("update": its
        index in the call) or an inference micro-batch ("forward": device
        iteration, replica) of the current call."""
        return derive_key(self.seed, self.KINDS[kind], self.calls, *where)

    def set(self, kind, *where):
        self.key, self.batched = self.key_of(kind, *where), False

    @property
    def current(self):
        """The key in force, as two integers (not in a batched call)."""
        if self._ints[0] is not self.key:
            self._ints = (self.key, key_ints(self.key))
        return self._ints[1]

    # -- random ops -------------------------------------------------------------------
    def handles(self, op):
        """Does ``op`` draw from the streams (rather than PyTorch's generator)?"""
        return self.mode == "counter" and random_kernel(op, self) is not None

    # -- stochastic rounding's bits -------------------------------------------------------
    def pool(self, device):
        """Stochastic rounding's pool on ``device`` (drawn once, copied to each device)."""
        kept = self._pools.get(device)
        if kept is not None:        # (a rounding asks for it: no device parsed then)
            return kept
        cpu = torch.device("cpu")
        device = torch.device(device) if device is not None else cpu
        if cpu not in self._pools:
            self._pools[cpu] = draw_pool(self.seed)
        if device not in self._pools:
            self._pools[device] = self._pools[cpu].to(device)
        return self._pools[device]

    def draw(self, fn):
        """``fn(key words)`` under the key in force: in a batched call, once
        per row with its own key (``_Rows``)."""
        if self.batched:
            return vmap_rules.apply(_Rows, self.key, fn)
        return fn(self.current)

    @staticmethod
    def window_start(key, stream):
        """Where result ``stream``'s window starts under ``key`` (two
        integers): word 0 of its stream."""
        k0, k1 = _op_key(key, stream)
        return mix32_int(mix32_int(k0) ^ k1) % POOL

    def window(self, stream, device=None):
        """The ``Window`` of result ``stream`` under the key in force (not
        in a batched call: ``rounding.Rounding.round`` takes those)."""
        return Window(self.pool(device), self.window_start(self.current, stream))


# -- the random ops, drawn from the streams ------------------------------------------------

def _shape_of(op):
    return tuple(op.outputs[0].shape)


def random_kernel(op, streams):
    """The host function of random ``op`` drawing from ``streams`` (stream:
    the op's id), or None where the op has no counter-based form here
    (it then draws from PyTorch's generator, in order)."""
    target = op.target
    name = getattr(getattr(target, "overloadpacket", None), "__name__", "")
    overload = getattr(target, "_overloadname", "")
    if not op.outputs or op.outputs[0] is None:
        return None
    shape, out_dtype, stream = _shape_of(op), op.outputs[0].dtype, op.id

    def draw_uniform(device):
        return streams.draw(lambda key: uniform(key, stream, shape, device))

    def draw_normal(device):
        return streams.draw(lambda key: normal(key, stream, shape, device))

    if name == "native_dropout":
        def native_dropout(x, p, train=True):
            if train is False:
                return x.clone(), torch.ones_like(x, dtype=torch.bool)
            if p >= 1:
                return torch.zeros_like(x), torch.zeros_like(x, dtype=torch.bool)
            keep = draw_uniform(x.device) >= p
            return x * keep.to(x.dtype) * (1.0 / (1.0 - p)), keep
        return native_dropout
    if name == "bernoulli" and overload in ("", "default", "p", "Tensor"):
        def bernoulli(x, p=None, generator=None):
            prob = x if p is None else p
            return (draw_uniform(x.device) < prob).to(x.dtype)
        return bernoulli
    if name in ("rand", "rand_like", "randn", "randn_like"):
        gaussian = name.startswith("randn")

        def rand(*args, dtype=None, layout=None, device=None, pin_memory=None,
                 memory_format=None, generator=None):
            if device is None and args and isinstance(args[0], torch.Tensor):
                device = args[0].device
            values = draw_normal(device) if gaussian else draw_uniform(device)
            return values.to(out_dtype)
        return rand
    if name == "uniform" and overload in ("", "default"):
        def uniform_(x, low=0.0, high=1.0, generator=None):
            return (low + (high - low) * draw_uniform(x.device)).to(x.dtype)
        return uniform_
    if name == "normal" and overload in ("Tensor_float", "float_Tensor", "Tensor_Tensor",
                                         "float_float"):
        def normal_(mean, std, *args, generator=None, dtype=None, layout=None, device=None,
                    pin_memory=None):
            tensors = [a for a in (mean, std) if isinstance(a, torch.Tensor)]
            device = tensors[0].device if tensors else device
            return (mean + std * draw_normal(device)).to(out_dtype)
        return normal_
    if name == "randint":
        def randint(*args, dtype=None, layout=None, device=None, pin_memory=None,
                    generator=None):
            if overload == "low" or (len(args) == 3):
                low, high = args[0], args[1]
            else:
                low, high = 0, args[0]
            n = math.prod(shape)
            w = streams.draw(lambda key: unsigned(words(key, stream, n, device)))
            return (low + w % max(int(high) - int(low), 1)).reshape(shape).to(out_dtype)
        return randint
    if name == "randperm" and overload in ("", "default"):
        def randperm(n, dtype=None, layout=None, device=None, pin_memory=None,
                     generator=None):
            w = streams.draw(lambda key: unsigned(words(key, stream, int(n), device)))
            return torch.argsort(w, stable=True).to(out_dtype)
        return randperm
    return None


# the IR's protocol (ir/interfaces.py), held to by the type checker
_CHECKED: type[RandomStreams] = Streams
