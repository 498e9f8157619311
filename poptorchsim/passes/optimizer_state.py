"""The optimizer state's layout on the device, with PopART's names: the
slots each update rule reads and writes (``Accl1___``, ``Accl2___``, ... in
``state_dict()["ipu_state"]``), the types they are stored in, their values
from and back to ``torch.optim``'s state, and the hyperparameter tensors
PopART creates for a weight (``state_dict()["ipu_param"]``)."""
from dataclasses import dataclass

import torch


def group_values(plan, settings, group):
    """The numeric hyperparameters of ``group`` as the update reads them."""
    out = {}
    for name in plan.hyper:
        value = settings.values.get((group, name))
        out[name] = float(value[0]) if value is not None else 0.0
    return out


def loss_scale(settings):
    return float(settings.values["optimizer", "loss_scaling"][0])


# -- state slots --------------------------------------------------------------------------
@dataclass(frozen=True)
class Slot:
    name: str           # the torch state key (and the IR name prefix)
    dtype: str          # "first", "second", "velocity", "weight" or "fp32"
    ipu_name: str       # PopART's prefix, for state_dict()["ipu_state"]


def slots(kind, flags) -> tuple[tuple[Slot, ...], tuple[Slot, ...]]:
    """(slots the update reads, slots it writes) for a parameter of a group
    with ``flags``."""
    f = flags
    if kind == "sgd":
        s = (Slot("momentum_buffer", "velocity", "Accl___"),) if f["momentum"] else ()
        return s, s
    if kind == "sgd_combined":
        out = (Slot("velocity", "weight", "Accl___"),)
        return (out if f["nesterov"] else ()), out
    if kind in ("adam", "adamw", "lamb"):
        moments = (Slot("exp_avg", "first", "Accl1___"), Slot("exp_avg_sq", "second", "Accl2___"))
        return moments, moments
    if kind == "rmsprop":
        rms = [Slot("square_avg", "first", "Accl1___")]
        if f["momentum"]:
            rms.append(Slot("momentum_buffer", "fp32", "Accl3___"))
        if f["centered"]:
            rms.append(Slot("grad_avg", "second", "Accl2___"))
        return tuple(rms), tuple(rms)
    raise AssertionError(kind)


def slot_dtype(plan, slot, param_dtype):
    if slot.dtype == "weight":
        return param_dtype
    if slot.dtype == "fp32":
        return torch.float32
    return dict(plan.dtypes).get(slot.dtype, torch.float32)


def grad_dtype(plan, param_dtype):
    """The type of the update's gradient input: the accumulator's."""
    return dict(plan.dtypes).get("accum") or param_dtype


def _vs(plan, group, values, ls):
    """The velocity scaling of SGD: the loss scaling for the separate variant."""
    if plan.kind == "sgd_combined":
        return values["velocity_scaling"]
    return ls if plan.group_flags(group)["velocity_scaled"] else 1.0


def initial_slot(plan, slot, param, torch_state, values, group, ls, dtype):
    """The device value of ``slot`` for ``param`` from torch's state of it
    (true values, as ``torch.optim`` keeps them), or the initial value."""
    p = param.detach()
    v = torch_state.get(slot.name)
    if plan.kind == "sgd_combined":
        f = plan.group_flags(group)
        if isinstance(v, torch.Tensor):             # already the combined tensor
            return v.detach().to(dtype).clone()
        # PopART precomputes the momentum and weight-decay terms of the next step
        vs, dm = values["velocity_scaling"], values["dampening"]
        out = torch.zeros_like(p, dtype=torch.float32)
        buf = torch_state.get("momentum_buffer")
        if isinstance(buf, torch.Tensor) and f["momentum"]:
            out += vs * values["momentum"] * buf.detach().float()
        if f["weight_decay"]:
            out += (1 - dm) * values["weight_decay"] * vs * p.float()
        return out.to(dtype)
    if isinstance(v, torch.Tensor):
        v = v.detach().float()
        if slot.name == "momentum_buffer" and plan.kind == "sgd":
            v = v * _vs(plan, group, values, ls)
        return v.to(dtype).clone()
    if slot.name == "square_avg" and plan.group_flags(group)["tf_variant"]:
        return torch.ones_like(p, dtype=dtype)      # TensorFlow's RMSprop starts at 1
    return torch.zeros_like(p, dtype=dtype)


def host_slot(plan, slot, value, values, group, ls):
    """(torch state key, value) to keep on the host for a device slot: the
    device's value in its stored type, but SGD's velocity divided by its
    scaling (in float32, where a float16 one could underflow)."""
    if plan.kind == "sgd" and slot.name == "momentum_buffer":
        vs = _vs(plan, group, values, ls)
        if vs != 1.0:
            return slot.name, value.float() / vs
    return slot.name, value.clone()


