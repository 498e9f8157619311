"""The IR alone: the verifier's checks and the printer, on hand-built graphs
and programs."""
import re
from dataclasses import dataclass

import pytest
import torch
from handbuilt import F32, Builder, aten, mlp_step, training_program, walk

from poptorchsim.errors import Error
from poptorchsim.estimate.targets import TEST_IPU
from poptorchsim.ir.graph import (
    AllGather,
    AllReduce,
    Call,
    DeviceToHost,
    HostToDevice,
    Op,
    ReduceScatter,
    RemoteLoad,
    RemoteStore,
    Repeat,
    Sequence,
    Step,
)
from poptorchsim.ir.verify import verify_graph, verify_program
from poptorchsim.passes.program import build_main
from poptorchsim.passes.tile_mapping import map_graph


def _relu_chain():
    b = Builder("g")
    x = b.input("x", (2, 3))
    y = b.op(aten.relu.default, x, name="r0")
    z = b.op(aten.add.Tensor, y, x, name="a1")
    return b.finish([z])


# -- verify_graph -----------------------------------------------------------------
def test_well_formed_graph_passes_and_is_returned():
    g = _relu_chain()
    assert verify_graph(g) is g
    assert [op.cost_class for op in g.ops] == ["elementwise", "elementwise"]


def test_use_before_definition():
    g = _relu_chain()
    g.ops.reverse()             # the add now reads %r0 before relu makes it
    with pytest.raises(Error, match=r"a1 in graph g reads %r0 before it is defined"):
        verify_graph(g)


def test_double_assignment():
    g = _relu_chain()
    first, second = g.ops
    second.outputs = [first.outputs[0]]       # the add writes %r0 again
    with pytest.raises(Error, match=r"%r0 is assigned twice"):
        verify_graph(g)


def test_wrong_producer():
    g = _relu_chain()
    g.ops[1].outputs[0].producer = g.ops[0]
    with pytest.raises(Error, match=r"%a1 does not name a1 as producer"):
        verify_graph(g)


def test_undefined_graph_output():
    g = _relu_chain()
    stray = g.new_tensor("stray", (2, 3), F32)
    g.outputs.append(stray)
    with pytest.raises(Error, match=r"returns undefined %stray"):
        verify_graph(g)


def test_constants_count_as_defined():
    b = Builder("c")
    x = b.input("x", (2,))
    c = b.const("k", torch.ones(2))
    g = b.finish([b.op(aten.add.Tensor, x, c)])
    assert verify_graph(g) is g


# -- verify_program ---------------------------------------------------------------
def _program():
    return build_main(training_program(di=2, ga=3, rf=2))


def test_built_program_verifies():
    p = _program()
    assert verify_program(p, "test") is p


@pytest.mark.parametrize("where", ["op", "graph", "tensor", "program"])
def test_undeclared_attribute(where):
    p = _program()
    step = p.graphs["training_step"]
    obj = {"op": step.ops[0], "graph": step, "tensor": step.tensors[0], "program": p}[where]
    obj.scratch = 1
    with pytest.raises(Error, match=r"undeclared attribute\(s\) \['scratch'\]: declare them "
                                    rf"as fields of {type(obj).__name__}"):
        verify_program(p, "test")


def test_op_stage_out_of_range():
    p = _program()
    p.graphs["training_step"].ops[2].stage = 1
    with pytest.raises(Error, match=r"\(after place\): layer0/relu_backward is in stage 1 "
                                    r"of a program with 1 stage"):
        verify_program(p, "place")


def test_op_ipu_out_of_range():
    p = _program()
    p.graphs["optimizer_update"].ops[0].ipu = 2
    with pytest.raises(Error, match=r"runs on IPU 2 of a program with 1 IPU"):
        verify_program(p, "x")


def test_stage_count_disagrees_with_ipu_assignments():
    p = _program()
    p.n_stages = 2
    with pytest.raises(Error, match=r"2 stage\(s\) but 1 IPU assignment"):
        verify_program(p, "x")


def test_call_of_a_graph_not_the_programs():
    p = _program()
    copy = mlp_step()
    p.main.body.steps[1].body = Call(copy, p.replicas)      # same name, another object
    with pytest.raises(Error, match=r"calls graph training_step, which is not the program's"):
        verify_program(p, "x")


def test_call_on_wrong_replica_count():
    p = _program()
    p.main.body.steps[1].body.replicas = 1
    with pytest.raises(Error, match=r"calls training_step on 1 replicas of 2"):
        verify_program(p, "x")


@pytest.mark.parametrize("counter,field", [("device_iteration", "device_iterations"),
                                           ("accumulation", "accumulation")])
def test_repeat_count_disagrees(counter, field):
    p = _program()
    setattr(p, field, getattr(p, field) + 1)
    with pytest.raises(Error, match=rf"the {counter} loop repeats"):
        verify_program(p, "x")


@pytest.mark.parametrize("kind", [AllReduce, ReduceScatter, AllGather])
def test_collective_with_wrong_replica_count(kind):
    p = _program()
    p.main.body.steps.insert(2, kind(64, 4))
    with pytest.raises(Error, match=r"a collective over 4 replicas of 2"):
        verify_program(p, "x")
    p.main.body.steps[2] = kind(64, 2)
    verify_program(p, "x")


def test_collective_counts_replicas_of_all_processes():
    p = build_main(training_program(rf=2, processes=2))
    assert [s.replicas for s, _ in _steps(p) if isinstance(s, AllReduce)] == [4]
    verify_program(p, "x")


