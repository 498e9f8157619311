"""CTC loss as tensor operations of fixed shapes, for the traced program.

ATen's ``ctc_loss`` reads its input and target lengths on the host and its
backward makes a tensor whose shape depends on them, so the step cannot be
traced as ATen computes it (under fake tensors it fails with a dynamic
output shape).  PopTorch lowers the loss to PopART's ``Ctc`` op, which runs
the same recursion on the IPU over the padded lengths.  Here the loss is the
forward (alpha) recursion of Graves et al. (2006) written with fixed shapes
and traced with the model: the targets extended with blanks (``2 S + 1``
positions), one step per input frame, frames past an input's length and
positions past a target's length masked, log-space sums as ATen's kernel
computes them (the largest term factored out).  Autograd differentiates
the recursion (ATen's beta recursion computes the same derivative), plus
the ``exp(log_probs)`` ATen's backward adds (see ``ctc_loss``), so the
gradient is eager PyTorch's.

An impossible alignment (a target longer than its input allows) has
probability 0: ATen's loss is infinite (zero with ``zero_infinity``).  The
recursion runs on a large finite stand-in for minus infinity, so that
gradients stay finite and masked branches pass zero; losses beyond
``IMPOSSIBLE`` are reported as infinite (or zero), as ATen reports them.
"""
import torch
from torch.nn import _reduction as _Reduction
from torch.overrides import handle_torch_function, has_torch_function_variadic

from ..errors import Error

#: stands in for log(0) in the recursion (finite, so that gradients stay finite)
LOG_ZERO = -1e30
#: a loss beyond this is an impossible alignment
IMPOSSIBLE = 1e29

def _log_sum_exp(*terms):
    top = terms[0]
    for t in terms[1:]:
        top = torch.maximum(top, t)
    return top + torch.log(sum(torch.exp(t - top) for t in terms))


def _padded_targets(targets, target_lengths):
    """(N, S) targets: as given, or cut from the concatenated 1-D form at the
    offsets of the target lengths (S: all the labels, an upper bound)."""
    if targets.dim() == 2:
        return targets.long()
    s = targets.numel()
    offsets = torch.cumsum(target_lengths, 0) - target_lengths
    index = offsets[:, None] + torch.arange(s, device=targets.device)[None]
    return targets[index.clamp(max=max(s - 1, 0))].long()


def aten_ctc_loss(log_probs, targets, input_lengths, target_lengths, blank=0, reduction=1,
                  zero_infinity=False):
    """``torch.ctc_loss`` (``reduction`` as ATen's number: 0 none, 1 mean,
    2 sum; lengths as tensors or lists)."""
    if log_probs.dtype not in (torch.float32, torch.float64):
        raise Error(f"CTC loss of {log_probs.dtype} log_probs: PyTorch's CTC loss takes "
                    "float32 or float64 (eager PyTorch refuses float16 too). Compute it on "
                    "log_probs.float().")
    unbatched = log_probs.dim() == 2
    if unbatched:
        log_probs = log_probs.unsqueeze(1)
        if targets.dim() == 1:
            targets = targets.unsqueeze(0)
    device = log_probs.device
    in_len = torch.as_tensor(input_lengths, device=device).reshape(-1).long()
    tgt_len = torch.as_tensor(target_lengths, device=device).reshape(-1).long()
    frames, n, _ = log_probs.shape
    labels = _padded_targets(targets, tgt_len)
    s = labels.shape[1]
    width = 2 * s + 1
    # the targets with a blank before, between and after their labels
    extended = torch.cat([torch.stack([torch.full_like(labels, blank), labels], 2)
                          .reshape(n, 2 * s),
                          torch.full((n, 1), blank, dtype=torch.long, device=device)], 1)
    position = torch.arange(width, device=device)[None]
    # a label may follow the label two positions back (skipping the blank
    # between) unless they are equal
    previous = torch.cat([extended[:, :2], extended[:, :-2]], 1)
    skips = (position % 2 == 1) & (position >= 3) & (extended != previous)
    valid = position < (2 * tgt_len + 1)[:, None]
    emitted = log_probs.gather(2, extended.unsqueeze(0).expand(frames, n, width))
    zero = torch.full((n, width), LOG_ZERO, dtype=log_probs.dtype, device=device)
    alpha = torch.where(valid & (position < 2), emitted[0], zero)
    for t in range(1, frames):
        from_previous = torch.cat([zero[:, :1], alpha[:, :-1]], 1)
        from_skipped = torch.where(skips, torch.cat([zero[:, :2], alpha[:, :-2]], 1), zero)
        step = torch.where(valid, _log_sum_exp(alpha, from_previous, from_skipped)
                           + emitted[t], zero)
        alpha = torch.where((t < in_len)[:, None], step, alpha)
    end = (2 * tgt_len)[:, None]
    last_blank = alpha.gather(1, end)
    last_label = torch.where(end > 0, alpha.gather(1, (end - 1).clamp(min=0)), zero[:, :1])
    loss = -_log_sum_exp(last_blank, last_label).squeeze(1)
    # ATen's backward returns exp(log_probs) more than the derivative, in the
    # frames within each input's length (the two agree once the gradient
    # passes through a log_softmax, whose backward cancels the term): a term
    # of value zero whose gradient is that, so that gradients equal eager's
    probs = torch.exp(log_probs)
    within = (torch.arange(frames, device=device)[:, None] < in_len[None])[..., None]
    loss = loss + torch.where(within, probs - probs.detach(), torch.zeros_like(probs)).sum((0, 2))
    impossible = loss > IMPOSSIBLE
    loss = torch.where(impossible, torch.zeros_like(loss) if zero_infinity
                       else torch.full_like(loss, float("inf")), loss)
    if reduction == 1:
        return (loss / tgt_len.clamp(min=1).to(loss.dtype)).mean()
    if reduction == 2:
        return loss.sum()
    return loss.squeeze(0) if unbatched else loss


def ctc_loss(log_probs, targets, input_lengths, target_lengths, blank=0, reduction="mean",
             zero_infinity=False):
    """``torch.nn.functional.ctc_loss`` (``reduction`` by name).  It is a
    torch function itself, so that the torch-function modes of the capture
    that come after the one replacing ``F.ctc_loss`` with it (the loss
    recorder) see the loss."""
    tensors = (log_probs, targets, input_lengths, target_lengths)
    if has_torch_function_variadic(*tensors):
        return handle_torch_function(ctc_loss, tensors, *tensors, blank=blank,
                                     reduction=reduction, zero_infinity=zero_infinity)
    return aten_ctc_loss(log_probs, targets, input_lengths, target_lengths, blank,
                         _Reduction.get_enum(reduction), zero_infinity)
