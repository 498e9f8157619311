"""``passes.program.build_main`` alone: the control program of hand-built
training and inference programs, step by step."""
from handbuilt import inference_program, kinds, map_tiles, mlp_step, training_program, walk

from poptorchsim.ir.graph import (
    AllGather,
    AllReduce,
    Call,
    DeviceToHost,
    HostToDevice,
    ReduceScatter,
    RemoteLoad,
    RemoteStore,
    Repeat,
)
from poptorchsim.ir.verify import verify_program
from poptorchsim.passes.locations import Location
from poptorchsim.passes.placement import Placement, place
from poptorchsim.passes.program import build_main

W = 4 * 4 * 4                     # bytes of one 4x4 fp32 weight


def _built(program):
    built = build_main(program)
    verify_program(built, "control program")
    return built


def _only(main, kind):
    return [s for s, _ in walk(main) if isinstance(s, kind)]


def test_plain_training():
    p = training_program(di=2, ga=3, n_layers=2)
    built = _built(p)
    assert kinds(built.main) == ("Repeat", "device_iteration", 2, [
        "HostToDevice", ("Repeat", "accumulation", 3, ["Call"]), "Call", "DeviceToHost"])
    step_call, update_call = _only(built.main, Call)
    assert step_call.graph is p.graphs["training_step"] and step_call.replicas == 1
    assert update_call.graph is p.graphs["optimizer_update"]
    assert built.grad_bytes == 2 * W
    assert p.main is None                      # a new program; the old one untouched


def test_host_streams_are_per_device_iteration():
    p = training_program(di=2, ga=3)
    built = _built(p)
    h2d = _only(built.main, HostToDevice)[0]
    d2h = _only(built.main, DeviceToHost)[0]
    x = 2 * 4 * 4
    assert h2d.nbytes == x * 3 and h2d.streams == [("no_overlap", 3.0, 3.0 * x)]
    assert d2h.nbytes == p.out_bytes // 2 and d2h.streams == [("no_overlap", 1.0, p.out_bytes / 2)]


def test_replicas_all_reduce_the_gradients_once_per_update():
    built = _built(training_program(ga=2, rf=2, n_layers=2))
    assert kinds(built.main)[3] == ["HostToDevice", ("Repeat", "accumulation", 2, ["Call"]),
                                    "AllReduce", "Call", "DeviceToHost"]
    (ar,) = _only(built.main, AllReduce)
    assert (ar.nbytes, ar.replicas) == (2 * W, 2)


def test_processes_count_in_the_collective():
    built = _built(training_program(rf=1, processes=2))
    (ar,) = _only(built.main, AllReduce)
    assert ar.replicas == 2 and _only(built.main, Call)[0].replicas == 1


def test_one_replica_reduces_nothing():
    built = _built(training_program(ga=4))
    assert not _only(built.main, (AllReduce, ReduceScatter, AllGather))


def test_sharded_optimizer_state():
    built = _built(training_program(rf=2, n_layers=2, sharded_state={"w1"}))
    body = kinds(built.main)[3]
    assert body == ["HostToDevice", ("Repeat", "accumulation", 1, ["Call"]), "AllReduce",
                    "ReduceScatter", "Call", "AllGather", "DeviceToHost"]
    (ar,), (rs,), (ag,) = (_only(built.main, k) for k in (AllReduce, ReduceScatter, AllGather))
    assert (ar.nbytes, rs.nbytes, ag.nbytes) == (W, W, W)
    assert built.grad_bytes == 2 * W


def test_all_state_sharded_needs_no_all_reduce():
    built = _built(training_program(rf=2, sharded_state={"w0"}))
    assert not _only(built.main, AllReduce)
    assert [type(s).__name__ for s in _only(built.main, (ReduceScatter, AllGather))] == [
        "ReduceScatter", "AllGather"]


def test_off_chip_weights_optimizer_state_and_accumulators():
    locations = {"w0": Location("weight", 16, 4, off_chip=True),
                 "grad/w0": Location("accumulator", 16, 4, off_chip=True),
                 "momentum_buffer/w0": Location("optimizer", 16, 4, off_chip=True,
                                                io_tiles=True)}
    built = _built(training_program(ga=2, locations=locations))
    assert kinds(built.main)[3] == [
        "HostToDevice",
        ("Repeat", "accumulation", 2, ["RemoteLoad", "RemoteLoad", "Call", "RemoteStore"]),
        "RemoteLoad", "Call", "RemoteStore", "RemoteStore", "DeviceToHost"]
    loads, stores = _only(built.main, RemoteLoad), _only(built.main, RemoteStore)
    assert [(s.names, s.nbytes, s.io_tiles, s.transfers) for s in loads] == [
        (["w0"], W, False, 1), (["grad/w0"], W, False, 1),
        (["momentum_buffer/w0"], W, True, 1)]
    assert [s.names for s in stores] == [["grad/w0"], ["momentum_buffer/w0"], ["w0"]]
    assert [s.io_tiles for s in stores] == [False, True, False]


