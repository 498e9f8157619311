"""The debug lines PopTorch logs when it gives PopART an optimizer
("Updating graph optimizer with ...", then one line per parameter group):
the values the compiled update holds, PopART's names for them, which are
constant, and the types its state is kept in.  PopTorch's tests, and users
at ``POPTORCH_LOG_LEVEL=DEBUG``, read them to see what an optimizer set
(``popart_compiler/source/CompilerImpl.cpp``: ``OptimizerParameters::debug``).

Logged when a model compiles and when ``setOptimizer`` (or a changed
optimizer before a call) gives the device values it did not hold.
"""
import logging

import torch

from ...capture.optimizer_checks import GROUP_VARS

# PopTorch's type name -> the name its debug line prints
_PRINTED_TYPE = {"LAMB_NO_BIAS": "LAMB", "ADAMW_NO_BIAS": "ADAMW",
                 "RMSPROP_CENTERED": "RMSPROP"}

# PopTorch's attribute -> PopART's name in a group; the graph-wide default
# prefixes it with "default" (``nesterov`` keeps its name)
_POPART = {"lr": "learningRate", "weight_decay": "weightDecay", "momentum": "momentum",
           "dampening": "dampening", "velocity_scaling": "velocityScaling",
           "nesterov": "nesterov", "beta1": "beta1", "beta2": "beta2", "eps": "eps",
           "alpha": "alpha", "max_weight_norm": "maxWeightNorm"}


def _number(v):
    """A float as C++'s stream prints it (6 significant digits)."""
    return f"{float(v):g}"


def _dtype(d):
    return "float16" if d == torch.float16 else "float32"


def _names(settings):
    names = []
    for name in GROUP_VARS[settings.family]:
        names += ["beta1", "beta2"] if name == "betas" else [name]
    return names


def _line(settings, scope, default):
    """PopART's parameters of ``scope`` ("defaults" or a group index),
    sorted by name, then the optimizer's types and settings."""
    params = {}
    loss_scaling = settings.values["optimizer", "loss_scaling"]
    for name in _names(settings):
        value = settings.values[scope, name]
        if name == "velocity_scaling" and settings.type == "SGD2":
            value = loss_scaling        # the separate variant's velocity scaling
        popart = _POPART[name]
        if default and name != "nesterov":
            popart = "default" + popart[0].upper() + popart[1:]
        params[popart] = value
    if default:
        params["lossScaling"] = loss_scaling
    a = settings.attrs
    sgd = settings.family == "sgd"
    first = a["velocity_accum_type"] if sgd else a["first_order_momentum_accum_type"]
    second = torch.float32 if sgd else a["second_order_momentum_accum_type"]
    norm = a["max_grad_norm"] if a["max_grad_norm"] is not None else float("inf")
    parts = [_PRINTED_TYPE.get(settings.type, settings.type)]
    parts += [f"{k}={_number(v)}{' (const)' if const else ''}"
              for k, (v, const) in sorted(params.items())]
    parts += [f"accumType={_dtype(a['accum_type'])}",
              f"firstOrderMomentumAccumType={_dtype(first)}",
              f"secondOrderMomentumAccumType={_dtype(second)}",
              f"useTfVariant={int(a['use_tf_variant'])}", f"maxGradNorm={_number(norm)}"]
    return ", ".join(parts)


def lines(settings, group_params):
    """The graph's line and each group's, for ``settings``
    (``optimizer_checks.Settings``); ``group_params``: each group's
    parameter names."""
    out = [f"Updating graph optimizer with {_line(settings, 'defaults', True)}"]
    for g, names in enumerate(group_params):
        out.append(f"Updating group {g} optimizer with {_line(settings, g, False)} "
                   f"for (tensors affected [{', '.join(names)}])")
    return out


def log(settings, group_params):
    logger = logging.getLogger("poptorchsim")
    if logger.isEnabledFor(logging.DEBUG):
        for line in lines(settings, group_params):
            logger.debug(line)
