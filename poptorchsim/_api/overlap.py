"""PopTorch's overlapped host IO annotations.

``set_overlap_for_input`` / ``set_overlap_for_output`` return their argument
unchanged (any nesting of tuples, lists and dicts) and mark its tensors so
that their host transfers go through the IO tiles
(``Options.TensorLocations.numIOTiles``) while the compute tiles work: the
cycle estimate then hides those transfers behind compute.
"""
import torch
import torch.utils._pytree as pytree

from ..capture.overlap import mark
from ..enums import OverlapMode
from ..errors import Error


def _mark_all(tensors, kind, mode):
    if not isinstance(mode, OverlapMode):
        raise Error(f"set_overlap_for_{kind} expects a poptorch.OverlapMode as its mode "
                    f"(got {mode!r}): use for example "
                    "poptorch.OverlapMode.OverlapAccumulationLoop.")
    for leaf in pytree.tree_leaves(tensors):
        if isinstance(leaf, torch.Tensor):
            mark(leaf, kind, mode.value)
    return tensors


def set_overlap_for_input(input_tensors, mode):
    """Overlaps the host -> IPU copies of ``input_tensors`` (model inputs,
    marked before any other op uses them) with compute.  Needs IO tiles and
    ``ShardedExecution``.  Returns ``input_tensors``."""
    return _mark_all(input_tensors, "input", mode)


def set_overlap_for_output(output_tensors, mode):
    """Overlaps the IPU -> host copies of ``output_tensors`` (returned by
    ``forward``, each once) with compute.  Needs IO tiles and
    ``ShardedExecution``.  Returns ``output_tensors``."""
    return _mark_all(output_tensors, "output", mode)