def test_off_chip_variables_travel_apart_by_io_tiles():
    locations = {"w0": Location("weight", 16, 4, off_chip=True),
                 "w1": Location("weight", 16, 4, off_chip=True, io_tiles=True),
                 "w2": Location("weight", 16, 4, off_chip=True)}
    built = _built(training_program(n_layers=3, locations=locations))
    loads = _only(built.main, RemoteLoad)
    assert [(s.names, s.nbytes, s.io_tiles) for s in loads] == [
        (["w0", "w2"], 2 * W, False), (["w1"], W, True)]


def test_sharded_off_chip_weights_move_one_shard_per_replica():
    locations = {"w0": Location("weight", 16, 4, off_chip=True, shards=2)}
    built = _built(training_program(rf=2, locations=locations))
    (load,) = _only(built.main, RemoteLoad)
    (gather,) = _only(built.main, AllGather)
    assert load.nbytes == W // 2 and gather.nbytes == W      # the gather rebuilds it whole
    # the gather is in the accumulation loop, before the call that reads it
    assert kinds(built.main)[3][1] == ("Repeat", "accumulation", 1,
                                       ["RemoteLoad", "AllGather", "Call"])


def test_inference_with_off_chip_and_sharded_weights():
    locations = {"w0": Location("weight", 16, 4, off_chip=True),
                 "w1": Location("weight", 16, 4, shards=2)}
    p = inference_program(di=3, rf=2, n_layers=2, locations=locations)
    built = _built(p)
    assert kinds(built.main) == ("Repeat", "device_iteration", 3, [
        "HostToDevice", "RemoteLoad", "AllGather", "Call", "DeviceToHost"])
    assert _only(built.main, AllGather)[0].nbytes == W
    assert _only(built.main, Call)[0].graph is p.graphs["inference_forward"]
    assert built.grad_bytes == 0


def test_plain_inference():
    built = _built(inference_program(di=2))
    assert kinds(built.main) == ("Repeat", "device_iteration", 2,
                                 ["HostToDevice", "Call", "DeviceToHost"])


def _phased(activations_off_chip):
    step = mlp_step(2, ipus=[0, 1])
    p = training_program(step=step, target=None)
    p = place(p, step, Placement({0: (0, 0), 1: (1, 1)}, (0, 1), pipelined=False,
                                 phase_of_stage=[0, 1], serial=True,
                                 activations_off_chip=activations_off_chip),
              {}, training=True, auto_round=False)
    return _built(map_tiles(p))


def test_phased_execution_loads_each_phase_weights_and_state():
    built = _phased(activations_off_chip=False)
    assert kinds(built.main)[3] == [
        "HostToDevice", ("Repeat", "accumulation", 1, ["RemoteLoad", "RemoteLoad", "Call"]),
        "Call", "RemoteStore", "RemoteLoad", "RemoteStore", "DeviceToHost"]
    remote = _only(built.main, (RemoteLoad, RemoteStore))
    assert all(s.phased and not s.io_tiles and s.transfers == 2 for s in remote)
    weights = (["w0", "w1"], 2 * W)
    state = (["grad/w0", "grad/w1", "momentum_buffer/w0", "momentum_buffer/w1"], 4 * W)
    assert [(s.names, s.nbytes) for s in remote] == [weights, weights, weights, state, state]


def test_phased_activations_off_chip_cross_phases_through_streaming_memory():
    built = _phased(activations_off_chip=True)
    micro = kinds(built.main)[3][1][3]
    assert micro == ["RemoteLoad", "RemoteLoad", "RemoteStore", "RemoteLoad", "Call"]
    store, load = _only(built.main, (RemoteLoad, RemoteStore))[2:4]
    # layer 0's result goes to phase 1, layer 1's input gradient back to phase 0
    assert store.names == load.names == ["layer0/relu", "layer1/grad_in"]
    assert store.nbytes == 2 * (2 * 4 * 4) and store.transfers == 0


def test_repeat_counts_follow_the_program():
    built = _built(training_program(di=5, ga=7, rf=2))
    loops = {s.counter: s.count for s in _only(built.main, Repeat)}
    assert loops == {"device_iteration": 5, "accumulation": 7}
