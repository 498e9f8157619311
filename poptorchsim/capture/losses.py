"""Finding the loss of a training model while it is traced.

PopTorch counts torch's loss functions (``F.cross_entropy``, ``nn.MSELoss``,
...) and ``identity_loss`` as losses.  A ``TorchFunctionMode`` sees each
call of a loss function from the outside only (a loss computed inside another
loss, like ``nll_loss`` inside ``cross_entropy``, is folded into its caller).
"""
import threading

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

LOSS_FUNCTIONS = {
    F.cross_entropy, F.nll_loss, F.mse_loss, F.l1_loss, F.smooth_l1_loss,
    F.huber_loss, F.binary_cross_entropy, F.binary_cross_entropy_with_logits,
    F.kl_div, F.soft_margin_loss, F.multi_margin_loss, F.multilabel_margin_loss,
    F.multilabel_soft_margin_loss, F.hinge_embedding_loss, F.cosine_embedding_loss,
    F.margin_ranking_loss, F.triplet_margin_loss, F.poisson_nll_loss,
    F.gaussian_nll_loss, F.ctc_loss,
}

_state = threading.local()


class LossRecorder(TorchFunctionMode):
    """Records, in call order, the tensors torch loss functions return."""

    def __init__(self):
        super().__init__()
        self.losses = []          # (kind, tensor)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in LOSS_FUNCTIONS and isinstance(out, torch.Tensor):
            self.losses.append((getattr(func, "__name__", str(func)), out))
        return out

    def __enter__(self):
        _state.recorder = self
        return super().__enter__()

    def __exit__(self, *exc):
        _state.recorder = None
        return super().__exit__(*exc)


def record_identity_loss(tensor):
    recorder = getattr(_state, "recorder", None)
    if recorder is not None:
        recorder.losses.append(("identity_loss", tensor))
