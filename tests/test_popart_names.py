"""``poptorchsim.popart``: PopART's enums with PopART's values, honoured by
``Options._Popart.set`` as ints or as enum members; PopART options the
simulator does not model are noted once; PopART's graph API raises."""
import logging

import pytest
import torch
import torch.nn as nn
from conftest import LogRecords

import poptorchsim as poptorch
from poptorchsim import popart
from poptorchsim.runtime.settings import popart_options


# -- values read in PopART's sources (willow/include/popart/*.hpp, popart.cpp) ----------
@pytest.mark.parametrize("member, value", [
    (popart.RecomputationType.NoRecompute, 0),      # C++ RecomputationType::None
    (popart.RecomputationType.Standard, 1),
    (popart.RecomputationType.NormOnly, 2),
    (popart.RecomputationType.Pipeline, 3),
    (popart.RecomputationType.RecomputeAll, 4),
    (popart.MergeVarUpdateType.Off, 0),             # C++ MergeVarUpdateType::None
    (popart.MergeVarUpdateType.AutoLoose, 2),
    (popart.MergeVarUpdateType.AutoTight, 3),
    (popart.VirtualGraphMode.Manual, 1),
    (popart.VirtualGraphMode.ExecutionPhases, 3),
    (popart.ReductionType.Sum, 0),
    (popart.ReductionType.NoReduction, 2),
    (popart.AccumulateOuterFragmentSchedule.Serial, 1),
    (popart.AccumulateOuterFragmentSchedule.OverlapMemoryOptimized, 3),
    (popart.SyntheticDataMode.RandomNormal, 2),
    (popart.SyntheticDataMode.RandomUniform, 3),
    (popart.SubgraphCopyingStrategy.JustInTime, 1),
    (popart.BatchSerializationBatchSchedule.Isomorphic, 1),
    (popart.BatchSerializationBatchSchedule.OverlapOnCompute, 3),
    (popart.TensorStorage.OffChip, 1),
    (popart.ReplicatedTensorSharding.On, 1),
    (popart.ExecutionPhaseSchedule.BatchClusteredIO, 2),
    (popart.AnchorReturnTypeId.Sum, 3),
    (popart.ReplicatedStreamMode.Broadcast, 0),     # C++ order, not pybind's
    (popart.GradientTensorTrackingMethod.AllNonViewChangingGradientTensors, 0),
    (popart.AdamMode.AdaMax, 2),
    (popart.AdamMode.Lamb, 3),
    (popart.PatternsLevel.Default, 2),
    (popart.ScatterReduction.NoReduction, 4),
    (popart.MeanReductionStrategy.Post, 1),
])
def test_enum_values_are_poparts(member, value):
    assert int(member) == value
    assert member == value


def test_enums_print_as_pybind_enums_and_alias_as_popart():
    assert str(popart.RecomputationType.Standard) == "RecomputationType.Standard"
    assert popart.RecomputationType.Standard.name == "Standard"
    assert popart.BatchSerializationTransformContext.Forward is \
        popart.BatchSerializationTransformContext.Fwd
    assert popart.versionString().startswith("3.4.0")
    assert popart.versionNumber() == (3, 4, 0)


def test_every_enum_the_applications_use_exists():
    """Each ``popart.X.Y`` Graphcore's PopTorch applications pass to PopTorch."""
    used = ["AccumulateOuterFragmentSchedule.OverlapMemoryOptimized",
            "SyntheticDataMode.RandomNormal", "SubgraphCopyingStrategy.JustInTime",
            "TensorStorage.OffChip", "RecomputationType.Standard",
            "RecomputationType.Pipeline", "RecomputationType.RecomputeAll",
            "VirtualGraphMode.Manual", "ReplicatedTensorSharding.On",
            "BatchSerializationBatchSchedule.Isomorphic"]
    for name in used:
        kind, member = name.split(".")
        assert isinstance(int(getattr(getattr(popart, kind), member)), int)


