"""Optimizers on the device: what the compiled update depends on, and the
update rules traced into the update graph.

*Reading an optimizer* follows PopTorch's ``_optimizer_attributes.py``:
every hyperparameter is a ``(value, is_const)`` pair.  For
``poptorchsim.optim`` optimizers the attributes passed to the constructor
are variable (``variable_attrs`` says which); for ``torch.optim`` ones an
attribute left at its default is constant (``lr`` never is).  A constant
may not change once compiled (PopART refuses the replacement, and so does
``check_replacement``); a variable one is a float64 device scalar, so a new
value through ``setOptimizer`` needs no recompilation.  Structural choices
(momentum present, nesterov, centered, bias correction, the types the state
is stored in) are compiled in: ``UpdatePlan``.

*Rules* mirror ``torch.optim``'s single-tensor implementations (numerics
equal PyTorch's in float32), with PopART's additions: the gradient arrives
multiplied by the loss scaling and is divided by it (``grad_scale``) before
anything else; state is computed in float32 and stored in its
accumulation type; SGD keeps its velocity multiplied by the velocity scaling
(the loss scaling for the separate variant), and the combined variant
(``use_combined_accum``) follows PopART's SGD1 equations.  Nothing is
mutated: a rule returns the new parameter and its new state.
"""
import math
from dataclasses import dataclass, field

import torch

from ..errors import Error

FP16_MAX = 65500.0

# -- PopTorch's optimizer types ------------------------------------------------------------
FAMILY_OF_TYPE = {"SGD1": "sgd", "SGD2": "sgd", "ADAM": "adam", "ADAMW": "adamw",
                  "ADAMW_NO_BIAS": "adamw", "RMSPROP": "rmsprop",
                  "RMSPROP_CENTERED": "rmsprop", "LAMB": "lamb", "LAMB_NO_BIAS": "lamb"}

UNSUPPORTED = ("Unsupported optimizer type {name}. Types supported are torch.optim.SGD, "
               "torch.optim.Adam, torch.optim.AdamW, torch.optim.RMSprop and their "
               "poptorchsim.optim versions, and poptorchsim.optim.LAMB.")


def optimizer_type(optimizer):
    """PopTorch's type name for ``optimizer`` (``SGD2``, ``ADAMW_NO_BIAS``, ...),
    or PopTorch's assertion."""
    if getattr(type(optimizer), "_poptorchsim_rule", None) == "lamb":
        return "LAMB" if getattr(optimizer, "bias_correction", True) else "LAMB_NO_BIAS"
    if isinstance(optimizer, torch.optim.SGD):
        return "SGD1" if getattr(optimizer, "use_combined_accum", False) else "SGD2"
    if isinstance(optimizer, torch.optim.AdamW) or (
            isinstance(optimizer, torch.optim.Adam)
            and optimizer.defaults.get("decoupled_weight_decay", False)):
        return "ADAMW" if getattr(optimizer, "bias_correction", True) else "ADAMW_NO_BIAS"
    if isinstance(optimizer, torch.optim.Adam):
        return "ADAM"
    if isinstance(optimizer, torch.optim.RMSprop):
        centered = optimizer.param_groups[0]["centered"]
        for i, group in enumerate(optimizer.param_groups):
            assert group["centered"] == centered, (
                "All parameter groups must have the same value for the 'centered' "
                f"attribute (Group 0: {centered} / Group {i}: {group['centered']})")
        return "RMSPROP_CENTERED" if centered else "RMSPROP"
    raise AssertionError(UNSUPPORTED.format(name=type(optimizer).__name__))


# PopART's optimizer classes (``Optimizer::type_s``) behind PopTorch's types
POPART_TYPE = {"SGD1": "SGD", "SGD2": "SGD", "ADAM": "Adam", "ADAMW": "Adam",
               "ADAMW_NO_BIAS": "Adam", "LAMB": "Adam", "LAMB_NO_BIAS": "Adam",
               "RMSPROP": "Adaptive", "RMSPROP_CENTERED": "Adaptive"}


