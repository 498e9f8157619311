"""``poptorchsim.optim``: PopTorch's optimizers.

SGD, Adam, AdamW and RMSprop are ``torch.optim`` optimizers with PopTorch's
extra arguments; LAMB is PopTorch's own (with a CPU ``step()``).  On the
simulated IPU they run as the compiled update (``capture/update_rules.py``):

* ``loss_scaling`` multiplies the loss before the backward pass and divides
  the gradients in the update, so float16 gradients underflow and overflow
  as they do on an IPU;
* ``accum_type`` / ``first_order_momentum_accum_type`` /
  ``second_order_momentum_accum_type`` / ``velocity_accum_type`` are the
  types the gradient accumulators and the optimizer state are stored in;
* ``use_combined_accum`` and ``velocity_scaling`` select and scale SGD's
  combined accumulator-and-velocity tensor.

As in PopTorch, the arguments passed to a constructor are *variable*
attributes (a new value through ``setOptimizer`` needs no recompilation)
and the others *constant*; ``variable_attrs`` changes that before
compiling.  ``state_dict()`` of an optimizer used by a training model holds
the device's optimizer state (``ipu_state``) and ``load_state_dict`` sends a
saved one back.  Behaviour and texts follow PopTorch's ``python/optim.py``.
"""
import logging
import math
import weakref
from typing import Any, Callable, Dict, Iterable, List, Optional, Tuple

import torch

logger = logging.getLogger("poptorchsim")

ACCUM_TYPES_ERROR = "Accumulation types must be either torch.float32 or torch.float16"
_ACCUM_TYPES = (torch.float16, torch.float32)
FP16_MAX = 65500.0          # LAMB's default max_weight_norm (PopTorch's "FP16 Max")


class VariableAttributes:
    """Which attributes of an optimizer are variable (changed through
    ``setOptimizer`` without recompiling) and which are constant (compiled
    into the program).  Every PopTorch optimizer has one as ``variable_attrs``.

    >>> opt = poptorch.optim.SGD(params, lr=0.01)
    >>> opt.variable_attrs.isConstant("lr")
    False
    """

    def __init__(self, variable_attributes: List[str], allowed_attributes: List[str]) -> None:
        self._variable_attributes = list(variable_attributes)
        self._allowed_attributes = list(allowed_attributes)

    def isConstant(self, attr: str) -> bool:
        """True if ``attr`` is constant."""
        return attr not in self._variable_attributes

    def markAsConstant(self, attr: str) -> None:
        """Compile ``attr`` into the program (before compiling)."""
        self._check(attr)
        self._variable_attributes = [a for a in self._variable_attributes if a != attr]

    def markAsVariable(self, attr: str) -> None:
        """Make ``attr`` changeable through ``setOptimizer`` (before compiling)."""
        self._check(attr)
        self._variable_attributes.append(attr)

    def _check(self, attr):
        assert attr in self._allowed_attributes, (
            f"Unknown attribute {attr}, allowed values: {self._allowed_attributes}")

    def __repr__(self):
        return f"VariableAttributes(variable={sorted(set(self._variable_attributes))})"


def _variables(all_args: Dict[str, Any], child_only=()):
    """(arguments for the torch parent, names passed explicitly): arguments
    given (not None) are variable, as in PopTorch."""
    args = {k: v for k, v in all_args.items() if k not in ("self", "__class__")}
    passed = [k for k, v in args.items() if v is not None]
    parent = {k: args[k] for k in passed if k not in child_only}
    return parent, passed


def _check_types(*types):
    for t in types:
        assert t in _ACCUM_TYPES, ACCUM_TYPES_ERROR


