"""A multi-convolution: convolutions PopTorch's ``MultiConv`` groups into
one compute set (PopLibs' ``multiconv``).  The face fills in the options,
lowering the member ops (forward convolutions traced inside the scope, in
trace order), ``estimate.cost`` plans them together."""
from dataclasses import dataclass, field
from typing import Optional

# PopLibs' multiconv defaults
RESERVED_TILES = 50
CYCLE_BACK_OFF = 0.1


@dataclass(eq=False)
class MultiConvGroup:
    plan: str = "parallel"                     # or "serial"
    available_memory: Optional[tuple] = None   # one value, or one per convolution
    partials: Optional[tuple] = None           # "float" / "half", likewise
    dithering: Optional[tuple] = None          # bools, likewise
    reserved_tiles: int = RESERVED_TILES
    cycle_back_off: float = CYCLE_BACK_OFF
    members: list = field(default_factory=list)   # the conv ops (lowering)

    def option(self, name, index):
        """Per-convolution option ``name`` of member ``index`` (None: unset)."""
        values = getattr(self, name)
        if values is None:
            return None
        return values[0] if len(values) == 1 else values[index]

    def check(self, n):
        """Per-convolution options must give one value or one per convolution."""
        for name in ("available_memory", "partials", "dithering"):
            values = getattr(self, name)
            if values is not None and len(values) not in (1, n):
                from ..errors import Error
                raise Error(f"MultiConv: {len(values)} values of {name} for {n} "
                            "convolutions; give one value for all of them or one per "
                            "convolution.")

    def __repr__(self):
        return f"MultiConv({self.plan}, {len(self.members)} convs)"