def check_same_type(old, new):
    """PopART's error for a compiled model given an optimizer of another type
    (``Optimizer::validReplacement``; ``old`` and ``new`` are PopTorch's type
    names): the type and mode of the optimizer are compiled into the program."""
    if old == new:
        return
    a, b = POPART_TYPE[old], POPART_TYPE[new]
    if a == b:
        a, b = old, new
    raise Error(f"Can not replace optimizer of type {a} with new optimizer of type {b} "
                f"(poptorchsim: the model was compiled for a {old} update, and setOptimizer "
                f"can change an optimizer's hyperparameters only. To train with {new}, "
                "call destroy() on the model and wrap it again with the new optimizer.)")


def optimizer_kind(optimizer):
    """The optimizer's family: sgd, adam, adamw, rmsprop or lamb."""
    return FAMILY_OF_TYPE[optimizer_type(optimizer)]


# The group attributes PopTorch sends with each optimizer type, PopART's name
# for them in its replacement errors, and when a torch.optim optimizer's value
# counts as constant (equal to the default; never for lr).
GROUP_VARS = {
    "sgd": ("lr", "momentum", "dampening", "weight_decay", "nesterov", "velocity_scaling"),
    "adam": ("lr", "betas", "eps", "weight_decay"),
    "adamw": ("lr", "betas", "eps", "weight_decay"),
    "rmsprop": ("lr", "momentum", "weight_decay", "alpha", "eps"),
    "lamb": ("lr", "weight_decay", "betas", "eps", "max_weight_norm"),
}
POPART_NAMES = {"lr": "learning rates", "weight_decay": "weight decays",
                "momentum": "momentums", "dampening": "dampenings",
                "velocity_scaling": "velocity scalings", "nesterov": "nesterov",
                "eps": "eps", "beta1": "beta1s", "beta2": "beta2s", "alpha": "alphas",
                "max_weight_norm": "mwn", "loss_scaling": "loss scaling"}
_ALWAYS = object()
_NEVER = object()
TORCH_CONSTANT_WHEN = {"lr": _NEVER, "momentum": 0.0, "dampening": 0.0, "eps": 1e-8,
                       "velocity_scaling": 1.0, "max_weight_norm": FP16_MAX,
                       "alpha": _ALWAYS, "nesterov": _ALWAYS, "betas": _ALWAYS}
GROUP_DEFAULTS = {"velocity_scaling": 1.0, "max_weight_norm": FP16_MAX, "momentum": 0.0,
                  "dampening": 0.0, "nesterov": False}


def _torch_constant(name, value, family):
    rule = TORCH_CONSTANT_WHEN.get(name)
    if name == "weight_decay":          # AdamW's default differs from the others'
        rule = 1e-2 if family == "adamw" else 0.0
    if rule is _ALWAYS:
        return True
    if rule is _NEVER or rule is None:
        return False
    return value == rule


def _number(value):
    return value.item() if isinstance(value, torch.Tensor) else value


@dataclass
class Settings:
    """An optimizer as the compiled program sees it (PopTorch's optimizer dict)."""
    type: str                       # PopTorch's optimizer type
    family: str
    # (scope, name) -> (value, is_const); scope: "defaults", a group index or "optimizer"
    values: dict
    attrs: dict                     # optimizer-level settings compiled in
    groups: int = 1
    marked: bool = False            # constness from variable_attrs (poptorchsim.optim)

    def is_variable(self, group, name):
        return not self.values[group, name][1]

    def value(self, group, name):
        return self.values[group, name][0]


