"""PyTorch as PopTorch's programs expect it (PopTorch is frozen at SDK 3.4,
torch 2.0.1), where a later PyTorch release changed an API they call.
Applied for programs that ``python -m poptorchsim.run`` runs (and the
processes they start), never by ``import poptorchsim`` alone.

* ``torch.utils.data.Sampler.__init__(self, data_source=None)``: torch 2.0
  took the argument and ignored it, and samplers written for it call
  ``super().__init__(data_source)`` (PopTorch's own tests do, with None).
  PyTorch 2.2 deprecated the argument and later releases dropped the
  method: the call raises ``TypeError: object.__init__() takes exactly one
  argument``.  Put back where the method is gone, with torch 2.0's
  behaviour (the argument ignored).
"""
import torch.utils.data


def _sampler_init(self, data_source=None):
    """torch 2.0's ``Sampler.__init__``: ``data_source`` is ignored."""


def install():
    """Applies the changes above that this PyTorch needs (idempotent)."""
    sampler = torch.utils.data.Sampler
    if "__init__" not in vars(sampler):
        sampler.__init__ = _sampler_init