class Optimizer:
    """What every PopTorch optimizer adds to its torch base: the device's
    optimizer state behind ``state_dict`` / ``load_state_dict``.

    ``state_dict()`` returns ``{"ipu_state": {name: tensor}, "ipu_param":
    {name: tensor}, "state": ..., "param_groups": ...}``: the device state
    (read from the device first when the optimizer belongs to a compiled
    training model) next to torch's own state dict, so learning-rate
    schedulers keep working.  ``load_state_dict`` takes such a dict only."""

    # Marks this class for capture.optimizer_checks.AttributeTracker: a direct
    # subclass of it is one of PopTorch's optimizers (runtime may not import the face)
    _poptorchsim_optimizer_base = True

    # Attributes PopTorch stores on the optimizer, not in param_groups.
    _child_vars: List[str] = ["loss_scaling"]
    _child_only: List[str] = []
    _group_vars: List[str] = []

    def __init__(self):
        self._state_dict = {"ipu_state": None, "ipu_param": None}
        self.ipu_state_is_dirty = False      # the state must go to the device
        self.host_state_is_dirty = False     # the device holds newer state
        self._executor_ref = None            # the training model using it (weak)

    def state_dict(self):
        executor = self._executor_ref() if self._executor_ref is not None else None
        # a state given to load_state_dict and not sent yet is returned as given
        # (PopTorch reads the device only when it holds newer state)
        if executor is not None and not self.ipu_state_is_dirty:
            executor._read_optimizer_state(self)
        return self.get_state_dict()

    def load_state_dict(self, state):
        # torch's state dict too, so that LR schedulers work
        torch.optim.Optimizer.load_state_dict(self, state)
        self.set_state_dict(state)

    def get_state_dict(self):
        return {**self._state_dict, **torch.optim.Optimizer.state_dict(self)}

    def set_state_dict(self, state):
        if not state:
            raise RuntimeError("Cannot load optimizer state dictionary because it is empty.")
        if not ("ipu_state" in state and "ipu_param" in state):
            raise RuntimeError("Only IPU optimizer states can be loaded onto the IPU.")
        self._state_dict = {"ipu_state": state["ipu_state"], "ipu_param": state["ipu_param"]}
        self.ipu_state_is_dirty = self.has_state()
        self.host_state_is_dirty = False

    def has_state(self):
        return (self._state_dict.get("ipu_state") is not None
                and self._state_dict.get("ipu_param") is not None)

    # -- pickling and copying keep PopTorch's attributes ------------------------------
    _NOT_PICKLED = ("_executor_ref", "defaults", "state", "param_groups")

    def __getstate__(self) -> Dict[str, Any]:
        executor = self._executor_ref() if self._executor_ref is not None else None
        if executor is not None:            # the device holds the newest state
            executor._read_optimizer_state(self)
        state = torch.optim.Optimizer.__getstate__(self)
        state.update({k: v for k, v in self.__dict__.items()
                      if k not in self._NOT_PICKLED and not k.startswith("_optimizer_")
                      and not k.endswith("_hooks")})
        state["ipu_state_is_dirty"] = self.has_state()
        state["host_state_is_dirty"] = False
        return state

    def __setstate__(self, state):
        torch.optim.Optimizer.__setstate__(self, state)
        self.__dict__.setdefault("_state_dict", {"ipu_state": None, "ipu_param": None})
        self.__dict__.setdefault("ipu_state_is_dirty", False)
        self.__dict__.setdefault("host_state_is_dirty", False)
        # torch's load_state_dict calls __setstate__ too: the model stays
        self.__dict__.setdefault("_executor_ref", None)

    def _use_on_device(self, executor):
        """``executor`` (a training model) reads and writes this optimizer's state."""
        self._executor_ref = None if executor is None else weakref.ref(executor)


