"""What the machine knows of a user's custom op: its declared cost.

``poptorchsim.register_custom_op`` defines the op (``capture.custom_ops``)
and records here, under its ATen-style name, the cost its author declares,
as a Poplar vertex's ``getCycleEstimate`` and its temporary buffers would:
the cost class ``custom`` (``estimate.cost``) reads it.
"""
from dataclasses import dataclass
from typing import Callable, Optional, Union

CUSTOM_NAMESPACE = "poptorchsim_custom"
# A vector-Jacobian product does about twice the work of its forward.
BACKWARD_FACTOR = 2.0


@dataclass(frozen=True)
class CustomCost:
    """Cycles a worker spends per output element (``cycles_per_element``),
    or ``cycles(input_shapes, output_shapes)``: worker cycles for the whole
    op, spread over the tiles its result occupies; ``temp_bytes``: bytes of
    temporary memory for the whole op (an int or a function of the shapes),
    spread the same way."""
    cycles_per_element: Optional[float] = None
    cycles: Optional[Callable] = None
    temp_bytes: Union[int, Callable] = 0
    scale: float = 1.0           # BACKWARD_FACTOR for the gradient op

    def worker_cycles(self, input_shapes, output_shapes):
        if self.cycles is not None:
            total = float(self.cycles(input_shapes, output_shapes))
        else:
            elements = sum(_numel(s) for s in output_shapes)
            assert self.cycles_per_element is not None, "a cost needs cycles or a rate"
            total = float(self.cycles_per_element) * elements
        return total * self.scale

    def temporary_bytes(self, input_shapes, output_shapes):
        t = self.temp_bytes
        return float(t(input_shapes, output_shapes) if callable(t) else t)


def _numel(shape):
    n = 1
    for s in shape:
        n *= int(s)
    return n


COSTS: dict = {}    # op name in CUSTOM_NAMESPACE (forward and "_grad") -> CustomCost


def cost_of(target):
    """The declared ``CustomCost`` of a custom op's overload, or None."""
    if getattr(target, "namespace", None) != CUSTOM_NAMESPACE:
        return None
    return COSTS.get(target._schema.name.split("::", 1)[1])
