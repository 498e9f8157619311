"""Stochastic rounding of a CPU tensor in one pass, compiled by numba.

``rounding.stochastic_round`` written as PyTorch operations makes ten passes
over the values (the sign, the magnitude, the subnormal shift, the bits
added, the bits cleared, the sign put back, the cast), about 2 ns a value on
a 2-core machine.  An fp16 program with stochastic rounding rounds every
fp16 result it makes: in a GPT-2 step that cost twice the fp32 step.  This
is the same rounding as one loop, compiled once by numba (``cache=True``:
on disk beside this file, so a later process loads it), and gives the same
values bit for bit (``tests/test_precision.py`` checks it against the
PyTorch form on normal, subnormal, huge, infinite and NaN values).

It is used where numba is installed (``pip install poptorchsim[fast]``;
``make test`` installs it) and the tensor is on the CPU.  Without numba,
on a GPU, or with ``POPTORCHSIM_NUMBA=0``, the PyTorch form runs.

Per value, with ``r`` its 13 random bits and ``m`` the magnitude's bits:

* ``m`` below fp16's smallest normal (2**-14): the magnitude moved up by
  2**-14 (its bits then 0x38800000 plus the magnitude in units of 2**-37,
  rounded to nearest even, as the fp32 addition does), ``r`` added, 13 bits
  cleared, moved back: the fp16 subnormal's bits are the magnitude in units
  of 2**-37 plus ``r``, shifted down 13 bits (0x38800000 is a multiple of
  2**13, so adding and removing it changes nothing);
* a NaN: fp16's quiet NaN, with the sign;
* otherwise: ``r`` added, 13 bits cleared; an exponent past fp16's (15)
  gives infinity; else fp16's exponent and the top 10 mantissa bits.
"""
import os
import threading
from typing import Any

import numpy as np
import torch

from .streams import POOL, mix32_int

try:
    import numba
    from llvmlite import ir as llvm_ir
    from numba import njit, prange, types
    from numba.extending import intrinsic
except ImportError:             # the PyTorch form runs (rounding.py)
    njit = None

_I = np.int32


def available():
    """Can the compiled kernel run here (numba installed, not switched off)?"""
    return njit is not None and os.environ.get("POPTORCHSIM_NUMBA", "1") != "0"


_threaded: dict[str, Any] = {"pid": None, "failed": False}   # the process using numba's threads


def _use_threads(n):
    """Round ``n`` values on numba's threads?  From 2 chunks, with as many
    threads as PyTorch's intra-op threads (``torch.set_num_threads``; a
    data loader's worker sets 1), and only in the process that first used
    them: GNU OpenMP terminates a forked child that starts its threads
    again ("fork() called from a process already using GNU OpenMP"), so a
    forked child rounds on one thread."""
    if n < 2 * _CHUNK or _threaded["failed"]:
        return False
    want = max(1, min(torch.get_num_threads(), numba.config.NUMBA_NUM_THREADS))
    if want < 2:
        return False
    if _threaded["pid"] is None:
        _threaded["pid"] = os.getpid()
    if _threaded["pid"] != os.getpid():
        return False
    # numba's thread count is per Python thread; read back (it costs more than
    # a rounding of a small result) only when this thread has not set it to this
    mine = (threading.get_ident(), want)
    if _threaded.get("set") != mine:
        if numba.get_num_threads() != want:
            numba.set_num_threads(want)
        _threaded["set"] = mine
    return True


