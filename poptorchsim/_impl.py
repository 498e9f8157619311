"""PopTorch's ``poptorch._impl`` helpers that programs and PopTorch's own
test helpers call."""
from .ops import isRunningOnIpu


def isDispatchTracing():
    """True while a model is traced for compilation (PopTorch's dispatcher
    front end is the only one poptorchsim has)."""
    return isRunningOnIpu()


def internal_cast(tensor, dtype):
    """PopTorch's ``poptorch._impl.internal_cast``: ``tensor`` cast to
    ``torch.float`` or ``torch.half`` through
    ``torch.ops.poptorch.internal_cast``."""
    import torch
    if dtype in (torch.float, torch.float32):
        return torch.ops.poptorch.internal_cast(tensor, "FLOAT")
    if dtype in (torch.half, torch.float16):
        return torch.ops.poptorch.internal_cast(tensor, "FLOAT16")
    raise ValueError("Invalid poptorch.cast target type. Expecting torch.float or torch.half")
