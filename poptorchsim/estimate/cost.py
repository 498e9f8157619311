"""The per-tile cost model: what one op costs as a BSP superstep.

For an op whose result is mapped by ``passes.tile_mapping``, the work on each
tile follows the bytes of the result on that tile (an array over tiles):

* matmul and convolution: multiply-accumulates on the AMP units, each output
  element costing its reduction length; the operands a tile needs arrive over
  the exchange and sit in temporary memory, which the available-memory
  proportion bounds (the planner then serializes, paying extra supersteps);
* element-wise work: bytes through the vector unit, transcendental functions
  at a quarter of that rate;
* reductions: a local pass, then partials exchanged and reduced in a second
  superstep;
* gathers and scatters: indices and selected rows cross the exchange, one
  element addressed at a time;
* sorts and scans: log-depth rounds of compare-exchange (sorting networks);
* views are free; copies cost exchange;
* a loop pays its body per iteration, a conditional its longer branch;
* host ops (a print, a CPU op) pay their tensors' trips over PCIe while the
  device waits (``OpCost.host``);
* host scalars (``op.host_scalar``: the optimizer's float64 scalar
  arithmetic, which the host does, ``passes/host_scalars.py``) cost nothing.

Every superstep pays one sync.  A step's cycles are the sum, over its
supersteps, of the slowest tile.
"""
from dataclasses import dataclass
from dataclasses import replace as _replace
from typing import Optional

import numpy as np

from ..ir.custom import cost_of as custom_cost_of
from . import constants as K
from .conv_ops import passes_of
from .conv_plan import plan as conv_plan
from .layer_costs import embedding_cycles, pool_cycles, reduce_cycles

# Every constant lives in estimate/constants.py with its unit and source; the
# functions below read them at call time (``K.NAME``) so that
# ``constants.overridden`` can vary them (sensitivity analysis).
VERTEX_OVERHEAD = K.VERTEX_OVERHEAD     # the default value, for tests that compare


def _extra_supersteps(name):
    """Compute sets of a matmul/convolution besides its AMP compute set."""
    if name == "convolution":
        return K.CONV_EXTRA_SUPERSTEPS
    if name == "convolution_backward":
        return K.CONV_BACKWARD_EXTRA_SUPERSTEPS
    return K.MATMUL_EXTRA_SUPERSTEPS


def _vector_rate(target):
    return target.vector_bytes / K.CYCLES_PER_VECTOR


def exchange_cycles(nbytes, target):
    """An exchange of ``nbytes`` to the busiest tile: its fixed set-up
    (``EXCHANGE_SETUP_CYCLES``) and the bytes at the effective rate."""
    if nbytes <= 0:
        return 0.0
    return K.EXCHANGE_SETUP_CYCLES + nbytes / (target.exchange_bytes_per_cycle
                                               * K.EXCHANGE_EFFICIENCY)


@dataclass
class OpCost:
    compute: float = 0.0        # cycles of the slowest tile
    exchange: float = 0.0
    sync: float = 0.0
    temp_bytes: object = 0      # temporary bytes per tile (array or 0)
    macs: int = 0
    flops: int = 0
    parts: Optional[dict] = None    # a loop's or conditional's sub-graphs: name -> [OpCost]
    host: float = 0.0           # cycles the device waits on the host (host ops)
    plan: str = ""              # a convolution's or matmul's plan (``conv_plan.Plan.describe``)

    @property
    def total(self):
        return self.compute + self.exchange + self.sync + self.host


def _itemsize(t):
    return t.nbytes // max(t.numel, 1)


