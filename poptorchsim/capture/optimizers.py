"""Optimizer updates as pure tensor functions, traced into the update graph.

Each rule mirrors the single-tensor implementation in ``torch.optim``, but
takes numeric hyperparameters (lr, betas, momentum, ...) as 0-d float64
tensors, so a new learning rate through ``setOptimizer`` needs no
recompilation: PopTorch streams these "variable" optimizer scalars to the IPU
the same way.  Structural choices (momentum on or off, nesterov, centered,
maximize) are Python booleans fixed at compile time, like PopTorch's
"constant" attributes.  Nothing is mutated: a rule returns the new parameter
and its new state tensors.
"""
import torch

# name -> (state slot names, numeric hyperparameter names, rule)
RULES = {}


def _step(param, direction, size):
    """``param - size * direction`` in one pass (``size`` a 0-d tensor), as
    torch.optim's ``param.add_(direction, alpha=-size)``."""
    return torch.addcmul(param, direction, -size)


def _rule(name, state, hyper):
    def register(fn):
        RULES[name] = (state, hyper, fn)
        return fn
    return register


@_rule("sgd", state=("momentum_buffer",),
       hyper=("lr", "momentum", "dampening", "weight_decay"))
def sgd(param, grad, state, h, step, flags):
    (buf,) = state
    if flags["maximize"]:
        grad = -grad
    if flags["weight_decay"]:
        grad = grad + h["weight_decay"] * param
    if flags["momentum"]:
        if flags["dampening"]:
            accumulated = buf * h["momentum"] + (1 - h["dampening"]) * grad
            # torch copies the first gradient into the buffer undamped
            accumulated = torch.where(step > 1, accumulated, grad)
        else:       # (1 - 0) * grad is grad: no multiply
            accumulated = buf * h["momentum"] + grad
        buf = accumulated
        grad = grad + h["momentum"] * buf if flags["nesterov"] else buf
    return _step(param, grad, h["lr"]), (buf,)


def _adam_like(param, grad, state, h, step, flags, decoupled):
    exp_avg, exp_avg_sq = state
    if flags["maximize"]:
        grad = -grad
    if flags["weight_decay"]:
        if decoupled:
            param = param * (1 - h["lr"] * h["weight_decay"])
        else:
            grad = grad + h["weight_decay"] * param
    beta1, beta2 = h["beta1"], h["beta2"]
    exp_avg = exp_avg + (grad - exp_avg) * (1 - beta1)
    exp_avg_sq = exp_avg_sq * beta2 + (1 - beta2) * grad * grad
    bias_correction1 = 1 - beta1 ** step
    bias_correction2 = 1 - beta2 ** step
    step_size = h["lr"] / bias_correction1
    denom = exp_avg_sq.sqrt() / bias_correction2.sqrt() + h["eps"]
    return _step(param, exp_avg / denom, step_size), (exp_avg, exp_avg_sq)


@_rule("adam", state=("exp_avg", "exp_avg_sq"),
       hyper=("lr", "beta1", "beta2", "eps", "weight_decay"))
def adam(param, grad, state, h, step, flags):
    return _adam_like(param, grad, state, h, step, flags, decoupled=False)


@_rule("adamw", state=("exp_avg", "exp_avg_sq"),
       hyper=("lr", "beta1", "beta2", "eps", "weight_decay"))
def adamw(param, grad, state, h, step, flags):
    return _adam_like(param, grad, state, h, step, flags, decoupled=True)


@_rule("rmsprop", state=("square_avg", "momentum_buffer", "grad_avg"),
       hyper=("lr", "alpha", "eps", "weight_decay", "momentum"))
def rmsprop(param, grad, state, h, step, flags):
    square_avg, buf, grad_avg = state
    if flags["maximize"]:
        grad = -grad
    if flags["weight_decay"]:
        grad = grad + h["weight_decay"] * param
    alpha = h["alpha"]
    square_avg = square_avg * alpha + (1 - alpha) * grad * grad
    if flags["centered"]:
        grad_avg = grad_avg + (grad - grad_avg) * (1 - alpha)
        avg = (square_avg - grad_avg * grad_avg).sqrt() + h["eps"]
    else:
        avg = square_avg.sqrt() + h["eps"]
    if flags["momentum"]:
        buf = buf * h["momentum"] + grad / avg
        return _step(param, buf, h["lr"]), (square_avg, buf, grad_avg)
    return _step(param, grad / avg, h["lr"]), (square_avg, buf, grad_avg)


def optimizer_kind(optimizer):
    """The rule name for a torch optimizer, or PopTorch's assertion."""
    kinds = [(torch.optim.AdamW, "adamw"), (torch.optim.Adam, "adam"),
             (torch.optim.SGD, "sgd"), (torch.optim.RMSprop, "rmsprop")]
    for cls, name in kinds:
        if isinstance(optimizer, cls):
            return name
    raise AssertionError(
        f"Unsupported optimizer type {type(optimizer).__name__}. Types supported "
        "are torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, "
        "torch.optim.RMSprop and their poptorchsim.optim versions.")


def group_settings(kind, group):
    """(numeric hyperparameters, structural flags) of one param_group."""
    if group.get("amsgrad", False):
        raise ValueError("Only non-amsgrad Adam/AdamW optimizers are supported.")
    g = dict(group)
    if kind in ("adam", "adamw"):
        g["beta1"], g["beta2"] = g["betas"]
    values = {}
    for name in RULES[kind][1]:
        value = g.get(name, 0.0)
        if isinstance(value, torch.Tensor):
            value = value.item()
        values[name] = float(value)
    flags = {
        "maximize": bool(g.get("maximize", False)),
        "weight_decay": float(g.get("weight_decay", 0.0)) != 0.0,
        "momentum": float(g.get("momentum", 0.0)) != 0.0,
        "dampening": float(g.get("dampening", 0.0)) != 0.0,
        "nesterov": bool(g.get("nesterov", False)),
        "centered": bool(g.get("centered", False)),
    }
    return values, flags