def _segment(bits, values, pool, first_bit, first, count, out):
    """Values ``first`` .. ``first + count - 1`` rounded with the bits at
    ``first_bit`` .. of ``pool``: every value both ways (normal and
    subnormal), then the one that applies chosen, so that the loop has no
    branch and compiles to vector instructions (a branch made it 3x slower;
    so did indexing with offsets rather than slicing first).  Every
    intermediate is cast back to int32: numba computes int32 arithmetic in
    int64, and the mixed widths kept the loop from vectorizing (3.5x slower
    on a 917,504-value result, bit for bit the same values)."""
    bits, values = bits[first:first + count], values[first:first + count]
    pool, out = pool[first_bit:first_bit + count], out[first:first + count]
    for k in range(count):
        r = _I(pool[k])
        i = bits[k]
        m = _I(i & _I(0x7FFFFFFF))
        h = min(_I(_I(_I(m + r) >> _I(13)) - _I(112 << 10)), _I(0x7C00))   # fp16's bits; inf
        # the subnormal way: |x| in units of 2**-37 (exact in fp32, rounded to even)
        t = _I(np.rint(abs(values[k]) * np.float32(137438953472.0)))
        low = _I(_I(t + r) >> _I(13))
        h = low if m < _I(0x38800000) else h
        h = _I(0x7E00) if m > _I(0x7F800000) else h            # NaN
        out[k] = np.int16(_I(_I(i >> _I(16)) & _I(0x8000)) | h)


def _segment_wide(bits, values, pool, first_bit, first, count, out):
    """``_segment`` with its fp16 results written in fp32 (int32 bits: the
    fp16 value exactly, what ``.float()`` of ``_segment``'s result gives),
    for ops whose consumers compute in fp32 anyway (``codegen.py``'s wide
    values), as the PyTorch form computes it: a magnitude below fp16's
    smallest normal moved up by 2**-14 (an fp32 addition, rounded to
    nearest even: the magnitude in units of 2**-37), ``r`` added, 13 bits
    cleared, moved back down (exact); infinity from fp16's overflow on
    (2**16 and up), a NaN fp32's quiet NaN.  (18% faster than the
    subnormal way ``_segment`` takes, the same bits: tests/test_wide_values.py.)"""
    bits, values = bits[first:first + count], values[first:first + count]
    pool, out = pool[first_bit:first_bit + count], out[first:first + count]
    for k in range(count):
        r = _I(pool[k])
        i = bits[k]
        m = _I(i & _I(0x7FFFFFFF))
        up = np.float32(2.0 ** -14) if m < _I(0x38800000) else np.float32(0.0)
        w = _I(_I(_f32_bits(abs(values[k]) + up) + r) & _I(-8192))
        w = _f32_bits(_bits_f32(w) - up)
        w = _I(0x7F800000) if w >= _I(0x47800000) else w           # past 65504: infinity
        w = _I(0x7FC00000) if m > _I(0x7F800000) else w            # NaN
        out[k] = _I(i & _I(-2147483648)) | w


def _rows(bits, values, pool, starts, n, out):
    for row in range(starts.size):
        done = 0
        while done < n:                 # a window wraps around the end of the pool
            first_bit = (starts[row] + done) % POOL
            count = min(n - done, POOL - first_bit)
            if out.itemsize == 4:       # fp32 results (``wide``)
                _segment_wide_compiled(bits, values, pool, first_bit, row * n + done, count,
                                       out)
            else:
                _segment_compiled(bits, values, pool, first_bit, row * n + done, count, out)
            done += count


_CHUNK = 1 << 16        # values a thread rounds at a time (``_rows_parallel``)


