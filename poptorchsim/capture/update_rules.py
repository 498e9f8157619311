"""The optimizer update's rules, traced into the update graph
(``capture/update_capture.py``), and the ``UpdatePlan`` that
says which rule, with which flags and state types, the graph is traced for.

What PopTorch reads from an optimizer and refuses when it changes
(``Settings``, ``read_settings``, ``check_replacement``) is in
``capture/optimizer_checks.py``; the optimizer state's layout (its slots,
their types and PopART's names for them) in ``passes/optimizer_state.py``.

Structural choices (momentum present, nesterov, centered, bias correction,
the types the state is stored in) are compiled in: ``UpdatePlan``.

*Rules* mirror ``torch.optim``'s single-tensor implementations (numerics
equal PyTorch's in float32), with PopART's additions: the gradient arrives
multiplied by the loss scaling and is divided by it (``grad_scale``) before
anything else; state is computed in float32 and stored in its
accumulation type; SGD keeps its velocity multiplied by the velocity scaling
(the loss scaling for the separate variant), and the combined variant
(``use_combined_accum``) follows PopART's SGD1 equations.  Nothing is
mutated: a rule returns the new parameter and its new state.
"""
from dataclasses import dataclass, field

import torch

from ..errors import Error


# -- the compiled update -----------------------------------------------------------------
@dataclass(frozen=True)
class UpdatePlan:
    """What the traced update graph depends on (comparable: a different plan
    means a different graph)."""
    kind: str                      # the rule
    type: str                      # PopTorch's optimizer type
    flags: tuple                   # per group: tuple of (flag, value)
    dtypes: tuple                  # (slot dtype key, dtype) pairs
    loss_scaling: bool             # scaled loss and gradients
    max_grad_norm: float = None
    accumulating: bool = False     # gradient accumulation (accumulators of accum_type)
    running_mean: bool = False     # MeanReductionStrategy.Running
    hyper: tuple = ()              # per-group hyperparameter names
    globals: tuple = ()            # optimizer-level ones: the loss scaling, where a rule reads it

    def group_flags(self, group):
        return dict(self.flags[group])

    @property
    def into_state(self):
        """SGD's combined variant without nesterov: every micro-batch's gradient
        is added straight to the combined velocity, which the update receives
        as its gradient input."""
        return self.kind == "sgd_combined" and not any(
            dict(f)["nesterov"] for f in self.flags)


def plan_update(optimizer, settings, *, accumulating=False, running_mean=False):
    """The ``UpdatePlan`` for ``optimizer`` (read into ``settings``)."""
    family, kind = settings.family, settings.family
    ls_value, ls_const = settings.values["optimizer", "loss_scaling"]
    loss_scaling = (not ls_const) or ls_value != 1.0
    flags = []
    for g in range(settings.groups):
        def on(name, g=g):
            value, const = settings.values.get((g, name), (0.0, True))
            return (not const) or value != 0.0
        f = {"maximize": settings.attrs["maximize"][g],
             "weight_decay": on("weight_decay"),
             "momentum": on("momentum") if family in ("sgd", "rmsprop") else False,
             "dampening": on("dampening") if family == "sgd" else False,
             "nesterov": bool(settings.value(g, "nesterov")) if family == "sgd" else False,
             "centered": settings.type == "RMSPROP_CENTERED",
             "bias_correction": settings.type not in ("ADAMW_NO_BIAS", "LAMB_NO_BIAS"),
             "tf_variant": settings.attrs["use_tf_variant"],
             "velocity_scaled": False}
        flags.append(f)
    if settings.type == "SGD1" and (accumulating or any(f["momentum"] for f in flags)):
        kind = "sgd_combined"
        running_mean = False        # PopTorch keeps the Post strategy for it
        if settings.attrs["max_grad_norm"] is not None and not any(
                f["nesterov"] for f in flags):
            raise Error("max_grad_norm needs the gradients, but SGD's combined variant "
                        "(use_combined_accum=True) adds them straight into its velocity "
                        "tensor: use use_combined_accum=False, or drop max_grad_norm.")
    if kind == "sgd":
        for f in flags:
            f["velocity_scaled"] = loss_scaling and f["momentum"]
    a = settings.attrs
    dtypes = {"accum": a["accum_type"] if accumulating else None}
    if kind == "sgd":
        dtypes["velocity"] = a["velocity_accum_type"]
    elif kind in ("adam", "adamw", "lamb", "rmsprop"):
        dtypes["first"] = a["first_order_momentum_accum_type"]
        dtypes["second"] = a["second_order_momentum_accum_type"]
    if kind == "sgd_combined":
        dtypes["accum"] = None      # PopTorch ignores accum_type and velocity_accum_type
    hyper = RULES[kind].hyper
    return UpdatePlan(kind, settings.type, tuple(tuple(sorted(f.items())) for f in flags),
                      tuple(sorted(((k, v) for k, v in dtypes.items() if v is not None),
                                   key=lambda kv: kv[0])),
                      loss_scaling, a["max_grad_norm"], accumulating, running_mean, hyper,
                      ("loss_scaling",) if any(f["velocity_scaled"] for f in flags) else ())


