"""The engine alone: ``Engine.run`` walking hand-built programs, with plain
Python callables standing in for the graphs (to see every call) or the
hand-built graphs compiled by ``codegen.compile_graph`` (to check numerics
against autograd)."""
import pytest
import torch
from handbuilt import (
    device_state,
    inference_program,
    mlp_step,
    reference_sgd,
    training_program,
    walk,
)

from poptorchsim.ir.graph import AllGather, ReduceScatter, RemoteLoad, RemoteStore
from poptorchsim.machine.call_state import OutputCollector, shard, unshard
from poptorchsim.machine.codegen import compile_graph
from poptorchsim.machine.engine import Engine
from poptorchsim.passes.locations import Location
from poptorchsim.passes.program import build_main


def _codes(di, ga, rf):
    """Inputs [di, ga, rf, 1] whose micro-batch (i, g, r) holds 100 i + 10 g + r."""
    x = torch.zeros(di, ga, rf, 1)
    for i in range(di):
        for g in range(ga):
            for r in range(rf):
                x[i, g, r] = 100 * i + 10 * g + r
    return x


class Recorder:
    """step_fn and update_fn that log their calls.  The step returns its
    micro-batch as output and as gradient; the update ``w - g`` (momentum
    kept as it was)."""

    def __init__(self):
        self.log = []

    def step(self, inputs):
        x = inputs[1]
        self.log.append(("step", int(x.item())))
        return [x.clone(), x.clone()]

    def update(self, inputs):
        w, g, v = inputs[:3]
        self.log.append(("update", int(g.item())))
        return [w - g, v]


def _run(di, ga, rf, mode="All", period=1, program=None, **kw):
    program = program or build_main(training_program(di, ga, rf))
    rec = Recorder()
    engine = Engine(rec.step, rec.update, **kw)
    state = device_state([torch.zeros(1)], rf)
    collector = OutputCollector(mode, period, di, ga, rf)
    result = engine.run(program, state, [_codes(di, ga, rf)], collector)
    return rec.log, result, state


def _values(result):
    return [int(outs[0].item()) for outs in result]


# -- order and indexing -------------------------------------------------------------
def test_calls_run_device_iteration_by_accumulation_by_replica():
    log, _, _ = _run(di=2, ga=2, rf=2)
    assert log == [("step", 0), ("step", 1), ("step", 10), ("step", 11), ("update", 22),
                   ("step", 100), ("step", 101), ("step", 110), ("step", 111),
                   ("update", 422)]


def test_gradients_summed_over_micro_batches_then_one_update():
    _, _, state = _run(di=2, ga=3, rf=1)
    # update 1: 0 + 10 + 20; update 2: 100 + 110 + 120
    assert state.params[0].item() == -(30 + 330)


def test_inference_calls_each_replica_per_device_iteration():
    program = build_main(inference_program(di=3, rf=2))
    state = device_state([torch.zeros(1)], rf=2)
    x = _codes(3, 1, 2)
    result = Engine(lambda ins: [ins[1] * 2]).run(program, state, [x],
                                                    OutputCollector("All", 1, 3, 1, 2))
    assert _values(result) == [0, 2, 200, 202, 400, 402]


# -- output modes ---------------------------------------------------------------------
def test_output_mode_all_keeps_every_micro_batch_in_order():
    _, result, _ = _run(di=2, ga=2, rf=2)
    assert _values(result) == [0, 1, 10, 11, 100, 101, 110, 111]


def test_output_mode_final_keeps_the_last_micro_batch_of_each_replica():
    _, result, _ = _run(di=3, ga=2, rf=2, mode="Final")
    assert _values(result) == [210, 211]


def test_output_mode_every_n_keeps_every_nth_device_iteration():
    _, result, _ = _run(di=4, ga=1, rf=1, mode="EveryN", period=2)
    assert _values(result) == [100, 300]


def test_output_mode_sum_adds_per_replica():
    _, result, _ = _run(di=2, ga=2, rf=2, mode="Sum")
    assert [row[0].item() for row in result] == [0 + 10 + 100 + 110, 1 + 11 + 101 + 111]