def read_settings(optimizer, auto_loss_scaling=False):
    """The ``Settings`` of ``optimizer`` (``auto_loss_scaling``: Options.Training's
    setAutomaticLossScaling, which makes the loss scaling variable)."""
    kind = optimizer_type(optimizer)
    family = FAMILY_OF_TYPE[kind]
    variable_attrs = getattr(optimizer, "variable_attrs", None)
    if variable_attrs is not None and auto_loss_scaling \
            and variable_attrs.isConstant("loss_scaling"):
        variable_attrs.markAsVariable("loss_scaling")     # as PopTorch does

    def pair(name, value):
        value = _number(value)
        if variable_attrs is not None:
            return value, variable_attrs.isConstant(name)
        return value, _torch_constant(name, value, family)

    values = {}
    for scope, group in [("defaults", optimizer.defaults)] + list(
            enumerate(optimizer.param_groups)):
        if group.get("amsgrad", False):
            raise ValueError("Only non-amsgrad Adam/AdamW optimizers are supported.")
        for name in GROUP_VARS[family]:
            value = group.get(name, GROUP_DEFAULTS.get(name))
            if name == "velocity_scaling" and family == "sgd" and kind == "SGD2":
                value = 1.0             # the separate variant uses the loss scaling
            if value is None:
                raise AssertionError(f"Mandatory attribute {name} not found in optimizer "
                                     "group")
            if name == "betas":
                const = pair("betas", value)[1]
                values[scope, "beta1"] = (_number(value[0]), const)
                values[scope, "beta2"] = (_number(value[1]), const)
            else:
                values[scope, name] = pair(name, value)
    loss_scaling = float(getattr(optimizer, "loss_scaling", 1.0))
    if variable_attrs is not None:
        values["optimizer", "loss_scaling"] = (loss_scaling,
                                               variable_attrs.isConstant("loss_scaling"))
    else:
        values["optimizer", "loss_scaling"] = (loss_scaling, loss_scaling == 1.0
                                               and not auto_loss_scaling)
    if math.isnan(loss_scaling):
        raise ValueError("loss_scaling must not be NaN")
    max_grad_norm = getattr(optimizer, "max_grad_norm", None)
    max_grad_norm = None if max_grad_norm is None or max_grad_norm == float("inf") \
        else float(max_grad_norm)
    if max_grad_norm is not None and math.isnan(max_grad_norm):
        raise ValueError("Maximum norm of gradients cannot be NaN")
    fp32 = torch.float32
    attrs = {
        "accum_type": getattr(optimizer, "accum_type", fp32),
        "velocity_accum_type": getattr(optimizer, "velocity_accum_type", fp32),
        "first_order_momentum_accum_type": getattr(optimizer,
                                                   "first_order_momentum_accum_type", fp32),
        "second_order_momentum_accum_type": getattr(optimizer,
                                                    "second_order_momentum_accum_type", fp32),
        "max_grad_norm": max_grad_norm,
        "use_tf_variant": bool(getattr(optimizer, "use_tf_variant", False)),
        "maximize": tuple(bool(g.get("maximize", False)) for g in optimizer.param_groups),
    }
    for name in ("accum_type", "velocity_accum_type", "first_order_momentum_accum_type",
                 "second_order_momentum_accum_type"):
        if attrs[name] not in (torch.float16, torch.float32):
            raise ValueError(f"{name} must be set to either torch.float16 or torch.float32 "
                             f"not {attrs[name]}")
    return Settings(kind, family, values, attrs, len(optimizer.param_groups),
                    variable_attrs is not None)


class AttributeTracker:
    """PopTorch's ``OptimizerAttrTracker``: the attributes an optimizer has
    when the model is wrapped are expected; one that appears later (the
    compiled update ignores it) is reported once, as a warning, or at debug
    level with ``Options.relaxOptimizerAttributesChecks``."""
    _NOT_ATTRIBUTES = ("defaults", "state", "param_groups", "variable_attrs")

    def __init__(self, relaxed=False):
        self.relaxed = relaxed
        self.expected = None            # kind -> names
        self.printed = set()

    @classmethod
    def _found(cls, optimizer):
        own = [k for k in vars(optimizer) if k not in cls._NOT_ATTRIBUTES
               and not k.startswith("_")]
        found = {"default group variable": list(optimizer.defaults),
                 "optimizer attribute": own}
        for i, group in enumerate(optimizer.param_groups):
            found[f"group {i} attribute"] = [k for k in group if k != "params"]
        return found

    def check(self, optimizer):
        import logging
        from ..optim import Optimizer
        bases = type(optimizer).__bases__
        if (torch.optim.Optimizer not in bases and Optimizer not in bases
                and not type(optimizer).__module__.startswith("torch.optim")):  # AdamW(Adam)
            # PopTorch's _toPoptorchOptimizer: a subclass' Python code never runs
            logging.getLogger("poptorchsim").warning(
                "Optimizer `%s` subclassed from classes in poptorch.optim or torch.optim "
                "are unlikely to behave as intended. Poptorch does not run Python "
                "optimizer code directly; but instead uses IPU native optimisers "
                "implemented in PopART.", type(optimizer).__name__)
        found = self._found(optimizer)
        if self.expected is None:
            self.expected = {k: set(v) for k, v in found.items()}
            return
        known = set().union(*self.expected.values())
        log = logging.getLogger("poptorchsim")
        for what, names in found.items():
            extra = [n for n in names if n not in self.expected.get(what, known)]
            if not extra:
                continue
            msg = (f"Ignoring unexpected {what} in {optimizer_type(optimizer)} optimizer: "
                   f"{extra}")
            if msg not in self.printed:
                self.printed.add(msg)
                (log.debug if self.relaxed else log.warning)(msg)