class SGD(Optimizer, torch.optim.SGD):
    """Stochastic gradient descent with optional momentum, loss scaling and
    velocity scaling: ``torch.optim.SGD`` plus PopTorch's arguments.

    Two variants, mathematically identical to PyTorch in float32:

    * separate (``use_combined_accum=False``, the default): a gradient
      accumulator (``accum_type``) and a velocity (``velocity_accum_type``)
      per weight; the velocity is kept multiplied by ``loss_scaling``
      (PopTorch ties velocity scaling to loss scaling for this variant, and
      ignores ``velocity_scaling`` with a warning);
    * combined (``use_combined_accum=True``): one tensor per weight, of the
      weight's type, holds the velocity multiplied by ``velocity_scaling``;
      every micro-batch adds its gradient (scaled by ``velocity_scaling /
      loss_scaling``) to it, and the momentum and weight-decay terms of the
      next step are added right after the weight update.  ``accum_type`` and
      ``velocity_accum_type`` are ignored, and there is no optimizer state
      (``setOptimizerLocation`` has no effect).

    With momentum 0 and no gradient accumulation the plain SGD update is used
    and ``use_combined_accum``, ``accum_type`` and ``velocity_accum_type`` are
    ignored.
    """
    _child_vars = ["loss_scaling"]
    _child_only = _child_vars + ["velocity_scaling", "use_combined_accum", "accum_type",
                                 "velocity_accum_type", "max_grad_norm"]
    _group_vars = ["lr", "momentum", "dampening", "weight_decay", "nesterov",
                   "velocity_scaling"]

    def __init__(self,
                 params: Iterable,
                 lr: float,
                 momentum: Optional[float] = None,
                 dampening: Optional[float] = None,
                 weight_decay: Optional[float] = None,
                 nesterov: Optional[bool] = None,
                 maximize: Optional[bool] = None,
                 foreach: Optional[bool] = None,
                 differentiable: Optional[bool] = None,
                 loss_scaling: Optional[float] = None,
                 velocity_scaling: Optional[float] = None,
                 use_combined_accum: Optional[bool] = None,
                 accum_type: Optional[torch.dtype] = None,
                 velocity_accum_type: Optional[torch.dtype] = None,
                 max_grad_norm: Optional[float] = None) -> None:
        parent_args, variables = _variables(locals(), SGD._child_only)
        Optimizer.__init__(self)
        torch.optim.SGD.__init__(self, **parent_args)
        self.loss_scaling = 1.0 if loss_scaling is None else loss_scaling
        self.use_combined_accum = bool(use_combined_accum)
        if velocity_scaling is None:
            velocity_scaling = 1.0
        elif not self.use_combined_accum:
            logger.warning("velocity_scaling value ignored when using the separate variant "
                           "(use_combined_accum=False). In future, this will lead to an "
                           "error. Please update your code.")
        if self.use_combined_accum:      # per group, like lr
            self.defaults["velocity_scaling"] = velocity_scaling
            for group in self.param_groups:
                group.setdefault("velocity_scaling", velocity_scaling)
        accum_type = torch.float32 if accum_type is None else accum_type
        velocity_accum_type = (torch.float32 if velocity_accum_type is None
                               else velocity_accum_type)
        _check_types(accum_type, velocity_accum_type)
        self.accum_type = accum_type
        self.velocity_accum_type = velocity_accum_type
        self.max_grad_norm = float("inf") if max_grad_norm is None else max_grad_norm
        self.variable_attrs = VariableAttributes(variables,
                                                 list(self.defaults) + SGD._child_vars)


class Adam(Optimizer, torch.optim.Adam):
    """Adam with optional loss scaling and accumulation types:
    ``torch.optim.Adam`` plus PopTorch's arguments.  AMSGrad is not supported."""
    _child_vars = ["loss_scaling"]
    _child_only = _child_vars + ["accum_type", "first_order_momentum_accum_type",
                                 "second_order_momentum_accum_type", "max_grad_norm"]
    _group_vars = ["lr", "betas", "eps", "weight_decay", "amsgrad"]

    def __init__(self,
                 params: Iterable,
                 lr: Optional[float] = None,
                 betas: Optional[Tuple[float, float]] = None,
                 eps: Optional[float] = None,
                 weight_decay: Optional[float] = None,
                 amsgrad: Optional[bool] = None,
                 foreach: Optional[bool] = None,
                 maximize: Optional[bool] = None,
                 capturable: Optional[bool] = None,
                 differentiable: Optional[bool] = None,
                 fused: Optional[bool] = None,
                 loss_scaling: Optional[float] = None,
                 accum_type: Optional[torch.dtype] = None,
                 first_order_momentum_accum_type: Optional[torch.dtype] = None,
                 second_order_momentum_accum_type: Optional[torch.dtype] = None,
                 max_grad_norm: Optional[float] = None) -> None:
        parent_args, variables = _variables(locals(), Adam._child_only)
        if amsgrad:
            raise ValueError("Only non-amsgrad Adam/AdamW optimizers are supported.")
        Optimizer.__init__(self)
        torch.optim.Adam.__init__(self, **parent_args)
        _set_adam_attributes(self, loss_scaling, accum_type, first_order_momentum_accum_type,
                             second_order_momentum_accum_type, max_grad_norm)
        self.variable_attrs = VariableAttributes(variables,
                                                 list(self.defaults) + Adam._child_vars)


