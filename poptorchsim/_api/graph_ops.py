"""PopTorch's graph ops: custom ops, ``MultiConv``, ``serializedMatMul``,
``dynamic_slice`` / ``dynamic_update``, ``nop``, ``NameScope`` and
``Attribute``.

Each behaves as in PopTorch on the CPU and, while a model is traced, marks
the ops it makes (``capture/scopes.py``, ``capture/annotations.py``) so that
the IR and the cost model see them: a custom op is one IR op of class
``custom`` costed as declared, the convolutions of a ``MultiConv`` share one
compute set, a serialized matmul is planned in pieces, a ``nop`` is a copy
that is never removed.
"""
import re

import torch

from .. import enums
from ..capture import custom_ops as _custom_ops
from ..capture import scopes as _scopes
from ..errors import Error, createPoptorchError
from ..ir import custom as _ir_custom
from ..ir.multiconv import MultiConvGroup

# ---------------------------------------------------------------------------
# Custom ops
# ---------------------------------------------------------------------------
_REGISTERED = {}       # (name, domain, domain_version) -> CustomOp


class CustomOp:
    """A registered custom op.  Call it as ``poptorch.custom_op`` is called,
    without the name: ``op(inputs, example_outputs, attributes=None)``."""

    def __init__(self, name, domain, domain_version, function):
        self.name, self.domain, self.domain_version = name, domain, domain_version
        self._function = function

    def __call__(self, inputs, example_outputs, attributes=None):
        inputs, example_outputs = _tensor_list(inputs, "inputs"), \
            _tensor_list(example_outputs, "example_outputs")
        _check_attributes(attributes)
        return _custom_ops.call(self._function, inputs, example_outputs, attributes)

    def __repr__(self):
        return (f"CustomOp({self.name!r}, domain={self.domain!r}, "
                f"domain_version={self.domain_version})")


def register_custom_op(name, forward=None, *, domain="custom.ops", domain_version=1,
                       backward=None, cycles_per_element=None, cycles=None, temp_bytes=0):
    """Registers a custom op implemented in Python, for ``poptorch.custom_op``.

    PopTorch runs custom ops compiled from C++ (a PopART op and its Poplar
    vertices).  Here the op is ``forward(*inputs, **attributes)``, returning
    a tensor or a tuple of them, and its cost on the tiles is what you
    declare, as a vertex's cycle estimate would: ``cycles_per_element``
    (worker cycles per output element) or ``cycles(input_shapes,
    output_shapes)`` (worker cycles of the whole op), and ``temp_bytes``
    (an int or a function of the shapes: temporary memory of the whole op).

    ``backward(grad_outputs, inputs, outputs, **attributes)`` returns one
    gradient (or None) per input; without it, training differentiates
    ``forward`` with PyTorch's autograd.  The gradient op costs twice the
    forward's declared cycles per element of its result.

    Use it as a decorator or call it: returns a ``CustomOp``.

    >>> @poptorch.register_custom_op("AddVectors", domain="tutorial",
    ...                              cycles_per_element=3)
    ... def add_vectors(x, y):
    ...     return x + y
    >>> z, = poptorch.custom_op([x, y], "AddVectors", "tutorial", 1,
    ...                         example_outputs=[x])
    """
    if forward is None:
        return lambda fn: register_custom_op(
            name, fn, domain=domain, domain_version=domain_version, backward=backward,
            cycles_per_element=cycles_per_element, cycles=cycles, temp_bytes=temp_bytes)
    key = _op_key(name, domain, domain_version)
    if not callable(forward) or (backward is not None and not callable(backward)):
        raise Error(f"register_custom_op({name!r}): forward and backward must be functions.")
    if key in _REGISTERED:
        raise Error(f"Custom op {name!r} (domain {domain!r}, version {domain_version}) is "
                    "already registered; register it once, or give it another name or "
                    "domain_version.")
    cost = _declared_cost(name, cycles_per_element, cycles, temp_bytes)
    qualname = re.sub(r"\W", "_", f"{domain}_{name}_v{domain_version}")
    function = _custom_ops.define(qualname, forward, backward)
    _ir_custom.COSTS[qualname] = cost
    _ir_custom.COSTS[f"{qualname}_grad"] = _ir_custom.CustomCost(
        cost.cycles_per_element, cost.cycles, cost.temp_bytes, _ir_custom.BACKWARD_FACTOR)
    op = CustomOp(name, domain, domain_version, function)
    _REGISTERED[key] = op
    return op


