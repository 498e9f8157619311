"""PopTorch's multi-IPU face: BeginBlock, Block, BlockFunction, removeBlocks,
recomputationCheckpoint, Stage, PipelinedExecution / ShardedExecution and
``Options.setExecutionStrategy``.  Texts follow PopTorch's."""
import copy
import pickle

import pytest
import torch
from conftest import (
    ClassifierWithLoss,
    assert_state_close,
    classification_batch,
    quiet_options,
    reference_call,
)
from torch import nn

import poptorchsim
from poptorchsim import (
    AutoStage,
    BeginBlock,
    Block,
    BlockFunction,
    PipelinedExecution,
    ShardedExecution,
    Stage,
    recomputationCheckpoint,
    removeBlocks,
)
from poptorchsim.annotations import LegacyBeginBlockFn, _BlockHook
from poptorchsim.capture import blocks as capture_blocks


@pytest.fixture(autouse=True)
def _auto_ids():
    Block.useAutoId()
    yield
    Block.useAutoId()


def block_hooks(module):
    return [h for h in module._forward_pre_hooks.values() if isinstance(h, _BlockHook)]


# ---------------------------------------------------------------------------
# BeginBlock and removeBlocks
# ---------------------------------------------------------------------------
def test_begin_block_returns_the_module_with_a_pre_hook():
    layer = nn.Linear(2, 2)
    assert BeginBlock(layer, "enc", ipu_id=1) is layer
    (hook,) = block_hooks(layer)
    assert (hook.user_id, hook.ipu_id) == ("enc", 1)
    assert repr(hook) == "BeginBlock(user_id=enc, ipu_id=1)"


def test_begin_block_twice_is_an_error():
    layer = BeginBlock(nn.Linear(2, 2), "A")
    with pytest.raises(poptorchsim.Error,
                       match="module has already been assigned to a block."):
        BeginBlock(layer, "B")
    assert len(block_hooks(layer)) == 1


def test_begin_block_rejects_what_is_not_callable():
    with pytest.raises(poptorchsim.Error,
                       match="module is not an instance of torch.nn.Module or function."):
        BeginBlock(42, "A")


def test_begin_block_on_a_function_wraps_it():
    def double(x):
        return 2 * x

    wrapped = BeginBlock(double, "fn", ipu_id=1)
    assert isinstance(wrapped, LegacyBeginBlockFn)
    assert wrapped.__name__ == "double"
    assert torch.equal(wrapped(torch.ones(2)), torch.full((2,), 2.0))   # outside tracing
    with capture_blocks.recording() as log:
        wrapped(torch.ones(2))
        assert capture_blocks.current_block() == ("fn", 1)
    assert log == [("fn", 1)]


def test_begin_block_hook_enters_the_block_while_recording():
    model = nn.Sequential(nn.Linear(3, 3), nn.ReLU(), nn.Linear(3, 2))
    BeginBlock(model[0], "first", ipu_id=0)
    BeginBlock(model[2], "second", ipu_id=1)
    x = torch.randn(4, 3)
    assert model(x).shape == (4, 2)          # a no-op outside tracing
    assert capture_blocks.current_block() is None
    with capture_blocks.recording() as log:
        model(x)
        # a pre-hook: the block stays active after the module returns
        assert capture_blocks.current_block() == ("second", 1)
    assert log == [("first", 0), ("second", 1)]


