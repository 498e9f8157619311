"""PopTorch's graph-level helper ops that are part of the face."""
import torch

from .capture import losses as _losses


def identity_loss(x, reduction):
    """Marks ``x`` as the final loss; backpropagation starts here.

    ``reduction`` is ``"sum"``, ``"mean"`` or ``"none"``, as in PopTorch.
    """
    assert reduction in ("sum", "mean", "none"), "Unsupported reduction type!"
    if reduction == "sum":
        out = torch.sum(x)
    elif reduction == "mean":
        out = torch.mean(x)
    else:
        out = x.clone()
    _losses.record_identity_loss(out)
    return out


def set_available_memory(tensor, available_memory_proportion):
    """Identity that sets the available-memory proportion (default 0.6) of the
    matmul or convolution producing ``tensor``: the share of each tile's memory
    its planner may use for temporary operand buffers.  Lower values use less
    memory and more cycles."""
    proportion = float(available_memory_proportion)
    if not 0.0 < proportion <= 1.0:
        raise ValueError(f"available_memory_proportion must be in (0, 1], got {proportion}")
    from .capture.annotations import annotate
    annotate(tensor, "available_memory", proportion)
    return tensor


def isRunningOnIpu():
    """True only while poptorchsim traces a model for compilation."""
    from .capture import trace
    return trace.is_tracing()


def ipuHardwareIsAvailable(num_ipus=1):
    """No hardware here: the IPUs are simulated."""
    return False
