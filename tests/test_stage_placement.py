"""Where ops run when a model is split over IPUs, as in PopTorch: ops outside
any block, after a ``Block`` scope closes, in ``AutoIncrement``/``SameAsIpu``
modes, with explicit ``Stage`` objects, and in sharded, pipelined and phased
execution.

PopTorch's compiler starts with stage 0 on IPU 0 active
(popart_compiler CompilerImpl.hpp: ``active_ipu{0}``, ``active_stage{0}``,
``active_phase{0}``), so ops before the first block run there: "PopTorch places
the first layers on ipu_id 0 by default" (user guide, "Model partitioning
using blocks"; pipelining_test.py::test_api_wrap_2stages, where the
unannotated ``l0`` is ``ipu(0), stage(0)``).  ``AutoStage.AutoIncrement``
numbers blocks from stage 1 (options.py ``_DefaultStageManager._next_id = 1``;
pipelining_test.py::test_api_AutoIncrement).  A closed ``Block`` scope leaves
no IPU active ("No active Block", test_missing_block).  The rules count
pipeline stages as one plus the changes of IPU from IPU 0
(CompilerImpl::numPipelineStages) and need gradientAccumulation >= 2N-1 in
training, deviceIterations >= N in inference.
"""
import copy

import pytest
import torch
from conftest import assert_state_close, quiet_options
from torch import nn

import poptorchsim as poptorch

WIDTH = 8


class Chain(nn.Module):
    """Four linear layers and a loss; ``ipus[i]`` puts ``layers[i]`` in a
    ``BeginBlock`` on that IPU, ``None`` leaves it unannotated."""

    def __init__(self, ipus=(None, 1, 2, 3)):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(4))
        self.loss = nn.MSELoss()
        for i, ipu in enumerate(ipus):
            if ipu is not None:
                poptorch.BeginBlock(self.layers[i], user_id=f"b{i}", ipu_id=ipu)

    def forward(self, x, y=None):
        for layer in self.layers:
            x = torch.relu(layer(x))
        return x if y is None else (x, self.loss(x, y))


class Scoped(nn.Module):
    """``layers[0]`` before any block, then ``with Block`` scopes A and B."""

    def __init__(self, after_scope=False):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(3))
        self.loss = nn.MSELoss()
        self.after_scope = after_scope

    def forward(self, x, y=None):
        x = torch.relu(self.layers[0](x))
        with poptorch.Block("A", ipu_id=1):
            x = torch.relu(self.layers[1](x))
        with poptorch.Block("B", ipu_id=2):
            x = self.layers[2](x)
            if not self.after_scope:
                return x if y is None else (x, self.loss(x, y))
        x = x * 2                       # after the last scope closed: no active block
        return x if y is None else (x, self.loss(x, y))


def batch(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, WIDTH, generator=g), torch.randn(n, WIDTH, generator=g)


def options(strategy=None, ga=1, di=1):
    o = quiet_options().deviceIterations(di)
    o.Training.gradientAccumulation(ga)
    if strategy is not None:
        o.setExecutionStrategy(strategy)
    return o


def compile_training(model, strategy=None, ga=7):
    tm = poptorch.trainingModel(model, options(strategy, ga=ga),
                                torch.optim.SGD(model.parameters(), lr=0.1))
    tm.compile(*batch(ga))
    return tm.getIR()


def phased(cls, *stages):
    return cls(*[poptorch.Phase(s) for s in stages])