def _set_adam_attributes(opt, loss_scaling, accum_type, first, second, max_grad_norm):
    opt.loss_scaling = 1.0 if loss_scaling is None else loss_scaling
    accum_type = torch.float32 if accum_type is None else accum_type
    first = torch.float32 if first is None else first
    second = torch.float32 if second is None else second
    _check_types(accum_type, first, second)
    opt.accum_type = accum_type
    opt.first_order_momentum_accum_type = first
    opt.second_order_momentum_accum_type = second
    if max_grad_norm is not False:
        opt.max_grad_norm = float("inf") if max_grad_norm is None else max_grad_norm


class AdamW(Optimizer, torch.optim.AdamW):
    """AdamW (decoupled weight decay) with optional loss scaling, accumulation
    types and ``bias_correction`` (False: no bias correction, PopTorch's
    ``ADAMW_NO_BIAS``; on the CPU, ``step()`` is torch's, which always
    corrects).  AMSGrad is not supported."""
    _child_vars = ["loss_scaling"]
    _child_only = _child_vars + ["bias_correction", "accum_type",
                                 "first_order_momentum_accum_type",
                                 "second_order_momentum_accum_type", "max_grad_norm"]
    _group_vars = ["lr", "betas", "weight_decay", "eps", "amsgrad"]

    def __init__(self,
                 params: Iterable,
                 lr: Optional[float] = None,
                 betas: Optional[Tuple[float, float]] = None,
                 eps: Optional[float] = None,
                 weight_decay: Optional[float] = None,
                 amsgrad: Optional[bool] = None,
                 maximize: Optional[bool] = None,
                 foreach: Optional[bool] = None,
                 capturable: Optional[bool] = None,
                 differentiable: Optional[bool] = None,
                 fused: Optional[bool] = None,
                 loss_scaling: Optional[float] = None,
                 bias_correction: Optional[bool] = None,
                 accum_type: Optional[torch.dtype] = None,
                 first_order_momentum_accum_type: Optional[torch.dtype] = None,
                 second_order_momentum_accum_type: Optional[torch.dtype] = None,
                 max_grad_norm: Optional[float] = None) -> None:
        parent_args, variables = _variables(locals(), AdamW._child_only)
        if amsgrad:
            raise ValueError("Only non-amsgrad Adam/AdamW optimizers are supported.")
        Optimizer.__init__(self)
        torch.optim.AdamW.__init__(self, **parent_args)
        self.bias_correction = True if bias_correction is None else bias_correction
        _set_adam_attributes(self, loss_scaling, accum_type, first_order_momentum_accum_type,
                             second_order_momentum_accum_type, max_grad_norm)
        self.variable_attrs = VariableAttributes(variables,
                                                 list(self.defaults) + AdamW._child_vars)


class RMSprop(Optimizer, torch.optim.RMSprop):
    """RMSprop with optional loss scaling and accumulation types:
    ``torch.optim.RMSprop`` plus PopTorch's arguments.  ``use_tf_variant``
    gives TensorFlow's variant on the IPU (mean square starting at 1, eps
    inside the square root, the learning rate folded into the momentum);
    ``step()`` on the CPU is torch's, as in PopTorch."""
    _child_vars = ["loss_scaling"]
    _child_only = _child_vars + ["accum_type", "first_order_momentum_accum_type",
                                 "second_order_momentum_accum_type", "use_tf_variant"]
    _group_vars = ["lr", "momentum", "weight_decay", "alpha", "eps", "centered"]

    def __init__(self,
                 params: Iterable,
                 lr: Optional[float] = None,
                 alpha: Optional[float] = None,
                 eps: Optional[float] = None,
                 weight_decay: Optional[float] = None,
                 momentum: Optional[float] = None,
                 centered: Optional[bool] = None,
                 foreach: Optional[bool] = None,
                 maximize: Optional[bool] = None,
                 differentiable: Optional[bool] = None,
                 loss_scaling: Optional[float] = None,
                 accum_type: Optional[torch.dtype] = None,
                 first_order_momentum_accum_type: Optional[torch.dtype] = None,
                 second_order_momentum_accum_type: Optional[torch.dtype] = None,
                 use_tf_variant: Optional[bool] = None) -> None:
        parent_args, variables = _variables(locals(), RMSprop._child_only)
        Optimizer.__init__(self)
        torch.optim.RMSprop.__init__(self, **parent_args)
        _set_adam_attributes(self, loss_scaling, accum_type, first_order_momentum_accum_type,
                             second_order_momentum_accum_type, max_grad_norm=False)
        self.use_tf_variant = bool(use_tf_variant)
        self.variable_attrs = VariableAttributes(variables,
                                                 list(self.defaults) + RMSprop._child_vars)


