"""The estimate's cost rules alone: ``program_cost.estimate`` on hand-built
programs with hand-made per-op costs (``OpCost``), one rule per step kind.

Each rule is checked against the formula written out here, and by
linearity: adding one step to a program adds exactly that step's charge."""
from dataclasses import replace

import numpy as np
import pytest
from handbuilt import map_tiles, mlp_step, training_program

from poptorchsim.estimate import constants as K
from poptorchsim.estimate.cost import OpCost
from poptorchsim.estimate.program_cost import estimate, link_cycles
from poptorchsim.estimate.schedule import schedule
from poptorchsim.estimate.targets import MK2, TEST_IPU, with_io_tiles
from poptorchsim.ir.graph import (
    AllGather,
    AllReduce,
    Call,
    HostToDevice,
    ReduceScatter,
    RemoteLoad,
    RemoteStore,
    Repeat,
)
from poptorchsim.passes.placement import Placement, place
from poptorchsim.passes.program import build_main

DEVICE = ("compute", "exchange", "sync")
T = TEST_IPU


def _costs(program, compute=100.0, exchange=20.0, sync=10.0):
    return {name: [OpCost(compute, exchange, sync) for _ in g.ops]
            for name, g in program.graphs.items()}


def _program(di=2, ga=3, rf=2, synthetic=True, n_ipus=1):
    p = build_main(training_program(di=di, ga=ga, rf=rf, synthetic=synthetic))
    p.n_ipus = n_ipus         # what the rules divide by; the graphs stay on IPU 0
    return p


def _body(p):
    """The device-iteration loop's body (runs ``di`` times per call)."""
    return p.main.body.steps


def _delta(p, costs, step, target=T, at=-1):
    """The estimate with ``step`` added to the device-iteration body, minus
    the estimate without."""
    before = estimate(p, costs, target)[0]
    steps = _body(p)
    steps.insert(at if at >= 0 else len(steps) + at + 1, step)
    after = estimate(p, costs, target)[0]
    return {k: after[k] - before[k] for k in before if k not in ("bubble",)}


def _ring(nbytes, replicas, phases, target=T):
    per_cycle = target.link_bytes_per_s / target.clock_hz
    return phases * (replicas - 1) * (nbytes / replicas / per_cycle + K.RING_STEP_SYNC_CYCLES)


def _streaming(nbytes, transfers, sharing, target=T):
    return (nbytes * sharing / target.streaming_bytes_per_s
            + transfers * target.host_latency_s) * target.clock_hz


def _only(delta, **expected):
    """Every kind of ``delta`` is 0 except those given, and the total adds up."""
    for kind in ("compute", "exchange", "sync", "host", "collective", "streaming"):
        assert delta[kind] == pytest.approx(expected.get(kind, 0.0), rel=1e-9, abs=1e-6), kind
    assert delta["total"] == pytest.approx(sum(expected.values()), rel=1e-9)
    assert delta["seconds"] == pytest.approx(delta["total"] / T.clock_hz, rel=1e-9)


# -- the walk ---------------------------------------------------------------------
def test_single_stage_training_charges_each_micro_batch_and_update():
    p = _program(di=2, ga=3, rf=2)
    n_step, n_update = (len(g.ops) for g in p.graphs.values())
    total, sched = estimate(p, _costs(p), T)
    # per device iteration: 3 micro-batches of the step, their gradients
    # added (a vector pass and a sync each), one update; the all-reduce
    acc_compute = 3 * (p.grad_bytes / T.tiles / T.vector_bytes)
    assert total["compute"] == pytest.approx(2 * (3 * 100 * n_step + acc_compute
                                                  + 100 * n_update))
    assert total["exchange"] == pytest.approx(2 * (3 * 20 * n_step + 20 * n_update))
    assert total["sync"] == pytest.approx(2 * (3 * 10 * n_step + 3 * T.sync_cycles
                                               + 10 * n_update))
    assert total["collective"] == pytest.approx(2 * _ring(p.grad_bytes, 2, 2))
    assert total["host"] == pytest.approx(T.call_overhead_s * T.clock_hz)
    assert sched.kind == "single" and sched.micro_batches == 3


def test_repeat_multiplies_its_body():
    p = _program(di=1, ga=1, rf=2)
    costs = _costs(p)
    once = estimate(p, costs, T)[0]
    p.main = Repeat(4, p.main.body, "device_iteration")
    four = estimate(p, costs, T)[0]
    for kind in DEVICE + ("collective",):
        assert four[kind] == pytest.approx(4 * once[kind]) and once[kind] > 0
    assert four["host"] == once["host"]           # the call's launch, paid once


