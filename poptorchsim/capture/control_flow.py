"""Loops and conditionals in a traced graph: the marker ops around a body.

``poptorchsim.for_loop`` and ``poptorchsim.cond`` trace their bodies once,
inline, between marker ops (as PopTorch's ``start_for_loop`` /
``end_for_loop`` and ``start_if_block`` / ``start_else_block`` /
``end_if_block`` do).  Lowering (``passes/lower.py``) turns every op traced
between a loop's markers into the loop's body graph, and those between a
conditional's markers into its two branch graphs; the markers themselves
never reach the IR.

The markers are ``torch.library`` operators in the ``poptorchsim``
namespace: functional (they return copies), with fake kernels, so that
``make_fx`` and functionalization record them where they were called.
"""
import torch
from torch.library import custom_op

NAMESPACE = "poptorchsim"


@custom_op(f"{NAMESPACE}::loop_begin", mutates_args=())
def loop_begin(inputs: list[torch.Tensor], count: int) -> list[torch.Tensor]:
    """The loop's carried inputs, as its body reads them."""
    return [t.clone() for t in inputs]


@loop_begin.register_fake
def _(inputs, count):
    return [torch.empty_like(t) for t in inputs]


@custom_op(f"{NAMESPACE}::loop_end", mutates_args=())
def loop_end(outputs: list[torch.Tensor], carried: list[torch.Tensor],
             count: int) -> list[torch.Tensor]:
    """The loop's results (``carried``: the body's inputs, ``loop_begin``'s
    outputs, which tie the two markers together)."""
    return [t.clone() for t in outputs]


@loop_end.register_fake
def _(outputs, carried, count):
    return [torch.empty_like(t) for t in outputs]


@custom_op(f"{NAMESPACE}::cond_begin", mutates_args=())
def cond_begin(condition: torch.Tensor) -> torch.Tensor:
    """Starts the ``then`` branch; returns the condition."""
    return condition.clone()


@cond_begin.register_fake
def _(condition):
    return torch.empty_like(condition)


@custom_op(f"{NAMESPACE}::cond_else", mutates_args=())
def cond_else(then_outputs: list[torch.Tensor], condition: torch.Tensor) -> list[torch.Tensor]:
    """Ends the ``then`` branch (its outputs) and starts the ``else`` branch."""
    return [t.clone() for t in then_outputs]


@cond_else.register_fake
def _(then_outputs, condition):
    return [torch.empty_like(t) for t in then_outputs]


@custom_op(f"{NAMESPACE}::cond_end", mutates_args=())
def cond_end(else_outputs: list[torch.Tensor], then_outputs: list[torch.Tensor],
             condition: torch.Tensor) -> list[torch.Tensor]:
    """Ends the ``else`` branch; the conditional's results."""
    take = bool(condition)
    return [(a if take else b).clone() for a, b in zip(then_outputs, else_outputs)]


@cond_end.register_fake
def _(else_outputs, then_outputs, condition):
    return [torch.empty_like(t) for t in then_outputs]


OPS = {name: getattr(torch.ops.poptorchsim, name).default
       for name in ("loop_begin", "loop_end", "cond_begin", "cond_else", "cond_end")}
MARKERS = frozenset(OPS.values())
