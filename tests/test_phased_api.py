"""PopTorch's phased-execution face: Phase, SerialPhasedExecution and
ParallelPhasedExecution (construction, IPUs, stage assignment, rules)."""
import pytest

import poptorchsim as poptorch
from poptorchsim.annotations import _IExecutionStrategy, _IPhasedExecution
from poptorchsim.enums import Liveness


# -- Phase ---------------------------------------------------------------------
def test_phase_of_block_ids_is_one_stage():
    p = poptorch.Phase("A", "B")
    assert len(p.stages) == 1
    assert p.stages[0].blocks == ("A", "B")
    assert p.stage(0) is p.stages[0]


def test_phase_of_stages_and_list():
    a, b = poptorch.Stage("A"), poptorch.Stage("B")
    assert poptorch.Phase(a, b).stages == [a, b]
    assert poptorch.Phase([a, b]).stages == [a, b]
    assert poptorch.Phase(["A", "B"]).stages[0].blocks == ("A", "B")


def test_phase_mixed_arguments_rejected():
    with pytest.raises(AssertionError, match="All arguments must either be block IDs"):
        poptorch.Phase("A", poptorch.Stage("B"))


def test_phase_ipus():
    p = poptorch.Phase(poptorch.Stage("A"), poptorch.Stage("B"))
    assert p.ipus(0, 2) is p
    assert [s._ipu for s in p.stages] == [0, 2]
    with pytest.raises(AssertionError,
                       match="^Phase contains 2 stages but you provided 3 ipus$"):
        p.ipus(0, 1, 2)
    with pytest.raises(AssertionError,
                       match="^Phase contains 1 stages but you provided 2 ipus$"):
        poptorch.Phase("A", "B").ipus(0, 1)


# -- construction ----------------------------------------------------------------
@pytest.mark.parametrize("cls", [poptorch.SerialPhasedExecution,
                                 poptorch.ParallelPhasedExecution])
def test_construction_forms(cls):
    # PopTorch's test_phased_api forms
    forms = [
        cls(poptorch.Phase("layer1"), poptorch.Phase("layer2")),
        cls(poptorch.Stage("layer1"), poptorch.Stage("layer2")),
        cls(["layer1"], ["layer2"]),
        cls("layer1", "layer2"),
        cls([poptorch.Phase("layer1"), poptorch.Phase("layer2")]),  # docstring form
    ]
    for s in forms:
        assert isinstance(s, _IPhasedExecution) and isinstance(s, _IExecutionStrategy)
        assert len(s.phases) == 2
        assert [st.blocks for st in s.stages] == [("layer1",), ("layer2",)]
        assert s.phase_of_stage() == [0, 1]
    s = cls([poptorch.Stage("a"), poptorch.Stage("a.b")],
            [poptorch.Stage("b"), poptorch.Stage("b.b")])
    assert s.phase_of_stage() == [0, 0, 1, 1]
    assert s.stage("b.b") is s.phase(1).stage(1)


@pytest.mark.parametrize("cls", [poptorch.SerialPhasedExecution,
                                 poptorch.ParallelPhasedExecution])
def test_no_phases(cls):
    with pytest.raises(AssertionError, match="^There is currently no AutoStage for "
                       "PhasedExecution, please explicitly specify the phases$"):
        cls()


def test_construction_errors():
    with pytest.raises(AssertionError, match="^A associated with more than one stage$"):
        poptorch.SerialPhasedExecution("A", ["B", "A"])
    with pytest.raises(AssertionError, match="Block IDs are supposed to be strings"):
        poptorch.SerialPhasedExecution(poptorch.Stage(1))
    s = poptorch.SerialPhasedExecution("A")
    with pytest.raises(AssertionError, match="^Unknown block B$"):
        s.stage("B")
    with pytest.raises(AssertionError, match="Phases are identified by positive integers"):
        s.phase(-1)
    with pytest.raises(IndexError):
        s.phase(1)


def test_properties_and_backend_options():
    s = poptorch.SerialPhasedExecution("A", "B")
    assert (s.is_phased, s.is_pipelined, s.is_sharded) == (True, False, False)
    assert s.execution_mode == 2 and s.serial is True
    assert s.separate_backward_phase is False
    assert s.tensors_liveness == Liveness.AlwaysLive
    assert s.backendOptions() == {"execution_mode": 2, "separate_backward_phase": False,
                                  "tensors_liveness": 0, "serial_phases_execution": True}
    assert s.useSeparateBackwardPhase() is s
    assert s.setTensorsLiveness(Liveness.OffChipAfterEachPhase) is s
    assert s.backendOptions() == {"execution_mode": 2, "separate_backward_phase": True,
                                  "tensors_liveness": 3, "serial_phases_execution": True}
    with pytest.raises(AssertionError):
        s.setTensorsLiveness(1)
    with pytest.raises(AssertionError):
        s.useSeparateBackwardPhase(1)

    p = poptorch.ParallelPhasedExecution("A", "B")
    assert p.serial is False and p.is_phased
    assert not hasattr(p, "setTensorsLiveness")
    assert p.backendOptions()["serial_phases_execution"] is False
    assert p.sendTensorsOffChipAfterFwd() is p
    assert p.tensors_liveness == Liveness.OffChipAfterFwd
    assert p.backendOptions()["tensors_liveness"] == 1
    p.sendTensorsOffChipAfterFwd(False)
    assert p.tensors_liveness == Liveness.AlwaysLive

    assert poptorch.PipelinedExecution().is_phased is False
    assert poptorch.ShardedExecution().is_phased is False


