"""What PopTorch reads from an optimizer, and what it refuses when a compiled
model is given another one (``setOptimizer``).

*Reading an optimizer* follows PopTorch's ``_optimizer_attributes.py``:
every hyperparameter is a ``(value, is_const)`` pair.  For
``poptorchsim.optim`` optimizers the attributes passed to the constructor
are variable (``variable_attrs`` says which); for ``torch.optim`` ones an
attribute left at its default is constant (``lr`` never is).  A constant
may not change once compiled (PopART refuses the replacement, and so does
``check_replacement``); a variable one is a float64 device scalar, so a new
value through ``setOptimizer`` needs no recompilation.  The structure
compiled in is ``capture/update_rules.UpdatePlan``.
"""
import logging
import math
from dataclasses import dataclass

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
        bases = type(optimizer).__bases__
        # poptorchsim.optim.Optimizer, known by the marker its own class body
        # sets (runtime does not import the face)
        poptorch_base = any(vars(b).get("_poptorchsim_optimizer_base") for b in bases)
        if (torch.optim.Optimizer not in bases and not poptorch_base
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
