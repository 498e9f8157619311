"""On-device control flow: ``for_loop`` and ``cond`` (PopTorch's names,
arguments and errors).

While a model is traced for the IPU, each becomes one op of the IR holding
its body as sub-graphs (``ir.graph.Op.subgraphs``): a loop holds its body
once and runs it ``count`` times; a conditional holds both branches (their
code and memory) and runs one, chosen on the device by a boolean tensor.
As in PopTorch, both are for inference models only.  Outside tracing (the
model run in plain PyTorch) they run in Python.
"""
import torch

from ..capture import control_flow as _markers
from ..capture.trace import is_tracing, tracing_training
from ..errors import Error


def _as_list(outputs):
    return list(outputs) if isinstance(outputs, (list, tuple)) else [outputs]


def for_loop(count, body, inputs):
    """Runs ``body`` ``count`` times on the device; each iteration takes the
    previous one's outputs as inputs (as many tensors as ``inputs``, of the
    same shapes and types).  Tensors of the enclosing ``forward`` may be
    read inside ``body``.  Returns the last iteration's outputs (a list)."""
    if not isinstance(inputs, list):
        raise ValueError("poptorch.for_loop expects input tensors (inputs) to be a list "
                         "of tensors. (Object is not list)")
    for k, t in enumerate(inputs):
        if not isinstance(t, torch.Tensor):
            raise ValueError("poptorch.for_loop expects input tensors (inputs) to be a "
                             "list of tensors. (Object contained in list at index "
                             f"{k} is not torch.tensor)")
    if isinstance(count, bool) or not isinstance(count, int) or count < 0:
        raise Error(f"poptorch.for_loop: count must be a non-negative int, got {count!r}")
    if not is_tracing():
        values = [t.clone() for t in inputs]
        for _ in range(count):
            values = _as_list(body(*values))
        return values
    if tracing_training():
        raise Error("poptorch.for_loop() is only supported in inference")
    carried = _markers.loop_begin(inputs, count)
    outputs = _as_list(body(*carried))
    _check_body_outputs(outputs, inputs)
    return _markers.loop_end(outputs, carried, count)


def _check_body_outputs(outputs, inputs):
    if len(outputs) != len(inputs):
        raise Error(f"poptorch.for_loop: the body returned {len(outputs)} tensor(s) for "
                    f"{len(inputs)} input(s). A loop body returns one new value per input.")
    for k, (out, inp) in enumerate(zip(outputs, inputs)):
        if not isinstance(out, torch.Tensor):
            raise Error(f"poptorch.for_loop: output {k} of the body is a "
                        f"{type(out).__name__}, not a tensor.")
        if out.shape != inp.shape or out.dtype != inp.dtype:
            raise Error(f"poptorch.for_loop: output {k} of the body is "
                        f"{out.dtype}{list(out.shape)} but input {k} is "
                        f"{inp.dtype}{list(inp.shape)}: each iteration's outputs are the "
                        "next one's inputs, so they must match.")


def cond(condition, then_body, then_inps, else_body, else_inps):
    """``then_body(*then_inps)`` if the boolean tensor ``condition`` is true,
    else ``else_body(*else_inps)``, decided on the device.  Both bodies
    return the same number of tensors of the same shapes and types; they may
    read tensors of the enclosing ``forward``.  Returns a list."""
    if not isinstance(then_inps, list) or not isinstance(else_inps, list):
        raise ValueError("poptorch.cond expects then_inps and else_inps tensors to be a "
                         "list of tensors. (Object is not list)")
    if not is_tracing():
        return _as_list(then_body(*then_inps) if condition else else_body(*else_inps))
    if tracing_training():
        raise Error("poptorch.cond() is only supported in inference")
    if not isinstance(condition, torch.Tensor) or condition.numel() != 1:
        raise Error("poptorch.cond: the condition must be a tensor of one element "
                    f"(got {type(condition).__name__}"
                    f"{list(condition.shape) if isinstance(condition, torch.Tensor) else ''}).")
    flag = _markers.cond_begin(condition.reshape(()).to(torch.bool))
    then_out = _as_list(then_body(*then_inps))
    then_out = _markers.cond_else(then_out, flag)
    else_out = _as_list(else_body(*else_inps))
    if len(then_out) != len(else_out) or any(
            a.shape != b.shape or a.dtype != b.dtype for a, b in zip(then_out, else_out)):
        raise Error(
            "poptorch.cond: then_body and else_body must return the same number of "
            "tensors with the same shapes and types; got "
            f"{[(a.dtype, list(a.shape)) for a in then_out]} and "
            f"{[(b.dtype, list(b.shape)) for b in else_out]}.")
    return _markers.cond_end(else_out, then_out, flag)
