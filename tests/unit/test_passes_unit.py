"""Passes alone, on hand-built graphs: stage placement, tile mapping,
recomputation."""
import logging

import numpy as np
import pytest
from handbuilt import map_tiles, mlp_step, training_program

from poptorchsim.errors import Error
from poptorchsim.estimate.targets import TEST_IPU
from poptorchsim.ir.graph import Program, all_ops
from poptorchsim.ir.verify import verify_program
from poptorchsim.passes import recompute
from poptorchsim.passes.pipeline import input_ipus, input_stages, place_update
from poptorchsim.passes.placement import Placement, place

TWO_IPUS = Placement({0: (0, 0), 1: (1, 1)}, (0, 1))


def _where(graph):
    return {op.name: (op.stage, op.ipu) for op in graph.ops}


def _placed(ipus=(0, 1), placement=TWO_IPUS, ga=3, training=True):
    step = mlp_step(len(ipus), ipus=list(ipus), training=training)
    if training:
        program = training_program(ga=ga, step=step, target=None)
    else:
        program = Program("inference", {"inference_forward": step}, device_iterations=ga)
    return place(program, step, placement, {}, training=training, auto_round=False), step


# -- placement --------------------------------------------------------------------
def test_place_pipelined_training_sets_stages_ipus_and_stash():
    program, step = _placed()
    where = _where(step)
    for name, (stage, ipu) in where.items():
        layer = int(name[len("layer")])
        assert (stage, ipu) == (layer, layer), name
    assert [op.backward for op in step.ops].count(True) == 8
    assert program.n_stages == 2 and program.ipu_of_stage == [0, 1]
    assert program.n_ipus == 2 and program.pipelined
    # stage s stashes 2 (N - 1 - s) + 1 activations: the oldest micro-batch's
    # until its backward comes back
    assert step.stash_depth == {0: 3, 1: 1}
    assert "stage 0 on IPU 0: blocks 0 (2 forward ops)" in program.stage_map
    assert "stage 1 on IPU 1: blocks 1 (2 forward ops)" in program.stage_map


def test_place_leaves_a_verifiable_program():
    program, step = _placed()
    place_update(program.graphs["optimizer_update"], input_ipus(step), input_stages(step))
    map_tiles(program)
    verify_program(program, "place")
    update = program.graphs["optimizer_update"]
    assert {op.ipu for op in update.ops if "w1" in str(op.args)} == {1}


def test_sharded_execution_is_not_pipelined_and_stashes_nothing():
    program, step = _placed(placement=Placement({0: (0, 0), 1: (1, 1)}, (0, 1),
                                                pipelined=False), ga=1)
    assert program.n_stages == 2 and not program.pipelined
    assert step.stash_depth is None


def test_inference_pipeline_stashes_nothing():
    program, step = _placed(training=False, ga=2)
    assert program.pipelined and step.stash_depth is None
    assert _where(step)["layer1/relu"] == (1, 1)


def test_one_ipu_is_never_pipelined():
    program, step = _placed(ipus=(0, 0), placement=Placement({0: (0, 0), 1: (1, 0)}, (0, 1)))
    assert program.n_stages == 2 and program.ipu_of_stage == [0, 0]
    assert not program.pipelined and step.stash_depth is None


def test_descending_stage_order_raises():
    bad = Placement({0: (1, 1), 1: (0, 0)}, (0, 1))
    with pytest.raises(Error, match=r"stage ids must ascend .* stage 0 runs after stage 1"):
        _placed(placement=bad)


def test_pipelined_training_needs_enough_accumulation():
    with pytest.raises(Error, match=r"gradientAccumulation must be greater than or equal to "
                                    r"the number of pipeline stages \(3\)"):
        _placed(ga=2)


def test_one_stage_id_on_two_ipus_is_two_stages():
    program, step = _placed(placement=Placement({0: (0, 0), 1: (0, 1)}, (0, 1)))
    assert program.n_stages == 2 and program.ipu_of_stage == [0, 1]
    assert _where(step)["layer1/mm"] == (1, 1)


