"""The optimizer update's graph: built from the optimizer's rules
(``capture/update_rules.py``) over the trainable parameters, lowered, with the
host's scalar arithmetic marked; its sharding over replicas and the
loss-scale update automatic loss scaling adds to it."""
import math
from dataclasses import dataclass
from typing import Optional

from ..capture.optimizer_checks import read_settings
from ..capture.update_capture import ParamUpdate, RuleCopies, capture_update
from ..capture.update_rules import plan_update
from ..errors import Error
from . import locations as tensor_locations
from . import optimizer_state as opt_layout
from .host_scalars import mark_host_scalars
from .lower import lower, mark_role
from .update_copies import lower_copies, reshaped


def update_plan(optimizer, ga, running_mean=False, auto_loss_scaling=False):
    """(Settings, UpdatePlan) of ``optimizer`` for a program accumulating ``ga``
    micro-batches per update."""
    read = read_settings(optimizer, bool(auto_loss_scaling))
    return read, plan_update(optimizer, read, accumulating=ga > 1,
                             running_mean=running_mean)


def max_grad_norm(optimizer):
    """poptorchsim.optim's global-norm clipping threshold, or None."""
    value = getattr(optimizer, "max_grad_norm", None)
    return None if value is None or value == float("inf") else float(value)


@dataclass
class UpdateGraph:
    graph: object
    group_of: list
    flags: list
    slots: list
    layouts: list
    traces: Optional[dict] = None   # the rules traced per parameter layout (capture_update)
    copies: Optional[RuleCopies] = None     # the rules copied per parameter, if copied
    took: Optional[dict] = None     # tensor id -> the parameter whose shape it takes (copies)


def build_update(model, optimizer, capture, plan, shards=None, unit_scale=False, traces=None):
    """The optimizer-update graph for ``optimizer`` over the trainable params.

    A parameter in ``shards`` (name -> R) is updated as one replica's shard:
    a flat tensor of ceil(numel / R) elements.  ``unit_scale``: one
    micro-batch per update on one replica and no loss scaling, so gradients
    need no scaling.  ``traces``: rules already traced for another update
    of the same optimizer (``UpdateGraph.traces``)."""
    shards = shards or {}
    traces = {} if traces is None else traces
    layouts, slots, group_of = _layouts(model, optimizer, capture, plan, shards)
    names = capture.trainable_names
    n_groups = len(optimizer.param_groups)
    update_fx = capture_update(plan, layouts, n_groups, unit_scale, traces)
    grad = "velocity" if plan.into_state else "grad"     # SGD1: the combined tensor
    roles = ([(n, "param") for n in names] + [(f"{grad}/{n}", "accumulator") for n in names]
             + [(f"{s.name}/{n}", "state") for n, (read, _) in zip(names, slots)
                for s in read]
             + [(f"step/{n}", "state") for n in names]
             + [(f"hyper/{g}/{h}", "hyper") for g in range(n_groups) for h in plan.hyper]
             + [(f"hyper/{h}", "hyper") for h in plan.globals]
             + [("grad_scale", "hyper")])
    took: Optional[dict] = {} if isinstance(update_fx, RuleCopies) else None
    graph = (lower_copies(update_fx, "optimizer_update", roles, took)
             if isinstance(update_fx, RuleCopies) else lower(update_fx, "optimizer_update", roles))
    graph = mark_role(graph, "grad_scale", "gradient unscale")
    # bias corrections, lr / bias_correction, the step count: the host's work
    graph = mark_host_scalars(graph, counters=[f"step/{n}" for n in names])
    graph.outputs_overwrite_inputs = True     # variables are updated in place
    return UpdateGraph(graph, group_of, [plan.group_flags(g) for g in range(n_groups)],
                       slots, layouts, traces,
                       update_fx if isinstance(update_fx, RuleCopies) else None, took)