# -- rules ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class Rule:
    hyper: tuple
    fn: object = field(compare=False)
    scale_grad: bool = True


RULES = {}


def _rule(name, hyper, scale_grad=True):
    def register(fn):
        RULES[name] = Rule(tuple(hyper), fn, scale_grad)
        return fn
    return register


def _step(param, direction, size):
    """``param - size * direction`` in one pass (``size`` a 0-d tensor), as
    torch.optim's ``param.add_(direction, alpha=-size)``."""
    return torch.addcmul(param, direction, -size)


# torch.optim's in-place arithmetic rounds as these do, so that the traced
# update equals it bit for bit: ``a.add(b, alpha=s)`` and ``addcmul`` round
# once (a fused multiply-add), ``lerp`` is a fused multiply-add, ``addcdiv``
# computes ``a + (s * b) / c``.  Written as separate multiplies and adds the
# update differs by an ulp a step, which unstable models amplify.
def _add_scaled(a, b, s):
    """``a + s * b`` as ``a.add(b, alpha=s)``."""
    return torch.addcmul(a, b, s)


def _add_square(a, b, s):
    """``a + s * b * b`` as ``a.addcmul(b, b, value=s)``."""
    return torch.addcmul(a, b * s, b)


def _add_quotient(a, b, c, s):
    """``a + s * b / c`` as ``a.addcdiv(b, c, value=s)``."""
    return a + s * b / c


@_rule("sgd", ("lr", "momentum", "dampening", "weight_decay"))
def sgd(param, grad, state, h, step, flags):
    if flags["maximize"]:
        grad = -grad
    if flags["weight_decay"]:
        grad = _add_scaled(grad, param, h["weight_decay"])
    if flags["momentum"]:
        buf = state["momentum_buffer"]
        if flags["velocity_scaled"]:        # stored multiplied by the loss scaling
            buf = buf / h["loss_scaling"]
        if flags["dampening"]:
            accumulated = _add_scaled(buf * h["momentum"], grad, 1 - h["dampening"])
            # torch copies the first gradient into the buffer undamped
            accumulated = torch.where(step > 1, accumulated, grad)
        else:       # (1 - 0) * grad is grad: no multiply
            accumulated = buf * h["momentum"] + grad
        buf = accumulated
        grad = _add_scaled(grad, buf, h["momentum"]) if flags["nesterov"] else buf
        if flags["velocity_scaled"]:
            state = {"momentum_buffer": buf * h["loss_scaling"]}
        else:
            state = {"momentum_buffer": buf}
    return _step(param, grad, h["lr"]), state


@_rule("sgd_combined", ("lr", "momentum", "dampening", "weight_decay", "velocity_scaling"),
       scale_grad=False)
def sgd_combined(param, grad, state, h, step, flags):
    """PopART's SGD1.  Without nesterov, ``grad`` is the combined tensor after
    this step's micro-batches were added to it: ``vs * velocity``.  With
    nesterov, it is the accumulated gradient (still loss scaled) and the
    velocity comes in ``state``."""
    vs = h["velocity_scaling"]
    if flags["nesterov"]:
        g = grad * h["grad_scale"]
        if flags["maximize"]:
            g = -g
        u = state["velocity"] + (1 - h["dampening"]) * vs * g
        direction = vs * (g + h["weight_decay"] * param) if flags["weight_decay"] else vs * g
        direction = direction + h["momentum"] * u
    else:
        u = direction = grad
    new = _step(param, direction, h["lr"] / vs)
    # the momentum and weight-decay terms of the next step, added at once
    nxt = u * h["momentum"] if flags["momentum"] else torch.zeros_like(u)
    if flags["weight_decay"]:
        nxt = nxt + ((1 - h["dampening"]) * h["weight_decay"] * vs) * new
    return new, {"velocity": nxt}


