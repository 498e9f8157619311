"""One walk over a program's control steps (``Program.main``), a rule per kind.

The control program is made of a closed set of step kinds (``STEP_KINDS``).
The engine runs it (``machine/engine.py``) and the estimate charges it
(``estimate/program_cost.py``), each with one rule per kind: both subclass
``StepVisitor`` and name their rules ``_<Kind>``.  A visitor missing a rule
fails when it is created, naming the kinds it lacks, so a new step kind fails
in the engine and in the estimate until both have a rule for it."""
from typing import Any, Callable

from .graph import STEP_KINDS, Step


class StepVisitor:
    """Dispatches ``visit(step, ...)`` to ``self._<type(step).__name__>``."""

    def __init__(self) -> None:
        missing = [k.__name__ for k in STEP_KINDS
                   if not callable(getattr(self, "_" + k.__name__, None))]
        if missing:
            raise TypeError(f"{type(self).__name__} has no rule for the control step(s) "
                            f"{', '.join(missing)}: define "
                            f"{', '.join('_' + m for m in missing)} (ir/visitor.py)")
        self._rules: dict[type, Callable[..., Any]] = {
            kind: getattr(self, "_" + kind.__name__) for kind in STEP_KINDS}

    def visit(self, step: Step, *args: Any) -> Any:
        """The rule of ``step``'s kind, applied to it."""
        return self._rules[type(step)](step, *args)