def _layouts(model, optimizer, capture, plan, shards):
    """(layouts, slots, group_of) of the trainable parameters: a
    ``ParamUpdate`` per parameter (a sharded one's a flat shard), its
    (read, written) optimizer state slots, its param group."""
    group_index = {}
    for gi, group in enumerate(optimizer.param_groups):
        for p in group["params"]:
            group_index[id(p)] = gi
    params = dict(model.named_parameters())
    names = capture.trainable_names
    group_of = [group_index[id(params[n])] for n in names]
    slots, layouts = [], []
    for n, grp in zip(names, group_of):
        p = params[n]
        shape = (-(-p.numel() // shards[n]),) if n in shards else tuple(p.shape)
        read, written = opt_layout.slots(plan.kind, plan.group_flags(grp))
        slots.append((read, written))
        layouts.append(ParamUpdate(
            shape, p.dtype, opt_layout.grad_dtype(plan, p.dtype), grp,
            tuple((s.name, opt_layout.slot_dtype(plan, s, p.dtype)) for s in read),
            tuple((s.name, opt_layout.slot_dtype(plan, s, p.dtype)) for s in written)))
    return layouts, slots, group_of


def numeric_update(model, optimizer, capture, plan, shards, update, unit_scale):
    """(update, shards) the engine runs.  LAMB's trust ratio needs the norms
    of whole weights: with sharded state PopART all-reduces the shards'
    partial squared norms, so every replica scales its shard as the whole
    weight would be.  The program (memory, cycles) keeps the sharded
    update; the numerics run the same update over whole weights, which
    gives those values."""
    if not shards or plan.kind != "lamb":
        return update, shards
    whole = _reshaped(model, optimizer, capture, plan, update, unit_scale)
    if whole is not None:
        return whole, {}
    return build_update(model, optimizer, capture, plan, None, unit_scale, update.traces), {}


def _reshaped(model, optimizer, capture, plan, update, unit_scale):
    """The update over whole weights as the sharded ``update`` with its
    parameters' tensors at their whole shapes (``update_copies.reshaped``):
    where both are copies of the same rules, at shapes that are each a
    shape another's rule may stand for (not 0-d, more than one element, so
    that no scalar work or cast changes).  None elsewhere."""
    if update.copies is None or update.took is None:
        return None
    layouts, slots, group_of = _layouts(model, optimizer, capture, plan, {})
    copies = capture_update(plan, layouts, len(optimizer.param_groups), unit_scale,
                            update.traces)
    if not isinstance(copies, RuleCopies) or len(copies.rules) != len(update.copies.rules):
        return None
    for (sub, traced), (their_sub, their_traced), ours, theirs in zip(
            copies.rules, update.copies.rules, layouts, update.layouts):
        if sub is not their_sub or tuple(traced) != tuple(their_traced):
            return None
        if ours.shape != theirs.shape and not (
                len(ours.shape) and len(theirs.shape)
                and math.prod(ours.shape) > 1 and math.prod(theirs.shape) > 1):
            return None
    graph = reshaped(update.graph, update.took, [layout.shape for layout in layouts])
    return UpdateGraph(graph, group_of, update.flags, slots, layouts, update.traces, copies,
                       update.took)


def sharded_state(model, optimizer, capture, settings, replicas, plan=None):
    """{param: replicas} for the parameters whose optimizer state is sharded."""
    params = dict(model.named_parameters())
    numels = {n: params[n].numel() for n in capture.trainable_names}
    names = tensor_locations.sharded_parameters(settings, numels, replicas)
    if plan is not None and plan.kind == "sgd_combined":
        return {}       # the combined variant has no optimizer state to shard
    if names and max_grad_norm(optimizer) is not None:
        raise Error(
            "max_grad_norm needs the global gradient norm, but replicated tensor sharding "
            f"of the optimizer state leaves each replica with a shard of {len(names)} "
            "parameter(s). Drop max_grad_norm, or turn sharding off with "
            "TensorLocationSettings().useReplicatedTensorSharding(False).")
    return {n: replicas for n in names}


def check_loss_scaling(compiled, plan):
    """The step graph is kept when the update changes: a new optimizer's loss
    scaling must be in it, or out of it, as compiled."""
    if plan.loss_scaling != compiled.capture.loss_scaling:
        now = "scales" if compiled.capture.loss_scaling else "does not scale"
        raise Error(
            "Problem with loss scaling. Can not replace a constant value with a non constant "
            f"value. (poptorchsim: the compiled training step {now} the loss, and the new "
            "optimizer's loss_scaling asks the opposite: give it a loss_scaling like the "
            "compiled optimizer's, or wrap the model again)")
