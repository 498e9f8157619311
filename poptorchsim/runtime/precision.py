"""The ``Options.Precision`` settings the compiler is given, and batch-norm
running statistics kept in float32 (``runningStatisticsAlwaysFloat``)."""
import contextlib

import torch
import torch.nn.functional as F

from ..machine.precision import Rounding, mark_partials


def settings(options):
    """The compiler's ``precision`` argument: what shapes the program."""
    p = options.Precision
    return {"stochastic_rounding": bool(p.enable_stochastic_rounding),
            "partials": p.partials_type,
            "running_statistics_always_float": bool(p.running_statistics_always_float),
            "seed": options._values.get("random_seed"),
            "process_id": int(options.Distributed.processId)}


def apply(precision, graphs):
    """Marks half-partials ops and attaches the stochastic-rounding state to
    ``graphs`` (one program's); returns the ``Rounding`` or None."""
    if not precision:
        return None
    if precision.get("partials") == "half":
        for g in graphs:
            mark_partials(g, "half")
    rounding = None
    if precision.get("stochastic_rounding"):
        rounding = Rounding(precision.get("seed"), precision.get("process_id", 0))
    for g in graphs:
        g.rounding = rounding
    return rounding


def _float_statistics_modules(model):
    return [m for m in model.modules()
            if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)
            and m.track_running_stats and m.running_mean is not None]


def keep_running_statistics_float(model):
    """Batch-norm running mean and variance of ``model`` as float32 (they
    stay fp16 in a model cast to half otherwise)."""
    for m in _float_statistics_modules(model):
        if m.running_mean.dtype != torch.float32:
            m.running_mean = m.running_mean.float()
            m.running_var = m.running_var.float()


def _forward_with_float_statistics(m):
    """``m.forward`` (a ``_BatchNorm``) for an fp16 input with float32
    running statistics: batch statistics normalize the fp16 input as
    PyTorch does; the running statistics are updated in float32 from the
    input widened to float32; evaluation normalizes with them in float32
    and rounds the result to the input's type."""
    def forward(x):
        if x.dtype == m.running_mean.dtype:
            return type(m).forward(m, x)
        m._check_input_dim(x)
        momentum = 0.0 if m.momentum is None else m.momentum
        if m.training:
            if m.num_batches_tracked is not None:
                m.num_batches_tracked.add_(1)
                if m.momentum is None:
                    momentum = 1.0 / float(m.num_batches_tracked)
            y = F.batch_norm(x, None, None, m.weight, m.bias, True, 0.0, m.eps)
            with torch.no_grad():
                dims = [0] + list(range(2, x.dim()))
                xf = x.detach().float()
                n = xf.numel() // xf.shape[1]
                mean = xf.mean(dims)
                var = xf.var(dims, unbiased=n > 1)
                m.running_mean.mul_(1 - momentum).add_(mean * momentum)
                m.running_var.mul_(1 - momentum).add_(var * momentum)
            return y
        w = m.weight.float() if m.weight is not None else None
        b = m.bias.float() if m.bias is not None else None
        return F.batch_norm(x.float(), m.running_mean, m.running_var, w, b, False, 0.0,
                            m.eps).to(x.dtype)
    return forward


@contextlib.contextmanager
def float_statistics_forward(model, precision):
    """While tracing: batch norms with float32 running statistics run
    ``_forward_with_float_statistics`` (when the option is set)."""
    mods = _float_statistics_modules(model) if precision and \
        precision.get("running_statistics_always_float") else []
    for m in mods:
        m.forward = _forward_with_float_statistics(m)
    try:
        yield
    finally:
        for m in mods:
            del m.forward