def test_liveness_enum():
    assert [(m.name, m.value) for m in poptorch.Liveness] == [
        ("AlwaysLive", 0), ("OffChipAfterFwd", 1), ("OffChipAfterFwdNoOverlap", 2),
        ("OffChipAfterEachPhase", 3)]


def test_repr():
    s = poptorch.SerialPhasedExecution(poptorch.Phase(poptorch.Stage("A"),
                                                      poptorch.Stage("B")), "C")
    s.phase(0).ipus(0, 1)
    assert repr(s) == ("SerialPhasedExecution(Phase(Stage('A').ipu(0), "
                       "Stage('B').ipu(1)), Phase(Stage('C')))")
    s.setTensorsLiveness(Liveness.OffChipAfterFwd).useSeparateBackwardPhase()
    assert repr(s).endswith(").useSeparateBackwardPhase()"
                            ".setTensorsLiveness(poptorch.Liveness.OffChipAfterFwd)")
    p = poptorch.ParallelPhasedExecution("A").sendTensorsOffChipAfterFwd()
    assert repr(p) == "ParallelPhasedExecution(Phase(Stage('A'))).sendTensorsOffChipAfterFwd()"


# -- assign ------------------------------------------------------------------------
def test_assign_serial():
    s = poptorch.SerialPhasedExecution(
        poptorch.Phase(poptorch.Stage("A"), poptorch.Stage("A2")),
        poptorch.Phase(poptorch.Stage("B"), poptorch.Stage("B2")),
        "C")
    s.phase(0).ipus(0, 1)
    blocks = [("A", None), ("A2", None), ("B", 3), ("B2", None), ("C", None), ("A", 5)]
    assert s.assign(blocks) == {
        "A": (0, 0), "A2": (1, 1),      # Phase.ipus
        "B": (2, 3),                    # the block's ipu_id
        "B2": (3, 1),                   # default: k-th stage of the phase on IPU k
        "C": (4, 0)}
    assert s.phase_of_stage() == [0, 0, 1, 1, 2]
    s.check(s.assign(blocks))           # no rule for serial phases
    s.stage("C").ipu(1)                 # edits after construction count
    assert s.assign(blocks)["C"] == (4, 1)


def test_assign_parallel_and_parity():
    p = poptorch.ParallelPhasedExecution(
        [poptorch.Stage("0"), poptorch.Stage("1")],
        [poptorch.Stage("2", "4"), poptorch.Stage("3", "5")])
    p.phase(0).ipus(0, 2)
    p.phase(1).ipus(1, 3)
    blocks = [(str(i), None) for i in range(6)]
    got = p.assign(blocks)
    assert got == {"0": (0, 0), "1": (1, 2), "2": (2, 1), "3": (3, 3),
                   "4": (2, 1), "5": (3, 3)}
    assert p.phase_of_stage() == [0, 0, 1, 1]
    p.check(got)

    # without IPUs: the block's ipu_id, else phase 0 on IPUs 0, 2 and phase 1 on 1, 3
    q = poptorch.ParallelPhasedExecution(["A"], [poptorch.Stage("B"), poptorch.Stage("C")])
    got = q.assign([("A", None), ("B", None), ("C", None)])
    assert got == {"A": (0, 0), "B": (1, 1), "C": (2, 3)}
    q.check(got)
    got = q.assign([("A", 4), ("B", 2), ("C", None)])
    assert got == {"A": (0, 4), "B": (1, 2), "C": (2, 3)}
    with pytest.raises(poptorch.Error, match=(
            r"^When phases are executed in parallel: even phases must run on even IPUs "
            r"and odd phases on odd IPUs\. Block 'B' \(stage 1\) is in phase 1 but runs "
            r"on IPU 2\. .*strategy\.phase\(1\)\.ipus\(1, 3\)")):
        q.check(got)


def test_assign_unknown_block():
    s = poptorch.SerialPhasedExecution("A", "B")
    with pytest.raises(AssertionError,
                       match=r"^Unknown Block 'Z' list of expected Blocks: \['A', 'B'\]$"):
        s.assign([("A", 0), ("Z", 0)])


def test_parallel_serial_only_liveness():
    for liveness in (Liveness.OffChipAfterEachPhase, Liveness.OffChipAfterFwdNoOverlap):
        p = poptorch.ParallelPhasedExecution("A")
        p._tensors_liveness = liveness       # PopTorch has no setter for it either
        with pytest.raises(poptorch.Error,
                           match="^This is only supported for serial phase execution"):
            p.check(p.assign([("A", None)]))
        s = poptorch.SerialPhasedExecution("A").setTensorsLiveness(liveness)
        s.check(s.assign([("A", None)]))


# -- Options -----------------------------------------------------------------------
def test_options_accept_phased_strategies():
    for strategy in (poptorch.SerialPhasedExecution("A", "B"),
                     poptorch.ParallelPhasedExecution("A", "B")):
        opts = poptorch.Options()
        assert opts.setExecutionStrategy(strategy) is opts
        assert opts.execution_strategy is strategy
        clone = opts.clone().execution_strategy
        assert clone.backendOptions() == strategy.backendOptions()
        assert clone.assign([("A", None), ("B", None)]) == strategy.assign(
            [("A", None), ("B", None)])