def _op_key(name, domain, domain_version):
    if not isinstance(name, str) or not name or not isinstance(domain, str) or \
            not isinstance(domain_version, int) or isinstance(domain_version, bool):
        raise Error("A custom op is named by name (str), domain (str) and domain_version "
                    f"(int); got {name!r}, {domain!r}, {domain_version!r}.")
    return name, domain, domain_version


def _declared_cost(name, cycles_per_element, cycles, temp_bytes):
    if (cycles_per_element is None) == (cycles is None):
        raise Error(f"register_custom_op({name!r}): declare the op's cost with exactly one "
                    "of cycles_per_element=<worker cycles per output element> or "
                    "cycles=<function(input_shapes, output_shapes) -> worker cycles>.")
    if cycles_per_element is not None and (
            not isinstance(cycles_per_element, (int, float)) or cycles_per_element < 0):
        raise Error(f"register_custom_op({name!r}): cycles_per_element must be a "
                    f"non-negative number, got {cycles_per_element!r}.")
    if cycles is not None and not callable(cycles):
        raise Error(f"register_custom_op({name!r}): cycles must be a function of "
                    "(input_shapes, output_shapes).")
    if not callable(temp_bytes) and (not isinstance(temp_bytes, int) or temp_bytes < 0):
        raise Error(f"register_custom_op({name!r}): temp_bytes must be a non-negative int "
                    "or a function of (input_shapes, output_shapes).")
    return _ir_custom.CustomCost(cycles_per_element, cycles, temp_bytes)


def custom_op(inputs, name, domain, domain_version, example_outputs, attributes=None):
    """Applies the custom op ``name`` of ``domain`` (PopTorch's signature);
    returns the list of its outputs, shaped as ``example_outputs``.

    The op must have been registered with ``register_custom_op`` (PopTorch
    loads it from a PopART shared library instead)."""
    op = _REGISTERED.get(_op_key(name, domain, domain_version))
    if op is None:
        known = ", ".join(f"{n!r} ({d}, v{v})" for n, d, v in _REGISTERED) or "none"
        raise Error(
            f"Custom op {name!r} (domain {domain!r}, version {domain_version}) is not "
            "registered. PopTorch loads custom ops from a compiled PopART library; in "
            "poptorchsim implement it in Python and register it before calling it: "
            f"poptorch.register_custom_op({name!r}, forward, domain={domain!r}, "
            f"domain_version={domain_version}, cycles_per_element=...). "
            f"Registered: {known}.")
    return op(inputs, example_outputs, attributes)


def _tensor_list(values, what):
    if isinstance(values, torch.Tensor) or not isinstance(values, (list, tuple)) or \
            not all(isinstance(v, torch.Tensor) for v in values):
        raise Error(f"custom_op: {what} must be a list or tuple of tensors, got "
                    f"{type(values).__name__}.")
    return list(values)


def _check_attributes(attributes):
    """PopTorch's checks of a custom op's attributes (its ValueError texts)."""
    if attributes is None:
        return
    for k, v in attributes.items():
        if not isinstance(k, str):
            raise ValueError("All attribute keys must be strings.")
        if not isinstance(v, (float, int, str, list, tuple)):
            raise ValueError("Attribute values must be floats, ints, strings or a "
                             "list/tuple of float, ints of strings.")
        if isinstance(v, (list, tuple)) and any(not isinstance(e, type(v[0])) for e in v):
            raise ValueError("The types in a list/tuple attribute must all be the same.")
    for s in list(attributes) + list(attributes.values()):
        for text in (s if isinstance(s, (list, tuple)) else [s]):
            if isinstance(text, str) and any(ord(ch) >= 128 for ch in text):
                raise ValueError(f"{text} contains non-ASCII characters.")


# ---------------------------------------------------------------------------
# nop, dynamic slices, serialized matmul
# ---------------------------------------------------------------------------
def nop(tensor):
    """Identity that the compiler never removes: one IR op, a small copy."""
    if not isinstance(tensor, torch.Tensor):
        raise createPoptorchError(
            f"nop must take a torch.tensor argument. {type(tensor)} is not supported.")
    return _custom_ops.nop(tensor)


