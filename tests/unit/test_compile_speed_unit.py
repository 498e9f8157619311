"""The compile path's fast forms against the plain ones they replaced (issues
22 and 33: compile time linear and small).  Each must give the same result,
bit for bit: memory per tile swept over the ops (and its peak, visiting only
the ops where it can rise) against the dense product of a liveness matrix
and the buffers' bytes, Standard recomputation's running sum against a live
set per op, the optimizer update's IR copied from one lowered trace per kind
of parameter against the lowered graph of one trace per layout followed by
torch.fx's CSE pass (and LAMB's whole-weight update laid out from its sharded
one against one built), the plan search's candidate splits against the filtered
grid, and argument walks against pytree."""
import dataclasses
import gc
import random
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.utils._pytree as pytree
from torch.fx.immutable_collections import immutable_dict, immutable_list

from poptorchsim.capture import blocks, update_capture
from poptorchsim.capture import trace as capture_trace
from poptorchsim.capture.update_capture import ParamUpdate, capture_update
from poptorchsim.capture.update_rules import RULES, UpdatePlan
from poptorchsim.ir.graph import Tensor
from poptorchsim.passes import liveness as memory
from poptorchsim.passes import recompute
from poptorchsim.passes.lower import _map_only, lower
from poptorchsim.passes.tile_mapping import TileMapping
from poptorchsim.passes.update_copies import _flatten, lower_copies
from poptorchsim.runtime import collector


# -- memory: the sweep is the dense product ------------------------------------------------
def _dense_loaded(temps, loads, op_phase):
    """The loads added one by one, as plan_memory added them before."""
    for nbytes, phase in loads:
        if phase is None:
            temps += nbytes
        else:
            temps[op_phase == phase] += nbytes


@pytest.mark.parametrize("seed", range(12))
def test_usage_swept_over_the_ops_equals_the_dense_product(seed):
    rng = np.random.default_rng(seed)
    tiles, n_ops, n_buf = 24, int(rng.integers(1, 120)), int(rng.integers(0, 30))
    start = rng.integers(0, n_ops, n_buf)
    end = np.minimum(n_ops - 1, start + rng.integers(0, n_ops, n_buf))
    lo = np.full(n_buf, -1)
    hi = np.full(n_buf, -1)
    gap = rng.random(n_buf) < 0.4          # recomputed: dead strictly between lo and hi
    lo[gap] = start[gap] + rng.integers(0, 4, gap.sum())
    hi[gap] = lo[gap] + rng.integers(2, 8, gap.sum())
    phased = seed % 3 == 2
    op_phase = rng.integers(0, 3, n_ops) if phased else None
    column = allowed = None
    if phased:
        phases, column = np.unique(op_phase, return_inverse=True)
        allowed = rng.random((n_buf, len(phases))) < 0.6
    live = memory.Liveness(n_ops, start, end, lo, hi, column, allowed)
    buffers = [SimpleNamespace(mapping=TileMapping(int(rng.integers(0, tiles)),
                                                   int(rng.integers(1, tiles + 1)),
                                                   int(rng.integers(0, 5000)), 8))
               for _ in range(n_buf)]
    scale = rng.integers(1, 4, n_buf).astype(float)
    per_tensor = (np.stack([b.mapping.bytes_per_tile(tiles) for b in buffers])
                  * scale[:, None] if n_buf else np.zeros((0, tiles)))
    matrix = np.asarray(live)
    assert matrix.shape == (n_ops, n_buf)
    for k in range(n_ops):
        assert (live[k] == matrix[k]).all()
    # temporary bytes: whole numbers, or a matmul's fractions; with and without loads
    temps = memory.Temps(n_ops, tiles, op_phase)
    dense = np.zeros((n_ops, tiles))
    for k in rng.choice(n_ops, size=min(n_ops, 5), replace=False):
        row = rng.integers(0, 900, tiles) / (3.0 if seed % 2 else 1.0)
        temps.add(int(k), row)
        dense[k] += row
    if seed % 4 >= 2:
        temps.loads = [(rng.integers(0, 300, tiles), (int(rng.integers(0, 3)) if phased and
                                                       rng.random() < 0.5 else None))
                       for _ in range(3)]
        _dense_loaded(dense, temps.loads, op_phase)
    expected = matrix.astype(np.float64) @ per_tensor + dense
    got = memory._usage(live, buffers, scale, tiles, temps)
    assert got.dtype == expected.dtype and np.array_equal(got, expected)
    # a dense array of temporary bytes (a sub-graph's) and none at all
    assert np.array_equal(memory._usage(live, buffers, scale, tiles, dense),
                          matrix.astype(np.float64) @ per_tensor + dense)
    assert np.array_equal(memory._usage(live, buffers, scale, tiles, 0),
                          matrix.astype(np.float64) @ per_tensor)
    # the peak of every tile and the first op at it, without the matrix: visiting
    # only the ops where the sum changes, a few rows at a time
    for block in (3, 256):
        for t, full in ((temps, expected), (dense, expected),
                        (0, matrix.astype(np.float64) @ per_tensor)):
            peak, at = memory._usage_peak(live, buffers, scale, tiles, t, block=block)
            assert np.array_equal(peak, full.max(axis=0))
            assert np.array_equal(at, full.argmax(axis=0))


