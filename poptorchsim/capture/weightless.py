"""Models without weights: parameters and buffers on PyTorch's ``meta``
device (``with torch.device("meta"): model = Net()``, or deferred
initialisation), which have shapes and types but no values.

Such a model compiles as the same model with weights does: the trace runs
over fake tensors anyway, and a fake tensor *is* a meta tensor that says
which device it stands for.  So each meta parameter or buffer enters the
trace as a fake CPU tensor built around the meta tensor itself (no bytes
allocated), in the fake mode ``make_fx`` then adopts, and it meets the
user's real CPU inputs on one device.  Nothing here knows about tiles.
"""
import itertools

import torch
import torch.utils._pytree as pytree

from ..errors import NoWeightsError

CPU = torch.device("cpu")


def meta_tensors(module):
    """Names of ``module``'s parameters and buffers on the meta device."""
    return [n for n, t in itertools.chain(module.named_parameters(), module.named_buffers())
            if t.device.type == "meta"]


def has_meta_state(module):
    """Does ``module`` hold a parameter or buffer without values (meta)?"""
    return any(t.device.type == "meta"
               for t in itertools.chain(module.parameters(), module.buffers()))


def _fake_mode():
    """The fake mode ``make_fx(tracing_mode="fake")`` would make itself."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv
    return FakeTensorMode(allow_fallback_kernels=True, allow_non_fake_inputs=True,
                          shape_env=ShapeEnv(), static_shapes=True)


def fake_meta_example(example):
    """``example`` (the trace's arguments) with every meta tensor replaced by
    a fake CPU tensor of the same shape, strides and type, all in one fake
    mode that ``make_fx`` detects and uses; real tensors are left for
    ``make_fx`` to fake as usual.  Returns ``example`` itself when it holds
    no meta tensor."""
    leaves = pytree.tree_leaves(example)
    if not any(isinstance(t, torch.Tensor) and t.device.type == "meta" for t in leaves):
        return example
    from torch._subclasses.fake_tensor import FakeTensor
    mode = _fake_mode()

    def fake(t):
        if t.device.type != "meta":
            return t
        out = FakeTensor(mode, t.detach(), CPU)
        out.requires_grad_(t.requires_grad)
        return out
    return pytree.tree_map_only(torch.Tensor, fake, example)


def meta_constants(module):
    """Names of tensors on the meta device that ``module`` holds as plain
    attributes (neither parameters nor buffers): forward() reads them as
    constants, whose values the program holds."""
    return [f"{prefix}.{name}" if prefix else name
            for prefix, m in module.named_modules()
            for name, value in vars(m).items()
            if isinstance(value, torch.Tensor) and value.device.type == "meta"]


def explain_meta_constant(exc, module, what):
    """The ``NoWeightsError`` behind ``exc`` (a trace that met tensors on two
    devices) when ``module`` holds a meta tensor as a constant; else None."""
    text = str(exc)
    if "meta" not in text or "device" not in text:
        return None
    names = meta_constants(module)
    if not names:
        return None
    first = names[0].rpartition(".")[2]
    return NoWeightsError(
        f"While tracing the {what}, tensors met on two devices: the model holds "
        f"{', '.join(names[:3])}, a tensor on the meta device that is neither a "
        "parameter nor a buffer: the program holds such a tensor as a constant, with "
        "its values, so the model cannot be compiled without them. Register it as a "
        f"buffer (self.register_buffer('{first}', tensor, persistent=False)), which is "
        "compiled from its shape like the weights, or create it on the CPU.")
