"""PopTorch's ``poptorch._impl`` helpers that programs and PopTorch's own
test helpers call."""
from .ops import isRunningOnIpu


def isDispatchTracing():
    """True while a model is traced for compilation (PopTorch's dispatcher
    front end is the only one poptorchsim has)."""
    return isRunningOnIpu()