# -- Options._Popart.set ---------------------------------------------------------------
class Tiny(nn.Module):
    """Four linear+tanh layers, a checkpoint after every other one."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(32, 32) for _ in range(4))
        self.loss = nn.MSELoss()

    def forward(self, x, y):
        for i, layer in enumerate(self.layers):
            x = torch.tanh(layer(x))
            if i % 2 == 1:
                x = poptorch.recomputationCheckpoint(x)
        return x, self.loss(x, y)


def _compiled(mode):
    torch.manual_seed(0)
    model = Tiny()
    opts = poptorch.Options().showCompilationProgressBar(False)
    if mode is not None:
        opts._Popart.set("autoRecomputation", mode)
    tm = poptorch.trainingModel(model, opts, torch.optim.SGD(model.parameters(), lr=0.1))
    tm.compile(torch.randn(64, 32), torch.randn(64, 32))
    return tm


def _recomputed(tm):
    return sorted(op.name for op in tm.getIR().graphs["training_step"].ops if op.recompute)


def test_auto_recomputation_as_enum_compiles_as_the_int():
    by_enum = _compiled(popart.RecomputationType.RecomputeAll)
    by_int = _compiled(int(popart.RecomputationType.RecomputeAll))
    plain = _compiled(popart.RecomputationType.NoRecompute)
    assert by_enum.options._Popart.options["autoRecomputation"] == 4
    assert type(by_enum.options._Popart.options["autoRecomputation"]) is int
    assert _recomputed(by_enum) == _recomputed(by_int)
    assert _recomputed(by_enum) and not _recomputed(plain)
    assert by_enum.cycleEstimate() == by_int.cycleEstimate() != plain.cycleEstimate()


def test_synthetic_data_mode_is_honoured():
    opts = poptorch.Options()
    opts._Popart.set("syntheticDataMode", popart.SyntheticDataMode.RandomNormal)
    from poptorchsim.runtime.settings.config import CompileConfig
    assert CompileConfig.from_options(opts, False).synthetic
    assert not CompileConfig.from_options(poptorch.Options(), False).synthetic
    opts = poptorch.Options()
    opts._Popart.set("syntheticDataMode", 7)
    with pytest.raises(poptorch.Error, match="SyntheticDataMode out of range.*7"):
        CompileConfig.from_options(opts, False)


@pytest.fixture
def records(monkeypatch):
    monkeypatch.setattr(popart_options, "_NOTED", set())
    handler = LogRecords()
    logger = logging.getLogger("poptorchsim")
    logger.addHandler(handler)
    yield handler
    logger.removeHandler(handler)


def test_unmodelled_options_are_stored_and_noted_once_per_name(records):
    opts = poptorch.Options()
    opts._Popart.set("accumulateOuterFragmentSettings.schedule",
                     int(popart.AccumulateOuterFragmentSchedule.OverlapMemoryOptimized))
    opts._Popart.set("accumulateOuterFragmentSettings.schedule",
                     popart.AccumulateOuterFragmentSchedule.Serial)
    poptorch.Options()._Popart.set("accumulateOuterFragmentSettings.schedule", 1)
    opts._Popart.set("subgraphCopyingStrategy", popart.SubgraphCopyingStrategy.JustInTime)
    assert opts._Popart.options["accumulateOuterFragmentSettings.schedule"] == 1
    assert opts._Popart.options["subgraphCopyingStrategy"] == 1
    notes = [m for m in records.messages if "not modelled by poptorchsim" in m]
    assert len(notes) == 2
    assert "accumulateOuterFragmentSettings.schedule" in notes[0]
    assert "subgraphCopyingStrategy" in notes[1]
    assert records.levels == ["WARNING", "WARNING"]


def test_modelled_options_are_not_noted(records):
    opts = poptorch.Options()
    opts._Popart.set("autoRecomputation", popart.RecomputationType.Standard)
    opts._Popart.set("automaticLossScalingSettings.updatePeriod", 3)
    opts._Popart.set("syntheticDataMode", 0)
    opts.enableExecutableCaching(None)
    assert records.messages == []


# -- PopART's graph API -----------------------------------------------------------------
@pytest.mark.parametrize("name, args", [
    ("Builder", ()), ("TrainingSession", ()), ("InferenceSession", ()),
    ("DeviceManager", ()), ("DataFlow", (1, {})), ("PyStepIO", ({}, {})),
    ("SessionOptions", ()), ("TensorInfo", ("FLOAT", [1])), ("DeviceInfo", ()),
    ("AnchorReturnType", ("ALL",)), ("TensorLocation", (1,)), ("SGD", ({},)),
])
def test_graph_api_raises_a_typed_error(name, args):
    cls = getattr(popart, name)             # the name exists ...
    assert not isinstance(object(), cls)
    with pytest.raises(popart.PopartApiNotSimulatedError,
                       match=rf"popart\.{name}: PopART's own graph-building and session "
                             "API is not simulated by poptorchsim. PopTorch programs only "
                             "need PopART's enums") as info:
        cls(*args)                          # ... creating one raises
    assert isinstance(info.value, poptorch.Error)
    assert isinstance(info.value, NotImplementedError)


def test_get_logger_raises_and_unknown_names_are_attribute_errors():
    with pytest.raises(popart.PopartApiNotSimulatedError, match="popart.Logger"):
        popart.getLogger()
    with pytest.raises(AttributeError, match="has no attribute 'NoSuchThing': it holds "
                                             "PopART's enums"):
        popart.NoSuchThing  # noqa: B018 - the attribute's access raises