def test_loads_added_at_once_equal_loads_added_one_by_one():
    rng = np.random.default_rng(0)
    temps = rng.integers(0, 1000, (30, 16)).astype(float)
    temps[[3, 7]] += 0.1                     # rows with fractions take them one by one
    op_phase = rng.integers(0, 3, 30)
    loads = [(rng.integers(0, 2**40, 16), phase) for phase in (None, 1, None, 2, 1)]
    plain, fast = temps.copy(), temps.copy()
    _dense_loaded(plain, loads, op_phase)
    memory.add_loaded(fast, loads, op_phase)
    assert np.array_equal(plain, fast)


# -- Standard recomputation: a running sum is the live sets' sum ------------------------------
def _standard_kept_by_live_sets(ops, order):
    """PopART's Standard recomputation with a live set built after every op."""
    position = {k: i for i, k in enumerate(order)}
    last_read = {}
    made = recompute._producers(ops, order)
    for k in order:
        for t in ops[k].input_tensors():
            p = made.get(t.id)
            if p is not None:
                last_read[p] = max(last_read.get(p, position[p]), position[k])
    nbytes = [0 if ops[k].cost_class == "view" else
              sum(t.nbytes for t in ops[k].outputs if t is not None) for k in order]
    live_sets, total = [], []
    for i in range(len(order)):
        live = [order[j] for j in range(i + 1) if j == i or last_read.get(order[j], j) > i]
        live_sets.append(live)
        total.append(sum(nbytes[position[k]] for k in live))
    kept = set()
    for begin, end in recompute._decreasing_intervals(len(order)):
        best = min(range(begin, end), key=lambda i: total[i])
        kept.update(live_sets[best])
    return kept


class _T:
    def __init__(self, i, nbytes):
        self.id, self.nbytes = i, nbytes


class _Op:
    def __init__(self, ins, outs, cls="elementwise"):
        self.ins, self.outputs, self.cost_class = ins, outs, cls

    def input_tensors(self):
        return self.ins


@pytest.mark.parametrize("seed", range(8))
def test_standard_recomputation_running_sum_keeps_what_live_sets_keep(seed):
    rnd = random.Random(seed)
    ops, tensors = [], []
    for k in range(rnd.randint(1, 120)):
        ins = rnd.sample(tensors, min(len(tensors), rnd.randint(0, 3)))
        out = _T(k, rnd.choice([0, 4, 64, 1024, 4096]))
        tensors.append(out)
        ops.append(_Op(ins, [out], "view" if rnd.random() < 0.1 else "elementwise"))
    order = [k for k in range(len(ops)) if ops[k].cost_class != "view"]
    assert recompute._standard_kept(ops, order) == _standard_kept_by_live_sets(ops, order)