# -- numerics through compiled hand-built graphs ----------------------------------------
def _reference(ws, x, di, ga, rf, lr, momenta):
    """Outputs and final weights, with autograd for the gradients and the
    mean over ga * rf micro-batches per update."""
    ws = [w.clone() for w in ws]
    momenta = [v.clone() for v in momenta]
    outs = []
    for i in range(di):
        grads = [torch.zeros_like(w) for w in ws]
        for g in range(ga):
            for r in range(rf):
                leaves = [w.clone().requires_grad_() for w in ws]
                h = x[i, g, r]
                for w in leaves:
                    h = torch.relu(h @ w)
                outs.append(h.detach())
                (0.5 * (h ** 2).sum()).backward()
                grads = [a + w.grad for a, w in zip(grads, leaves)]
        for k in range(len(ws)):
            ws[k], momenta[k] = reference_sgd(ws[k], grads[k], momenta[k], lr, 1 / (ga * rf))
    return outs, ws, momenta


def _compiled_run(program, di, ga, rf, shards=None, width=4, momenta=None, engine=None):
    torch.manual_seed(0)
    step, update = program.graphs["training_step"], program.graphs["optimizer_update"]
    n = sum(t.role == "param" for t in step.inputs)
    ws = [torch.randn(width, width) for _ in range(n)]
    momenta = momenta or [torch.randn(width, width) for _ in range(n)]
    x = torch.randn(di, ga, rf, 2, width)
    engine = engine or Engine(compile_graph(step), compile_graph(update), shards)
    state = device_state(ws, rf, momenta, lr=0.05, grad_scale=1 / (ga * rf))
    for i, r in (shards or {}).items():
        state.opt_state[i] = [shard(v, r) for v in state.opt_state[i]]
    result = engine.run(program, state, [x], OutputCollector("All", 1, di, ga, rf))
    return result, state, (ws, x, momenta)


def test_compiled_graphs_train_as_autograd_and_sgd_do():
    di, ga, rf = 2, 2, 2
    program = build_main(training_program(di, ga, rf, n_layers=2))
    result, state, (ws, x, momenta) = _compiled_run(program, di, ga, rf)
    outs, want_ws, want_v = _reference(ws, x, di, ga, rf, 0.05, momenta)
    assert len(result) == di * ga * rf
    for got, want in zip(result, outs):
        torch.testing.assert_close(got[0], want)
    for got, want in zip(state.params, want_ws):
        torch.testing.assert_close(got, want)
    for got, want in zip(state.opt_state, want_v):
        torch.testing.assert_close(got[0], want)


class Spy(Engine):
    """An engine that keeps what its collectives did."""

    def _ReduceScatter(self, step):
        super()._ReduceScatter(step)
        self.cut = {i: [p.clone() for p in parts] for i, parts in self._update.cut.items()}
        self.acc = [a.clone() for a in self._update.acc]

    def _AllGather(self, step):
        self.pending = self._update is not None and self._update.gather is not None
        super()._AllGather(step)


@pytest.mark.parametrize("ga", [1, 2])
def test_sharded_update_equals_the_unsharded_one(ga):
    di, rf, width = 2, 2, 3                  # 9 elements: shards of 5, one padded
    plain = build_main(training_program(di, ga, rf, n_layers=2, width=width))
    sharded = build_main(training_program(di, ga, rf, n_layers=2, width=width,
                                          sharded_state={"w1"}))
    assert [type(s) for s, _ in walk(sharded.main)].count(ReduceScatter) == 1
    _, want, _ = _compiled_run(plain, di, ga, rf, width=width)
    step, update = sharded.graphs["training_step"], sharded.graphs["optimizer_update"]
    spy = Spy(compile_graph(step), compile_graph(update), {1: 2})
    _, got, _ = _compiled_run(sharded, di, ga, rf, {1: 2}, width, engine=spy)
    # the reduce-scatter cut w1's gradient into one shard per replica
    assert list(spy.cut) == [1] and [p.numel() for p in spy.cut[1]] == [5, 5]
    torch.testing.assert_close(unshard(spy.cut[1], (3, 3)), spy.acc[1])
    assert spy.cut[1][1][-1].item() == 0              # the padding
    # the all-gather found a sharded update to put back, and did
    assert spy.pending
    for a, b in zip(got.params, want.params):
        assert a.shape == (3, 3)
        torch.testing.assert_close(a, b)
    torch.testing.assert_close(got.opt_state[0][0], want.opt_state[0][0])
    v1 = got.opt_state[1][0]                          # w1's momentum: one shard per replica
    assert len(v1) == 2
    torch.testing.assert_close(unshard(v1, (3, 3)), want.opt_state[1][0])


