"""The ``Options.Precision`` settings the compiler is given, and batch-norm
running statistics kept in float32 (``runningStatisticsAlwaysFloat``)."""
import contextlib
import logging
import os
from typing import Optional

import torch

from ..capture.mixed_precision import batch_norm_float_statistics
from ..errors import Error
from ..machine.gradient_watch import GradientWatch
from ..machine.precision import Rounding, mark_partials
from ..machine.streams import Streams
from .loss_scaling import add_gradient_statistics, add_loss_scale_update, mark_watched
from .loss_scaling import settings as loss_scaling_settings

logger = logging.getLogger("poptorchsim")


def settings(options):
    """The compiler's ``precision`` argument: what shapes the program."""
    p = options.Precision
    return {"stochastic_rounding": bool(p.enable_stochastic_rounding),
            "floating_point_exceptions": bool(p.enable_floating_point_exceptions),
            "partials": p.partials_type,
            "running_statistics_always_float": bool(p.running_statistics_always_float),
            "seed": getattr(options, "random_seed", None),
            "random_streams": random_streams_mode(options),
            "process_id": int(options.Distributed.processId)}


def random_streams_mode(options):
    """"counter" or "eager": ``Options.randomStreams``, else the environment
    variable ``POPTORCHSIM_RANDOM_STREAMS``, else "counter"."""
    mode = getattr(options, "random_streams", None)
    if mode is None:
        env = os.environ.get("POPTORCHSIM_RANDOM_STREAMS", "").strip().lower()
        if env in ("eager", "counter"):
            mode = env
        elif env in ("permicrobatch", "per_micro_batch"):
            mode = "counter"
        elif env:
            raise Error(f"POPTORCHSIM_RANDOM_STREAMS={env!r}: use 'eager' (PyTorch's "
                        "generator in eager order) or 'counter' (per micro-batch streams)")
    return mode or "counter"


def floating_point_checks(precision):
    """Does the program check every op for floating-point exceptions
    (``enableFloatingPointExceptions``)?  Its model is then traced with
    stack traces, so that an exception names the model's line."""
    return bool((precision or {}).get("floating_point_exceptions"))