# -- the stage map, case by case -------------------------------------------------------
# (model, strategy, ipu_of_stage, n_ipus); every case has ops before its first block
CASES = {
    # PopTorch runs layers[0] on IPU 0 as stage 0, then one stage per IPU
    "before_first_BeginBlock": (lambda: Chain((None, 1, 2, 3)), None, [0, 1, 2, 3], 4),
    # Block scopes: the same
    "before_first_Block_scope": (lambda: Scoped(), None, [0, 1, 2], 3),
    # AutoIncrement: stage 0 is the default block, blocks take stages 1, 2, 3
    # (PopTorch's test_api_AutoIncrement: ipu(0) stage(0), ipu(1) stage(1),
    # ipu(2) stage(2), ipu(1) stage(3))
    "AutoIncrement": (lambda: Chain((None, 1, 2, 1)),
                      lambda: poptorch.PipelinedExecution(poptorch.AutoStage.AutoIncrement),
                      [0, 1, 2, 1], 3),
    # SameAsIpu (given explicitly): the default block is stage 0 on IPU 0
    "SameAsIpu": (lambda: Chain((None, 2, 3, 3)),
                  lambda: poptorch.PipelinedExecution(poptorch.AutoStage.SameAsIpu),
                  [0, 2, 3], 4),
    # explicit stages: the default block is stage 0 on IPU 0, before stage 0
    # on IPU 1
    "explicit_Stage": (lambda: Chain((None, 0, 0, 0)),
                       lambda: poptorch.PipelinedExecution(
                           poptorch.Stage("b1").ipu(1), poptorch.Stage("b2", "b3").ipu(2)),
                       [0, 1, 2], 3),
    "ShardedExecution": (lambda: Chain((None, 1, 2, 3)), poptorch.ShardedExecution,
                         [0, 1, 2, 3], 4),
    # phased: the default block runs in phase 0 on IPU 0
    "SerialPhasedExecution": (lambda: Chain((None, 0, 0, 0)),
                              lambda: phased(poptorch.SerialPhasedExecution,
                                             poptorch.Stage("b1").ipu(1),
                                             poptorch.Stage("b2").ipu(1),
                                             poptorch.Stage("b3").ipu(1)),
                              [0, 1, 1, 1], 2),
    "ParallelPhasedExecution": (lambda: Chain((None, 0, 0, 0)),
                                lambda: phased(poptorch.ParallelPhasedExecution,
                                               poptorch.Stage("b1").ipu(2),
                                               poptorch.Stage("b2").ipu(1),
                                               poptorch.Stage("b3").ipu(2)),
                                [0, 2, 1, 2], 3),
}


@pytest.mark.parametrize("case", list(CASES))
def test_ops_before_the_first_block_run_on_ipu_0_in_their_own_stage(case):
    make_model, make_strategy, ipu_of_stage, n_ipus = CASES[case]
    program = compile_training(make_model(), make_strategy() if make_strategy else None)
    assert program.ipu_of_stage == ipu_of_stage
    assert program.n_stages == len(ipu_of_stage)
    assert program.n_ipus == n_ipus
    assert program.stage_map.splitlines()[0].startswith(
        "  stage 0 on IPU 0: the ops before the first block")
    graph = program.graphs["training_step"]
    first = [op for op in graph.ops if not op.backward][:3]      # layers[0]: t, addmm, relu
    assert [(op.stage, op.ipu) for op in first] == [(0, 0)] * 3


def test_phased_default_block_is_in_phase_0():
    program = compile_training(Chain((None, 0, 0, 0)), CASES["ParallelPhasedExecution"][1]())
    assert program.phase_of_stage == [0, 0, 1, 2]
    program = compile_training(Chain((None, 0, 0, 0)), CASES["SerialPhasedExecution"][1]())
    assert program.phase_of_stage == [0, 0, 1, 2]


def test_default_block_shares_stage_0_with_a_first_block_on_ipu_0():
    """SameAsIpu: a block on IPU 0 is stage 0, like the default block.
    AutoIncrement while pipelining merges consecutive stages on one IPU.
    A model that begins on IPU 1 with no op before it has no stage on IPU 0."""
    for strategy in (None, poptorch.PipelinedExecution(poptorch.AutoStage.AutoIncrement)):
        program = compile_training(Chain((None, 0, 1, 1)), strategy)
        assert program.ipu_of_stage == [0, 1]
        assert "stage 0 on IPU 0: blocks b1 and the ops before the first block" \
            in program.stage_map
    program = compile_training(Chain((1, 2, 3, 3)))
    assert program.ipu_of_stage == [1, 2, 3] and program.n_ipus == 4
    # ...though PopTorch's rules count IPU 0 as the first stage (next test)


