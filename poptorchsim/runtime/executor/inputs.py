"""The inputs of a wrapped model, call by call.

``ModelInputs`` binds each call's arguments to ``forward``'s signature (dict
inputs in any key order), checks them against the inputs the model was
compiled for with PopTorch's texts, lays the combined batch out as
``[deviceIterations, gradientAccumulation, replicas, micro-batch, ...]`` and
writes inputs that ``forward`` changed in place back to the caller's tensors.
"""

import logging

import torch
import torch.utils._pytree as pytree

from ...capture.trace import bind_inputs, forward_signature, register_dict_types
from ...errors import BatchDimensionError, Error, InputMismatchError

MISMATCH_SUFFIX = (
    "\nThis error occurred because the inputs passed at runtime don't match the "
    "inputs used to compile the model.\nTo recompile the model for the new inputs "
    "create a new inferenceModel / trainingModel wrapper or call destroy() on the "
    "curent one and try again.")


def _leaf_names(args, kwargs, arg_names):
    """A readable name for every leaf of (args, kwargs), e.g. ``x`` or ``batch[1]``."""
    names = []
    for name, value in list(zip(arg_names, args)) + list(kwargs.items()):
        leaves, _ = pytree.tree_flatten(value)
        if len(leaves) == 1 and not isinstance(value, (list, tuple, dict)):
            names.append(name)
        else:
            names.extend(f"{name}[{i}]" for i in range(len(leaves)))
    return names


def _reorder_like(value, like):
    """``value`` with its dicts' keys in the order of ``like``'s (the inputs
    the model was compiled with): dict inputs may come in any key order."""
    if isinstance(value, dict) and isinstance(like, dict) and set(value) == set(like):
        return type(value)((k, _reorder_like(value[k], like[k])) for k in like)
    if isinstance(value, (list, tuple)) and type(value) is type(like) \
            and len(value) == len(like):
        items = [_reorder_like(a, b) for a, b in zip(value, like)]
        return type(value)(*items) if hasattr(value, "_fields") else type(value)(items)
    return value


class _TensorSlot:
    """Where the inputs the model was compiled with held a tensor."""

    def __repr__(self):
        return "Tensor"


_TENSOR = _TensorSlot()


def _check_like_structure(value, like, arg_names):
    """Dict inputs have the keys, tuples and lists the lengths, they were
    compiled with (PopTorch's texts, naming the input)."""
    def check(name, v, c):
        if c is _TENSOR and not isinstance(v, torch.Tensor):
            raise InputMismatchError(f"Type mismatch for {name}: expected {torch.Tensor} "
                                     f"but got {type(v)}." + MISMATCH_SUFFIX)
        if isinstance(c, (bool, int, float, str, type(None))):   # compiled in as constants
            if type(v) is not type(c):
                raise InputMismatchError(f"Type mismatch for {name}: expected {type(c)} "
                                         f"but got {type(v)}." + MISMATCH_SUFFIX)
            if v != c:      # compiled into the program: the same value only
                raise InputMismatchError(f"Value mismatch for {name}: expected {c} but got "
                                         f"{v}." + MISMATCH_SUFFIX)
        if isinstance(c, dict) and isinstance(v, dict):
            keys(name, v, c)
            for k in c:
                check(f"{name}[{k}]", v[k], c[k])
        elif isinstance(c, (list, tuple)) and type(v) is type(c):
            if len(v) != len(c):
                raise InputMismatchError(f"Length mismatch for {name}: expected {len(c)} "
                                         f"elements but got {len(v)}." + MISMATCH_SUFFIX)
            for i, (a, b) in enumerate(zip(v, c)):
                check(f"{name}[{i}]", a, b)

    def keys(name, v, c):
        if set(v) != set(c):
            details = []
            if set(v) - set(c):
                details.append("Unexpected arguments: " +
                               ", ".join(sorted(map(str, set(v) - set(c)))))
            if set(c) - set(v):
                details.append("Missing arguments: " +
                               ", ".join(sorted(map(str, set(c) - set(v)))))
            raise InputMismatchError(f"Keys mismatch for {name}: {'. '.join(details)}."
                                     + MISMATCH_SUFFIX)

    (args, kwargs), (like_args, like_kwargs) = value, like
    if len(args) != len(like_args):
        raise InputMismatchError("Number of positional arguments mismatch: expected "
                                 f"{len(like_args)} arguments but got {len(args)}."
                                 + MISMATCH_SUFFIX)
    for name, v, c in zip(arg_names, args, like_args):
        check(name, v, c)
    keys("named arguments", kwargs, like_kwargs)
    for k in set(kwargs) & set(like_kwargs):
        check(k, kwargs[k], like_kwargs[k])


