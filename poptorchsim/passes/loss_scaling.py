"""Automatic loss scaling, as PopART's ``AutomaticLossScale`` transform builds it.

``Options.Training.setAutomaticLossScaling(True)`` adds two things to a
training program:

* **Gradient statistics** (``add_gradient_statistics``, the training step):
  after every *tracked* fp16 gradient tensor, a histogram op counts its
  elements whose magnitude lies below and above one bin edge,
  ``binEdgeLocation`` x 65504 (fp16's largest value; PopART's default
  location 1/16, an edge at 4094).  The histograms are summed into one
  ``[lower, upper]`` count, a new output of the step.  Tracked tensors
  (``automaticLossScalingSettings.gradientTensorTrackingMethod``): 1, the
  default, every fp16 gradient an op of the backward pass computes (views,
  gathers, slices, concatenations and ops reading a weight left out, as
  PopART does); 0, only the fp16 outputs of the backward pass's matmuls and
  convolutions.  (The default is 1 because PopTorch's own test of automatic
  loss scaling passes on hardware with a float32 input to an fp16 Linear:
  its matmul then runs in float32, PyTorch's type promotion, and the only
  fp16 gradients are the casts of the weight gradients to fp16.)
* **The update** (``add_loss_scale_update``, the optimizer update): one op
  reads the counts summed over the weight update's micro-batches and
  replicas and the update factor, and halves the factor when the upper
  count exceeds ``t / (1 - t)`` times the lower one (``t``:
  ``thresholdUpperCountProportion``, default 1e-7, so one gradient value in
  ten million near fp16's top halves the scale), and doubles it otherwise.
  With fp16 weights the factor is clipped so the loss scale stays at or
  below 2**15.  It acts every ``updatePeriod`` weight updates (default 1).

The loss scale the next step uses is ``loss_scaling x factor``
(``finalLossScale``); the optimizer's ``loss_scaling`` is its start value.
"""
from dataclasses import dataclass

import torch

from ..errors import Error
from ..ir.graph import Op
from ..ir.ops import cost_class

HALF_MAX = 65504.0
CLIP = 2.0 ** 15                 # the largest power of two below HALF_MAX
GATHERS_AND_SLICES = ("gather", "cat", "slice", "select", "index_select",
                      "embedding_dense_backward", "slice_backward", "select_backward", "index",
                      "index_put")

_lib = torch.library.Library("poptorchsim", "FRAGMENT")
_lib.define("gradient_histogram(Tensor x, float edge) -> Tensor")
_lib.define("loss_scale_update(Tensor factor, Tensor statistics, Tensor loss_scaling, "
            "Tensor counter, float threshold, int period, bool clip) -> Tensor")


def _histogram(x, edge):
    """[elements with |x| < edge, the rest (infinities and NaN too)]."""
    lower = (x.abs() < edge).sum()
    return torch.stack([lower, x.numel() - lower]).to(torch.int32)


def _update(factor, statistics, loss_scaling, counter, threshold, period, clip):
    if (int(counter) + 1) % period:
        return factor.clone()
    lower, upper = (float(v) for v in statistics)
    down = upper > threshold / (1.0 - threshold) * lower
    new = factor * (0.5 if down else 2.0)
    if clip:
        new = torch.minimum(new, CLIP / loss_scaling.to(new.dtype))
    return new


_lib.impl("gradient_histogram", _histogram, "CompositeExplicitAutograd")
_lib.impl("loss_scale_update", _update, "CompositeExplicitAutograd")
torch.library.register_fake("poptorchsim::gradient_histogram",
                            lambda x, edge: x.new_empty((2,), dtype=torch.int32), lib=_lib)
torch.library.register_fake("poptorchsim::loss_scale_update",
                            lambda factor, *_: torch.empty_like(factor), lib=_lib)
HISTOGRAM = torch.ops.poptorchsim.gradient_histogram.default
UPDATE = torch.ops.poptorchsim.loss_scale_update.default


@dataclass(frozen=True)
class Settings:
    """``automaticLossScalingSettings`` (PopART's names and defaults)."""
    enabled: bool = False
    bin_edge_location: float = 0.0625
    threshold_upper_count_proportion: float = 1e-7
    update_period: int = 1
    tracking_method: int = 1       # 1: all non-view gradients, 0: conv and matmul ones

    @property
    def edge(self):
        return HALF_MAX * self.bin_edge_location


def settings(popart_options, enabled):
    """The ``Settings`` from ``Options._Popart``'s ``automaticLossScalingSettings.*``
    entries, validated with PopART's texts."""
    get = popart_options.get
    prefix = "automaticLossScalingSettings."
    s = Settings(bool(enabled or get(prefix + "enabled", False)),
                 float(get(prefix + "binEdgeLocation", 0.0625)),
                 float(get(prefix + "thresholdUpperCountProportion", 1e-7)),
                 int(get(prefix + "updatePeriod", 1)),
                 int(get(prefix + "gradientTensorTrackingMethod", 1)))
    if not 0 <= s.bin_edge_location <= 1:
        raise Error("[AutomaticLossScale transform] Out of range value for 'binEdgeLocation'. "
                    f"The current value is {s.bin_edge_location}, but it should be in the "
                    "range [0, 1].")
    if not 0 <= s.threshold_upper_count_proportion <= 1:
        raise Error("Out of range value for 'thresholdUpperCountProportion'. The current "
                    f"value is {s.threshold_upper_count_proportion}, but it should be in the "
                    "range [0, 1].")
    if s.update_period < 1:
        raise Error("[AutomaticLossScale transform] 'updatePeriod' must be at least 1, not "
                    f"{s.update_period}.")
    if s.tracking_method not in (0, 1):
        raise Error("[AutomaticLossScale transform] gradientTensorTrackingMethod "
                    f"{s.tracking_method} (GradientsOfUserSpecifiedTensors) needs tensor "
                    "names PopTorch cannot give; use 0 (ConvAndMatmulGradients) or 1 "
                    "(AllNonViewChangingGradientTensors).")
    return s