def test_backward_of_ops_before_the_first_block_runs_on_ipu_0():
    for model in (Chain((None, 1, 2, 3)), Scoped()):
        graph = compile_training(model).graphs["training_step"]
        backward = [op for op in graph.ops if op.backward]
        # the last backward ops are layers[0]'s: relu, weight and bias gradients
        assert {(op.stage, op.ipu) for op in backward[-6:]} == {(0, 0)}
        assert {(op.stage, op.ipu) for op in backward if op.block is None} == {(0, 0)}
        # and every backward op of a later layer stays off IPU 0
        later = [op for op in backward if op.block is not None]
        assert later and all(op.ipu != 0 for op in later)


def test_auto_increment_blocks_without_ipu_ids_run_on_the_ipu_of_their_number():
    """PopTorch numbers AutoIncrement blocks from 1 (stage 0 is the default
    block's) and puts a block with no ipu_id on the IPU of its number."""
    class Anonymous(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, WIDTH)

        def forward(self, x):
            poptorch.Block.useAutoId()
            with poptorch.Block():
                x = self.a(x)
            with poptorch.Block():
                return self.b(x)

    o = options(poptorch.PipelinedExecution(poptorch.AutoStage.AutoIncrement), di=3)
    im = poptorch.inferenceModel(Anonymous(), o)
    im.compile(batch(3)[0])
    program = im.getIR()
    assert program.ipu_of_stage == [1, 2] and program.n_ipus == 3
    # PopTorch counts 3 pipeline stages (IPU 0, then 1, then 2): deviceIterations >= 3
    im = poptorch.inferenceModel(Anonymous(), options(
        poptorch.PipelinedExecution(poptorch.AutoStage.AutoIncrement), di=2))
    with pytest.raises(poptorch.Error, match=r"number of pipeline stages \(3\)"):
        im.compile(batch(2)[0])


def test_loops_and_conditionals_run_in_their_block():
    """``for_loop``/``cond`` inside a block are that block's ops, not ops
    outside any block."""
    class Looped(nn.Module):
        def __init__(self):
            super().__init__()
            self.layer = nn.Linear(WIDTH, WIDTH)

        def forward(self, x):
            x = x * 2                                   # before any block: IPU 0
            with poptorch.Block("A", ipu_id=1):
                x = poptorch.for_loop(3, lambda y: [self.layer(y)], [x])[0]
                return poptorch.cond(x.sum() > 0, lambda y: [y + 1], [x],
                                     lambda y: [y - 1], [x])[0]

    im = poptorch.inferenceModel(Looped(), options(di=2))
    im.compile(batch(2)[0])
    program = im.getIR()
    assert program.ipu_of_stage == [0, 1]
    flow = [op for op in program.graphs["inference_forward"].ops if op.subgraphs]
    assert len(flow) == 2 and {(op.stage, op.ipu) for op in flow} == {(1, 1)}


