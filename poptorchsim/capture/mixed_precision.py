"""Mixed fp16/fp32 operands while tracing, resolved as PopTorch resolves them.

PopTorch 3.x computes an op whose operands mix float16 and float32 the way
PyTorch's type promotion does (in float32), except for the layers whose
parameters follow their input (PopTorch's ``castWeightAndBias`` in its
canonicalization of linear, convolutions and normalizations): their weight
and bias are cast to the input's type, so a float16 activation through a
float32 ``Linear`` gives a float16 result (float32 "master weights" train
an fp16 model; the gradient flows back through the cast into the float32
weight), and a float32 activation through an fp16 layer a float32 one.
PyTorch itself rejects these mixed calls on the CPU; PopTorch's own tests
(``half_float_test.py``) run them.

Matrix products of two activations (``matmul``, ``mm``, ``bmm``) whose
types differ compute in float32, as type promotion would.  A batch norm of
an fp16 input with float32 running statistics (PopTorch's way to keep
them in float32: cast the buffers back) normalizes in fp16 with the
batch's statistics and keeps the running ones in float32
(``batch_norm_float_statistics``).  ``device="ipu"`` (PopTorch's device,
``poptorch._impl.isDispatchTracing()`` code) means the simulated device.
"""
import inspect

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

HALF, FLOAT = torch.float16, torch.float32

# function -> ((argument name, position), ...) of the parameters that follow the input
_FOLLOW_INPUT = {}
for _f in (F.linear, F.conv1d, F.conv2d, F.conv3d, F.conv_transpose1d, F.conv_transpose2d,
           F.conv_transpose3d):
    _FOLLOW_INPUT[_f] = (("weight", 1), ("bias", 2))
for _f in (F.layer_norm, F.group_norm):
    _FOLLOW_INPUT[_f] = (("weight", 2), ("bias", 3))
for _f in (F.batch_norm, F.instance_norm):
    _FOLLOW_INPUT[_f] = (("weight", 3), ("bias", 4))

_PRODUCTS = {torch.matmul, torch.mm, torch.bmm, torch.Tensor.matmul, torch.Tensor.mm,
             torch.Tensor.bmm, torch.Tensor.__matmul__, torch.Tensor.__rmatmul__}


def _floating(x):
    return isinstance(x, torch.Tensor) and x.dtype in (HALF, FLOAT)


def _cast(x, dtype):
    return x.to(dtype) if _floating(x) and x.dtype != dtype else x


def batch_norm_float_statistics(x, running_mean, running_var, weight=None, bias=None,
                                training=False, momentum=0.1, eps=1e-5):
    """``F.batch_norm`` of an fp16 ``x`` with float32 running statistics:
    in training the batch is normalized with its own statistics in fp16, as
    PyTorch does, and the running statistics are updated in float32 from
    the input widened to float32; in evaluation the input is normalized
    with the float32 statistics in float32 and the result rounded to fp16."""
    if training:
        y = F.batch_norm(x, None, None, weight, bias, True, 0.0, eps)
        if running_mean is not None:
            with torch.no_grad():
                dims = [0] + list(range(2, x.dim()))
                xf = x.detach().float()
                n = xf.numel() // xf.shape[1]
                running_mean.mul_(1 - momentum).add_(xf.mean(dims) * momentum)
                running_var.mul_(1 - momentum).add_(xf.var(dims, unbiased=n > 1) * momentum)
        return y
    w = weight.float() if weight is not None else None
    b = bias.float() if bias is not None else None
    return F.batch_norm(x.float(), running_mean, running_var, w, b, False, 0.0,
                        eps).to(x.dtype)


_BATCH_NORM = inspect.signature(F.batch_norm)


def _ipu_device(value):
    return (value == "ipu" or (isinstance(value, str) and value.startswith("ipu:"))
            or (isinstance(value, torch.device) and value.type == "ipu"))


class MixedPrecision(TorchFunctionMode):
    """While a model is traced: layers' weights and biases take their input's
    float type; mixed fp16/fp32 matrix products compute in fp32; fp16 batch
    norms keep float32 running statistics; ``device="ipu"`` is the device."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if _ipu_device(kwargs.get("device")):
            kwargs["device"] = "cpu"
        if func is torch.Tensor.to and args and _ipu_device(args[1] if len(args) > 1 else None):
            args = (args[0],) + tuple(args[2:])
            if not args[1:] and not kwargs:
                return args[0]
        if func is F.batch_norm:
            bound = _BATCH_NORM.bind(*args, **kwargs)
            a = bound.arguments
            x, mean = a.get("input"), a.get("running_mean")
            if _floating(x) and x.dtype == HALF and _floating(mean) and mean.dtype == FLOAT:
                return batch_norm_float_statistics(
                    x, mean, a.get("running_var"), a.get("weight"), a.get("bias"),
                    a.get("training", False), a.get("momentum", 0.1), a.get("eps", 1e-5))
        follow = _FOLLOW_INPUT.get(func)
        if follow and args and _floating(args[0]):
            dtype = args[0].dtype
            args = list(args)
            for name, pos in follow:
                if pos < len(args):
                    args[pos] = _cast(args[pos], dtype)
                elif name in kwargs:
                    kwargs[name] = _cast(kwargs[name], dtype)
        elif func in _PRODUCTS and len(args) >= 2 and _floating(args[0]) \
                and _floating(args[1]) and args[0].dtype != args[1].dtype:
            args = [_cast(args[0], FLOAT), _cast(args[1], FLOAT)] + list(args[2:])
        return func(*args, **kwargs)
