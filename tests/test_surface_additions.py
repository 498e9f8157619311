"""The names tests/test_api_surface.py found missing and poptorchsim now
provides, each doing what PopTorch does on the host side."""
import logging

import pytest
import torch

import poptorchsim
from poptorchsim import CommGroupType, Options


# -- Options.enableStableNorm (vision/cnns) ---------------------------------------------
def test_enable_stable_norm_is_recorded_as_poptorch_records_it():
    opts = Options()
    assert opts.enableStableNorm(True) is opts
    assert opts._Popart.options["enableStableNorm"] is True
    assert opts.outputMode(poptorchsim.OutputMode.All).toDict()["enableStableNorm"] is True
    opts.enableStableNorm(False)
    assert opts._Popart.options["enableStableNorm"] is False
    assert opts.clone()._Popart.options["enableStableNorm"] is False


def test_enable_stable_norm_validates_and_respects_freezing():
    with pytest.raises(AssertionError, match="Unexpected type <class 'int'> for option "
                                             "enableStableNorm"):
        Options().enableStableNorm(1)
    opts = Options()
    opts._freeze()
    with pytest.raises(AttributeError, match="Can't modify frozen Options"):
        opts.enableStableNorm(True)


def test_enable_stable_norm_leaves_numerics_unchanged():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.GroupNorm(2, 8))
    x = torch.randn(4, 4) * 1e3 + 1e4
    plain = poptorchsim.inferenceModel(model)(x)
    stable = poptorchsim.inferenceModel(model, Options().enableStableNorm(True))(x)
    assert torch.equal(plain, stable)
    assert torch.allclose(stable, model(x))


# -- Options.inputReplicaGrouping ------------------------------------------------------
def test_input_replica_grouping_sets_size_and_type():
    opts = Options().replicationFactor(4)
    assert opts.input_cgt == CommGroupType.Consecutive
    assert opts.inputReplicaGrouping(2, CommGroupType.Orthogonal) is opts
    assert (opts.input_group_size, opts.input_cgt) == (2, CommGroupType.Orthogonal)
    opts.inputReplicaGrouping(2, CommGroupType.NoGrouping)
    assert (opts.input_group_size, opts.input_cgt) == (1, CommGroupType.Consecutive)


@pytest.mark.parametrize("size,kind,message", [
    (2, CommGroupType.All, "input_group_type cannot be All"),
    (8, CommGroupType.Consecutive, "input_group_size cannot be larger than replication_factor"),
    (3, CommGroupType.Consecutive, "input_group_size must be a factor of replication_factor"),
])
def test_input_replica_grouping_errors_are_poptorchs(size, kind, message):
    with pytest.raises(ValueError, match=message):
        Options().replicationFactor(4).inputReplicaGrouping(size, kind)


def test_input_replica_grouping_rejects_wrong_types():
    with pytest.raises(AssertionError, match="input_cgt"):
        Options().replicationFactor(4).inputReplicaGrouping(2, 1)
    with pytest.raises(AssertionError, match="input_group_size"):
        Options().replicationFactor(4).inputReplicaGrouping(2.0, CommGroupType.Consecutive)