def _ceil_to(x, m):
    return -(-x // m) * m


def _channels(op):
    """(reduction channels, output channels) the AMP units see for ``op``.

    AMP units take input channels in groups of 8 (fp32) and produce output
    channels in groups of 16: a convolution with 1 input or 5 output channels
    leaves most of each unit idle."""
    name = op.target.overloadpacket.__name__
    if name == "convolution":
        w = op.args[1]
        return w.shape[1], w.shape[0]
    if name == "convolution_backward":
        w = op.args[2]
        # grad-input swaps the roles of the channels; grad-weight reduces over
        # batch x positions, which fill the units whatever the channels
        if op.outputs[0] is not None:
            return w.shape[0], w.shape[1]
        return 1 << 30, w.shape[0]
    a = op.args[1] if name in ("addmm", "baddbmm", "addmv") else op.args[0]
    out = op.outputs[0]
    return a.shape[-1], (out.shape[-1] if out.shape else 1)


def _macs(op):
    """(MACs, reduction length per output element) of matmul/conv ops."""
    name = op.target.overloadpacket.__name__
    out = op.outputs[0]
    if name in ("mm", "addmm", "bmm", "baddbmm", "matmul", "linear", "mv", "addmv", "dot"):
        a = op.args[1] if name in ("addmm", "baddbmm", "addmv") else op.args[0]
        k = a.shape[-1]
        return out.numel * k, k
    if name == "convolution":
        weight = op.args[1]
        k = weight.numel // weight.shape[0]
        return out.numel * k, k
    if name == "convolution_backward":
        grad_out, inp, weight = op.args[0], op.args[1], op.args[2]
        total = 0
        if op.outputs[0] is not None:          # grad input
            total += inp.numel * (weight.numel // weight.shape[1])
        if op.outputs[1] is not None:          # grad weight
            total += weight.numel * (grad_out.numel // grad_out.shape[1])
        return total, max(1, total // max(grad_out.numel, 1))
    return out.numel, 1


def op_cost(op, target, amp=0.6):
    """The ``OpCost`` of ``op`` on ``target``; tensors must be tile-mapped."""
    cls = op.cost_class
    outs = [t for t in op.outputs if t is not None]
    if op.host_scalar:
        return OpCost()
    if cls in ("loop", "cond"):
        return _control_flow_cost(op, target, amp)
    if cls == "host":
        return _host_cost(op, target)
    if cls == "view" or not outs:
        return OpCost()
    if cls in ("elementwise", "transcendental", "random", "creation"):   # no layer cost
        out_max = float(outs[0].mapping.max_bytes()) if len(outs) == 1 else float(
            sum(t.mapping.bytes_per_tile(target.tiles) for t in outs).max())
        per_cycle = _vector_rate(target) * {"transcendental": K.TRANSCENDENTAL_RATE,
                                           "random": K.RANDOM_RATE,
                                           "creation": K.CREATION_RATE}.get(cls, 1.0)
        cost = OpCost(compute=out_max / per_cycle + K.VERTEX_OVERHEAD, sync=target.sync_cycles,
                      flops=sum(t.numel for t in outs))
        # Inputs of the same size mapped elsewhere travel over the exchange.
        size, at, moved = outs[0].nbytes, outs[0].mapping, 0.0
        for t in op.input_tensors():
            m, nbytes = t.mapping, t.nbytes
            if m is not None and nbytes == size and (m.start, m.n_tiles) != (at.start, at.n_tiles):
                moved += out_max
            elif m is not None and nbytes < size:
                moved += min(nbytes, out_max)           # broadcast operand
        cost.exchange = exchange_cycles(moved, target)
        return cost
    tiles = target.tiles
    if len(outs) == 1:
        out_bytes = outs[0].mapping.bytes_per_tile(tiles)
        out_max = float(outs[0].mapping.max_bytes())
    else:
        out_bytes = sum(t.mapping.bytes_per_tile(tiles) for t in outs)
        out_max = float(out_bytes.max())
    item = max(_itemsize(outs[0]), 1)
    sync = target.sync_cycles
    cost = OpCost(sync=sync)

    if cls in ("matmul", "conv", "rnn"):
        if op.available_memory is not None:
            amp = op.available_memory
        plan = _rnn_cost if cls == "rnn" else _plan_matmul
        return plan(op, target, amp, outs, item, cost)

    layer = _layer_cost(op, target, item)
    if layer is not None:
        compute, exchange, steps = layer
        cost.compute = compute
        cost.exchange = exchange + (K.EXCHANGE_SETUP_CYCLES if exchange > 0 else 0)
        cost.sync = steps * sync
        cost.flops = sum(t.numel for t in op.input_tensors())
        return cost

    if cls == "custom":
        return _custom_cost(op, target, outs, out_bytes, cost)
    if cls == "gather":
        return _gather_cost(op, target, outs, out_max, item, cost)
    if cls == "sort":
        return _sort_cost(op, target, outs, cost)

    ins = op.input_tensors()
    in_bytes = sum(t.nbytes for t in ins)
    spread_in = float(max((t.mapping.max_bytes() for t in ins), default=0))
    if cls in ("reduction", "softmax", "loss", "norm", "pool"):
        passes = {"reduction": 1, "pool": 1, "softmax": K.SOFTMAX_PASSES,
                  "loss": K.SOFTMAX_PASSES, "norm": K.NORM_PASSES}[cls]
        cost.compute = passes * spread_in / _vector_rate(target) + 2 * K.VERTEX_OVERHEAD
        partials = min(in_bytes, tiles * item * max(1, sum(t.numel for t in outs) // tiles + 1))
        cost.exchange = exchange_cycles(partials / max(1, outs[0].mapping.n_tiles)
                                         + out_max, target)
        cost.sync = 2 * sync
        cost.flops = passes * sum(t.numel for t in ins)
        return cost

    # copies and rearrangements: data moves over the exchange
    cost.exchange = exchange_cycles(out_max, target)
    cost.compute = out_max / _vector_rate(target) + K.VERTEX_OVERHEAD
    return cost


_REDUCTIONS = ("sum", "amax", "amin", "mean", "prod", "max", "min", "logsumexp", "norm",
               "linalg_vector_norm")


def _layer_cost(op, target, item):
    """(compute, exchange, supersteps) of max pooling, a reduction over
    dimensions or an embedding lookup or its gradient at Poplar's vertex
    rates (``layer_costs``); None for any other op."""
    name = op.target.overloadpacket.__name__
    outs = [t for t in op.outputs if t is not None]
    if name in ("max_pool2d_with_indices", "max_pool2d_with_indices_backward"):
        backward = name.endswith("backward")
        x = op.args[1] if backward else op.args[0]
        y = op.args[0] if backward else outs[0]
        if len(x.shape) != 4:
            return None
        kernel = op.args[2] if backward else op.args[1]
        kernel = list(kernel) * 2 if len(kernel) == 1 else list(kernel)
        return pool_cycles(x.shape[0], x.shape[1], x.shape[2], x.shape[3], y.shape[2],
                           y.shape[3], kernel[:2], item, backward, target.tiles)
    if op.cost_class == "reduction" and name in _REDUCTIONS and outs and op.args:
        x = op.args[0]
        if getattr(x, "mapping", None) is None or x.numel <= outs[0].numel:
            return None
        return reduce_cycles(x.numel, outs[0].numel, x.mapping.n_tiles, _itemsize(x),
                             target.tiles)
    if name == "embedding":
        w, idx = op.args[0], op.args[1]
        return embedding_cycles(w.shape[0], w.shape[1], idx.numel, _itemsize(w), False,
                                target.tiles)
    if name == "embedding_dense_backward":
        grad, idx, rows = op.args[0], op.args[1], op.args[2]
        width = grad.shape[-1]
        compute, exchange, steps = embedding_cycles(rows, width, idx.numel, _itemsize(grad),
                                                    True, target.tiles)
        # the dense gradient starts as zeros
        zero = rows * width * _itemsize(grad) / target.tiles / (2 * _vector_rate(target))
        return compute + zero + K.VERTEX_OVERHEAD, exchange, steps + 1
    return None


def _host_cost(op, target):
    """An op the host runs while the device waits (a print, a CPU op): its
    inputs stream to the host and, for a CPU op, its results stream back,
    each tensor one host copy (bytes over PCIe plus the copy latency); the
    device syncs before and after.  A print's result is its input, still on
    the device: nothing comes back."""
    ins = op.input_tensors()
    returns = op.target.overloadpacket.__name__ == "host_call"
    back = [t for t in op.outputs if t is not None] if returns else []
    copies = len(ins) + len(back)
    nbytes = sum(t.nbytes for t in ins) + sum(t.nbytes for t in back)
    seconds = nbytes / target.host_bytes_per_s + copies * target.host_latency_s
    return OpCost(sync=2 * target.sync_cycles, host=seconds * target.clock_hz)


def _control_flow_cost(op, target, amp):
    """A loop or conditional: its sub-graphs' op costs (kept in ``parts``;
    memory planning reads their temporary buffers), combined by
    ``_combine``."""
    parts = {name: [op_cost(inner, target, amp) for inner in sub.ops]
             for name, sub in op.subgraphs.items()}
    return _combine(op, parts, target)


_KINDS = ("compute", "exchange", "sync", "host", "macs", "flops")


def _combine(op, parts, target, taken=None):
    """A loop pays its body ``count`` times, and per iteration one compute set
    that advances the counter and branches (a sync) plus the copy of the
    body's results into the next iteration's inputs.  A conditional sends
    its condition to the control program (a sync) and pays one branch: at
    compile time the longer one (which branch runs is known only on the
    device); given ``taken`` = [then count, else count] observed on the
    device, the branches in that proportion."""
    totals = {name: {k: sum(getattr(c, k) for c in costs) for k in _KINDS}
              for name, costs in parts.items()}
    sync = target.sync_cycles
    if op.cost_class == "loop":
        n, body = op.attrs["count"], totals["body"]
        carried = sum(float(t.mapping.max_bytes()) for t in op.outputs if t is not None)
        return OpCost(compute=n * (body["compute"] + K.VERTEX_OVERHEAD),
                      exchange=n * (body["exchange"] + exchange_cycles(carried, target)),
                      sync=n * (body["sync"] + sync), host=n * body["host"],
                      macs=n * body["macs"], flops=n * body["flops"], parts=parts)
    if taken and sum(taken):
        weights = {"then": taken[0] / sum(taken), "else": taken[1] / sum(taken)}
    else:
        longest = max(totals, key=lambda name: sum(totals[name][k] for k in _KINDS[:4]))
        weights = {name: float(name == longest) for name in totals}
    paid = {k: sum(weights[name] * totals[name][k] for name in totals) for k in _KINDS}
    return OpCost(compute=paid["compute"] + K.VERTEX_OVERHEAD,
                  exchange=paid["exchange"] + exchange_cycles(4, target),
                  sync=paid["sync"] + sync, host=paid["host"], macs=int(paid["macs"]),
                  flops=int(paid["flops"]), parts=parts)


def with_branches_taken(op, cost, taken, target):
    """``cost`` of ``op`` with every conditional inside it paying the branches
    the device took (``taken``: op name -> [then count, else count])."""
    if not cost.parts:
        return cost
    parts = {name: [with_branches_taken(inner, c, taken, target)
                    for inner, c in zip(sub.ops, cost.parts[name])]
             for name, sub in op.subgraphs.items()}
    return _combine(op, parts, target, taken.get(op.name))


def _custom_cost(op, target, outs, out_bytes, cost):
    """A user's custom op (``register_custom_op``): the worker cycles and
    temporary bytes its author declared (``ir.custom.CustomCost``), spread
    over the tiles as its result is, each tile's six workers sharing that
    tile's part; inputs mapped elsewhere cross the exchange first."""
    declared = custom_cost_of(op.target)
    ins = op.input_tensors()
    shapes = ([t.shape for t in ins], [t.shape for t in outs])
    share = out_bytes / max(float(out_bytes.sum()), 1.0)
    work = share * declared.worker_cycles(*shapes) / target.workers
    cost.compute = float(work.max()) + K.VERTEX_OVERHEAD
    moved = 0.0
    home = (outs[0].mapping.start, outs[0].mapping.n_tiles)
    for t in ins:
        m = t.mapping
        if m is not None and (m.start, m.n_tiles) != home:
            moved += min(float(m.max_bytes()), float(out_bytes.max()))
    cost.exchange = exchange_cycles(moved, target)
    cost.temp_bytes = share * declared.temporary_bytes(*shapes)
    cost.flops = sum(t.numel for t in outs)
    return cost


def _gather_cost(op, target, outs, out_max, item, cost):
    """Indexed reads and writes (gather, scatter, index, embedding): the
    indices and the rows they select cross the exchange, and each element is
    addressed on its own, so the vector unit moves one element (not one
    64-bit vector) per ``CYCLES_PER_VECTOR`` cycles."""
    ints = [t for t in op.input_tensors() if not t.dtype.is_floating_point]
    index_bytes = max((t.mapping.max_bytes() for t in ints), default=0)
    cost.exchange = exchange_cycles(out_max + index_bytes, target)
    cost.compute = out_max * K.CYCLES_PER_VECTOR / item + K.VERTEX_OVERHEAD
    cost.sync = 2 * target.sync_cycles           # exchange indices, then rows
    return cost


_SORTS = ("sort", "topk", "kthvalue", "median", "nanmedian", "mode", "argsort", "msort")


def _sort_cost(op, target, outs, cost):
    """Sorting networks and scans: ``r = ceil(log2 n)`` over the ``n``
    elements of the sorted dimension.  A bitonic sort takes r(r+1)/2
    compare-exchange rounds, a scan (cumsum, searchsorted) r rounds; each
    round passes over the tile's data, and the rounds whose partners sit on
    other tiles exchange it."""
    ins = op.input_tensors()
    name = op.target.overloadpacket.__name__
    data = ins[-1] if name == "searchsorted" else (ins[0] if ins else outs[0])
    n = _sorted_length(op, data)
    r = max(1, int(np.ceil(np.log2(max(n, 2)))))
    rounds = r * (r + 1) // 2 if name in _SORTS else r
    per_tile = float(data.mapping.max_bytes())
    spread = max(1, data.mapping.n_tiles)
    remote = min(rounds, int(np.ceil(np.log2(spread))) * (r + 1) // 2) if spread > 1 else 0
    cost.compute = rounds * (per_tile / _vector_rate(target) + K.VERTEX_OVERHEAD)
    cost.exchange = remote * exchange_cycles(per_tile, target)
    cost.sync = (1 + remote) * target.sync_cycles
    cost.flops = rounds * data.numel
    return cost


def _sorted_length(op, data):
    """Elements along the dimension ``op`` sorts or scans."""
    if not data.shape:
        return 1
    name = op.target.overloadpacket.__name__
    pos = 2 if name in ("topk", "kthvalue") else 1
    dim = op.kwargs.get("dim", op.args[pos] if len(op.args) > pos else -1)
    if name in ("searchsorted", "bucketize"):
        boundaries = op.args[0] if name == "searchsorted" else op.args[1]
        return boundaries.shape[-1] if getattr(boundaries, "shape", None) else 1
    if not isinstance(dim, int):
        return data.numel
    return data.shape[dim]




def _plan_matmul(op, target, amp, outs, item, cost):
    """Matmul/convolution ``op`` on the AMP units (``_matmul_on_tiles``); a
    convolution of a ``MultiConv`` with its group (``_multiconv_cost``), a
    ``serializedMatMul`` in pieces (``_serialized_matmul``)."""
    if op.attrs.get("multiconv") is not None:
        return _multiconv_cost(op, op.attrs["multiconv"], target, amp, item)
    if op.attrs.get("serialization") is not None:
        return _serialized_matmul(op, op.attrs["serialization"], target, amp, outs, item, cost)
    return _plan_matmul_plain(op, target, amp, outs, item, cost)


def _amp_rate(target, item, partial_item):
    """AMP multiply-accumulates per tile per cycle: fp32 operands, or fp16
    ones with fp16 partials (``partial_item`` 2) or float partials (any
    other; Poplar's default), which run at half the rate on Mk2
    (``Target.amp_macs_fp16_float_partials``, ipu-facts §1b)."""
    if item != 2:
        return target.amp_macs_fp32
    if partial_item == 2:
        return target.amp_macs_fp16
    return target.amp_macs_fp16_float_partials or target.amp_macs_fp16


def _kernel_positions(op):
    """Vertex runs a convolution needs per channel group: ConvPartialnx1 runs
    its workers once per kernel position, taking up to 4 kernel rows at
    once when the input channels leave room in the AMP's weights
    (convUnitWeightHeight 1, 2 or 4: poplibs lib/poplin/PerformanceEstimation.hpp
    l.955-1000).  A grad-weight convolution reduces over the field as a 1x1
    (ConvPartial1x1) run; a matmul is one run."""
    name = op.target.overloadpacket.__name__
    if name not in ("convolution", "convolution_backward"):
        return 1
    w = op.args[1] if name == "convolution" else op.args[2]
    kernel = list(w.shape[2:]) or [1]
    in_ch = w.shape[1] if name == "convolution" else w.shape[0]
    fold = next(f for f in (4, 2, 1) if f <= kernel[0] and f * in_ch <= K.AMP_IN_GROUP
                or f == 1)
    positions = -(-kernel[0] // fold) * int(np.prod(kernel[1:]))
    if name == "convolution":
        return positions
    return (positions if op.outputs[0] is not None else 0) + \
        (1 if len(op.outputs) > 1 and op.outputs[1] is not None else 0)


def _vertex_cycles(positions, k_ch, o_ch, p):
    """The AMP vertex's fixed cycles on the busiest tile: its supervisor code
    (``CONV_VERTEX_CYCLES``) and one worker run per kernel position and
    input/output channel group it holds (``CONV_POSITION_CYCLES``).  Tiles
    share the channel groups before a kernel position is split (that would
    need a reduction), so a tile runs at least every kernel position once."""
    groups = (-(-min(k_ch, 1 << 16) // K.AMP_IN_GROUP)) * (-(-o_ch // K.AMP_OUT_GROUP))
    runs = max(positions, positions * groups / max(p, 1))
    return K.CONV_VERTEX_CYCLES + runs * K.CONV_POSITION_CYCLES


def _matmul_on_tiles(macs, k_ch, o_ch, operand_bytes, out_elems, item, extra, target, amp,
                     cost, partial_item=None, min_serial=1, positions=1):
    """A matmul of ``macs`` multiply-accumulates spread over P tiles, splitting
    output and reduction.

    P = as many tiles as keep each above ``MIN_MACS_PER_TILE``.  The output is
    split over ``p_out`` tiles and the reduction over ``r = P // p_out``.  The
    largest operand is stationary (allocated in the matmul's layout); each tile
    receives its slices of the others (a 2-D split: about their bytes /
    sqrt(P)), and with ``r > 1`` partial sums are exchanged and added in a
    second superstep.  Operand buffers larger than the
    available-memory proportion of a tile are processed in serial chunks.
    """
    tiles = target.tiles
    k_ch, o_ch = max(1, int(k_ch)), max(1, int(o_ch))
    fill = (min(k_ch, K.AMP_IN_GROUP) / _ceil_to(min(k_ch, K.AMP_IN_GROUP), K.AMP_IN_GROUP)
            * o_ch / _ceil_to(o_ch, K.AMP_OUT_GROUP))
    amp_rate = _amp_rate(target, item, partial_item)
    rate = max(_vector_rate(target) / item, amp_rate * fill)   # vector MACs as a floor
    p = int(max(1, min(tiles, macs // K.MIN_MACS_PER_TILE)))
    p_out = int(max(1, min(p, -(-out_elems // K.OUTPUT_GRAIN))))
    r = max(1, p // p_out)
    # The largest operand (usually the weights) is laid out for this matmul and
    # stays put; the others are exchanged, each tile receiving its slices.
    operands = sorted(operand_bytes, reverse=True)
    recv = float(sum(operands[1:])) / np.sqrt(p)
    limit = amp * target.bytes_per_tile
    serial = max(min_serial, int(np.ceil(recv / limit)))
    cost.macs, cost.flops = macs, 2 * macs
    cost.compute = (macs / p / rate + K.VERTEX_OVERHEAD * extra
                    + serial * _vertex_cycles(positions, k_ch, o_ch, p))
    cost.exchange = exchange_cycles(recv, target)
    cost.sync = target.sync_cycles * (serial + extra)
    temp = np.zeros(tiles)
    temp[:p] = recv / serial
    if r > 1:
        partial_bytes = out_elems * (partial_item or item) / p_out * r
        cost.exchange += exchange_cycles(partial_bytes, target)
        cost.compute += partial_bytes / _vector_rate(target) + K.VERTEX_OVERHEAD
        cost.sync += target.sync_cycles
        # each tile holds its partial sums of its outputs until they are reduced
        temp[:p] += out_elems * (partial_item or item) / p_out / serial
    cost.temp_bytes = temp
    return cost


_SERIALIZABLE = {"mm": (0, 1), "bmm": (0, 1), "addmm": (1, 2), "baddbmm": (1, 2)}


def _serialized_matmul(op, serialization, target, amp, outs, item, cost):
    """A ``serializedMatMul``: ``factor`` matmuls one after the other, each
    on a slice of the split dimension (PopART's serialization): the rows of
    the left operand (input channels), the reduction (reducing dim: each
    piece then adds its partial result into an accumulator, float32 with
    ``keep_precision``) or the columns of the right operand (output
    channels).  Each piece's operands are 1/factor of the split ones, so
    its temporary buffers shrink; every piece pays its own supersteps."""
    mode, factor, keep_precision = serialization
    name = op.target.overloadpacket.__name__
    if name not in _SERIALIZABLE or factor <= 1:
        return _plan_matmul_plain(op, target, amp, outs, item, cost)
    passes = passes_of(op, item, _partials_item(op, item))
    if passes:
        whole = passes[0]           # Conv.matmul: cin = K, cout = N, cols = M
        m, k, n = whole.cols, whole.cin, whole.cout
        if mode == "input_channels":
            m = -(-m // factor)
        elif mode == "reducing_dim":
            k = -(-k // factor)
        else:
            n = -(-n // factor)
        piece = _planned(op, [type(whole).matmul(whole.groups, m, k, n, item,
                                                 whole.partial_bytes)],
                         target, amp, outs, item, OpCost())
        macs = whole.macs
    else:
        lhs, rhs = (op.args[i] for i in _SERIALIZABLE[name])
        macs, _ = _macs(op)
        k_ch, o_ch = _channels(op)
        out_elems = sum(t.numel for t in outs)
        lhs_b, rhs_b = lhs.nbytes, rhs.nbytes
        if mode == "input_channels":
            lhs_b, out_elems = lhs_b / factor, out_elems / factor
        elif mode == "reducing_dim":
            lhs_b, rhs_b, k_ch = lhs_b / factor, rhs_b / factor, k_ch / factor
        else:
            rhs_b, out_elems, o_ch = rhs_b / factor, out_elems / factor, o_ch / factor
        piece = _matmul_on_tiles(macs / factor, k_ch, o_ch, [lhs_b, rhs_b], int(out_elems),
                                 item, _extra_supersteps(name), target, amp, OpCost(),
                                 _partials_item(op, item))
    cost.macs, cost.flops = macs, 2 * macs
    cost.compute, cost.exchange = piece.compute * factor, piece.exchange * factor
    cost.sync = piece.sync * factor
    cost.temp_bytes = piece.temp_bytes
    if mode == "reducing_dim":
        partial = 4 if keep_precision else item
        acc = sum(t.numel for t in outs) * partial / target.tiles
        cost.compute += (factor - 1) * (acc / _vector_rate(target) + K.VERTEX_OVERHEAD)
        cost.temp_bytes = piece.temp_bytes + acc
    return cost


def _partials_item(op, item):
    """Bytes of one partial sum: fp16 operands accumulate in float32 (Poplar's
    default) unless ``Precision.setPartialsType(torch.half)`` marked the op."""
    if op.partials == "half":
        return 2
    return 4 if item == 2 else item


def _plan_matmul_plain(op, target, amp, outs, item, cost):
    """A convolution (each pass) or matrix product planned as Poplar plans
    it (``conv_plan.plan``); other AMP ops by ``_matmul_on_tiles``."""
    passes = passes_of(op, item, _partials_item(op, item))
    if passes:
        return _planned(op, passes, target, amp, outs, item, cost)
    macs, _ = _macs(op)
    k_ch, o_ch = _channels(op)
    extra = _extra_supersteps(op.target.overloadpacket.__name__)
    return _matmul_on_tiles(macs, k_ch, o_ch, [t.nbytes for t in op.input_tensors()],
                            sum(t.numel for t in outs), item, extra, target, amp, cost,
                            _partials_item(op, item), positions=_kernel_positions(op))


def _planned(op, passes, target, amp, outs, item, cost):
    """The op's cost from one Poplar-style plan per pass: their cycles
    added, their temporary bytes the largest (the passes run one after
    another); an input gradient first transposes and flips the weights (one
    more compute set), an ``addmm`` adds its bias after the product."""
    limit = amp * target.bytes_per_tile
    plans = [conv_plan(p, target.tiles, limit, target.sync_cycles, K.AMP_COEFF_LOAD_BYTES,
                       K.MEMCPY_BYTES_PER_CYCLE)
             for p in passes]
    macs = sum(p.macs for p in passes)
    cost.macs, cost.flops = macs, 2 * macs
    cost.compute = sum(p.compute for p in plans)
    cost.exchange = sum(p.exchange for p in plans)
    cost.sync = target.sync_cycles * sum(p.supersteps for p in plans)
    temp = np.zeros(target.tiles)
    for p in plans:
        temp[:p.tiles] = np.maximum(temp[:p.tiles], p.live_bytes)
    cost.temp_bytes = temp
    for p in passes:
        if p.pass_name == "bwd":
            w = p.groups * p.cin * p.cout * p.kh * p.kw * p.in_bytes / target.tiles
            cost.compute += w / _vector_rate(target) + K.VERTEX_OVERHEAD
            cost.exchange += exchange_cycles(w, target)
            cost.sync += target.sync_cycles
    if op.target.overloadpacket.__name__ in ("addmm", "baddbmm", "addmv"):
        out_max = float(max(t.mapping.max_bytes() for t in outs))
        cost.compute += out_max / _vector_rate(target) + K.VERTEX_OVERHEAD
        cost.sync += target.sync_cycles
    cost.plan = "; ".join(f"{p.pass_name}: {q.describe()}" for p, q in zip(passes, plans))
    return cost


def _conv_plan(op, target, amp, item, partial_item, back_off):
    """One convolution of a ``MultiConv`` on ``target``'s tiles: the fastest
    plan, or, within ``back_off`` (a proportion) of its cycles, the plan
    with the least temporary memory (more serial chunks).  A plain
    convolution gets its Poplar-style plan on the tiles it is given."""
    outs = [t for t in op.outputs if t is not None]
    passes = passes_of(op, item, partial_item or _partials_item(op, item))
    if passes:
        return _planned(op, passes, target, amp, outs, item, OpCost())
    macs, _ = _macs(op)
    k_ch, o_ch = _channels(op)
    extra = _extra_supersteps(op.target.overloadpacket.__name__)
    args = (macs, k_ch, o_ch, [t.nbytes for t in op.input_tensors()],
            sum(t.numel for t in outs), item, extra, target, amp)
    positions = _kernel_positions(op)
    best = fastest = _matmul_on_tiles(*args, OpCost(), partial_item, positions=positions)
    for chunks in (2, 4, 8, 16):
        plan = _matmul_on_tiles(*args, OpCost(), partial_item, min_serial=chunks,
                                positions=positions)
        if plan.total <= fastest.total * (1 + back_off) and \
                np.max(plan.temp_bytes) < np.max(best.temp_bytes):
            best = plan
    return best


def _multiconv_cost(op, group, target, amp, item):
    """A convolution of a ``MultiConv`` (``ir.multiconv.MultiConvGroup``).

    Serial plan: one convolution after another, each planned alone.
    Parallel plan: one compute set; each convolution gets its reserved
    tiles plus a share of the rest in proportion to its work, and the
    group's supersteps take as long as its slowest member's (syncs paid
    once).  The group's cycles are shared among its ops in proportion to
    their own.  Per-convolution options: available memory, partials type
    (half partials halve the partial sums exchanged), dithering (the
    temporary buffers start on another tile)."""
    members, k = group.members, group.members.index(op)
    n, tiles = len(members), target.tiles

    def plan(i, tgt):
        m = members[i]
        a = group.option("available_memory", i) or m.available_memory or amp
        partial = 2 if group.option("partials", i) == "half" else None
        return _conv_plan(m, tgt, a, item, partial, group.cycle_back_off)

    if group.plan == "serial" or n == 1:
        own = plan(k, target)
        if group.option("dithering", k):
            own.temp_bytes = np.roll(own.temp_bytes, k * tiles // n + tiles // (2 * n))
        return own
    work = np.array([_macs(m)[0] for m in members], dtype=float)
    spare = tiles - n * group.reserved_tiles
    if spare < 0:
        from ..errors import Error
        raise Error(f"MultiConv: {n} convolutions with {group.reserved_tiles} reserved tiles "
                    f"each need {n * group.reserved_tiles} tiles; the IPU has {tiles}. Lower "
                    "perConvReservedTiles or use MultiConvPlanType.Serial.")
    shares = group.reserved_tiles + np.floor(spare * work / max(work.sum(), 1.0)).astype(int)
    shares = np.maximum(shares, 1)
    costs = [plan(i, _replace(target, tiles=int(shares[i]))) for i in range(n)]
    weight = costs[k].total / max(sum(c.total for c in costs), 1e-9)
    cost = OpCost(compute=max(c.compute for c in costs) * weight,
                  exchange=max(c.exchange for c in costs) * weight,
                  sync=max(c.sync for c in costs) * weight,
                  macs=costs[k].macs, flops=costs[k].flops)
    own = np.asarray(costs[k].temp_bytes, dtype=float)
    if group.option("dithering", k):
        own = np.roll(own, int(shares[k]) // 2)
    temp = np.zeros(tiles)
    start = int(shares[:k].sum())
    temp[start:start + own.size] = own[:tiles - start]
    cost.temp_bytes = temp
    return cost


# Work per hidden unit and time step of an LSTM cell: constants.LSTM_CELL_*.


def _rnn_cost(op, target, amp, outs, item, cost):
    """A fused LSTM layer (oneDNN's ``mkldnn_rnn_layer`` and its backward,
    which PyTorch uses for LSTMs only; on the IPU popnn's LSTM).  Forward: the input projection of
    every time step as one matmul, then per time step the recurrent matmul
    and the cell's element-wise work, each its own superstep.  Backward: per
    time step the cell's derivative and the matmul that carries the hidden
    state's gradient back, then three whole-sequence matmuls (gradients of
    the input and of both weights).  The steps of the sequence cannot
    overlap: each needs the last one's hidden state."""
    backward = op.target.overloadpacket.__name__.endswith("backward")
    x, w_ih, w_hh = op.args[0], op.args[1], op.args[2]
    steps, batch = x.shape[0], x.shape[1]
    gates, hidden = w_hh.shape[0], w_hh.shape[1]
    features = w_ih.shape[1]
    wbytes = gates * hidden * item

    def matmul(macs, k, n, operand_bytes, out_elems):
        return _matmul_on_tiles(macs, k, n, operand_bytes, out_elems, item,
                                K.MATMUL_EXTRA_SUPERSTEPS, target, amp, OpCost())

    cell = batch * hidden
    per_cycle = _vector_rate(target) / item
    cell_cycles = (cell * K.LSTM_CELL_ELEMENTWISE + 4 * cell * K.LSTM_CELL_TRANSCENDENTAL) / \
        min(target.tiles, max(1, cell // K.OUTPUT_GRAIN)) / per_cycle + K.VERTEX_OVERHEAD
    rows = steps * batch
    if not backward:
        whole = [matmul(rows * features * gates, features, gates,
                        [rows * features * item, gates * features * item], rows * gates)]
        step = matmul(batch * hidden * gates, hidden, gates, [batch * hidden * item, wbytes],
                      batch * gates)
    else:
        whole = [matmul(rows * gates * features, gates, features,          # grad input
                        [rows * gates * item, gates * features * item], rows * features),
                 matmul(rows * gates * features, rows, features,           # grad W_ih
                        [rows * gates * item, rows * features * item], gates * features),
                 matmul(rows * gates * hidden, rows, hidden,               # grad W_hh
                        [rows * gates * item, rows * hidden * item], gates * hidden)]
        step = matmul(batch * gates * hidden, gates, hidden, [batch * gates * item, wbytes],
                      batch * hidden)
        cell_cycles *= 2
    parts = whole + [step] * steps
    cost.compute = sum(c.compute for c in parts) + steps * cell_cycles
    cost.exchange = sum(c.exchange for c in parts)
    cost.sync = sum(c.sync for c in parts) + steps * target.sync_cycles
    cost.macs = sum(c.macs for c in parts)
    cost.flops = 2 * cost.macs + steps * cell * (K.LSTM_CELL_ELEMENTWISE
                                                 + K.LSTM_CELL_TRANSCENDENTAL)
    temp = np.zeros(target.tiles)
    for c in parts:
        temp = np.maximum(temp, c.temp_bytes)
    cost.temp_bytes = temp
    return cost