def test_sharded_update_without_its_all_gather_is_an_error():
    program = build_main(training_program(1, 1, 2, n_layers=2, sharded_state={"w1"}))
    body = program.main.body.steps
    body[:] = [s for s in body if not isinstance(s, AllGather)]
    with pytest.raises(RuntimeError, match="without the all-gather after it"):
        _compiled_run(program, 1, 1, 2, {1: 2})


def test_streaming_memory_steps_leave_values_unchanged():
    locations = {"w0": Location("weight", 16, 4, off_chip=True),
                 "grad/w0": Location("accumulator", 16, 4, off_chip=True),
                 "momentum_buffer/w1": Location("optimizer", 16, 4, off_chip=True,
                                                io_tiles=True)}
    remote = build_main(training_program(2, 2, 1, n_layers=2, locations=locations))
    assert sum(isinstance(s, (RemoteLoad, RemoteStore)) for s, _ in walk(remote.main)) == 6
    plain = build_main(training_program(2, 2, 1, n_layers=2))
    out_a, a, _ = _compiled_run(remote, 2, 2, 1)
    out_b, b, _ = _compiled_run(plain, 2, 2, 1)
    for x, y in zip(a.params + [s[0] for s in a.opt_state], b.params + [s[0] for s in b.opt_state]):
        assert torch.equal(x, y)
    assert all(torch.equal(x[0], y[0]) for x, y in zip(out_a, out_b))


def test_all_reduce_sums_across_processes_once_per_update():
    program = build_main(training_program(di=2, ga=2, rf=1, processes=2))
    calls = []

    def reduce(tensors):                 # a second process with the same gradients
        calls.append([t.item() for t in tensors])
        return [t * 2 for t in tensors]
    rec = Recorder()
    engine = Engine(rec.step, rec.update)
    engine.reduce = reduce
    state = device_state([torch.zeros(1)], 1)
    engine.run(program, state, [_codes(2, 2, 1)], OutputCollector("All", 1, 2, 2, 1))
    assert calls == [[0 + 10], [100 + 110]]
    assert [e for e in rec.log if e[0] == "update"] == [("update", 20), ("update", 420)]


def test_buffers_are_kept_per_replica():
    program = build_main(training_program(di=1, ga=2, rf=2))

    def step(inputs):                    # one buffer: counts the replica's micro-batches
        w, count, x = inputs[:3]
        return [x.clone(), x.clone(), count + 1 + x]
    state = device_state([torch.zeros(1)], 2)
    state.buffers = [[torch.zeros(1)], [torch.zeros(1)]]
    Engine(step, Recorder().update).run(program, state, [_codes(1, 2, 2)],
                                        OutputCollector("All", 1, 1, 2, 2))
    assert [b[0].item() for b in state.buffers] == [2 + 0 + 10, 2 + 1 + 11]


def test_hand_built_inference_graph_runs():
    program = build_main(inference_program(di=2, rf=1, n_layers=2))
    fn = compile_graph(mlp_step(2, training=False))
    torch.manual_seed(1)
    ws = [torch.randn(4, 4), torch.randn(4, 4)]
    x = torch.randn(2, 1, 1, 2, 4)
    state = device_state(ws, 1)
    result = Engine(fn).run(program, state, [x], OutputCollector("All", 1, 2, 1, 1))
    for i in range(2):
        torch.testing.assert_close(result[i][0], torch.relu(torch.relu(x[i, 0, 0] @ ws[0])
                                                            @ ws[1]))