def _adam_like(param, grad, state, h, step, flags, decoupled):
    exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
    if flags["maximize"]:
        grad = -grad
    if flags["weight_decay"]:
        if decoupled:
            param = param * (1 - h["lr"] * h["weight_decay"])
        else:
            grad = _add_scaled(grad, param, h["weight_decay"])
    beta1, beta2 = h["beta1"], h["beta2"]
    exp_avg = torch.lerp(exp_avg, grad, (1 - beta1).to(exp_avg.dtype))
    exp_avg_sq = _add_square(exp_avg_sq * beta2, grad, 1 - beta2)
    new_state = {"exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq}
    if not flags["bias_correction"]:
        denom = exp_avg_sq.sqrt() + h["eps"]
        return _add_quotient(param, exp_avg, denom, -h["lr"]), new_state
    bias_correction1 = 1 - beta1 ** step
    bias_correction2 = 1 - beta2 ** step
    step_size = h["lr"] / bias_correction1
    denom = exp_avg_sq.sqrt() / bias_correction2.sqrt() + h["eps"]
    return _add_quotient(param, exp_avg, denom, -step_size), new_state


@_rule("adam", ("lr", "beta1", "beta2", "eps", "weight_decay"))
def adam(param, grad, state, h, step, flags):
    return _adam_like(param, grad, state, h, step, flags, decoupled=False)


@_rule("adamw", ("lr", "beta1", "beta2", "eps", "weight_decay"))
def adamw(param, grad, state, h, step, flags):
    return _adam_like(param, grad, state, h, step, flags, decoupled=True)


@_rule("rmsprop", ("lr", "alpha", "eps", "weight_decay", "momentum"))
def rmsprop(param, grad, state, h, step, flags):
    new_state = {}
    if flags["maximize"]:
        grad = -grad
    if flags["weight_decay"]:
        grad = _add_scaled(grad, param, h["weight_decay"])
    alpha = h["alpha"]
    square_avg = _add_square(state["square_avg"] * alpha, grad, 1 - alpha)
    new_state["square_avg"] = square_avg
    if flags["centered"]:
        grad_avg = torch.lerp(state["grad_avg"], grad, (1 - alpha).to(grad.dtype))
        new_state["grad_avg"] = grad_avg
        square_avg = torch.addcmul(square_avg, -grad_avg, grad_avg)
    if flags["tf_variant"]:         # eps inside the square root
        avg = (square_avg + h["eps"]).sqrt()
    else:
        avg = square_avg.sqrt() + h["eps"]
    if flags["momentum"]:
        if flags["tf_variant"]:     # the learning rate folded into the momentum
            buf = state["momentum_buffer"] * h["momentum"] + h["lr"] * (grad / avg)
            new_state["momentum_buffer"] = buf
            return param - buf, new_state
        buf = state["momentum_buffer"] * h["momentum"] + grad / avg
        new_state["momentum_buffer"] = buf
        return _step(param, buf, h["lr"]), new_state
    return _add_quotient(param, grad, avg, -h["lr"]), new_state


@_rule("lamb", ("lr", "beta1", "beta2", "eps", "weight_decay", "max_weight_norm"))
def lamb(param, grad, state, h, step, flags):
    """PopTorch's LAMB (``poptorchsim.optim.LAMB.step``), the trust ratio
    min(||w||, max_weight_norm) / ||u|| computed in float32."""
    beta1, beta2 = h["beta1"], h["beta2"]
    exp_avg = state["exp_avg"] * beta1 + (1 - beta1) * grad
    exp_avg_sq = state["exp_avg_sq"] * beta2 + (1 - beta2) * grad * grad
    if flags["bias_correction"]:
        denom = exp_avg_sq.sqrt() / (1 - beta2 ** step).sqrt() + h["eps"]
        update = (exp_avg / (1 - beta1 ** step)) / denom
    else:
        update = exp_avg / (exp_avg_sq.sqrt() + h["eps"])
    if flags["weight_decay"]:
        update = update + h["weight_decay"] * param
    r1 = param.pow(2).sum().sqrt()
    r1 = torch.clamp(r1, max=h["max_weight_norm"].to(r1.dtype))
    r2 = update.pow(2).sum().sqrt()
    ones = torch.ones_like(r1)
    trust = torch.where((r1 == 0) | (r2 == 0), ones, r1 / torch.where(r2 == 0, ones, r2))
    return _step(param, update * trust, h["lr"]), {"exp_avg": exp_avg,
                                                     "exp_avg_sq": exp_avg_sq}