def _fp16_outputs(op):
    outs = [t for t in op.outputs if t is not None]
    return outs if outs and all(t.dtype == torch.float16 for t in outs) else []


def _op_name(op):
    packet = getattr(op.target, "overloadpacket", None)
    return getattr(packet, "__name__", "")


def tracked_gradients(graph, method=1):
    """The fp16 gradient tensors of ``graph`` (a training step) whose values
    decide the loss scale: [(producing op, tensor)].  ``method`` 0: outputs
    of the backward pass's matmuls and convolutions; 1: outputs of every
    backward op that is not a view, a gather, a slice or a concatenation,
    reads no weight and whose result is used."""
    used = {id(t) for op in graph.ops for t in op.input_tensors()}
    used |= {id(t) for t in graph.outputs}
    found = []
    for op in graph.ops:
        if not op.backward:
            continue
        outs = _fp16_outputs(op)
        if not outs:
            continue
        if method == 0:
            keep = op.cost_class in ("matmul", "conv")
        else:
            keep = (op.cost_class not in ("view", "host") and not op.inplace
                    and _op_name(op) not in GATHERS_AND_SLICES
                    and not any(t.role == "param" for t in op.input_tensors())
                    and any(id(t) in used for t in outs))
        if keep:
            found += [(op, t) for t in outs]
    return found


def mark_watched(graph):
    """In-place rewrite: marks every op of the backward pass computing an fp16 result (casts
    included, views and in-place writes left out) with
    ``Op.watched``: the engine's gradient watch counts the values
    each one loses to underflow and overflow."""
    for op in graph.ops:
        if op.backward and _fp16_outputs(op) and not op.inplace \
                and op.cost_class not in ("view", "host"):
            op.watched = True


def _new_op(graph, name, target, args, out, at, like, kwargs=None):
    op = Op(0, name, target, args, kwargs or {}, [out], cost_class(target), block=like.block,
            stage=like.stage,
            ipu=like.ipu, backward=True, role="loss scaling histogram")
    out.producer = op
    graph.ops.insert(at, op)
    return op


def add_gradient_statistics(graph, s):
    """In-place rewrite: adds the histogram ops and their sum to ``graph`` (a training step);
    the ``[lower, upper]`` counts become its last output
    (``graph.statistics_outputs = 1``).  Raises PopART's error when no fp16
    gradient is tracked."""
    tracked = tracked_gradients(graph, s.tracking_method)
    if not tracked:
        raise Error("[AutomaticLossScale transform] No tracked gradient tensors of type fp16 "
                    "were found. (Automatic loss scaling watches fp16 gradients: cast the "
                    "model to half with model.half(), or switch "
                    "Options.Training.setAutomaticLossScaling off for a float32 model.)")
    histograms = []
    last = None
    for k, (op, t) in enumerate(tracked):
        out = graph.new_tensor(f"histogram{k}", (2,), torch.int32)
        at = graph.ops.index(op) + 1
        _new_op(graph, f"{t.name}_histogram", HISTOGRAM, (t, s.edge), out, at, op)
        histograms.append(out)
        last = op if last is None or op.stage < last.stage else last
    # the backward pass ends in the first forward stage: the sum is made there
    stacked = graph.new_tensor("gradient_histograms", (len(histograms), 2), torch.int32)
    total = graph.new_tensor("gradientStatistics", (2,), torch.int32)
    end = len(graph.ops)
    _new_op(graph, "gradient_histograms", torch.ops.aten.stack.default, (histograms,),
            stacked, end, last)
    _new_op(graph, "gradientStatistics", torch.ops.aten.sum.dim_IntList, (stacked, [0]),
            total, end + 1, last, {"dtype": torch.int32})
    for i, op in enumerate(graph.ops):
        op.id = i
    graph.outputs.append(total)
    graph.statistics_outputs = 1
    for t in graph.inputs:          # the scale the step uses: loss_scaling x factor
        if t.name == "lossScaling":
            t.name = "finalLossScale"
    return total


def add_loss_scale_update(graph, s, clip):
    """In-place rewrite: adds PopART's loss-scale update op to ``graph`` (an optimizer
    update): inputs ``statistics`` ([lower, upper], summed over the weight
    update), ``lossScaleUpdateFactor``, ``lossScaling`` and the update
    counter are appended to its inputs, the new factor to its outputs.
    ``clip``: fp16 weights, the loss scale kept at or below 2**15."""
    stats = graph.new_tensor("gradientStatistics", (2,), torch.int32, "hyper")
    factor = graph.new_tensor("lossScaleUpdateFactor", (), torch.float32, "state")
    scale = graph.new_tensor("lossScaling", (), torch.float32, "hyper")
    counter = graph.new_tensor("lossScaleUpdateCounter", (), torch.float32, "state")
    graph.inputs += [stats, factor, scale, counter]
    new = graph.new_tensor("updatedLossScaleUpdateFactor", (), torch.float32)
    op = Op(len(graph.ops), "lossScaleUpdate", UPDATE,
            (factor, stats, scale, counter, s.threshold_upper_count_proportion,
             s.update_period, bool(clip)), {}, [new], cost_class(UPDATE),
            role="loss scale update")
    new.producer = op
    graph.ops.append(op)
    graph.outputs.append(new)
    return op
