"""Floating-point exceptions (``Options.Precision.enableFloatingPointExceptions``).

With the option on, Poplar sets the tiles' floating-point control register
so that an invalid operation, a division by zero or an overflow raises an
exception on the tile (``poplar::FloatingPointBehaviour(inv, div0, oflo)``);
the run stops there and the host sees ``poplar::application_runtime_error``.
The engine imitates this by checking each computing op's result right after
it runs (``compile_graph(..., fp_checks=True)`` puts one call after the op
in the generated code; with the option off the code has no checks at all).

What raises, and why (Poplar's ``FloatingPointBehaviour`` and
``ErrorCode``, PopTorch's ``enableFloatingPointExceptions`` docstring):

* a NaN in a result (``FLOATING_POINT_INVALID_OPERATION``): made there
  (0/0, inf - inf, 0 * inf, sqrt(-1)) or carried in from a NaN operand,
  since an operation with a NaN operand is itself invalid;
* an infinity in a result when no operand held one
  (``FLOATING_POINT_DIVIDE_BY_ZERO`` for divisions, reciprocals and
  logarithms; ``FLOATING_POINT_OVERFLOW`` otherwise, exp(1000) or
  60000 * 2 in fp16);
* a comparison (``eq ne lt le gt ge``) with a NaN operand.

An infinity passed on from an operand or a constant (an attention mask of
-inf added to scores, ``exp(-inf) = 0``) is no exception on the IPU and is
none here.  Ops that only move data (views, copies, gathers, constants) are
not checked: a tile copying a NaN raises nothing; the op that next computes
with it does.  Casts are checked (a float32 value beyond fp16's range
overflows).
"""
import math

import torch

from ..errors import FloatingPointException

INVALID = "FLOATING_POINT_INVALID_OPERATION"
DIVIDE_BY_ZERO = "FLOATING_POINT_DIVIDE_BY_ZERO"
OVERFLOW = "FLOATING_POINT_OVERFLOW"

_DESCRIPTION = {
    INVALID: "an invalid operation (a NaN operand or result: 0/0, inf - inf, 0 * inf, "
             "the square root or logarithm of a negative number, or a comparison with NaN)",
    DIVIDE_BY_ZERO: "a division by zero",
    OVERFLOW: "an overflow (a finite result too large for its type)",
}

# data movement and constants: no arithmetic on the tiles
_UNCHECKED = {"view", "copy", "creation", "gather", "random", "loop", "cond", "host"}
_CASTS = {"_to_copy", "to", "type_as", "convert_element_type"}
_COMPARISONS = {"eq", "ne", "lt", "le", "gt", "ge"}
_DIVISIONS = {"div", "reciprocal", "rsqrt", "remainder", "fmod", "floor_divide",
              "log", "log2", "log10", "log1p", "true_divide", "_log_softmax",
              "xlogy"}


_PLACES = {"training_step": "the training step", "inference_forward": "the forward pass",
           "optimizer_update": "the optimizer update"}


def _name(op):
    target = op.target
    packet = getattr(target, "overloadpacket", None)
    return getattr(packet, "__name__", None) or getattr(target, "__name__", str(target))


def checked(op):
    """Does the engine check ``op``'s results when the option is on?"""
    if op.subgraphs or op.cost_class in _UNCHECKED and _name(op) not in _CASTS \
            or op.host_scalar:     # the host's arithmetic
        return False
    if _name(op) in _COMPARISONS:
        return True
    return any(t is not None and t.dtype.is_floating_point for t in op.outputs)


def _scalars(x, found):
    if isinstance(x, float):
        found.append(x)
    elif isinstance(x, (list, tuple)):
        for y in x:
            _scalars(y, found)
    elif isinstance(x, dict):
        for y in x.values():
            _scalars(y, found)
    return found


def _finite(t):
    """All of ``t`` finite?  One reduction: a finite sum means finite
    elements (a sum that overflows is checked element by element)."""
    if math.isfinite(float(t.sum())):
        return True
    return bool(torch.isfinite(t).all())


def _has_inf(t):
    return t.dtype.is_floating_point and bool(torch.isinf(t).any())


def _has_nan(t):
    return t.dtype.is_floating_point and bool(torch.isnan(t).any())


def make_check(op, graph_name):
    """``check(result, operands)`` for ``op``: raises ``FloatingPointException``
    as the IPU would (see the module's text); ``operands``: the op's tensor
    arguments, as the generated code passes them."""
    name = _name(op)
    inf_constant = any(math.isinf(v) for v in _scalars([op.args, op.kwargs], []))
    comparison = name in _COMPARISONS

    def fail(code, detail):
        raise FloatingPointException(
            _message(op, graph_name, code, detail), error_code=code, op=op.name,
            location=op.source)

    def check(result, operands):
        if comparison:
            for x in operands:
                if x.dtype.is_floating_point and not _finite(x) and _has_nan(x):
                    fail(INVALID, "a comparison with a NaN operand")
            return
        results = result if isinstance(result, (list, tuple)) else (result,)
        for out in results:
            if not isinstance(out, torch.Tensor) or not out.dtype.is_floating_point \
                    or _finite(out):
                continue
            if _has_nan(out):
                nan_in = any(_has_nan(x) for x in operands)
                fail(INVALID, "a NaN operand" if nan_in else "a NaN result")
            if inf_constant or any(_has_inf(x) for x in operands):
                continue            # an infinity passed on, as IEEE arithmetic does
            by_zero = name in _DIVISIONS and (
                not operands or any(bool((x == 0).any()) for x in operands))
            fail(DIVIDE_BY_ZERO if by_zero else OVERFLOW, "")
    return check


def _message(op, graph_name, code, detail):
    where = op.source
    text = (f"Floating point exception on the IPU ({code}): operation '{op.name}' "
            f"({op.target}) in {_PLACES.get(graph_name, graph_name)}"
            f"{' (backward pass)' if op.backward else ''} performed {_DESCRIPTION[code]}")
    if detail:
        text += f": {detail}"
    text += "."
    if where:
        text += f" The operation was created by the model at {where}."
    return text