def test_unknown_step_type():
    @dataclass(eq=False)
    class Teleport(Step):
        nbytes: int

    p = _program()
    p.main.body.steps.append(Teleport(8))
    with pytest.raises(Error, match=r"unknown step Teleport"):
        verify_program(p, "x")


def _steps(p):
    return list(walk(p.main))


# -- the printer --------------------------------------------------------------------
def test_printer_prints_every_step_kind():
    p = training_program(rf=2)
    step, update = p.graphs["training_step"], p.graphs["optimizer_update"]
    p.main = Repeat(1, Sequence([
        HostToDevice(96),
        Repeat(1, Sequence([
            RemoteLoad(["w0", "a", "b", "c"], 64, io_tiles=True),
            Call(step, 2),
            RemoteStore(["grad/w0"], 64, transfers=3, phased=True)]), "accumulation"),
        AllReduce(64, 2), ReduceScatter(32, 2), Call(update, 2), AllGather(32, 2),
        DeviceToHost(16, "per output mode")]), "device_iteration")
    text = str(p).split("\n\ngraph")[0].splitlines()
    assert text == [
        "program training (replicas=2)",
        "  repeat 1 (device_iteration):",
        "    stream host->device 96 B",
        "    repeat 1 (accumulation):",
        "      load from Streaming Memory 64 B per replica via IO tiles (w0, a, b, ...)",
        f"      call training_step on 2 replica(s) [{len(step.ops)} ops]",
        "      store to Streaming Memory 64 B per replica (phased, 3 transfer(s)) (grad/w0)",
        "    all-reduce 64 B across 2 replicas",
        "    reduce-scatter 32 B across 2 replicas",
        f"    call optimizer_update on 2 replica(s) [{len(update.ops)} ops]",
        "    all-gather 32 B across 2 replicas",
        "    stream device->host 16 B (per output mode)",
    ]


def test_printer_shows_placement_of_each_op():
    p = training_program()
    g = p.graphs["training_step"]
    mm = g.ops[0]
    mm.stage, mm.ipu, mm.recompute = 0, 0, True
    grad = next(op for op in g.ops if op.name == "layer0/grad")
    text = str(g)
    m = mm.outputs[0].mapping
    assert (f"%layer0/mm: f32[2,4] = aten.mm.default(%x, %w0)  # matmul; stage 0, ipu 0, "
            f"{m.n_tiles} tile(s) from {m.start}, recomputed") in text
    gm = grad.outputs[0].mapping
    assert (f"= aten.mm.default(%layer0/t_in, %layer0/relu_backward)  # matmul; stage 0, "
            f"ipu 0, {gm.n_tiles} tile(s) from {gm.start}, backward") in text
    assert "%w0: f32[4,4]  # param" in text
    assert "return [%layer0/relu, %layer0/grad]" in text


def test_printer_stage_and_ipu_after_change():
    b = Builder("g")
    x = b.input("x", (2,))
    b.op(aten.relu.default, x, name="r")
    g = b.finish([b.graph.ops[0].outputs[0]])
    g.ops[0].stage, g.ops[0].ipu = 2, 1
    g.ops[0].partials = "half"
    assert "# elementwise; stage 2, ipu 1, half partials" in str(g)


def test_printer_names_only_tiles_the_ipu_has():
    """A mapping may wrap round to tile 0: the printer gives its tile count
    and first tile, never a range past the IPU's last tile."""
    b = Builder("g")
    b.input("a", (16,))                       # one grain: tile 0
    big = b.input("big", (64, 16))            # 64 grains over all 4 tiles, from tile 1
    g = b.finish([b.op(aten.relu.default, big, name="r")])
    map_graph(g, TEST_IPU)
    assert (big.mapping.start, big.mapping.n_tiles) == (1, 4)
    line = next(x for x in str(g).splitlines() if "%r:" in x)
    assert "4 tile(s) from 1" in line and not re.search(r"tiles \d+\.\.\d+", line), line


def test_graph_with_stray_op_object_is_not_confused_with_another():
    # the verifier compares producers by identity, not by name or id
    g = _relu_chain()
    twin = Op(g.ops[0].id, g.ops[0].name, g.ops[0].target, g.ops[0].args, {}, [],
              "elementwise")
    g.ops[0].outputs[0].producer = twin
    with pytest.raises(Error, match=r"%r0 does not name r0 as producer"):
        verify_graph(g)


# -- op kinds ---------------------------------------------------------------------
def test_inplace_by_schema_agrees_with_pytorchs_tag():
    """Before torch 2.12 there is no ``torch.Tag.inplace``: ``is_inplace``
    reads the schema instead, which must name the same ATen overloads."""
    from poptorchsim.ir import ops
    if ops._INPLACE_TAG is None:
        pytest.skip("this PyTorch has no torch.Tag.inplace to compare with")
    overloads = []
    for schema in torch._C._jit_get_all_schemas():     # every ATen overload, loaded or not
        if schema.name.startswith("aten::"):
            try:
                overloads.append(getattr(getattr(torch.ops.aten, schema.name[6:]),
                                         schema.overload_name or "default"))
            except (AttributeError, RuntimeError):
                pass
    tagged = {str(o) for o in overloads if ops._INPLACE_TAG in o.tags}
    assert len(tagged) > 100 and "aten.add_.Tensor" in tagged
    assert {str(o) for o in overloads if ops._inplace_by_schema(o)} == tagged