def test_phased_placement_records_phases():
    placement = Placement({0: (0, 0), 1: (1, 1)}, (0, 1), pipelined=False,
                          phase_of_stage=[0, 1], serial=True, activations_off_chip=True)
    program, _ = _placed(placement=placement, ga=1)
    assert program.phased == "serial" and program.phase_of_stage == [0, 1]
    assert program.activations_off_chip and not program.pipelined


# -- tile mapping ---------------------------------------------------------------------
def test_every_tensor_mapped_on_the_ipu_that_computes_it():
    program, step = _placed()
    map_tiles(program)
    ipu_in = input_ipus(step)
    for graph in program.graphs.values():
        for t in graph.tensors:
            m = t.mapping
            assert m is not None, t.name
            want = t.producer.ipu if t.producer is not None else ipu_in.get(t.name, m.ipu)
            assert m.ipu == want, t.name
            per_tile = m.bytes_per_tile(TEST_IPU.tiles)
            assert per_tile.sum() == t.nbytes and per_tile.max() == m.max_bytes()
    assert step.inputs[1].mapping.ipu == 1          # w1: read first on IPU 1
    assert set(program.variables) >= {"w0", "w1", "grad/w0", "momentum_buffer/w1"}


def test_elementwise_results_stay_where_their_input_is():
    program = training_program()
    step = program.graphs["training_step"]
    mm, relu = step.ops[0].outputs[0], step.ops[1].outputs[0]
    assert (relu.mapping.start, relu.mapping.n_tiles) == (mm.mapping.start, mm.mapping.n_tiles)


def test_fresh_results_start_where_the_last_one_ended():
    program = training_program()
    step = program.graphs["training_step"]
    fresh = [t.mapping for t in step.inputs] + [op.outputs[0].mapping for op in step.ops
                                               if op.cost_class == "matmul"]
    starts = [m.start for m in fresh]
    # each 32 or 64-byte tensor fills one 64-byte grain: consecutive tiles, wrapping
    assert starts == [k % TEST_IPU.tiles for k in range(len(fresh))]


def test_update_reuses_the_step_variables_mapping():
    program = training_program()
    step, update = program.graphs["training_step"], program.graphs["optimizer_update"]
    assert update.inputs[0].mapping is step.inputs[0].mapping
    assert program.variables["w0"] is step.inputs[0]


