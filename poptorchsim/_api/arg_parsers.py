"""PopTorch's custom argument parsers: user-defined input and output types.

A model may take (or return) objects of its own classes holding tensors.
``registerCustomArgParser(MyType, parser)`` tells poptorchsim how to take
such an object apart (``parser.yieldTensors``) and build one again around
other tensors (``parser.reconstruct``).  The type is registered as a
``torch.utils._pytree`` node, so every place that flattens a model's inputs
and outputs (batching, validation, tracing, returning outputs) handles it as
it handles tuples and dicts.
"""
import abc

import torch.utils._pytree as pytree

from ..errors import Error

_parsers = {}


class ICustomArgParser(abc.ABC):
    """Extracts the tensors of a custom type and rebuilds it from tensors."""

    @abc.abstractmethod
    def yieldTensors(self, struct):
        """Yields every ``torch.Tensor`` of ``struct``, in a deterministic order."""

    @abc.abstractmethod
    def reconstruct(self, original_structure, tensor_iterator):
        """A new object like ``original_structure`` whose tensors are taken,
        in ``yieldTensors``' order, from ``tensor_iterator``."""


class _Template:
    """The non-tensor part of a custom object: the object itself, compared by
    type (two objects of one type with the same tensors match, as in
    PopTorch, which validates only their tensors)."""

    def __init__(self, obj):
        self.obj = obj

    def __eq__(self, other):
        return isinstance(other, _Template) and type(other.obj) is type(self.obj)

    def __hash__(self):
        return hash(type(self.obj))

    def __repr__(self):
        return f"{type(self.obj).__name__}(...)"


def _flatten_with(parser):
    def flatten(obj):
        return list(parser.yieldTensors(obj)), _Template(obj)
    return flatten


def _unflatten_with(parser):
    def unflatten(values, template):
        return parser.reconstruct(template.obj, iter(values))
    return unflatten


def registerCustomArgParser(arg_data_type, arg_parser):
    """Registers ``arg_parser`` for inputs and outputs of type
    ``arg_data_type`` (replacing an earlier one); ``None`` removes it."""
    if arg_parser is not None and not isinstance(arg_parser, ICustomArgParser):
        raise Error("arg_parser must inherit from ICustomArgParser")
    if arg_data_type in _parsers:
        pytree._deregister_pytree_node(arg_data_type)
        del _parsers[arg_data_type]
    if arg_parser is None:
        return
    if arg_data_type in pytree.SUPPORTED_NODES:
        raise Error(f"{arg_data_type.__name__} already has a torch.utils._pytree "
                    "registration (a tuple, list, dict or a type registered by other "
                    "code): it cannot also take a custom argument parser.")
    pytree.register_pytree_node(arg_data_type, _flatten_with(arg_parser),
                                _unflatten_with(arg_parser))
    _parsers[arg_data_type] = arg_parser