def test_nested_repeat_of_a_collective():
    p = _program(di=2)
    one = _delta(p, _costs(p), AllReduce(1000, 2))
    p = _program(di=2)
    three = _delta(p, _costs(p), Repeat(3, AllReduce(1000, 2), "device_iteration"))
    assert three["collective"] == pytest.approx(3 * one["collective"]) and one["collective"] > 0


# -- one rule per step kind, by linearity ---------------------------------------------
@pytest.mark.parametrize("kind,phases", [(AllReduce, 2), (ReduceScatter, 1), (AllGather, 1)])
@pytest.mark.parametrize("n_ipus", [1, 2])
def test_collectives_charge_a_ring_shared_by_the_replica_ipus(kind, phases, n_ipus):
    p = _program(di=3, rf=4, n_ipus=n_ipus)
    delta = _delta(p, _costs(p), kind(12_000, 4))
    _only(delta, collective=3 * _ring(12_000 / n_ipus, 4, phases))


def test_one_replica_collective_is_free():
    p = _program(rf=1)
    _only(_delta(p, _costs(p), AllReduce(12_000, 1)))


@pytest.mark.parametrize("kind", [RemoteLoad, RemoteStore])
def test_streaming_memory_charges_bytes_through_the_shared_gateway(kind):
    p = _program(di=2, rf=2)
    delta = _delta(p, _costs(p), kind(["w0", "w1"], 50_000))
    # 2 replicas x 1 IPU share the gateway; 2 transfers (one per variable)
    _only(delta, streaming=_streaming(2 * 50_000, 2 * 2, sharing=2))


def test_streaming_gateway_sharing_is_capped_by_the_machine():
    p = _program(di=1, rf=8)
    delta = _delta(p, _costs(p), RemoteLoad(["w0"], 50_000, transfers=5))
    _only(delta, streaming=_streaming(50_000, 5, sharing=T.ipus_per_machine))


@pytest.mark.parametrize("busy", [True, False])
def test_io_tiles_pay_only_what_compute_cannot_hide(busy):
    target = with_io_tiles(MK2, 32)
    p = _program(di=1, ga=1, rf=1)
    costs = _costs(p, *((1e9, 0, 0) if busy else (0, 0, 0)))
    nbytes = 64_000
    delta = _delta(p, costs, RemoteLoad(["w0"], nbytes, io_tiles=True), target)
    # from the IO tiles to the compute tiles: an exchange of the bytes per IO tile
    exchange = K.EXCHANGE_SETUP_CYCLES + (nbytes / 32) / (
        target.exchange_bytes_per_cycle * K.EXCHANGE_EFFICIENCY)
    transfer = _streaming(nbytes, 1, sharing=1, target=target)
    assert delta["streaming"] == pytest.approx(exchange if busy else exchange + transfer)
    plain = _delta(_program(di=1, ga=1, rf=1), costs, RemoteLoad(["w0"], nbytes), target)
    assert plain["streaming"] == pytest.approx(transfer)


def test_host_streams_charge_latency_per_copy_and_bytes():
    p = _program(di=2, synthetic=False)
    streams = [("no_overlap", 3, 10_000), ("no_overlap", 1, 5_000)]
    delta = _delta(p, _costs(p), HostToDevice(15_000, streams))
    seconds = 2 * (4 * T.host_latency_s + 15_000 / T.host_bytes_per_s)
    _only(delta, host=seconds * T.clock_hz)


def test_synthetic_data_drops_the_host_streams():
    p = _program(di=2, synthetic=True)
    total = estimate(p, _costs(p), T)[0]
    assert total["host"] == pytest.approx(T.call_overhead_s * T.clock_hz)
    _only(_delta(p, _costs(p), HostToDevice(15_000, [("no_overlap", 3, 15_000)])))
    streamed = estimate(replace(p, synthetic_data=False), _costs(p), T)[0]
    assert streamed["host"] > total["host"]


def test_update_call_charged_once_per_update_shared_by_parameter_ipus():
    p = _program(di=2)
    update = p.graphs["optimizer_update"]
    delta = _delta(p, _costs(p), Call(update, 2))
    n = len(update.ops)
    _only(delta, compute=2 * 100 * n, exchange=2 * 20 * n, sync=2 * 10 * n)
    p = _program(di=2)
    p.ipu_of_stage = [0, 1]                 # parameters on two IPUs: half each
    p.n_stages = 2
    half = _delta(p, _costs(p), Call(update, 2))
    assert half["compute"] == pytest.approx(100 * n)