def test_large_tensor_spreads_over_all_tiles():
    program = training_program(width=64, batch=8)
    w = program.graphs["training_step"].inputs[0]
    per_tile = w.mapping.bytes_per_tile(TEST_IPU.tiles)
    assert w.mapping.n_tiles == TEST_IPU.tiles
    assert np.array_equal(per_tile, [64 * 64 * 4 // 4] * 4)


# -- recomputation --------------------------------------------------------------------
def _three_layers(ipus):
    """Layers 0 and 1 in stage 0, layer 2 in stage 1 (on ``ipus``)."""
    stages = {0: (0, ipus[0]), 1: (0, ipus[1]), 2: (1, ipus[2])}
    return _placed(ipus=ipus, placement=Placement(stages, (0, 1, 2)))


def _recomputed(step):
    return sorted(op.name for op in step.ops if op.recompute)


def test_pipeline_recomputation_keeps_what_crosses_stages():
    _, step = _three_layers((0, 0, 1))
    rec = recompute.plan(step, recompute.PIPELINE, pipelined=True)
    # stage 0's forward runs again; layer1/relu crosses to stage 1 and is
    # stashed; layer1/mm's result no backward op reads
    assert _recomputed(step) == ["layer0/mm", "layer0/relu"]
    assert step.recompute is rec and rec.name == "Pipeline"
    assert set(rec.segment.values()) == {0}


def test_recompute_all_keeps_checkpoints_and_the_last_segment():
    _, step = _three_layers((0, 0, 0))
    next(op for op in step.ops if op.name == "layer1/relu").attrs[
        "recomputation_checkpoint"] = True
    rec = recompute.plan(step, recompute.RECOMPUTE_ALL)
    assert _recomputed(step) == ["layer0/mm", "layer0/relu"]
    assert rec.checkpoints == 1
    assert not any(op.recompute for op in all_ops(step) if op.backward)


def test_pipeline_recomputation_off_a_pipeline_warns_and_does_nothing():
    _, step = _three_layers((0, 0, 0))
    logger = logging.getLogger("poptorchsim")
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logger.addHandler(handler)
    try:
        rec = recompute.plan(step, recompute.PIPELINE, pipelined=False)
    finally:
        logger.removeHandler(handler)
    assert not rec and _recomputed(step) == []
    assert any("not pipelined over several IPUs" in r.getMessage() for r in records)


def test_norm_only_recomputes_no_matmul():
    _, step = _three_layers((0, 0, 1))
    assert not recompute.plan(step, recompute.NORM_ONLY, pipelined=True)
    assert _recomputed(step) == []


# -- code and vertex state --------------------------------------------------------------
def _code_of(program, per_step=16):
    """``passes.memory.Code`` after adding the training step's ops, each
    costing two compute sets."""
    from dataclasses import replace as _replace

    from poptorchsim.estimate.cost import OpCost
    from poptorchsim.passes.memory import Code
    target = _replace(TEST_IPU, control_code_bytes_per_step=per_step)
    code = Code(target.tiles, target.control_code_bytes_per_step, target.sync_cycles)
    step = program.graphs["training_step"]
    for op in step.ops:
        code.add(op, OpCost(sync=2 * target.sync_cycles))
    return code, step


def test_identical_ops_share_their_code_and_vertex_state():
    """PopART's outlining makes repeated layers one function: three identical
    layers, mapped alike, hold the code and vertex state of one."""
    one, _ = _code_of(training_program(n_layers=1, width=64, batch=8))
    three, step = _code_of(training_program(n_layers=3, width=64, batch=8))
    mms = [op for op in step.ops if op.name.endswith("/mm")]
    assert len({tuple(op.outputs[0].mapping.bytes_per_tile(4)) for op in mms}) == 1
    # (the later layers' input gradient is an mm of the forward's shapes too)
    assert one.control.any() and np.array_equal(three.control, one.control)
    assert one.state.any() and np.array_equal(three.state, one.state)


def test_control_code_is_per_compute_set_on_the_tiles_an_op_runs_on():
    code, step = _code_of(training_program(n_layers=1, width=64, batch=8), per_step=10)
    unique = len(code.seen)
    assert unique and code.control.max() <= unique * 2 * 10
    none, _ = _code_of(training_program(n_layers=1, width=64, batch=8), per_step=0)
    assert not none.control.any() and np.array_equal(none.state, code.state)


# -- the fit check's margin -------------------------------------------------------------
def test_a_tile_fuller_than_the_estimates_uncertainty_is_warned_of():
    """Fits by the estimate, but within the max-tile uncertainty of the
    limit: a warning naming the tile and the headroom; with more room, none."""
    import logging
    from types import SimpleNamespace

    import numpy as np
    from conftest import poptorchsim_log

    from poptorchsim.estimate.targets import MK2
    from poptorchsim.passes.memory import MAX_TILE_UNCERTAINTY, check_fits
    cap = 638_976
    tight = np.full(MK2.tiles, 1000.0)
    tight[7] = cap * (1 - MAX_TILE_UNCERTAINTY / 2)
    roomy = np.full(MK2.tiles, cap * (1 - 2 * MAX_TILE_UNCERTAINTY))
    with poptorchsim_log(logging.WARNING) as log:
        check_fits(SimpleNamespace(total=roomy, capacity=cap, ipu=0), MK2)
        assert not log.messages
        check_fits(SimpleNamespace(total=tight, capacity=cap, ipu=0), MK2)
        check_fits(SimpleNamespace(total=tight, capacity=cap, ipu=0), MK2, warn_tight=False)
    records = log.messages
    assert len(records) == 1
    text = records[0]
    assert "fullest tile (tile 7)" in text and "may not fit" in text