def _offsets(tensor, dim, start, size, step, what):
    """Indices start, start + step, ... (``size`` elements, every ``step``-th)
    along ``dim``, computed on the device from the ``start`` tensor (never
    read into Python), taken modulo the dimension's length."""
    if start.dtype.is_floating_point or start.dtype.is_complex or start.dtype == torch.bool:
        raise createPoptorchError(f"Expected integer typed start tensor for {what}, got "
                                  f"{start.dtype}.")
    if start.numel() != 1:
        raise createPoptorchError(f"The start of {what} must hold one index, got a tensor "
                                  f"of shape {list(start.shape)}.")
    if size == 0:
        raise createPoptorchError("The start and end of a slice must be different.")
    if size < 0:
        raise createPoptorchError("Taking a slice of a tensor with the end less than the "
                                  "start is not supported.")
    if not -tensor.dim() <= dim < tensor.dim():
        raise createPoptorchError(f"Dimension {dim} is out of range for a tensor of "
                                  f"{tensor.dim()} dimensions.")
    length = tensor.shape[dim]
    steps = torch.arange(0, size, step, device=tensor.device, dtype=torch.int64)
    return torch.remainder(start.reshape(1).to(torch.int64) + steps, length)


def dynamic_slice(tensor, dim, start, size, step):
    """``tensor`` sliced along ``dim`` from the index held in the tensor
    ``start``: ``size`` elements, every ``step``-th (PopTorch's checks and
    texts).  The start is a tensor, not a Python int, so one compiled
    program serves every start: it is computed on the device."""
    if not isinstance(tensor, torch.Tensor):
        raise createPoptorchError(f"dynamic_slice must take a torch.tensor input. "
                                  f"{type(tensor)} is not supported.")
    if not isinstance(dim, int):
        raise createPoptorchError("Dimension must be an integer.")
    if not isinstance(start, torch.Tensor):
        raise createPoptorchError("Slice start argument to dynamic_slice must be a "
                                  f"torch.tensor. {type(tensor)} is not supported.")
    if not isinstance(size, int):
        raise createPoptorchError("Size must be an integer.")
    if not isinstance(step, int):
        raise createPoptorchError("Step must be an integer.")
    if step < 1:
        raise createPoptorchError("Slicing step must be at least 1")
    index = _offsets(tensor, dim, start, size, step, "dynamic_slice")
    length = tensor.shape[dim]
    if length % size != 0:
        raise createPoptorchError(f"The size of the slice ({size}) must be a factor of the "
                                  f"slicing dimension ({length}).")
    return torch.index_select(tensor, dim, index)


def _ipu_dtype(dtype):
    """The dtype a tensor has on the IPU, which holds no 64-bit types."""
    return {torch.int64: torch.int32, torch.float64: torch.float32}.get(dtype, dtype)


def dynamic_update(input, src, dim, start, size):  # PopTorch's name
    """``input`` with ``size`` elements along ``dim``, from the index held in
    the tensor ``start``, replaced by ``src`` (PopTorch's checks and texts)."""
    if not isinstance(input, torch.Tensor):
        raise createPoptorchError(f"dynamic_update must take a torch.tensor input. "
                                  f"{type(input)} is not supported.")
    if not isinstance(dim, int):
        raise createPoptorchError("Dimension must be an integer.")
    if not isinstance(start, torch.Tensor):
        raise createPoptorchError("Slice start argument to dynamic_update must be a "
                                  f"torch.tensor. {type(start)} is not supported.")
    if not isinstance(src, torch.Tensor):
        raise createPoptorchError("Src argument to dynamic_update must be a torch.tensor. "
                                  f"{type(src)} is not supported.")
    if not isinstance(size, int):
        raise createPoptorchError("Size must be an integer.")
    if input.dim() != src.dim():
        raise createPoptorchError("input and src tensors must have same dimensionality. "
                                  f"({input.dim()}) vs ({src.dim()})")
    if input.dtype != src.dtype:
        # Named as the IPU holds them: 64-bit inputs arrive as 32-bit tensors.
        raise createPoptorchError("input and src tensor must have same dtype. "
                                  f"({_ipu_dtype(input.dtype)} vs {_ipu_dtype(src.dtype)})")
    index = _offsets(input, dim, start, size, 1, "dynamic_update")
    if src.shape[dim] != size:
        raise createPoptorchError(f"src has {src.shape[dim]} elements along dimension "
                                  f"{dim} but the update's size is {size}.")
    return torch.index_copy(input, dim, index, src)