class LAMB(Optimizer, torch.optim.Optimizer):
    """Layer-wise Adaptive Moments (LAMB), PopTorch's optimizer.

    From "Large Batch Optimization for Deep Learning: Training BERT in 76
    minutes" (https://arxiv.org/abs/1904.00962).  For every weight ``w``::

        m = beta1 * m + (1 - beta1) * g
        v = beta2 * v + (1 - beta2) * g * g
        u = (m / (1 - beta1**t)) / (sqrt(v) / sqrt(1 - beta2**t) + eps) + weight_decay * w
        r1 = min(||w||, max_weight_norm);  r2 = ||u||
        w = w - lr * (r1 / r2 if r1 > 0 and r2 > 0 else 1) * u

    (without the ``(1 - beta**t)`` terms when ``bias_correction`` is False).
    The scaling function phi(z) is min(z, max_weight_norm); ``None`` means
    65500 (float16's largest value), as in PopTorch.  ``step()`` runs it on
    the CPU; a training model runs it on the simulated IPU."""
    _child_vars = ["loss_scaling"]
    _child_only = _child_vars + ["bias_correction", "accum_type",
                                 "first_order_momentum_accum_type",
                                 "second_order_momentum_accum_type"]
    _group_vars = ["lr", "weight_decay", "betas", "eps", "max_weight_norm"]
    _poptorchsim_rule = "lamb"

    def __init__(self,
                 params: Iterable,
                 lr: Optional[float] = None,
                 betas: Optional[Tuple[float, float]] = None,
                 eps: Optional[float] = None,
                 weight_decay: Optional[float] = None,
                 bias_correction: Optional[bool] = None,
                 loss_scaling: Optional[float] = None,
                 max_weight_norm: Optional[float] = None,
                 accum_type: Optional[torch.dtype] = None,
                 first_order_momentum_accum_type: Optional[torch.dtype] = None,
                 second_order_momentum_accum_type: Optional[torch.dtype] = None) -> None:
        _, variables = _variables(locals())
        max_weight_norm = FP16_MAX if max_weight_norm is None else max_weight_norm
        defaults = dict(lr=1e-3 if lr is None else lr,
                        betas=(0.9, 0.999) if betas is None else betas,
                        eps=1e-8 if eps is None else eps,
                        weight_decay=1e-2 if weight_decay is None else weight_decay,
                        max_weight_norm=max_weight_norm)
        Optimizer.__init__(self)
        torch.optim.Optimizer.__init__(self, params, defaults)
        self.bias_correction = True if bias_correction is None else bias_correction
        _set_adam_attributes(self, loss_scaling, accum_type, first_order_momentum_accum_type,
                             second_order_momentum_accum_type, max_grad_norm=False)
        self.max_weight_norm = max_weight_norm
        self.variable_attrs = VariableAttributes(variables,
                                                 list(self.defaults) + LAMB._child_vars)

    @torch.no_grad()
    def step(self, closure: Optional[Callable] = None) -> Optional[float]:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            max_weight_norm = group.get("max_weight_norm", self.max_weight_norm)
            for p in group["params"]:
                if p.grad is None:
                    continue
                grad = p.grad
                state = self.state[p]
                if len(state) == 0:
                    state["step"] = 0
                    state["exp_avg"] = torch.zeros_like(p)
                    state["exp_avg_sq"] = torch.zeros_like(p)
                state["step"] += 1
                exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
                if self.bias_correction:
                    bias_correction1 = 1 - beta1 ** state["step"]
                    bias_correction2 = 1 - beta2 ** state["step"]
                else:
                    bias_correction1 = bias_correction2 = 1
                exp_avg.mul_(beta1).add_(grad, alpha=1 - beta1)
                exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
                denom = (exp_avg_sq.sqrt() / math.sqrt(bias_correction2)).add_(group["eps"])
                update = (exp_avg / bias_correction1) / denom + group["weight_decay"] * p
                r1 = p.pow(2).sum().sqrt()
                r2 = update.pow(2).sum().sqrt()
                r1 = r1.clamp(max=max_weight_norm)
                trust = 1.0 if r1 == 0 or r2 == 0 else r1 / r2
                p.add_(update * trust, alpha=-group["lr"])
        return loss