# -- the optimizer update: one trace per kind, copies merged as made ----------------------------
def _update_by_layout(plan, layouts, n_groups, unit_scale):
    """The update graph as it was built before: one trace per distinct layout,
    every parameter's copy put in one graph, then torch.fx's CSE pass."""
    from torch.fx.experimental.proxy_tensor import make_fx
    from torch.fx.passes.dialect.common.cse_pass import CSEPass, get_CSE_banned_ops
    n, n_h, n_g = len(layouts), len(plan.hyper), len(plan.globals)

    def one(layout):
        prepare, apply = update_capture._update_rule(plan, layout, unit_scale)

        def update(param, grad, state, step, hyper, globals_, grad_scale):
            step = step + 1
            p_new, s_new = apply(param, prepare(grad, grad_scale), state, step, hyper,
                                 globals_, grad_scale)
            return p_new, s_new, step
        return update
    traced = {}
    with capture_trace.tracing_scope():
        for layout in dict.fromkeys(layouts):
            example = update_capture._example(layout) + (
                [torch.zeros((), dtype=torch.float64) for _ in range(n_h)],
                [torch.zeros((), dtype=torch.float64) for _ in range(n_g)],
                torch.ones((), dtype=torch.float32))
            traced[layout] = make_fx(one(layout), tracing_mode="fake")(*example)
    graph = torch.fx.Graph()

    def inputs(prefix, count):
        return [graph.placeholder(f"{prefix}_{k}") for k in range(count)]
    params, grads = inputs("params", n), inputs("grads", n)
    state = [inputs(f"state_{i}", len(layout.slots_in)) for i, layout in enumerate(layouts)]
    steps = inputs("steps", n)
    hyper = inputs("hyper", n_groups * n_h)
    globals_ = inputs("globals", n_g)
    grad_scale, = inputs("grad_scale", 1)
    new_params, new_state, new_steps = [], [], []
    for i, layout in enumerate(layouts):
        grp, n_out = layout.group, len(layout.slots_out)
        sub = traced[layout].graph
        ours = ([params[i], grads[i]] + state[i] + [steps[i]]
                + hyper[grp * n_h:(grp + 1) * n_h] + globals_ + [grad_scale])
        theirs = [node for node in sub.nodes if node.op == "placeholder"]
        for mine, node in zip(ours, theirs):
            mine.meta.setdefault("val", node.meta["val"])
        outs = pytree.tree_leaves(graph.graph_copy(sub, dict(zip(theirs, ours))))
        new_params.append(outs[0])
        new_state.append(outs[1:1 + n_out])
        new_steps.append(outs[1 + n_out])
    scalar = torch.empty((), dtype=torch.float64, device="meta")
    for node in hyper + globals_:
        node.meta.setdefault("val", scalar)
    graph.output((new_params, new_state, new_steps))
    gm = CSEPass(get_CSE_banned_ops())(torch.fx.GraphModule(torch.nn.Module(), graph))
    return update_capture._cast_scalars_once(gm.graph_module)


def _roles(layouts, n_groups, plan):
    n = len(layouts)
    return ([(f"p{i}", "param") for i in range(n)] + [(f"g{i}", "accumulator") for i in range(n)]
            + [(f"s{i}_{k}", "state") for i, lay in enumerate(layouts)
               for k in range(len(lay.slots_in))]
            + [(f"step{i}", "state") for i in range(n)]
            + [(f"h{g}_{h}", "hyper") for g in range(n_groups) for h in plan.hyper]
            + [(f"g_{h}", "hyper") for h in plan.globals] + [("grad_scale", "hyper")])


def _lowered(update, layouts, n_groups, plan):
    """The update's IR graph: ``RuleCopies`` copied at IR level, an fx graph
    lowered."""
    roles = _roles(layouts, n_groups, plan)
    if isinstance(update, update_capture.RuleCopies):
        return lower_copies(update, "optimizer_update", roles)
    return lower(update, "optimizer_update", roles)


def _described(graph):
    """Every input, op and output of an IR graph, in order: names, targets,
    arguments (tensors by name), shapes, types and every field lowering sets."""
    def arg(x):
        return _map_only(Tensor, lambda t: ("%", t.name), x)
    ins = [(t.id, t.name, t.shape, t.dtype, t.role) for t in graph.inputs]
    ops = [(op.id, op.name, str(op.target), str(arg(op.args)), str(arg(op.kwargs)),
            [None if t is None else (t.id, t.name, t.shape, t.dtype, t.role) for t in op.outputs],
            op.cost_class, op.multi_output, op.inplace, op.traced_layout, op.block,
            op.backward, op.available_memory, op.attrs, op.source) for op in graph.ops]
    assert [t.id for t in graph.tensors] == list(range(len(graph.tensors)))
    return ins, ops, [t.name for t in graph.outputs]


def _plan(kind, n_groups, flags, dtypes=(), loss_scaling=True):
    return UpdatePlan(kind, kind.upper(), tuple(tuple(sorted(flags.items()))
                                                for _ in range(n_groups)),
                      dtypes, loss_scaling, hyper=RULES[kind].hyper)