class KeywordOnly(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(3, 3)

    def forward(self, *, x):
        return self.fc(x)


@pytest.mark.parametrize("how", ["BeginBlock", "BeginBlock kwargs", "function",
                                 "BlockFunction"])
def test_backward_of_a_block_returns_to_the_previous_block(how):
    """The tensors entering a block reach the capture side, which hooks their
    gradients: once the block's backward is done, the previous block is active
    again, so backward ops land in the block of their forward ops."""
    first = BeginBlock(nn.Linear(3, 3), "A", ipu_id=0)
    if how == "BeginBlock":
        second = BeginBlock(nn.Linear(3, 3), "B", ipu_id=1)
    elif how == "BeginBlock kwargs":
        layer = BeginBlock(KeywordOnly(), "B", ipu_id=1)
        second = lambda t: layer(x=t)              # noqa: E731 - a one-line helper
    elif how == "function":
        second = BeginBlock(torch.sin, "B", ipu_id=1)
    else:
        second = BlockFunction("B", ipu_id=1)(torch.sin)
    seen = []
    with capture_blocks.recording() as log:
        x = torch.randn(2, 3, requires_grad=True)
        h = first(x)
        y = second(h)
        if how != "BlockFunction":
            assert capture_blocks.current_block() == ("B", 1)
        Block.start("C", 2)
        # runs after the capture side's hook on h, registered when B began
        h.register_hook(lambda g: seen.append(capture_blocks.current_block()))
        y.sum().backward()
    assert log == [("A", 0), ("B", 1), ("C", 2)]
    assert seen == [("A", 0)]


def test_remove_blocks_strips_block_hooks_recursively():
    model = nn.Sequential(nn.Linear(3, 3), nn.Sequential(nn.ReLU(), nn.Linear(3, 2)))
    BeginBlock(model[0], "A", ipu_id=0)
    BeginBlock(model[1][1], "B", ipu_id=1)
    calls = []
    model[1][1].register_forward_pre_hook(lambda m, i: calls.append(m))
    removeBlocks(model)
    assert not any(block_hooks(m) for m in model.modules())
    model(torch.randn(1, 3))
    assert len(calls) == 1                   # other hooks stay
    BeginBlock(model[0], "A2")               # and the module may be annotated again
    assert len(block_hooks(model[0])) == 1


def test_remove_blocks_needs_a_module():
    with pytest.raises(AssertionError):
        removeBlocks(lambda x: x)


def test_annotated_module_survives_deepcopy_and_pickle():
    model = nn.Sequential(nn.Linear(3, 3))
    BeginBlock(model[0], "A", ipu_id=1)
    for clone in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
        (hook,) = block_hooks(clone[0])
        assert (hook.user_id, hook.ipu_id) == ("A", 1)


# ---------------------------------------------------------------------------
# Automatic ids
# ---------------------------------------------------------------------------
def test_auto_ids_count_in_order_of_creation():
    first, named, second = Block(), Block("special"), Block(ipu_id=2)
    assert (first.user_id, named.user_id, second.user_id) == ("0", "special", "1")
    layer = BeginBlock(nn.Linear(1, 1))
    assert block_hooks(layer)[0].user_id == "2"
    assert BeginBlock(lambda x: x).user_id == "3"
    Block.useAutoId()
    assert Block().user_id == "0"


def test_integer_user_ids_become_strings():
    assert Block(3).user_id == "3"
    with pytest.raises(AssertionError, match="ipu_id must be"):
        Block("A", ipu_id=-1)
    with pytest.raises(AssertionError, match="user_id must be"):
        Block(1.5)


def test_auto_ids_are_stable_across_traces_with_use_auto_id():
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(2, 2), nn.Linear(2, 2)

        def forward(self, x):
            Block.useAutoId()
            with Block(ipu_id=0):
                x = self.a(x)
            with Block(ipu_id=1):
                return self.b(x)

    net = Net()
    for _ in range(2):
        with capture_blocks.recording() as log:
            net(torch.ones(1, 2))
        assert log == [("0", 0), ("1", 1)]


# ---------------------------------------------------------------------------
# Block, Block.start, BlockFunction
# ---------------------------------------------------------------------------
def test_block_scope_restores_the_previous_block():
    with capture_blocks.recording() as log:
        assert capture_blocks.current_block() is None
        with Block("outer", ipu_id=0) as outer:
            assert isinstance(outer, Block)
            assert capture_blocks.current_block() == ("outer", 0)
            with Block("inner", ipu_id=1):
                assert capture_blocks.current_block() == ("inner", 1)
            assert capture_blocks.current_block() == ("outer", 0)
        assert capture_blocks.current_block() is None
    assert log == [("outer", 0), ("inner", 1)]


def test_block_scope_restores_on_exceptions_and_can_be_reentered():
    block = Block("A", ipu_id=0)
    with capture_blocks.recording():
        with pytest.raises(ValueError):
            with block:
                raise ValueError("boom")
        assert capture_blocks.current_block() is None
        with block:
            with block:
                assert capture_blocks.current_block() == ("A", 0)
            assert capture_blocks.current_block() == ("A", 0)
        assert capture_blocks.current_block() is None


def test_blocks_do_nothing_outside_tracing():
    with Block("A", ipu_id=1):
        assert capture_blocks.current_block() is None
    Block.start("B", 1)
    assert capture_blocks.current_block() is None


def test_block_start_is_unscoped():
    with capture_blocks.recording() as log:
        Block.start("A", ipu_id=0)
        assert capture_blocks.current_block() == ("A", 0)
        Block.start(ipu_id=1)
        assert capture_blocks.current_block() == ("0", 1)
    assert log == [("A", 0), ("0", 1)]


def test_block_function_runs_each_call_in_one_block():
    seen = []

    @BlockFunction(ipu_id=1)
    def decoder(x):
        """Decodes."""
        seen.append(capture_blocks.current_block())
        return x + 1

    assert decoder.__name__ == "decoder" and decoder.__doc__ == "Decodes."
    assert decoder(1) == 2
    with capture_blocks.recording() as log:
        decoder(1)
        decoder(2)
        assert capture_blocks.current_block() is None
    assert log == [("0", 1), ("0", 1)]
    assert seen == [None, ("0", 1), ("0", 1)]    # nothing outside tracing


# ---------------------------------------------------------------------------
# recomputationCheckpoint
# ---------------------------------------------------------------------------
def test_recomputation_checkpoint_is_an_identity():
    a, b = torch.ones(2), torch.zeros(3)
    assert recomputationCheckpoint(a) is a
    out = recomputationCheckpoint(a, b)
    assert isinstance(out, tuple) and out[0] is a and out[1] is b
    as_list = recomputationCheckpoint([a, b])
    assert isinstance(as_list, list) and as_list[0] is a and as_list[1] is b
    as_tuple = recomputationCheckpoint((a,))
    assert isinstance(as_tuple, tuple) and as_tuple[0] is a


def test_recomputation_checkpoint_needs_tensors():
    with pytest.raises(ValueError, match="All inputs must be tensors"):
        recomputationCheckpoint(torch.ones(1), 3)


# ---------------------------------------------------------------------------
# Stage and the strategies' arguments
# ---------------------------------------------------------------------------
def test_stage_holds_blocks_and_an_ipu():
    stage = Stage("A", "B")
    assert stage.blocks == ("A", "B")
    assert stage.ipu(2) is stage
    assert repr(stage) == "Stage('A', 'B').ipu(2)"


def test_stage_block_ids_must_be_strings():
    with pytest.raises(AssertionError,
                       match=r"Block IDs are supposed to be strings but got \('A', 1\)"):
        Stage("A", 1)


@pytest.mark.parametrize("cls", [PipelinedExecution, ShardedExecution])
def test_strategy_argument_forms(cls):
    d = Stage("D").ipu(3)
    strategy = cls("A", ["B", "C"], d)
    assert [s.blocks for s in strategy.stages] == [("A",), ("B", "C"), ("D",)]
    assert strategy.stage("C") is strategy.stage("B")
    assert strategy.stage("D") is d
    assert strategy.auto_stage is None
    assert cls().auto_stage == AutoStage.SameAsIpu
    assert cls(AutoStage.AutoIncrement).auto_stage == AutoStage.AutoIncrement
    assert repr(cls(AutoStage.AutoIncrement)) == (
        f"{cls.__name__}(poptorch.AutoStage.AutoIncrement)")


def test_strategy_stage_edits_the_ipu():
    strategy = PipelinedExecution("A", "B")
    strategy.stage("B").ipu(0)
    assert strategy.assign([("A", None), ("B", 1)]) == {"A": (0, 0), "B": (1, 0)}


def test_strategy_errors():
    with pytest.raises(AssertionError, match="A associated with more than one stage"):
        PipelinedExecution("A", ["B", "A"])
    with pytest.raises(AssertionError, match="Unknown block Z"):
        PipelinedExecution("A").stage("Z")
    with pytest.raises(AssertionError, match="Unknown block A"):
        PipelinedExecution().stage("A")
    with pytest.raises(AssertionError, match="Block IDs are supposed to be strings"):
        ShardedExecution(["A", 2])
    with pytest.raises(AssertionError, match="takes a single poptorch.AutoStage"):
        PipelinedExecution("A", AutoStage.AutoIncrement)


def test_strategy_kinds():
    pipelined, sharded = PipelinedExecution(), ShardedExecution()
    assert pipelined.is_pipelined and not pipelined.is_sharded
    assert sharded.is_sharded and not sharded.is_pipelined
    assert pipelined.backendOptions() == {"execution_mode": 0}
    assert sharded.backendOptions() == {"execution_mode": 1}


# ---------------------------------------------------------------------------
# strategy.assign: stage ids and IPUs
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("cls", [PipelinedExecution, ShardedExecution])
def test_same_as_ipu_uses_the_ipu_as_stage(cls):
    blocks = [("A", 0), ("B", 0), ("C", 1), ("D", 0)]
    # consecutive blocks on one IPU share a stage; revisiting IPU 0 gives stage 0
    # again, which PopTorch documents as unschedulable (AutoIncrement avoids it)
    assert cls().assign(blocks) == {"A": (0, 0), "B": (0, 0), "C": (1, 1), "D": (0, 0)}
    assert cls(AutoStage.SameAsIpu).assign([]) == {}


def test_same_as_ipu_needs_an_ipu_for_every_block():
    with pytest.raises(AssertionError,
                       match="poptorch.AutoStage.SameAsIpu was selected but no IPU was "
                             "specified for block B"):
        PipelinedExecution().assign([("A", 0), ("B", None)])


def test_auto_increment_merges_consecutive_blocks_on_one_ipu_when_pipelined():
    # PopTorch numbers blocks from stage 1 (stage 0: the ops before any block)
    blocks = [("A", 0), ("B", 0), ("C", 1), ("D", 1), ("E", 0)]
    assert PipelinedExecution(AutoStage.AutoIncrement).assign(blocks) == {
        "A": (1, 0), "B": (1, 0), "C": (3, 1), "D": (3, 1), "E": (5, 0)}
    # sharding: every block is its own stage
    assert ShardedExecution(AutoStage.AutoIncrement).assign(blocks) == {
        "A": (1, 0), "B": (2, 0), "C": (3, 1), "D": (4, 1), "E": (5, 0)}
    # the ops before any block: stage 0 on IPU 0, merged with a first block there
    assert PipelinedExecution(AutoStage.AutoIncrement).assign(blocks, default=True) == {
        None: (0, 0), "A": (0, 0), "B": (0, 0), "C": (3, 1), "D": (3, 1), "E": (5, 0)}


def test_auto_increment_without_ipus_puts_each_stage_on_its_own_ipu():
    # PopTorch: a block with no ipu_id runs on the IPU of its stage number,
    # which starts at 1 (options.py _DefaultStageManager, _options_impl.beginStage)
    blocks = [("0", None), ("1", None), ("2", 1)]
    assert PipelinedExecution(AutoStage.AutoIncrement).assign(blocks) == {
        "0": (1, 1), "1": (2, 2), "2": (3, 1)}


def test_explicit_stages_take_their_position_and_ipu():
    strategy = PipelinedExecution("A", ["B", "C"], Stage("D").ipu(3), Stage("E", "F").ipu(0))
    blocks = [("A", None), ("B", 1), ("C", None), ("D", 0), ("E", 2), ("F", None)]
    # IPU: Stage.ipu() if set, else the block's ipu_id, else the stage id
    assert strategy.assign(blocks) == {
        "A": (0, 0), "B": (1, 1), "C": (1, 1), "D": (2, 3), "E": (3, 0), "F": (3, 0)}
    # blocks the model never entered are no error
    assert strategy.assign([("A", None)]) == {"A": (0, 0)}


def test_explicit_stages_reject_unknown_blocks():
    with pytest.raises(AssertionError,
                       match=r"Unknown Block 'Z' list of expected Blocks: \['A', 'B'\]"):
        ShardedExecution("A", "B").assign([("A", 0), ("Z", 1)])


def test_a_block_entered_twice_keeps_its_first_entry():
    blocks = [("A", 0), ("B", 1), ("A", 1)]
    assert PipelinedExecution().assign(blocks) == {"A": (0, 0), "B": (1, 1)}


# ---------------------------------------------------------------------------
# Options.setExecutionStrategy
# ---------------------------------------------------------------------------
def test_default_strategy_is_pipelined_same_as_ipu():
    opts = poptorchsim.Options()
    strategy = opts.execution_strategy
    assert isinstance(strategy, PipelinedExecution)
    assert strategy.auto_stage == AutoStage.SameAsIpu
    assert opts.execution_strategy is strategy


def test_set_execution_strategy():
    strategy = ShardedExecution("A", "B")
    opts = poptorchsim.Options()
    assert opts.setExecutionStrategy(strategy) is opts
    assert opts.execution_strategy is strategy
    with pytest.raises(AssertionError, match="strategy must be an instance of an execution "
                                             "strategy class"):
        opts.setExecutionStrategy("pipelined")
    with pytest.raises(AssertionError):
        opts.setExecutionStrategy(AutoStage.AutoIncrement)


def test_strategy_survives_clone_and_pickle():
    opts = poptorchsim.Options().setExecutionStrategy(
        PipelinedExecution(Stage("A").ipu(1), "B"))
    opts._freeze()
    for clone in (opts.clone(), copy.deepcopy(opts), pickle.loads(pickle.dumps(opts))):
        assert clone.execution_strategy is not opts.execution_strategy
        assert repr(clone.execution_strategy) == "PipelinedExecution(Stage('A').ipu(1), Stage('B'))"
        assert clone.execution_strategy.assign([("A", 0), ("B", None)]) == {
            "A": (0, 1), "B": (1, 1)}
    assert not opts.clone()._frozen
    opts.clone().setExecutionStrategy(ShardedExecution())     # the clone is unfrozen
    assert "Options(" in repr(opts)
    with pytest.raises(AssertionError, match="An output mode must be picked"):
        opts.toDict()           # PopTorch's rule


def test_frozen_options_refuse_a_new_strategy():
    opts = poptorchsim.Options()
    opts._freeze()
    with pytest.raises(AttributeError, match="Can't modify frozen Options"):
        opts.setExecutionStrategy(PipelinedExecution())
    assert isinstance(opts.execution_strategy, PipelinedExecution)   # still readable


def test_auto_round_num_ipus():
    opts = poptorchsim.Options()
    assert opts.auto_round_num_ipus is False
    assert opts.autoRoundNumIPUs() is opts and opts.auto_round_num_ipus is True
    opts.autoRoundNumIPUs(False)
    assert opts.auto_round_num_ipus is False


# ---------------------------------------------------------------------------
# Integration: annotated models still train and infer
# ---------------------------------------------------------------------------
def annotated_classifier():
    model = ClassifierWithLoss()
    BeginBlock(model.fc1, "L1", ipu_id=0)
    BeginBlock(model.fc2, "L2", ipu_id=1)
    return model


def test_annotated_model_trains_like_pytorch():
    ga, micro = 3, 4
    model = annotated_classifier()
    reference = copy.deepcopy(model)
    opts = quiet_options()
    opts.Training.gradientAccumulation(ga)
    training = poptorchsim.trainingModel(
        model, opts, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    batch = classification_batch(ga * micro, seed=7)
    out, loss = training(*batch)
    ref_out, ref_loss = reference_call(reference, ref_opt, batch, 1, ga, 1)
    torch.testing.assert_close(out, ref_out[0, -1, 0])          # OutputMode.Final
    torch.testing.assert_close(loss, ref_loss[0, -1, 0])
    training.copyWeightsToHost()
    assert_state_close(model, reference)


def test_annotated_model_infers_like_pytorch():
    model = annotated_classifier()
    model.eval()
    x, _ = classification_batch(2 * 5, seed=3)
    expected = model(x)
    inference = poptorchsim.inferenceModel(model, quiet_options().deviceIterations(2))
    torch.testing.assert_close(inference(x), expected)
