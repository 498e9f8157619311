"""How far to trust an estimate: which cost-model constant it depends on most.

``sensitivity(compiled, amp)`` re-estimates a compiled program with each
constant of ``estimate.constants`` scaled by 0.8 and by 1.2 (nothing is traced
or planned again: only the ops' costs and the step's estimate are
recomputed) and returns, per constant, the relative change of the samples/s
estimate, the constants that move it most first.  A constant whose ±20 %
moves the estimate by 15 % is one the number leans on: the bracket
[low, high] is how far the estimate would move were that constant off by a
fifth.
"""
from dataclasses import dataclass

from ...estimate import constants as K
from ...estimate.cost import op_cost
from ...estimate.program_cost import estimate

#: constants that only the whole-call estimate reads (not one op's cost):
#: varying them reuses the ops' costs
_CALL_LEVEL = {"RING_STEP_SYNC_CYCLES", "LINK_HOP_SECONDS", "HOST_COPY_LATENCY_S",
               "CALL_OVERHEAD_S", "host_bytes_per_s", "link_bytes_per_s",
               "streaming_bytes_per_s"}


@dataclass
class Sensitivity:
    name: str
    value: float
    unit: str
    kind: str
    source: str
    low: float          # relative change of samples/s with the constant x (1 - step)
    high: float         # ... x (1 + step)

    @property
    def swing(self):
        return max(abs(self.low), abs(self.high))

    def as_dict(self):
        return {"name": self.name, "value": self.value, "unit": self.unit,
                "kind": self.kind, "source": self.source, "low": self.low,
                "high": self.high, "swing": self.swing}


def _costs(program, target, amp):
    return {name: [op_cost(op, target, amp) for op in g.ops]
            for name, g in program.graphs.items()}


def _seconds(compiled, target, amp, costs=None):
    program = compiled.program
    return estimate(program, costs or _costs(program, target, amp), target)[0]["seconds"]


def sensitivity(compiled, amp=0.6, step=0.2, names=None):
    """[Sensitivity] for every variable constant (or ``names``), sorted by
    how much ±``step`` moves the estimate's samples/s, most first."""
    target = compiled.target
    base = _seconds(compiled, target, amp, compiled.costs)
    rows = []
    for name in names or K.VARIABLE:
        c = K.REGISTRY[name]
        changes = []
        for factor in (1 - step, 1 + step):
            if c.field:
                varied = K.vary_target(target, name, factor)
                costs = compiled.costs if name in _CALL_LEVEL else None
                seconds = _seconds(compiled, varied, amp, costs)
            elif name in _CALL_LEVEL:
                with K.overridden(**{name: c.value * factor}):
                    seconds = _seconds(compiled, target, amp, compiled.costs)
            else:
                with K.overridden(**{name: c.value * factor}):
                    seconds = _seconds(compiled, target, amp)
            changes.append(base / seconds - 1.0)
        rows.append(Sensitivity(name, c.value, c.unit, c.kind, c.source, *changes))
    rows.sort(key=lambda r: -r.swing)
    return rows
