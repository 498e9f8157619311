"""The host device: where the simulator's host side computes a program's
numbers (the CPU, or a CUDA device).

The simulated IPU is a model; its arithmetic runs on the host, by default on
the CPU.  Chosen, it runs on a CUDA device instead: the weights, buffers,
optimizer state and accumulators of an executable live there, with its
random streams, fp16 partials, stochastic rounding and batched
micro-batches.  Inputs go to it from pinned memory, without waiting;
outputs come back to the CPU as PopTorch returns them; the user's model
gets the trained weights when it reads them (``runtime/state/weights.py``).  The
IR, the estimate, ``getIR()`` and the reports do not depend on it.

Chosen three ways, the first found wins:

1. ``poptorchsim.setHostDevice("cuda")`` in the program;
2. the environment variable ``POPTORCHSIM_DEVICE`` (``cuda``, ``cuda:1``,
   ``cpu``), so that an unchanged program can use it;
3. ``python -m poptorchsim.run --device cuda script.py``, which sets (2).

The default is the CPU.  An executable keeps the device it was compiled on
(its graphs' constants are placed there when they are compiled).
"""
import os

import torch
from torch.utils import _pytree as pytree

from ..errors import Error

ENV = "POPTORCHSIM_DEVICE"
_chosen = None          # setHostDevice's choice (a torch.device), or None


def parse_device(device, source):
    """``device`` as a ``torch.device`` the host can compute on, or a clear
    error naming ``source`` (where the choice was made)."""
    try:
        parsed = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise Error(f"{source}: {device!r} is not a device ({e}); use 'cpu' or "
                    "'cuda' (or 'cuda:N')") from None
    if parsed.type not in ("cpu", "cuda"):
        raise Error(f"{source}: the simulator's host side runs on 'cpu' or 'cuda', not "
                    f"{parsed.type!r}")
    if parsed.type == "cuda":
        if not torch.cuda.is_available():
            raise Error(f"{source}: {device!r} asks for a CUDA device, but this PyTorch "
                        f"({torch.__version__}) sees none; install a CUDA build of "
                        "PyTorch on a machine with a GPU, or use 'cpu'")
        index = parsed.index if parsed.index is not None else torch.cuda.current_device()
        if index >= torch.cuda.device_count():
            raise Error(f"{source}: {device!r}: there are {torch.cuda.device_count()} "
                        "CUDA devices")
        parsed = torch.device("cuda", index)
    return parsed


def choose(device):
    """``poptorchsim.setHostDevice``: the host device of executables
    compiled from now on (None: back to the environment's or the CPU)."""
    global _chosen
    _chosen = None if device is None else parse_device(device, "setHostDevice")


def current():
    """The host device executables compile for now."""
    if _chosen is not None:
        return _chosen
    env = os.environ.get(ENV, "").strip()
    if env:
        return parse_device(env, f"{ENV}={env}")
    return torch.device("cpu")


def to(tree, device):
    """``tree`` (tensors in lists, tuples and dicts) with its tensors on
    ``device`` (``Tensor.to`` keeps a tensor already there, not a copy)."""
    return pytree.tree_map_only(torch.Tensor, lambda t: t.to(device), tree)


def send(tensors, device):
    """Inputs to ``device``: from pinned memory, without waiting (the copy
    overlaps what the host does until the step reads them)."""
    if device.type == "cpu":
        return tensors
    return [t.pin_memory().to(device, non_blocking=True) if t.device.type == "cpu" else
            t.to(device) for t in tensors]