def _holds_tensors(leaf):
    """An input object (not a tensor, tuple, list or dict) with tensors in
    its attributes: a custom type without a registered parser."""
    if isinstance(leaf, torch.Tensor):
        return False
    return any(isinstance(v, torch.Tensor) for v in getattr(leaf, "__dict__", {}).values())


class ModelInputs:
    """What ``PoplarExecutor`` knows of its model's inputs."""

    def __init__(self, model):
        self._model = model
        self.template = None          # (leaves as meta tensors, spec, names) compiled for
        self._positional = None       # (spec, names, count): compiled for plain tensors
        self.structure = None         # (args, kwargs) compiled for, tensors as None
        self.call_tensors = []        # the caller's input tensors of this call
        self.input_writes = []        # which of them forward() changes in place

    @staticmethod
    def warn_requires_grad(leaves):
        """An input that requires grad is detached, with PopTorch's warning
        (PopTorch 3's ``_preprocessGraph``): the backward pass runs on the
        device and does not reach the caller's tensors."""
        for t in leaves:
            if isinstance(t, torch.Tensor) and t.requires_grad:
                logging.getLogger("poptorchsim").warning(
                    "Input tensor has requires_grad=True set. This tensor will be detached "
                    "because backward pass via inputs is not supported.")

    def micro_batch(self, args, kwargs, leaves, di, ga, rf, o):
        """The inputs checked (batch dimensions that divide; those that
        require grad detached, with a warning) and cut to one micro-batch,
        dense as it lands on the device: an expanded or strided host tensor
        traces as a contiguous one (``x.view(-1)`` works)."""
        self.warn_requires_grad(leaves)
        self.check_batch(leaves, di, ga, rf, o)
        factor = di * ga * rf
        return pytree.tree_map_only(
            torch.Tensor,
            lambda t: t.detach()[: (t.shape[0] // factor)].contiguous() if t.dim() else t.detach(),
            (args, kwargs))

    def check_batch(self, leaves, di, ga, rf, o):
        """Every input's batch dimension divides by the combined batch factor."""
        factor = di * ga * rf
        for leaf in leaves:
            if not isinstance(leaf, torch.Tensor):
                continue
            dim0 = leaf.shape[0] if leaf.dim() else 1
            if dim0 % factor:
                raise BatchDimensionError(
                    f"Invalid batch dimension: In the input {tuple(leaf.shape)}, the "
                    f"batch dimension ({dim0}) must be a multiple of "
                    f"Options.deviceIterations({di}) * (Options.replicationFactor("
                    f"{o.replication_factor}) / Options.inputReplicaGrouping."
                    f"input_group_size({o.input_group_size})) * "
                    f"Options.Training.gradientAccumulation({ga}) = {factor} because it "
                    "is used to calculate the batch size which will be executed on the "
                    "device in any given iteration. For a full explanation see the "
                    "batching semantics page of the documentation.")

    def prepare(self, args, kwargs):
        """Bind, convert float64 to float32, and flatten the call's inputs."""
        fast = self._positional
        if fast is not None and not kwargs and len(args) == fast[2] and all(
                isinstance(t, torch.Tensor) and t.dtype != torch.float64 and t.numel()
                for t in args):
            # the inputs the model was compiled for were these plain tensors,
            # positionally: binding, reordering and flattening change nothing
            # (this path saves a small model's call about 30 us)
            self.call_tensors = list(args)
            return tuple(args), {}, list(args), fast[0], fast[1]
        args, kwargs = bind_inputs(self._model, args, kwargs)
        register_dict_types((args, kwargs))
        if self.structure is not None:
            _check_like_structure((args, kwargs), self.structure,
                                  list(forward_signature(self._model).parameters))
            args, kwargs = _reorder_like((args, kwargs), self.structure)
        self.call_tensors = [t for t in pytree.tree_leaves((args, kwargs))
                             if isinstance(t, torch.Tensor)]
        args, kwargs = pytree.tree_map_only(
            torch.Tensor, lambda t: t.float() if t.dtype == torch.float64 else t,
            (args, kwargs))
        arg_names = list(forward_signature(self._model).parameters)
        leaves, spec = pytree.tree_flatten((args, kwargs))
        names = _leaf_names(args, kwargs, arg_names)
        for name, leaf in zip(names, leaves):
            if isinstance(leaf, torch.Tensor) and leaf.numel() == 0:
                raise Error("Zero-sized tensors are unsupported (Got shape "
                            f"{list(leaf.shape)})")
            if _holds_tensors(leaf):
                kind = type(leaf).__name__
                raise Error(
                    f"Input {name} is a {kind} holding tensors, which would be compiled "
                    f"into the model as constants. Register a poptorch.ICustomArgParser "
                    f"for it: poptorch.registerCustomArgParser({kind}, parser).")
        return args, kwargs, leaves, spec, names

    def remember(self, args, kwargs, leaves, spec, names):
        """The inputs the model was compiled for."""
        self.template = ([torch.empty(t.shape, dtype=t.dtype, device="meta")
                          if isinstance(t, torch.Tensor) else t for t in leaves], spec, names)
        self.structure = pytree.tree_map_only(torch.Tensor, lambda t: _TENSOR, (args, kwargs))
        plain = not kwargs and len(leaves) == len(args) and \
            all(type(t) is torch.Tensor for t in args)
        self._positional = (spec, names, len(args)) if plain else None

    def validate(self, leaves, spec, names):
        """The inputs match those the model was compiled for (PopTorch's texts)."""
        expected_leaves, expected_spec, expected_names = self.template
        if len(leaves) == len(expected_leaves) and spec != expected_spec:
            raise InputMismatchError(
                f"Input structure mismatch: the model was compiled for inputs "
                f"{expected_names} but got {names}." + MISMATCH_SUFFIX)
        if len(leaves) != len(expected_leaves):
            raise InputMismatchError(
                f"Number of positional arguments mismatch: expected "
                f"{len(expected_leaves)} arguments but got {len(leaves)}." + MISMATCH_SUFFIX)
        for name, got, want in zip(names, leaves, expected_leaves):
            if isinstance(want, torch.Tensor):
                if not isinstance(got, torch.Tensor):
                    raise InputMismatchError(
                        f"Type mismatch for {name}: expected {torch.Tensor} but got "
                        f"{type(got)}." + MISMATCH_SUFFIX)
                if got.dtype != want.dtype:
                    raise InputMismatchError(
                        f"Data type mismatch for {name}: expected {want.dtype} but got "
                        f"{got.dtype}." + MISMATCH_SUFFIX)
                if got.shape != want.shape:
                    raise InputMismatchError(
                        f"Shape mismatch for {name}: expected {want.shape} but got "
                        f"{got.shape}." + MISMATCH_SUFFIX)
            elif got != want:
                raise InputMismatchError(
                    f"Value mismatch for {name}: expected {want} but got {got}."
                    + MISMATCH_SUFFIX)

    @staticmethod
    def layout(leaves, di, ga, rf):
        """The tensor inputs shaped ``[di, ga, rf, micro, ...]`` (a 0-dim input
        as ``[1, 1, 1]``)."""
        return [t.reshape(di, ga, rf, t.shape[0] // (di * ga * rf), *t.shape[1:])
                if t.dim() else t.reshape(1, 1, 1)
                for t in leaves if isinstance(t, torch.Tensor)]

    def write_back(self, written):
        """Inputs that forward() changed in place get their new values, every
        micro-batch's in its place of the combined batch (as PopTorch does).
        ``written``: per micro-batch, the new values of ``input_writes``."""
        if not written:
            return
        with torch.no_grad():
            for j, k in enumerate(self.input_writes):
                caller = self.call_tensors[k]
                caller.copy_(torch.stack([w[j] for w in written]).reshape(caller.shape))