def _rows_parallel(bits, values, pool, starts, n, out):
    """``_rows`` on numba's threads: the values cut into chunks of ``_CHUNK``
    (each chunk's values read the bits ``_rows`` gives them)."""
    total = starts.size * n
    for c in prange((total + _CHUNK - 1) // _CHUNK):
        k = c * _CHUNK
        end = min(total, k + _CHUNK)
        while k < end:
            row = k // n
            done = k - row * n
            first_bit = (starts[row] + done) % POOL
            count = min(end - k, n - done, POOL - first_bit)
            if out.itemsize == 4:
                _segment_wide_compiled(bits, values, pool, first_bit, k, count, out)
            else:
                _segment_compiled(bits, values, pool, first_bit, k, count, out)
            k += count


def _starts(keys, stream, out):
    """``streams.Streams.window_start`` of result ``stream`` under each row
    of ``keys`` (int64, rows x 2, words in [0, 2**32))."""
    s = stream & 0xFFFFFFFF
    a = (s * 0x9E3779B1) & 0xFFFFFFFF
    b = _mix32_compiled(s ^ 0x5BD1E995)
    for row in range(keys.shape[0]):
        k0 = _mix32_compiled(keys[row, 0] ^ a)
        k1 = _mix32_compiled(keys[row, 1] ^ b)
        out[row] = _mix32_compiled(_mix32_compiled(k0) ^ k1) % POOL


if njit is not None:
    @intrinsic
    def _f32_bits(typingctx, value):
        """An fp32 value's bits as an int32 (a bit cast, no instruction)."""
        def codegen(context, builder, signature, args):
            return builder.bitcast(args[0], llvm_ir.IntType(32))
        return types.int32(types.float32), codegen

    @intrinsic
    def _bits_f32(typingctx, value):
        """An int32's bits as an fp32 value (a bit cast, no instruction)."""
        def codegen(context, builder, signature, args):
            return builder.bitcast(args[0], llvm_ir.FloatType())
        return types.float32(types.int32), codegen

    if "NUMBA_THREADING_LAYER" not in os.environ:
        # OpenMP or TBB: safe for rounding from several threads at once
        numba.config.THREADING_LAYER = "threadsafe"
    _mix32_compiled = njit(cache=True, nogil=True)(mix32_int)     # the same hash, compiled
    _starts_compiled = njit(cache=True, nogil=True)(_starts)
    _segment_compiled = njit(cache=True, nogil=True, boundscheck=False)(_segment)
    _segment_wide_compiled = njit(cache=True, nogil=True, boundscheck=False)(_segment_wide)
    _kernel = njit(cache=True, nogil=True, boundscheck=False)(_rows)
    _kernel_parallel = njit(cache=True, nogil=True, boundscheck=False, parallel=True)(
        _rows_parallel)
else:
    _kernel = _kernel_parallel = None


def key_words(keys):
    """Keys (rows of two int32 words: as ``Tensor.tolist`` gives them, or an
    array) as the rows of words in [0, 2**32) that ``starts_of_words`` takes."""
    return np.asarray(keys).astype(np.int64).reshape(-1, 2) & 0xFFFFFFFF


def starts_of_words(words, stream):
    """``window_starts`` of keys already read by ``key_words``."""
    out = np.empty(words.shape[0], dtype=np.int64)
    _starts_compiled(words, int(stream), out)
    return out


def window_starts(keys, stream):
    """Where result ``stream``'s windows start under ``keys`` (rows of two
    int32 words: as ``Tensor.tolist`` gives them, or an array), as an int64
    array: ``Streams.window_start`` of each row, in one compiled loop (the
    same integers; ``tests/test_random_streams.py`` checks it)."""
    return starts_of_words(key_words(keys), stream)


def round_rows(x, pool, starts, n, wide=False):
    """``x`` (fp32, CPU) rounded stochastically to fp16: value ``k`` of row
    ``i`` (rows of ``n`` values in memory order) reads bit ``k`` of the
    window at ``starts[i]`` of ``pool`` (int16, ``POOL`` values).  ``wide``:
    the fp16 values returned in fp32 (``_segment_wide``)."""
    if x.dtype != torch.float32:
        x = x.float()
    # (flat views taken on the numpy side: a tensor view costs more than a small
    # result's rounding)
    values = x.contiguous().numpy().reshape(-1)
    out = torch.empty(x.shape, dtype=torch.int32 if wide else torch.int16)
    result = torch.float32 if wide else torch.float16
    if not isinstance(starts, np.ndarray) or starts.dtype != np.int64:
        starts = np.asarray(starts, dtype=np.int64)
    args = (values.view(np.int32), values, pool.numpy(), starts, int(n),
            out.numpy().reshape(-1))
    # on two threads from 2 chunks (1.7-2x faster on a 2-core machine); smaller
    # results on one (the threads' start cost more than they saved)
    if _use_threads(values.size):
        try:
            _kernel_parallel(*args)
            return out.view(result)
        except ValueError:          # no thread-safe threading layer here: one thread
            _threaded["failed"] = True
    _kernel(*args)
    return out.view(result)
