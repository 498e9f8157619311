"""``Compiled``: what compiling a model gives the executor: the program, its
estimate (memory, costs, cycles), the host functions that run it and what
the optimizer update needs (``passes/compile.py`` builds it)."""
from dataclasses import dataclass, field
from typing import Callable, Optional

from ..capture.trace import Capture
from ..capture.update_capture import ParamUpdate
from ..capture.update_rules import UpdatePlan
from ..estimate.cost import OpCost
from ..estimate.schedule import Schedule
from ..estimate.targets import Target
from ..ir.graph import Program
from ..machine.gradient_watch import GradientWatch
from ..machine.rounding import Rounding
from .loss_scaling import Settings as LossScalingSettings
from .memory import MemoryReport


@dataclass(kw_only=True)
class Compiled:
    """A compiled model: the program, its estimate (memory, costs, cycles) and
    the host functions that run it; built by ``compile_training`` and
    ``compile_inference`` by keyword."""
    capture: Capture
    program: Program
    target: Target
    memory: MemoryReport              # IPU 0's report; ``memory.ipus``: every IPU's
    costs: dict[str, list[OpCost]]    # graph name -> its ops' costs
    cycles: dict                      # breakdown of one call
    step_fn: Optional[Callable]       # the model's graph (None: estimate only)
    update_fn: Optional[Callable] = None
    optimizer_kind: str = ""
    group_of: list[int] = field(default_factory=list)   # per trainable param: its group
    flags: list[dict] = field(default_factory=list)     # per param group: the rule's flags
    compile_seconds: float = 0.0
    max_grad_norm: Optional[float] = None
    shards: dict[str, int] = field(default_factory=dict)   # param -> replicas its optimizer
                                                        # state is cut over
    plan: Optional[UpdatePlan] = None     # the optimizer update's plan
    slots: list[tuple] = field(default_factory=list)    # per trainable param: (Slots read,
                                                        # Slots written)
    layouts: list[ParamUpdate] = field(default_factory=list)   # per trainable param
    schedule: Optional[Schedule] = None   # the pipeline schedule of one weight update (or call)
    location_settings: dict = field(default_factory=dict)   # TensorLocations, as compiled
    precision: Optional[dict] = None      # passes.precision settings
    rounding: Optional[Rounding] = None   # stochastic rounding
    watch: Optional[GradientWatch] = None     # fp16 gradients
    auto_loss_scaling: Optional[LossScalingSettings] = None
    pass_seconds: dict[str, float] = field(default_factory=dict)   # compile pass -> seconds
    loaded_from: Optional[str] = None     # the executable cache file it was read from, if any