def needs_running_mean(optimizer):
    """PopTorch switches the mean reduction to MeanReductionStrategy.Running for
    a float16 gradient accumulator (not for SGD's combined variant)."""
    return (getattr(optimizer, "accum_type", torch.float32) == torch.float16
            and not getattr(optimizer, "use_combined_accum", False))


def _fix(name, marked):
    if marked:
        return (f"`{name}` is a constant of the compiled program. To change it with "
                "setOptimizer, pass it to the optimizer's constructor or call "
                f"optimizer.variable_attrs.markAsVariable('{name}') before the model is "
                "compiled")
    return (f"`{name}` is a constant of the compiled program: a torch.optim optimizer's "
            "attribute is constant when it has its default value at compile time. To change "
            f"it with setOptimizer, use the poptorch.optim optimizer and pass `{name}` to its "
            "constructor")


def check_replacement(old, new, param_names=None):
    """Raises PopART's error where ``new`` changes what the compiled program holds
    constant: a constant attribute's value, an attribute's constness, or an
    optimizer-level setting (PopART's ``Optimizer::validReplacement``).
    Same optimizer types assumed."""
    for key, (value, const) in old.values.items():
        if key not in new.values:
            continue
        new_value, new_const = new.values[key]
        scope, name = key
        if scope == "defaults":
            where = "Default value is not a valid replacement. "
        elif scope == "optimizer":
            where = ""
        else:
            tensor = (param_names or {}).get(scope, f"of parameter group {scope}")
            where = f"OptimizerValue for tensor {tensor} is not a valid replacement."
        what = POPART_NAMES.get(name, name)
        attr = "betas" if name in ("beta1", "beta2") else name
        if const != new_const:
            raise Error(f"Problem with {what}. {where}Can not replace a constant value with "
                        f"a non constant value. (poptorchsim: {_fix(attr, old.marked)})")
        if const and value != new_value:
            raise Error(f"Problem with {what}. {where}Values are constant but do not "
                        f"match. (poptorchsim: {attr} was {value} when the model was "
                        f"compiled, now {new_value}. {_fix(attr, old.marked)})")
    if old.attrs["max_grad_norm"] != new.attrs["max_grad_norm"]:
        raise Error("Clip norm settings do not match. (poptorchsim: max_grad_norm is "
                    f"compiled in: it was {old.attrs['max_grad_norm']}, now "
                    f"{new.attrs['max_grad_norm']}; wrap the model again to change it)")
    for name in ("accum_type", "velocity_accum_type", "first_order_momentum_accum_type",
                 "second_order_momentum_accum_type", "use_tf_variant", "maximize"):
        if old.attrs[name] != new.attrs[name]:
            raise Error(f"Can not replace the optimizer: its {name} was "
                        f"{old.attrs[name]} when the model was compiled, now "
                        f"{new.attrs[name]}. The types the optimizer state is stored in and "
                        "the variant of the update are compiled in; wrap the model again "
                        "to change them.")


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
        def on(name):
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


def slots(kind, flags):
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
        s = (Slot("exp_avg", "first", "Accl1___"), Slot("exp_avg_sq", "second", "Accl2___"))
        return s, s
    if kind == "rmsprop":
        s = [Slot("square_avg", "first", "Accl1___")]
        if f["momentum"]:
            s.append(Slot("momentum_buffer", "fp32", "Accl3___"))
        if f["centered"]:
            s.append(Slot("grad_avg", "second", "Accl2___"))
        return tuple(s), tuple(s)
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