_FLAGS = {"maximize": False, "weight_decay": True, "momentum": True, "dampening": False,
          "nesterov": False, "centered": False, "bias_correction": True,
          "tf_variant": False, "velocity_scaled": False}


@pytest.mark.parametrize("kind", ["sgd", "adamw", "lamb", "rmsprop"])
def test_update_from_one_trace_per_kind_equals_one_trace_per_layout(kind):
    plan = _plan(kind, 2, _FLAGS)
    slots = {"sgd": ("momentum_buffer",), "adamw": ("exp_avg", "exp_avg_sq"),
             "lamb": ("exp_avg", "exp_avg_sq"),
             "rmsprop": ("square_avg", "momentum_buffer")}[kind]
    shapes = [(8, 4), (4,), (8, 4), (3, 5, 2), (7,), (), (), (4,), (1,), (2, 2)]
    layouts = []
    for i, shape in enumerate(shapes):
        dtype = torch.float16 if i % 4 == 3 else torch.float32
        slot_dtype = torch.float32
        layouts.append(ParamUpdate(shape, dtype, dtype, i % 2,
                                   tuple((s, slot_dtype) for s in slots),
                                   tuple((s, slot_dtype) for s in slots)))
    fast = capture_update(plan, layouts, 2, unit_scale=False)
    assert isinstance(fast, update_capture.RuleCopies)
    plain = _update_by_layout(plan, layouts, 2, unit_scale=False)
    assert _described(_lowered(fast, layouts, 2, plan)) == \
        _described(_lowered(plain, layouts, 2, plan))
    # a second capture of the same optimizer (the update over whole weights of
    # sharded state) at other shapes reuses the kinds already traced and checked
    shards = [layout for layout in layouts if layout.dtype == torch.float32 and layout.group == 0]
    traces = {}
    capture_update(plan, shards, 2, False, traces)

    def rules():      # the traced rules (the dict also keeps whole updates, key "update")
        return [k for k in traces if k[0] != "update"]
    n_traces = len(rules())
    whole = [dataclasses.replace(layout, shape=(11, k + 1)) for k, layout in enumerate(shards)]
    again = capture_update(plan, whole, 2, False, traces)
    assert len(rules()) == n_traces
    assert capture_update(plan, whole, 2, False, traces) is again     # kept whole
    assert _described(_lowered(again, whole, 2, plan)) == \
        _described(_lowered(_update_by_layout(plan, whole, 2, False), whole, 2, plan))


def test_a_rule_that_names_a_shape_is_traced_per_shape(monkeypatch):
    """A rule whose trace depends on the shape (here a view to the flat size)
    is not shared between shapes."""
    rule = RULES["sgd"]

    def flattened(param, grad, state, h, step, flags):
        new, st = rule.fn(param, grad, state, h, step, flags)
        return new.reshape(-1).reshape(param.shape), st
    monkeypatch.setitem(RULES, "sgd", type(rule)(rule.hyper, flattened, rule.scale_grad))
    plan = _plan("sgd", 1, dict(_FLAGS, momentum=False))
    layouts = [ParamUpdate(s, torch.float32, torch.float32, 0) for s in [(6, 2), (5,), (6, 2)]]
    fast = capture_update(plan, layouts, 1)
    plain = _update_by_layout(plan, layouts, 1, False)
    assert _described(_lowered(fast, layouts, 1, plan)) == \
        _described(_lowered(plain, layouts, 1, plan))


def test_a_rule_with_a_multi_output_op_is_copied_at_every_shape(monkeypatch):
    """A rule with an op of several results (here ``sort``, its results the
    parameter's shape) is copied to other shapes with every result at the
    parameter's shape, and its result nodes named as the graph of copies
    names them."""
    rule = RULES["sgd"]

    def sorted_(param, grad, state, h, step, flags):
        new, st = rule.fn(param, grad, state, h, step, flags)
        values, indices = torch.sort(new, dim=-1)
        return values + indices.to(values.dtype), st
    monkeypatch.setitem(RULES, "sgd", type(rule)(rule.hyper, sorted_, rule.scale_grad))
    plan = _plan("sgd", 1, dict(_FLAGS, momentum=False))
    layouts = [ParamUpdate(s, torch.float32, torch.float32, 0) for s in [(6, 2), (5,), (3, 4)]]
    fast = capture_update(plan, layouts, 1)
    assert isinstance(fast, update_capture.RuleCopies)
    graph = _lowered(fast, layouts, 1, plan)
    sorts = [op for op in graph.ops if op.multi_output]
    assert [[t.shape for t in op.outputs] for op in sorts] == [[(6, 2)] * 2, [(5,)] * 2,
                                                               [(3, 4)] * 2]
    plain = _update_by_layout(plan, layouts, 1, False)
    assert _described(graph) == _described(_lowered(plain, layouts, 1, plan))