def test_input_replica_grouping_shrinks_the_combined_batch():
    opts = Options().replicationFactor(4).deviceIterations(3)
    opts.inputReplicaGrouping(2, CommGroupType.Consecutive)
    loader = poptorchsim.DataLoader(opts, torch.utils.data.TensorDataset(torch.zeros(60, 1)),
                                    batch_size=5)
    assert loader.combinedBatchSize == 5 * 3 * (4 // 2)


# -- source location excludes ------------------------------------------------------------
def test_source_location_excludes_replace_and_append():
    opts = Options()
    assert opts.source_location_excludes == ["install/poptorch", "site-packages/torch",
                                             "site-packages/poptorch"]
    assert opts.sourceLocationExcludes(["a"]) is opts
    assert opts.appendToLocationExcludes("b", "c") is opts
    assert opts.source_location_excludes == ["a", "b", "c"]
    assert opts.clone().source_location_excludes == ["a", "b", "c"]
    assert Options().source_location_excludes[0] == "install/poptorch"
    with pytest.raises(AssertionError, match="list of strings"):
        opts.sourceLocationExcludes("abc")
    with pytest.raises(AssertionError, match="expects strings"):
        opts.appendToLocationExcludes(3)


# -- the option groups' shared methods ------------------------------------------------
def test_check_is_frozen_update_and_call():
    opts = Options().deviceIterations(4)
    opts.checkIsFrozen()
    assert opts("device_iterations") == 4
    merged = opts.Training.update({"x": 1})
    assert merged["x"] == 1 and merged["gradient_accumulation"] == 1
    with pytest.raises(AssertionError, match="keys in common"):
        opts.Training.update({"gradient_accumulation": 2})
    opts._freeze()
    with pytest.raises(AttributeError, match="Can't modify frozen Options"):
        opts.Training.checkIsFrozen()
    opts.checkIsFrozen("_is_frozen")        # PopTorch lets this one through


def test_convolution_dithering_is_recorded():
    training = Options().Training
    assert training.setConvolutionDithering(True) is training
    assert training.convolution_dithering is True
    with pytest.raises(AssertionError, match="Expected <class 'bool'>"):
        training.setConvolutionDithering("yes")


# -- DataLoader._combined_batch_size (speech/fastpitch, speech/conformer) ---------------
def test_combined_batch_size_is_poptorchs_product():
    opts = Options().deviceIterations(3).replicationFactor(2)
    opts.Training.gradientAccumulation(4)
    loader = poptorchsim.DataLoader(opts, torch.utils.data.TensorDataset(torch.zeros(96, 1)),
                                    batch_size=2)
    assert loader._combined_batch_size == 2 * 3 * 2 * 4 == loader.combinedBatchSize
    assert len(loader) == 2


def test_batch_sampler_combined_batch_size_and_drop_last():
    data = torch.utils.data.TensorDataset(torch.arange(8.))
    sampler = torch.utils.data.BatchSampler(torch.utils.data.SequentialSampler(data), 3,
                                            drop_last=False)
    loader = poptorchsim.DataLoader(Options().deviceIterations(2), data,
                                    batch_sampler=sampler, drop_last=False)
    assert loader._combined_batch_size == 6 and loader.batch_sampler_drop_last is False
    assert [b[0].tolist() for b in loader] == [[0, 1, 2, 3, 4, 5], [6, 7]]
    assert len(loader) == 2
    kept = poptorchsim.DataLoader(Options().deviceIterations(2), data, batch_sampler=sampler)
    assert [b[0].tolist() for b in kept] == [[0, 1, 2, 3, 4, 5]] and len(kept) == 1


# -- PoplarExecutor ------------------------------------------------------------------------
def test_executable_rng_state_and_lazy_copies():
    model = poptorchsim.inferenceModel(torch.nn.Linear(2, 2))
    assert model._executable is None
    with pytest.raises(poptorchsim.Error, match="has not been compiled"):
        _ = model.rng_state
    model(torch.zeros(1, 2))
    assert model._executable is not None
    assert model.copyWeightsToHostIfNeeded() is False
    state = model.rng_state
    assert isinstance(state, list) and all(isinstance(v, int) for v in state)
    first = torch.rand(3)
    model.rng_state = state
    assert torch.equal(torch.rand(3), first)
    with pytest.raises(poptorchsim.Error, match="rng_state expects"):
        model.rng_state = [1, 2, 3]
    model.destroy()
    assert model._executable is None


def test_rng_state_seed_is_the_options_seed():
    model = poptorchsim.inferenceModel(torch.nn.Linear(2, 2), Options().randomSeed(42))
    model(torch.zeros(1, 2))
    assert model.rng_state[0] == 42


# -- poptorch.profiling.Channel, poptorch.options names ---------------------------------
def test_profiling_channel_times_tracepoints(capsys):
    channel = poptorchsim.profiling.Channel("MyApp")

    class Thing:
        def work(self, x):
            return x + 1

    thing = channel.instrument(Thing(), "work")
    logger = logging.getLogger("poptorchsim")
    level = logger.level
    logger.setLevel(logging.DEBUG)
    try:
        with channel.tracepoint("TimeThis"):
            pass
        assert thing.work(1) == 2
    finally:
        logger.setLevel(level)
    err = capsys.readouterr().err
    assert "tracepoint MyApp.TimeThis" in err and "tracepoint MyApp.work" in err


def test_options_module_names():
    from poptorchsim import options
    assert options.ShardedExecution is poptorchsim.ShardedExecution
    assert options.Stage is poptorchsim.Stage and options.Phase is poptorchsim.Phase
    assert options.Attribute is poptorchsim.Attribute and options.BlockId is str


def test_set_patterns_uses_poptorchs_keys():
    popart = Options()._Popart
    assert popart.setPatterns({"TiedGather": True}, 0) is popart
    assert popart.options["patterns"] == {"TiedGather": True}
    assert popart.options["patterns_level"] == 0
    with pytest.raises(AssertionError):
        popart.setPatterns({"TiedGather": True}, "0")


def test_cpu_op_records_shapes_and_runs_on_persistent_buffers():
    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.cpu = poptorchsim.CPU(lambda x: (x * 2.0, x.sum(1)), "MyCPUOp")

        def forward(self, x):
            doubled, total = self.cpu(x)
            return doubled + 1, total

    model = Model()
    x = torch.arange(6.).reshape(2, 3)
    doubled, total = poptorchsim.inferenceModel(model)(x)
    assert torch.equal(doubled, x * 2 + 1) and torch.equal(total, x.sum(1))
    cpu = model.cpu
    assert cpu.in_shapes == [torch.Size([2, 3])]
    assert cpu.out_shapes == [torch.Size([2, 3]), torch.Size([2])]
    cpu.registerPersistentData()
    cpu.inputs[0].copy_(x)
    cpu.execute()
    assert torch.equal(cpu.outputs[0], x * 2) and torch.equal(cpu.outputs[1], x.sum(1))