def serializedMatMul(lhs, rhs, mode, factor=0, keep_precision=False):
    """``lhs @ rhs`` planned as ``factor`` smaller matmuls, one after the
    other, split along ``mode``'s dimension (``MatMulSerializationMode``):
    less temporary memory, more supersteps.  ``keep_precision``: half
    inputs add their partial results in float32 (the partials' memory and
    exchange double).  The numerics are those of one matmul."""
    assert isinstance(keep_precision, bool)
    assert isinstance(factor, int)
    assert isinstance(mode, enums.MatMulSerializationMode)
    out = torch.matmul(lhs, rhs)
    if mode is enums.MatMulSerializationMode.Disabled:
        return out
    if factor < 1:
        raise createPoptorchError(f"serializedMatMul: the factor must be at least 1 to "
                                  f"serialize on {mode.value}, got {factor}.")
    length = {enums.MatMulSerializationMode.InputChannels: lhs.shape[-2] if lhs.dim() > 1
              else 1,
              enums.MatMulSerializationMode.ReducingDim: lhs.shape[-1],
              enums.MatMulSerializationMode.OutputChannels: rhs.shape[-1] if rhs.dim() > 1
              else 1}[mode]
    if length % factor != 0:
        raise createPoptorchError(
            f"serializedMatMul: the factor ({factor}) must divide the {mode.value} "
            f"dimension ({length}); pick a factor of {length}.")
    from ..capture.annotations import annotate_producer
    annotate_producer(out, "serialization", (mode.value, factor, keep_precision))
    return out


# ---------------------------------------------------------------------------
# Scopes
# ---------------------------------------------------------------------------
class NameScope:
    """Ops traced inside ``with NameScope("name"):`` have their IR names
    prefixed with ``name/`` (nested scopes join with ``/``).  Entering
    pushes the name on the trace's name-scope stack and leaving pops it,
    as PopTorch's ``NameScope`` calls ``torch.ops.poptorch.push_name_scope``
    and ``pop_name_scope``."""

    def __init__(self, name):
        assert isinstance(name, str), 'Parameter to NameScope must be a string'
        self.name = name

    def __enter__(self):
        _scopes.push_name_scope(self.name)

    def __exit__(self, exc_type, exc, tb):
        _scopes.pop_name_scope()
        return False


class Attribute:
    """``with Attribute(__outline={"layer": "embedding"}):`` sets attributes
    (PopART's ``__outline``, ``__recompute_output_in_backward``, ...) on the
    ops traced inside; they are kept on the IR ops (``op.attrs``).  Each
    attribute maps string keys to string values, as PopTorch's
    ``set_attribute(str attribute, str key, str value)`` requires; nested
    scopes add to the attributes of the outer ones."""

    def __init__(self, **kwargs):
        for attr, values in kwargs.items():
            if not isinstance(values, dict):
                raise RuntimeError(f"Attribute {attr} must be a dict of string keys and "
                                   f"values, got {type(values).__name__}: use "
                                   f"Attribute({attr}={{'key': 'value'}}).")
            for k, v in values.items():
                for arg, x in (("key", k), ("value", v)):
                    if not isinstance(x, str):
                        raise RuntimeError(
                            f"set_attribute() Expected a value of type 'str' for argument "
                            f"'{arg}' but instead found type '{type(x).__name__}'. Pass "
                            f"attribute {attr}'s {arg}s as strings ({str(x)!r}).")
        self._kwargs = kwargs
        self._scope = None

    def __enter__(self):
        merged = dict(_scopes.current(_scopes.ATTRIBUTES) or {})
        for attr, values in self._kwargs.items():
            merged[attr] = {**merged.get(attr, {}), **values}
        self._scope = _scopes.scope(_scopes.ATTRIBUTES, merged)
        self._scope.__enter__()

    def __exit__(self, exc_type, exc, tb):
        self._scope.__exit__(exc_type, exc, tb)
        return False


