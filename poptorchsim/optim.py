"""``poptorchsim.optim``: PopTorch's optimizers, torch's with its extra arguments.

They behave like their ``torch.optim`` bases (and run on the CPU the same
way); the extra PopTorch arguments are accepted and checked.  ``loss_scaling``
has no mathematical effect in fp32, as in PopTorch.
"""
import torch

_ACCUM_TYPES = (torch.float16, torch.float32)


def _check_types(*types):
    for t in types:
        assert t in _ACCUM_TYPES, "Accumulation types must be either torch.float32 or torch.float16"


class SGD(torch.optim.SGD):
    def __init__(self, params, lr, momentum=0, dampening=0, weight_decay=0, nesterov=False,
                 maximize=False, foreach=None, differentiable=False, loss_scaling=None,
                 velocity_scaling=None, use_combined_accum=None, accum_type=torch.float32,
                 velocity_accum_type=torch.float32, max_grad_norm=None):
        _check_types(accum_type, velocity_accum_type)
        super().__init__(params, lr=lr, momentum=momentum, dampening=dampening,
                         weight_decay=weight_decay, nesterov=nesterov, maximize=maximize,
                         foreach=foreach, differentiable=differentiable)
        self.loss_scaling = 1.0 if loss_scaling is None else loss_scaling
        self.max_grad_norm = max_grad_norm


class Adam(torch.optim.Adam):
    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0,
                 amsgrad=False, maximize=False, foreach=None, capturable=False,
                 differentiable=False, fused=None, loss_scaling=None,
                 accum_type=torch.float32, first_order_momentum_accum_type=torch.float32,
                 second_order_momentum_accum_type=torch.float32, max_grad_norm=None):
        _check_types(accum_type, first_order_momentum_accum_type,
                     second_order_momentum_accum_type)
        if amsgrad:
            raise ValueError("Only non-amsgrad Adam/AdamW optimizers are supported.")
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                         maximize=maximize, foreach=foreach)
        self.loss_scaling = 1.0 if loss_scaling is None else loss_scaling
        self.max_grad_norm = max_grad_norm


class AdamW(torch.optim.AdamW):
    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2,
                 amsgrad=False, maximize=False, foreach=None, capturable=False,
                 differentiable=False, fused=None, loss_scaling=None, bias_correction=True,
                 accum_type=torch.float32, first_order_momentum_accum_type=torch.float32,
                 second_order_momentum_accum_type=torch.float32, max_grad_norm=None):
        _check_types(accum_type, first_order_momentum_accum_type,
                     second_order_momentum_accum_type)
        if amsgrad:
            raise ValueError("Only non-amsgrad Adam/AdamW optimizers are supported.")
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                         maximize=maximize, foreach=foreach)
        self.loss_scaling = 1.0 if loss_scaling is None else loss_scaling
        self.max_grad_norm = max_grad_norm


class RMSprop(torch.optim.RMSprop):
    def __init__(self, params, lr=1e-2, alpha=0.99, eps=1e-8, weight_decay=0, momentum=0,
                 centered=False, foreach=None, maximize=False, differentiable=False,
                 loss_scaling=None, accum_type=torch.float32,
                 first_order_momentum_accum_type=torch.float32,
                 second_order_momentum_accum_type=torch.float32, use_tf_variant=False):
        _check_types(accum_type, first_order_momentum_accum_type,
                     second_order_momentum_accum_type)
        super().__init__(params, lr=lr, alpha=alpha, eps=eps, weight_decay=weight_decay,
                         momentum=momentum, centered=centered, foreach=foreach,
                         maximize=maximize)
        self.loss_scaling = 1.0 if loss_scaling is None else loss_scaling
