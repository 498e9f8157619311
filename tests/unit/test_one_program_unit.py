"""One program, walked twice: the estimate charges, the engine runs and the
printer prints the very step objects of ``Program.main`` (identity, not
look-alikes), the engine each as many times as the loops around it say."""
from collections import Counter

import pytest
import torch
from handbuilt import device_state, inference_program, training_program, walk

from poptorchsim.estimate import program_cost
from poptorchsim.estimate.cost import OpCost
from poptorchsim.estimate.targets import TEST_IPU
from poptorchsim.ir.graph import Call, Sequence
from poptorchsim.machine.call_state import OutputCollector, shard
from poptorchsim.machine.codegen import compile_graph
from poptorchsim.machine.engine import Engine
from poptorchsim.passes.locations import Location
from poptorchsim.passes.program import build_main

DI, GA, RF = 2, 3, 2


@pytest.fixture
def program():
    locations = {"w0": Location("weight", 16, 4, off_chip=True),
                 "grad/w0": Location("accumulator", 16, 4, off_chip=True),
                 "momentum_buffer/w0": Location("optimizer", 16, 4, off_chip=True,
                                                io_tiles=True)}
    return build_main(training_program(DI, GA, RF, n_layers=2, locations=locations,
                                       sharded_state={"w1"}))


def _expected(program, sequences=True):
    """id -> (step, times it runs per call) over every step of ``main``
    (``sequences``: with the ``Sequence`` nodes, which have no rule of their
    own)."""
    return {id(s): (s, times) for s, times in walk(program.main)
            if sequences or not isinstance(s, Sequence)}


def test_program_holds_every_step_kind(program):
    names = {type(s).__name__ for s, _ in walk(program.main)}
    assert names == {"Repeat", "Sequence", "HostToDevice", "RemoteLoad", "Call", "RemoteStore",
                     "AllReduce", "ReduceScatter", "AllGather", "DeviceToHost"}


def test_estimate_charges_exactly_the_steps_of_main(program, monkeypatch):
    seen = []
    step_rule = program_cost._Walk.step

    def step(self, s, times):
        if not isinstance(s, Sequence):
            seen.append((s, times))
        return step_rule(self, s, times)
    monkeypatch.setattr(program_cost._Walk, "step", step)
    costs = {name: [OpCost(10.0, 1.0, 1.0) for _ in g.ops]
             for name, g in program.graphs.items()}
    program_cost.estimate(program, costs, TEST_IPU)

    want = _expected(program, sequences=False)
    assert len(seen) == len(want)                    # each step charged once ...
    for s, times in seen:
        assert want[id(s)][0] is s                   # ... the same object ...
        assert times == want[id(s)][1], type(s).__name__   # ... for all its runs


def test_engine_runs_exactly_the_steps_of_main(program, monkeypatch):
    runs = Counter()
    objects = {}
    walk_rule = Engine._walk

    def walk_step(self, s):
        runs[id(s)] += 1
        objects[id(s)] = s
        return walk_rule(self, s)
    monkeypatch.setattr(Engine, "_walk", walk_step)
    step, update = program.graphs["training_step"], program.graphs["optimizer_update"]
    engine = Engine(compile_graph(step), compile_graph(update), {1: RF})
    torch.manual_seed(0)
    state = device_state([torch.randn(4, 4), torch.randn(4, 4)], RF, grad_scale=1 / (GA * RF))
    state.opt_state[1] = [shard(v, RF) for v in state.opt_state[1]]
    x = torch.randn(DI, GA, RF, 2, 4)
    out = engine.run(program, state, [x], OutputCollector("All", 1, DI, GA, RF))
    assert len(out) == DI * GA * RF

    want = _expected(program)
    assert set(runs) == set(want)
    for key, (s, times) in want.items():
        assert objects[key] is s
        assert runs[key] == times, type(s).__name__
    # the model's call ran once per micro-batch, the update once per device iteration
    calls = {s.graph.name: runs[id(s)] for s, _ in walk(program.main) if isinstance(s, Call)}
    assert calls == {"training_step": DI * GA, "optimizer_update": DI}


def test_printer_prints_one_line_per_step_of_main(program):
    control = str(program).split("\n\ngraph")[0].splitlines()[1:]
    steps = [s for s, _ in walk(program.main) if not isinstance(s, Sequence)]
    assert len(control) == len(steps)
    assert [line.split()[0] for line in control] == [
        {"Repeat": "repeat", "Call": "call", "HostToDevice": "stream", "DeviceToHost": "stream",
         "AllReduce": "all-reduce", "ReduceScatter": "reduce-scatter",
         "AllGather": "all-gather", "RemoteLoad": "load", "RemoteStore": "store"}[
            type(s).__name__] for s in steps]


def test_inference_walks_the_same_steps_too(monkeypatch):
    locations = {"w0": Location("weight", 16, 4, off_chip=True),
                 "w1": Location("weight", 16, 4, shards=RF)}
    program = build_main(inference_program(DI, RF, n_layers=2, locations=locations))
    ran, charged = Counter(), []
    walk_rule, step_rule = Engine._walk, program_cost._Walk.step

    def engine_walk(self, s):
        ran[id(s)] += 1
        return walk_rule(self, s)

    def estimate_step(self, s, times):
        charged.append(id(s))
        return step_rule(self, s, times)
    monkeypatch.setattr(Engine, "_walk", engine_walk)
    monkeypatch.setattr(program_cost._Walk, "step", estimate_step)
    fn = compile_graph(program.graphs["inference_forward"])
    state = device_state([torch.randn(4, 4), torch.randn(4, 4)], RF)
    out = Engine(fn).run(program, state, [torch.randn(DI, 1, RF, 2, 4)],
                         OutputCollector("All", 1, DI, 1, RF))
    costs = {"inference_forward": [OpCost(5.0) for _ in program.graphs["inference_forward"].ops]}
    program_cost.estimate(program, costs, TEST_IPU)
    assert len(out) == DI * RF
    want = _expected(program)
    # every step by its rule, once (the model's call charges the
    # device-iteration loop's pipeline schedule)
    assert sorted(charged) == sorted(want)
    assert {k: ran[k] for k in want} == {k: t for k, (_, t) in want.items()}
