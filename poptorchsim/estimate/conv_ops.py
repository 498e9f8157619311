"""ATen convolutions and matrix products as the passes Poplar plans.

``passes_of(op)`` reads an IR op and returns the ``conv_plan.Conv`` passes it
runs: a forward convolution one, its backward the input gradient and the
weight update's gradient (each its own convolution, as Poplar plans
``TRAINING_BWD`` and ``TRAINING_WU``), a matrix product one per product
(``[G][M][K] x [G][K][N]``).  ``None`` where the op is none of these (the
caller keeps its general model).
"""
import math

MATMULS = ("mm", "addmm", "bmm", "baddbmm", "matmul", "mv", "addmv", "dot", "linear")


def _pair(v, n=2):
    if isinstance(v, (list, tuple)):
        v = list(v) + [v[-1]] * (n - len(v))
        return v[:n]
    return [v] * n


def _spatial(shape):
    """(height, width) of a convolution operand's field (1-D: height 1)."""
    field = list(shape[2:]) or [1]
    if len(field) == 1:
        return 1, field[0]
    return field[0], math.prod(field[1:])


def forward_conv(x_shape, w_shape, stride, padding, groups, item, partial):
    from .conv_params import Conv
    batch = x_shape[0]
    h, w = _spatial(x_shape)
    kh, kw = _spatial(w_shape)
    sh = _pair(stride)[0]
    ph, pw = (_pair(padding) + [0, 0])[:2] if len(x_shape) > 3 else (0, _pair(padding)[0])
    return Conv.forward(groups, batch, w_shape[1], w_shape[0] // groups, h, w, kh, kw,
                        sh, ph, pw, item, partial)


def passes_of(op, item, partial):
    """The ``Conv`` passes of ``op`` (a list), or None."""
    from .conv_params import Conv
    name = op.target.overloadpacket.__name__
    if name == "convolution":
        x, w = op.args[0], op.args[1]
        transposed = bool(op.args[6]) if len(op.args) > 6 else False
        if transposed or len(x.shape) < 3:
            return None
        dilation = op.args[5] if len(op.args) > 5 else 1
        if any(d != 1 for d in _pair(dilation)):
            return None
        return [forward_conv(x.shape, w.shape, op.args[3], op.args[4], op.args[8], item,
                             partial)]
    if name == "convolution_backward":
        x, w = op.args[1], op.args[2]
        transposed = bool(op.args[7])
        if transposed or len(x.shape) < 3 or any(d != 1 for d in _pair(op.args[6])):
            return None
        fwd = forward_conv(x.shape, w.shape, op.args[4], op.args[5], op.args[9], item, partial)
        mask = op.args[10]
        out = []
        if mask[0]:
            out.append(fwd.input_grad(x.shape[0], *_spatial(x.shape)))
        if mask[1]:
            out.append(fwd.weight_grad())
        return out
    if name in MATMULS:
        out = op.outputs[0]
        a = op.args[1] if name in ("addmm", "baddbmm", "addmv") else op.args[0]
        k = a.shape[-1] if a.shape else 1
        n = out.shape[-1] if len(out.shape) >= 1 and name not in ("mv", "addmv", "dot") else 1
        m = out.numel // max(n, 1)
        groups = 1
        if name in ("bmm", "baddbmm") or (name == "matmul" and len(out.shape) > 2):
            groups = math.prod(out.shape[:-2])
            m = out.shape[-2]
        return [Conv.matmul(groups, max(m, 1), max(k, 1), max(n, 1), item, partial)]
    return None
