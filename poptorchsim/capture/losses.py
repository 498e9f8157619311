"""Finding the loss of a training model while it is traced.

PopTorch counts torch's loss functions (``F.cross_entropy``, ``nn.MSELoss``,
...) and ``identity_loss`` as losses.  A ``TorchFunctionMode`` sees each
call of a loss function from the outside only (a loss computed inside another
loss, like ``nll_loss`` inside ``cross_entropy``, is folded into its caller).
"""
import sys
import threading

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from . import ctc_loss

LOSS_FUNCTIONS = {
    F.cross_entropy, F.nll_loss, F.mse_loss, F.l1_loss, F.smooth_l1_loss,
    F.huber_loss, F.binary_cross_entropy, F.binary_cross_entropy_with_logits,
    F.kl_div, F.soft_margin_loss, F.multi_margin_loss, F.multilabel_margin_loss,
    F.multilabel_soft_margin_loss, F.hinge_embedding_loss, F.cosine_embedding_loss,
    F.margin_ranking_loss, F.triplet_margin_loss, F.poisson_nll_loss,
    F.gaussian_nll_loss, F.ctc_loss,
    ctc_loss.ctc_loss,         # F.ctc_loss as the capture traces it (decompositions.py)
}

# Functions whose result has the value of their input: a loss returned as
# ``loss.detach()``, ``loss.float()`` or ``loss.view(1)`` is still the loss.
_SAME_VALUE = {"detach", "clone", "view", "reshape", "squeeze", "unsqueeze", "flatten",
               "float", "to", "type_as", "contiguous", "__get__", "expand_as", "view_as"}

_state = threading.local()


def user_line():
    """``file:line: code`` of the innermost frame outside torch and poptorchsim."""
    import linecache
    frame = sys._getframe(1)
    while frame is not None:
        path = frame.f_code.co_filename.replace("\\", "/")
        if "/torch/" not in path and "/poptorchsim/" not in path and "<" not in path:
            code = linecache.getline(frame.f_code.co_filename, frame.f_lineno).strip()
            return f"{frame.f_code.co_filename}:{frame.f_lineno}: {code}"
        frame = frame.f_back
    return "unknown location"


class LossRecorder(TorchFunctionMode):
    """Records, in call order, the tensors torch loss functions return, and
    which tensors are computed from a loss (``derived``: id -> where), so
    that a training model returning ``loss * 0.5`` or ``loss + other`` can
    be told that the backward pass uses the loss alone."""

    def __init__(self):
        super().__init__()
        self.losses = []          # (kind, tensor, where)
        self.aliases = {}         # id(tensor) -> the loss tensor it has the value of
        self.derived = {}         # id(tensor) -> (loss tensor, "file:line: code")
        self._keep = []           # the tensors above, so their ids stay unique

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in LOSS_FUNCTIONS and isinstance(out, torch.Tensor):
            self._record(getattr(func, "__name__", str(func)), out)
        elif self.losses and isinstance(out, torch.Tensor):
            self._follow(func, args, kwargs, out)
        return out

    def _record(self, kind, tensor):
        self.losses.append((kind, tensor, user_line()))
        self.aliases[id(tensor)] = tensor
        self._keep.append(tensor)

    def _follow(self, func, args, kwargs, out):
        """``out`` is computed from a loss: is it the loss's value or a new one?"""
        found = None
        for a in list(args) + list((kwargs or {}).values()):
            if isinstance(a, torch.Tensor):
                i = id(a)
                if i in self.aliases:
                    found = ("alias", self.aliases[i])
                elif i in self.derived:
                    found = ("derived", self.derived[i][0])
                    break
        if found is None:
            return
        self._keep.append(out)
        name = getattr(func, "__name__", "")
        if found[0] == "alias" and name in _SAME_VALUE:
            self.aliases[id(out)] = found[1]
        else:
            self.derived[id(out)] = (found[1], user_line())

    def unused_terms(self, loss, outputs):
        """Where each output that is computed from ``loss``, but is not its
        value, was made: the backward pass does not differentiate it."""
        return [self.derived[id(t)][1] for t in outputs
                if isinstance(t, torch.Tensor) and id(t) in self.derived
                and self.derived[id(t)][0] is loss]

    def __enter__(self):
        _state.recorder = self
        return super().__enter__()

    def __exit__(self, *exc):
        _state.recorder = None
        return super().__exit__(*exc)


def record_identity_loss(tensor):
    recorder = getattr(_state, "recorder", None)
    if recorder is not None:
        recorder._record("identity_loss", tensor)