@pytest.mark.parametrize("tiny", [False, True])
def test_whole_weight_update_reshaped_from_the_sharded_one_equals_one_built(tiny):
    """LAMB's whole-weight update (its numerics) made from the sharded one by
    laying its tensors out at whole shapes equals the update built over
    whole weights, field for field and mark for mark; a shard of one element
    (``tiny``: a bias of 3 over 4 replicas) is built instead."""
    import poptorchsim
    from poptorchsim.passes.update import build_update, numeric_update, update_plan
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.LayerNorm(8),
                                torch.nn.Linear(8, 3, bias=tiny))
    params = list(model.parameters())
    opt = poptorchsim.optim.LAMB([{"params": params[:3]}, {"params": params[3:],
                                                           "weight_decay": 0.0}], lr=1e-3)
    names = [n for n, _ in model.named_parameters()]
    capture = SimpleNamespace(trainable_names=names)
    _, plan = update_plan(opt, 2)
    shards = {n: 4 for n, p in model.named_parameters() if p.dim() == 2 or tiny}
    sharded = build_update(model, opt, capture, plan, shards)
    whole, now_sharded = numeric_update(model, opt, capture, plan, shards, sharded, False)
    built = build_update(model, opt, capture, plan, None, False, sharded.traces)
    assert now_sharded == {} and (whole.took is sharded.took) is not tiny

    def marked(graph):
        return _described(graph), [(op.host_scalar, op.role) for op in graph.ops], \
            graph.outputs_overwrite_inputs
    assert marked(whole.graph) == marked(built.graph)
    assert marked(whole.graph) != marked(sharded.graph)
    assert (whole.layouts, whole.slots, whole.group_of, whole.flags) == \
        (built.layouts, built.slots, built.group_of, built.flags)


# -- argument walks against pytree ---------------------------------------------------------------
def _cases():
    g = torch.fx.Graph()
    a, b = g.placeholder("a"), g.placeholder("b")
    return [(a, 1), (a, [1, 2]), (a, (1, 2)), (a, immutable_list([1, 2])), {"dtype": torch.half},
            {}, (), (a, None), ({"x": a},), (immutable_dict({"x": a}),), (a, b), (b, a), (1,),
            (True,), (1.0,), (a, slice(1, 2)), (torch.Size([2, 3]), a)]


def test_flatten_is_equal_where_pytree_is_equal():
    cases = _cases()
    for x in cases:
        flat, _ = pytree.tree_flatten(x)
        assert _flatten(x)[0] == flat
        for y in cases:
            same = (tuple(pytree.tree_flatten(x)[0]) == tuple(pytree.tree_flatten(y)[0])
                    and pytree.tree_flatten(x)[1] == pytree.tree_flatten(y)[1])
            mine = (tuple(_flatten(x)[0]) == tuple(_flatten(y)[0])
                    and _flatten(x)[1] == _flatten(y)[1])
            assert same == mine, (x, y)


def test_map_only_and_tensor_walks_match_pytree():
    t, u = torch.zeros(1), torch.ones(2)
    values = [(1, immutable_list([2, 3.0, (4,)]), {"a": immutable_dict({"b": [5]})},
               torch.Size([2, 3]), slice(1, 2), None, "x"),
              ((t, 1, [u, {"k": t}]), {"out": None}), torch.max(u, 0), (torch.Size([1]), t)]
    for x in values:
        def f(v):
            return v * 10
        assert _map_only(int, f, x) == pytree.tree_map_only(int, f, x)
        expected = [y for y in pytree.tree_leaves(x) if isinstance(y, torch.Tensor)]
        assert [id(y) for y in blocks._tensors(x)] == [id(y) for y in expected]