def popart_params(plan, settings, group, values, ls, reduction):
    """``[(PopART prefix, value)]``: the optimizer tensors PopART creates for a
    weight of ``group`` (``state_dict()["ipu_param"]`` names each
    ``<prefix>specific___<weight>``, as PopTorch inserts every group's values
    per weight): the variable hyperparameters only (a constant one is
    compiled in), the SGD ones as PopART's compound scalars
    (``compoundscalarhelper``).  ``values``: the group's values on the device;
    ``ls``: the loss scaling; ``reduction``: ``(accumulation factor,
    replicas, mean reduction, post strategy)``."""
    af, rf, mean, post = reduction
    acc = af > 1
    post_af = af if acc and mean and post else 1
    post_rf = rf if rf > 1 and mean and post else 1

    def var(*names):
        return any(not settings.values.get((group, n), (None, True))[1] for n in names)

    ls_var = not settings.values["optimizer", "loss_scaling"][1]
    v = values
    out = []

    def add(prefix, value, *depends, ls_dep=False):
        if var(*depends) or (ls_dep and ls_var):
            out.append((prefix, float(value)))

    if plan.kind in ("sgd", "sgd_combined"):
        f = plan.group_flags(group)
        lr, wd, dm, mm = v["lr"], v["weight_decay"], v["dampening"], v["momentum"]
        if not (f["momentum"] or plan.accumulating):            # PopART's SGD0
            add("scaledLearningRate0___", lr * (1 - dm) / (ls * post_af * post_rf),
                "lr", "dampening", ls_dep=True)
            add("weightDecayScaleFactor0___", 1 - lr * (1 - dm) * wd,
                "weight_decay", "lr", "dampening")
            return out
        combined = plan.kind == "sgd_combined"
        vs = v["velocity_scaling"] if combined else ls           # glued to the loss scaling
        vs_names = ("velocity_scaling",) if combined else ()
        vs_ls = not combined
        add("scaledWeightDecay1___", (1 - dm) * wd * vs, "dampening", "weight_decay",
            *vs_names, ls_dep=vs_ls)
        if combined:                                             # SGD1
            rf1 = rf if acc else 1
            rfd = rf if acc and not mean else (1 / rf if not acc and mean else 1)
            afd = af if mean else 1
            add("scaledLearningRate1___", lr / (vs * rf1), "lr", *vs_names)
            add("scaledMomentum1___", mm / rf1, "momentum")
            add("dampeningScaleFactor1___", (1 - dm) * vs * rfd / (ls * afd), "dampening",
                *vs_names, ls_dep=True)
            if f["nesterov"]:
                add("nesterovDampeningScaleFactor1___", post_af / ((1 - dm) * vs * rfd),
                    "dampening", *vs_names, ls_dep=True)
                add("nesterovGradScaleFactor1___", vs * rfd, *vs_names)
        else:                                                    # SGD2
            add("scaledLearningRate2___", lr / vs, "lr", ls_dep=True)
            add("scaledMomentum2___", mm, "momentum")
            add("dampeningScaleFactor2___", (1 - dm) * vs / (ls * post_af * post_rf),
                "dampening", ls_dep=True)
            if f["nesterov"]:
                add("nesterovDampeningScaleFactor2___",
                    post_af * post_rf / ((1 - dm) * vs), "dampening", ls_dep=True)
                add("nesterovGradScaleFactor2___", vs, ls_dep=True)
        if f["nesterov"]:
            add("sgdMomentum___", mm, "momentum")
            add("sgdWeightDecay___", wd, "weight_decay")
        return out
    add("learningRate___", v["lr"], "lr")
    add("weightDecay___", v["weight_decay"], "weight_decay")
    if plan.kind == "rmsprop":                                   # PopART's Adaptive
        add("adaptiveAlpha___", v["alpha"], "alpha")
        add("adaptiveMomentum___", v["momentum"], "momentum")
        add("adaptiveEps___", v["eps"], "eps")
        add("lossScaling___", ls, ls_dep=True)
        add("adaptiveGradientScaling___", 1 / (ls * post_af * post_rf), ls_dep=True)
        return out
    add("adamBeta1___", v["beta1"], "beta1")
    add("adamBeta2___", v["beta2"], "beta2")
    add("adamEps___", v["eps"], "eps")
    add("lossScaling___", ls, ls_dep=True)
    if plan.kind == "lamb":
        add("maxWeightNorm___", v["max_weight_norm"], "max_weight_norm")
    add("adamGradientScaling___", 1 / (ls * post_af * post_rf), ls_dep=True)
    return out


def combined_scale(plan, values, group, mean_factor, ls):
    """SGD1's dampening scale factor: how much of each micro-batch's (loss
    scaled) gradient goes into the combined velocity."""
    f = plan.group_flags(group)
    scale = (1 - values["dampening"]) * values["velocity_scaling"] * mean_factor / ls
    return -scale if f["maximize"] else scale