@pytest.mark.parametrize("mode", ["serial", "parallel"])
def test_phased_traffic(mode):
    p = _program(di=1, ga=1, rf=1, n_ipus=2)
    p.phased, p.phase_of_stage = mode, [0, 1]
    costs = _costs(p, compute=1e8)          # far more compute than traffic
    delta = _delta(p, costs, RemoteLoad(["w0", "w1"], 80_000, transfers=4, phased=True))
    # each of the 2 IPUs moves half; in parallel phases the next phase loads
    # while this one computes: at least 1/n_phases of it is still paid
    cycles = _streaming(40_000, 2, sharing=2)
    _only(delta, streaming=cycles if mode == "serial" else cycles / 2)


# -- the pipeline rule --------------------------------------------------------------------
def _pipelined(ga=4):
    step = mlp_step(2, ipus=[0, 1])
    p = training_program(ga=ga, step=step, synthetic=True, target=None)
    p = place(p, step, Placement({0: (0, 0), 1: (1, 1)}, (0, 1)), {}, training=True,
              auto_round=False)
    return build_main(map_tiles(p))


def _stage_costs(p):
    """Each op of the step costs 100 x (stage + 1) compute, x 2 in backward."""
    step = p.graphs["training_step"]
    costs = _costs(p)
    costs["training_step"] = [OpCost(100.0 * (op.stage + 1) * (2 if op.backward else 1))
                              for op in step.ops]
    return costs


def test_pipeline_rule_charges_the_schedule():
    p = _pipelined(ga=4)
    step = p.graphs["training_step"]
    costs = _stage_costs(p)
    fwd, bwd = [0.0, 0.0], [0.0, 0.0]
    for op, c in zip(step.ops, costs["training_step"]):
        (bwd if op.backward else fwd)[op.stage] += c.total
    # layer 0's result crosses to IPU 1, layer 1's input gradient back to IPU 0
    fwd[1] += link_cycles(32, 0, 1, T)
    bwd[0] += link_cycles(32, 1, 0, T)
    want = schedule(fwd, bwd, [0, 1], 4, True, True)
    p.main = Repeat(4, Call(step, 1), "accumulation")
    p.grad_bytes = 0
    total, sched = estimate(p, costs, T)
    assert sched.kind == "pipelined" and sched.cycles == pytest.approx(want.cycles)
    assert sched.events == want.events
    # 4 micro-batches + 3 pipeline stages - 1, each as long as the slowest IPU
    assert want.cycles == pytest.approx((4 + 3 - 1) * max(f + b for f, b in zip(fwd, bwd)))
    device = sum(total[k] for k in DEVICE)
    assert device == pytest.approx(want.cycles + 4 * T.sync_cycles)
    assert total["bubble"] == pytest.approx(want.bubble) and 0 < want.bubble < 1


def test_pipeline_splits_the_schedule_by_kind():
    p = _pipelined(ga=3)
    step = p.graphs["training_step"]
    costs = _costs(p, compute=30.0, exchange=10.0, sync=0.0)
    p.main = Repeat(3, Call(step, 1), "accumulation")
    p.grad_bytes = 0
    total, sched = estimate(p, costs, T)
    # three quarters of the op cycles are compute: so is three quarters of the schedule
    compute = total["compute"]
    exchange = total["exchange"]
    assert compute / exchange == pytest.approx(3.0)
    assert compute + exchange == pytest.approx(sched.cycles)


def test_recomputed_ops_run_again_in_the_backward():
    p = _program(di=1, ga=2, rf=1)
    step = p.graphs["training_step"]
    costs = _costs(p)
    plain = estimate(p, costs, T)[0]
    step.ops[0].recompute = True
    again = estimate(p, costs, T)[0]
    assert again["recompute"] == pytest.approx(2 * 130.0)
    for kind, v in zip(DEVICE, (100.0, 20.0, 10.0)):
        assert again[kind] - plain[kind] == pytest.approx(2 * v)
    assert plain["recompute"] == 0


def test_estimate_is_repeatable_and_its_total_adds_up():
    # the walk leaves the program as it was: a second estimate is the same
    p = _program()
    costs = _costs(p)
    first, second = estimate(p, costs, T)[0], estimate(p, costs, T)[0]
    assert first == second
    assert np.isclose(first["total"], sum(v for k, v in first.items()
                                          if k in DEVICE + ("host", "collective", "streaming")))