def apply(precision, graphs, streams=None):
    """Marks half-partials ops and attaches the random streams (a new
    ``Streams``, or ``streams``), the stochastic-rounding state and the
    floating-point checks to ``graphs`` (one program's); returns the
    ``Rounding`` or None."""
    if not precision:
        return None
    if streams is None:
        streams = Streams(precision.get("seed"), precision.get("process_id", 0),
                          precision.get("random_streams") or "counter")
    if floating_point_checks(precision):
        for g in graphs:
            g.floating_point_checks = True
    if precision.get("partials") == "half":
        for g in graphs:
            mark_partials(g, "half")
    rounding = Rounding(streams) if precision.get("stochastic_rounding") else None
    for g in graphs:
        g.rounding, g.streams = rounding, streams
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
    running statistics (``capture.mixed_precision.batch_norm_float_statistics``)."""
    def forward(x):
        if x.dtype == m.running_mean.dtype:
            return type(m).forward(m, x)
        m._check_input_dim(x)
        momentum = 0.0 if m.momentum is None else m.momentum
        if m.training and m.num_batches_tracked is not None:
            m.num_batches_tracked.add_(1)
            if m.momentum is None:
                momentum = 1.0 / float(m.num_batches_tracked)
        return batch_norm_float_statistics(x, m.running_mean, m.running_var, m.weight, m.bias,
                                           m.training, momentum, m.eps)
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


# -- automatic loss scaling and the fp16 gradients of the last call --------------------

def auto_loss_scaling(options):
    """The ``passes.loss_scaling.Settings`` of automatic loss scaling when
    ``Options.Training.setAutomaticLossScaling(True)`` (or PopART's
    ``automaticLossScalingSettings.enabled``) is set, else None."""
    s = loss_scaling_settings(options._Popart.options, options.Training.auto_loss_scaling)
    return s if s.enabled else None


_UNDER = ("fp16 gradients of the last call underflowed to zero: {n:,} of the {total:,} "
          "values the backward pass computes non-zero in fp32; {op} lost {pct:.1f}% of its "
          "result's magnitude. Raise the optimizer's loss_scaling, or turn on "
          "Options.Training.setAutomaticLossScaling(True).")
_OVER = ("fp16 gradients of the last call overflowed to infinity: {n:,} of the {total:,} "
         "values the backward pass computes non-zero in fp32. Lower the optimizer's "
         "loss_scaling, or turn on Options.Training.setAutomaticLossScaling(True).")


class GradientMonitor:
    """What the fp16 gradients of a training program did (``precisionReport()``):
    values lost to underflow and overflow, and the loss scale automatic
    loss scaling chose; warns once per executor when an op lost more than
    ``WARN_FRACTION`` of its result's (fp32) magnitude to underflow, or any
    value overflowed.

    The gradient watch counts the first micro-batch of a call in the first
    call, in a call whose loss scale differs from the last counted one's,
    and in a call at least ``EVERY`` micro-batches after the last counted
    one: every micro-batch computes the same way, and counting one in about
    ``EVERY`` keeps its cost (about one fp32 micro-batch) a small fraction
    of the host time.  The report says which call it counted."""
    WARN_FRACTION = 0.01
    EVERY = 16

    def __init__(self):
        self.warned = set()
        self.calls = 0
        self.counted_call = None        # the call whose first micro-batch was counted
        self._since = 0                 # micro-batches run since that one
        self._scale = None
        self._watch: Optional[GradientWatch] = None     # the GradientWatch counted last

    def start(self, compiled, state, micro_batches=1):
        """A training call of ``micro_batches`` (over replicas) starts."""
        self.calls += 1
        watch = compiled.watch
        if watch is not None:
            scale = _loss_scale(state)
            fresh = watch is not self._watch or self._since >= self.EVERY or scale != self._scale
            if fresh:
                watch.reset()       # a new program counts its first call
                self._watch = watch
                self.counted_call = self.calls
                self._since, self._scale = 0, scale
            else:
                watch.skip()
            self._since += micro_batches
        if getattr(state, "loss_scale", None) is not None:
            state.loss_scale.history = []

    def finish(self, compiled):
        watch = compiled.watch
        if watch is None or not watch.nonzero:
            return
        under = watch.worst_lost_share
        if under > self.WARN_FRACTION and "under" not in self.warned:
            self.warned.add("under")
            worst = watch.summary(1)["ops"]
            logger.warning(_UNDER.format(pct=100 * under, n=watch.underflowed,
                                         total=watch.nonzero,
                                         op=worst[0]["op"] if worst else "an op"))
        if watch.overflowed and "over" not in self.warned:
            self.warned.add("over")
            logger.warning(_OVER.format(n=watch.overflowed, total=watch.nonzero))

    def report(self, compiled, state):
        """A JSON-ready dict: the loss scale and the fp16 gradients' fate
        (``counted_call``: which call, of ``calls``, the counts come from)."""
        scale = getattr(state, "loss_scale", None)
        out = {"loss_scale": _loss_scale(state),
               "automatic_loss_scaling": None, "gradients": None}
        if scale is not None:
            als = compiled.auto_loss_scaling
            out["automatic_loss_scaling"] = {
                "loss_scaling": scale.loss_scaling, "update_factor": float(scale.factor),
                "final_loss_scale": scale.final, "history": list(scale.history),
                "updates": int(scale.counter), "bin_edge": als.edge,
                "threshold_upper_count_proportion": als.threshold_upper_count_proportion,
                "update_period": als.update_period}
        watch = compiled.watch
        if watch is not None:
            out["gradients"] = {**watch.summary(), "counted_call": self.counted_call,
                                "calls": self.calls}
        return out


def _loss_scale(state):
    extra = getattr(state, "step_extra", None)
    return float(extra[0]) if extra else 1.0


def watch_gradients(program, model, als):
    """Marks the backward ops of the training step with fp16 results and
    gives it a ``GradientWatch`` (None when it has none); with automatic
    loss scaling (``als``, its ``Settings``), adds PopART's histogram ops to
    the step and the loss-scale update to the optimizer update."""
    step, update = program.graphs["training_step"], program.graphs["optimizer_update"]
    if als:
        if program.pipelined and program.accumulation == 1:
            raise Error("[AutomaticLossScale transform] Automatic loss scaling is not "
                        "currently supported when the 'enablePipelining' SessionOption is set "
                        "to 'true', but the 'enableGradientAccumulation' SessionOption is set "
                        "to 'false'")
        add_gradient_statistics(step, als)
        add_scale_update(update, model, als)
    mark_watched(step)
    watched = any(op.watched for op in step.ops)
    step.watch = GradientWatch() if watched else None
    return step.watch


def add_scale_update(update, model, als):
    """Automatic loss scaling's loss-scale update, added to the optimizer
    update (fp16 gradients are clipped when the model has fp16 weights)."""
    clip = any(p.dtype == torch.float16 for p in model.parameters() if p.requires_grad)
    add_loss_scale_update(update, als, clip)