# -- the collector ---------------------------------------------------------------------------
def test_the_collector_is_paused_while_compiling_and_restored():
    seen = []

    @collector.paused
    def compile_(fail=False):
        seen.append(gc.isenabled())
        if fail:
            raise ValueError("no")
        return 1
    assert gc.isenabled()
    assert compile_() == 1 and seen == [False] and gc.isenabled()
    with pytest.raises(ValueError):
        compile_(fail=True)
    assert gc.isenabled()
    gc.disable()                    # a caller's choice stays
    try:
        compile_()
        assert not gc.isenabled() and seen[-1] is False
    finally:
        gc.enable()


# -- the op costs' kept plans and tile spreads ---------------------------------------------
@pytest.mark.parametrize("seed", range(16))
def test_a_tile_spread_sliced_equals_the_modular_index(seed):
    """``TileMapping.bytes_per_tile`` writes its tiles as one slice (two when
    it wraps round the last tile) and reads the spread kept per size and
    grain: the array the modular index over its tiles gave, and its fullest
    tile."""
    rng = np.random.default_rng(seed)
    tiles = int(rng.integers(1, 48))
    n = int(rng.integers(1, tiles + 1))
    start, nbytes = int(rng.integers(0, 3 * tiles)), int(rng.integers(0, 5000))
    grain = int(rng.choice([1, 2, 8, 64]))
    plain = np.zeros(tiles, dtype=np.int64)
    if nbytes:
        n_grains = -(-nbytes // grain)
        base, extra = divmod(n_grains, n)
        used = (base + (np.arange(n) < extra)).astype(np.int64) * grain
        used[(extra - 1) if extra else n - 1] -= n_grains * grain - nbytes
        plain[(start + np.arange(n)) % tiles] = used
    m = TileMapping(start, n, nbytes, grain)
    assert np.array_equal(m.bytes_per_tile(tiles), plain)
    assert m.bytes_per_tile(tiles).sum() == nbytes
    assert m.max_bytes() == (int(plain.max()) if nbytes else 0)


def test_a_kept_matmul_plan_is_the_plan_made_afresh():
    """The planner keeps its plans per arguments (a model's repeated layers
    plan once): a kept plan equals the one made afresh."""
    from poptorchsim.estimate import conv_plan
    from poptorchsim.estimate.conv_params import Conv
    for c in (Conv(1, 768, 3072, 128, 1, pass_name="matmul"),
              Conv(1, 64, 128, 56, 56, kh=3, kw=3, in_rows=58, in_cols=58),
              Conv(4, 32, 32, 14, 14, pass_name="wu")):
        args = (c, 1472, 0.6 * 638976, 34, 8, 8)
        assert conv_plan.plan(*args) == conv_plan.plan.__wrapped__(*args)
        assert conv_plan.plan(*args) is conv_plan.plan(*args)


# -- the plan search's candidate splits ----------------------------------------------------
def _candidates_by_meshgrid(c, tiles):
    """The candidate splits as they were made: the whole grid, then the rows
    whose product fits."""
    from poptorchsim.estimate import conv_plan
    from poptorchsim.estimate.conv_params import cdiv

    def useful(limit):
        return conv_plan._SPLITS[conv_plan._SPLITS <= max(1, limit)]
    grid = np.stack(np.meshgrid(useful(c.groups), useful(c.rows * c.cols), useful(cdiv(c.cin, 2)),
                                useful(cdiv(c.cout, 4)), indexing="ij"), -1).reshape(-1, 4)
    grid = grid[np.prod(grid, axis=1) <= tiles]
    return grid[:, 0], grid[:, 1], grid[:, 2], grid[:, 3]


@pytest.mark.parametrize("seed", range(2))
def test_candidate_splits_built_a_split_at_a_time_equal_the_filtered_grid(seed):
    from poptorchsim.estimate import conv_plan
    rng = np.random.default_rng(seed)
    for _ in range(30):
        c = SimpleNamespace(groups=int(rng.integers(1, 130)), rows=int(rng.integers(1, 200)),
                            cols=int(rng.integers(1, 50)), cin=int(rng.integers(1, 5000)),
                            cout=int(rng.integers(1, 5000)))
        tiles = int(rng.choice([1, 2, 7, 1216, 1472]))
        got, expected = conv_plan._candidates(c, tiles), _candidates_by_meshgrid(c, tiles)
        for x, y in zip(got, expected):
            assert x.dtype == y.dtype and np.array_equal(x, y)