# -- PopTorch's rules ------------------------------------------------------------------
def test_four_stage_rule_counts_the_default_stage():
    """layers[1..3] on IPUs 1..3, layers[0] unannotated: 4 pipeline stages, so
    7 in training (gradientAccumulation >= 7) and deviceIterations >= 4."""
    model = Chain((None, 1, 2, 3))
    tm = poptorch.trainingModel(model, options(ga=5),
                                torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(poptorch.Error, match=(
            r"poptorch.Options\(\).Training.gradientAccumulation must be greater than or "
            r"equal to the number of pipeline stages \(7\) when using "
            r"poptorch.PipelinedExecution. Please note that a model with 4 pipeline stages "
            r"in PopTorch will have an additional 3 stages when training.")):
        tm(*batch(5))
    im = poptorch.inferenceModel(Chain((None, 1, 2, 3)), options(di=3))
    with pytest.raises(poptorch.Error, match=(
            r"poptorch.Options\(\).deviceIterations must be greater than or equal to the "
            r"number of pipeline stages \(4\) when using PopTorch.PipelinedExecution")):
        im(batch(3)[0])
    assert poptorch.inferenceModel(Chain((None, 1, 2, 3)), options(di=4))(
        batch(4)[0]).shape == (4, WIDTH)


def test_rule_counts_ipu_changes_from_ipu_0():
    """PopTorch starts on IPU 0 and counts a stage at every change of IPU: a
    model that begins on IPU 1 counts 4 pipeline stages for blocks on IPUs
    1, 2, 3 (CompilerImpl::numPipelineStages), and the message says so."""
    model = Chain((1, 2, 3, 3))
    tm = poptorch.trainingModel(model, options(ga=5),
                                torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(poptorch.Error, match=r"(?s)pipeline stages \(7\).*3 stages hold ops; "
                       r"PopTorch counts 4"):
        tm(*batch(5))


def test_rules_apply_to_pipelined_execution_only():
    # sharded and phased execution have no accumulation rule
    for strategy in (poptorch.ShardedExecution(),
                     CASES["SerialPhasedExecution"][1]()):
        compile_training(Chain((None, 1, 1, 1) if strategy.is_phased else (None, 1, 2, 3)),
                         strategy, ga=1)
    # two stages on one IPU: PopTorch does not pipeline (enablePipelining only
    # with more than one IPU) and counts one pipeline stage
    program = compile_training(Chain((None, 0, 0, 0)), poptorch.PipelinedExecution(
        poptorch.Stage("b1").ipu(0), poptorch.Stage("b2", "b3").ipu(0)), ga=1)
    assert program.n_ipus == 1 and not program.pipelined


def test_ops_after_a_closed_block_scope_have_no_ipu():
    """After a ``with Block`` scope closes PopTorch has no active IPU."""
    model = Scoped(after_scope=True)
    tm = poptorch.trainingModel(model, options(ga=5),
                                torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(poptorch.Error, match="No active Block, all the ops must belong to a "
                       "Block"):
        tm(*batch(5))
    # before that scope, the same model's first layer is on IPU 0
    program = compile_training(Scoped())
    assert program.ipu_of_stage == [0, 1, 2]


# -- numerics --------------------------------------------------------------------------
def test_four_ipu_pipeline_with_unannotated_first_layer_trains_like_eager():
    torch.manual_seed(0)
    eager = Chain((None, None, None, None))
    split = copy.deepcopy(eager)
    for i in (1, 2, 3):
        poptorch.BeginBlock(split.layers[i], user_id=f"b{i}", ipu_id=i)
    plain = copy.deepcopy(eager)
    ga = 7
    opt_eager = torch.optim.SGD(eager.parameters(), lr=0.05, momentum=0.9)
    pipelined = poptorch.trainingModel(
        split, options(ga=ga), torch.optim.SGD(split.parameters(), lr=0.05, momentum=0.9))
    single = poptorch.trainingModel(
        plain, options(ga=ga), torch.optim.SGD(plain.parameters(), lr=0.05, momentum=0.9))
    for step in range(4):
        x, y = batch(2 * ga, seed=step)
        pipelined(x, y)
        single(x, y)
        opt_eager.zero_grad()
        for xs, ys in zip(x.chunk(ga), y.chunk(ga)):
            (eager(xs, ys)[1] / ga).backward()
        opt_eager.step()
    program = pipelined.getIR()
    assert program.ipu_of_stage == [0, 1, 2, 3] and program.n_stages == 4
    assert program.pipelined and single.getIR().n_ipus == 1
    for (name, p), q, r in zip(split.named_parameters(), plain.parameters(),
                               eager.parameters()):
        torch.testing.assert_close(p, r, rtol=1e-5, atol=1e-6, msg=name)
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=name)
    assert_state_close(split, eager)
