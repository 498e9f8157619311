"""The control program's visitor: the engine and the estimate have a rule for
every step kind, and a new kind fails in both until both have one."""
from dataclasses import dataclass

import pytest
from handbuilt import inference_program

from poptorchsim.estimate import program_cost
from poptorchsim.estimate.targets import default_target
from poptorchsim.ir import visitor
from poptorchsim.ir.graph import STEP_KINDS, Step
from poptorchsim.ir.visitor import StepVisitor
from poptorchsim.machine.engine import Engine


def _estimate_walk():
    program = inference_program()
    return program_cost._Walk(program, {}, default_target())


def test_engine_and_estimate_visit_every_kind():
    for walker in (Engine(None), _estimate_walk()):
        assert isinstance(walker, StepVisitor)
        assert set(walker._rules) == set(STEP_KINDS)


def test_a_new_step_kind_fails_in_both_until_both_have_a_rule(monkeypatch):
    @dataclass(eq=False)
    class Broadcast(Step):
        nbytes: int = 0
    monkeypatch.setattr(visitor, "STEP_KINDS", STEP_KINDS + (Broadcast,))
    with pytest.raises(TypeError, match="Engine has no rule for the control step.*Broadcast"):
        Engine(None)
    with pytest.raises(TypeError, match="_Walk has no rule .*_Broadcast"):
        _estimate_walk()

    class Both(StepVisitor):
        pass
    for kind in STEP_KINDS + (Broadcast,):
        setattr(Both, "_" + kind.__name__, lambda self, step: type(step).__name__)
    assert Both().visit(Broadcast()) == "Broadcast"