class MultiConv:
    """Convolutions traced inside ``with MultiConv():`` run as one
    multi-convolution: with the parallel plan (the default) in one compute
    set, each on its share of the tiles, paying each superstep's sync once;
    with the serial plan one after another.  Builder methods take one value
    for all convolutions or one per convolution (PopTorch's checks)."""

    def __init__(self):
        self._available_memory_proportions = None
        self._partials_types = None
        self._plan_type = None
        self._per_conv_reserved_tiles = None
        self._cycle_back_off = None
        self._enable_conv_ditherings = None
        self._scope = self._current = None

    @staticmethod
    def _per_conv(name, value, scalar_type):
        if value is None:
            return None
        if isinstance(value, scalar_type):
            return (value,)
        if isinstance(value, (list, tuple)) and value and \
                all(isinstance(x, scalar_type) for x in value):
            return tuple(value)
        raise AssertionError(f"Invalid {name}!")

    def availableMemoryProportions(self, value):
        """The available memory proportion of each convolution, in (0, 1]."""
        value = self._per_conv("available memory proportion", value, float)
        if value is not None and not all(0.0 < v <= 1.0 for v in value):
            raise ValueError(f"Available memory proportions must be in (0, 1], got {value}")
        self._available_memory_proportions = value
        return self

    def partialsTypes(self, value):
        """The partials type (``torch.float`` or ``torch.half``) of each
        convolution: the type of the partial sums its tiles exchange."""
        def encode(dtype):
            if dtype in (torch.float, torch.float32):
                return "float"
            if dtype in (torch.half, torch.float16):
                return "half"
            raise ValueError('Invalid partials types. Expecting torch.float or torch.half')
        values = value if isinstance(value, (list, tuple)) else (value,)
        self._partials_types = tuple(encode(v) for v in values)
        return self

    def enableConvDithering(self, value):
        """Per-convolution dithering: each convolution's temporary buffers
        start on a different tile, spreading the memory peak."""
        if value is None:
            self._enable_conv_ditherings = None
        elif isinstance(value, (list, tuple)):
            if not all(isinstance(x, bool) for x in value):
                raise ValueError("value must be bool or list of bools")
            self._enable_conv_ditherings = tuple(value)
        elif isinstance(value, bool):
            self._enable_conv_ditherings = (value,)
        else:
            raise ValueError("value must be bool or list of bools")
        return self

    def planType(self, value):
        """``MultiConvPlanType.Parallel`` (default) or ``Serial``."""
        if value is not None and not isinstance(value, enums.MultiConvPlanType):
            raise AssertionError("Invalid plan type!")
        self._plan_type = value
        return self

    def perConvReservedTiles(self, value):
        """Tiles reserved for each convolution of a parallel plan (the rest
        are shared in proportion to their work); default 50."""
        assert isinstance(value, int)
        self._per_conv_reserved_tiles = value
        return self

    def cycleBackOff(self, value):
        """How much slower than its fastest plan (a proportion) each
        convolution's plan may be, to use less temporary memory; default 0.1."""
        assert isinstance(value, float)
        self._cycle_back_off = value
        return self

    def _group(self):
        plan = self._plan_type
        group = MultiConvGroup(
            plan="serial" if plan == enums.MultiConvPlanType.Serial else "parallel",
            available_memory=self._available_memory_proportions,
            partials=self._partials_types, dithering=self._enable_conv_ditherings)
        if self._per_conv_reserved_tiles is not None:
            group.reserved_tiles = self._per_conv_reserved_tiles
        if self._cycle_back_off is not None:
            group.cycle_back_off = self._cycle_back_off
        return group

    def __enter__(self):
        if _scopes.current(_scopes.MULTICONV) is not None:     # only while tracing
            raise createPoptorchError("Nested poptorch.MultiConv is not supported.")
        self._current = self._group()
        self._scope = _scopes.scope(_scopes.MULTICONV, self._current)
        self._scope.__enter__()

    def __exit__(self, exc_type, exc, tb):
        # as in PopTorch, the options in force when the scope closes apply
        vars(self._current).update(vars(self._group()))
        self._scope.__exit__(exc_type, exc, tb)
        return False
