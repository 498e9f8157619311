"""PopTorch's ``ctc_beam_search_decoder``: the most likely label sequences
of a connectionist temporal classification (CTC) output.

PopTorch lowers it to PopART's ``CtcBeamSearchDecoder`` op (PopLibNN's
beam search, validated against TensorFlow's ``ctc_beam_search_decoder``).
poptorchsim runs the same algorithm, CTC prefix beam search, on the host's
CPU as one IR op: a custom op (``ai.graphcore``'s) whose declared
cost is an estimate (each time step scores ``beam_width * num_classes``
extensions and keeps the best ``beam_width``), not PopLibNN's measured
cycles.  Its results carry no gradient, as in PopTorch.

Outputs, as PopTorch's: the paths' log probabilities ``[batch_size,
top_paths]``, their lengths ``[batch_size, top_paths]`` and the decoded
paths ``[batch_size, top_paths, input_length]`` (zero after each path's
end), all of the type of ``probs``.
"""
import math

import torch

from ..capture import custom_ops as _custom_ops
from ..errors import createPoptorchError
from ..ir import custom as _ir_custom

_NEG_INF = float("-inf")


def _log_add(*values):
    top = max(values)
    if top == _NEG_INF:
        return _NEG_INF
    return top + math.log(sum(math.exp(v - top) for v in values))


def _beam_search(log_probs, blank, beam_width):
    """``[(log probability, labels)]`` of the best prefixes, best first:
    prefix beam search over ``log_probs`` (``[time][class]`` floats)."""
    beams = {(): (0.0, _NEG_INF)}         # prefix -> (ending in blank, ending in a label)
    for step in log_probs:
        grown = {}

        def add(prefix, blank_end, label_end, grown=grown):
            old_b, old_l = grown.get(prefix, (_NEG_INF, _NEG_INF))
            grown[prefix] = (_log_add(old_b, blank_end), _log_add(old_l, label_end))

        for prefix, (p_blank, p_label) in beams.items():
            last = prefix[-1] if prefix else None
            for c, p in enumerate(step):
                if c == blank:
                    add(prefix, _log_add(p_blank, p_label) + p, _NEG_INF)
                elif c == last:
                    add(prefix, _NEG_INF, p_label + p)           # a repeat merges
                    add(prefix + (c,), _NEG_INF, p_blank + p)    # after a blank it is new
                else:
                    add(prefix + (c,), _NEG_INF, _log_add(p_blank, p_label) + p)
        ranked = sorted(grown.items(), key=lambda kv: (-_log_add(*kv[1]), kv[0]))
        beams = dict(ranked[:beam_width])
    ranked = sorted(((_log_add(*p), prefix) for prefix, p in beams.items()),
                    key=lambda sp: (-sp[0], sp[1]))
    return ranked


def _decode(probs, lengths, blank=0, beam_width=100, top_paths=1):
    time, batch, _ = probs.shape
    scores = torch.full((batch, top_paths), _NEG_INF, dtype=torch.float64)
    sizes = torch.zeros((batch, top_paths), dtype=torch.float64)
    paths = torch.zeros((batch, top_paths, time), dtype=torch.float64)
    table = probs.detach().to(torch.float64).permute(1, 0, 2).tolist()
    for b, length in enumerate(lengths.detach().reshape(-1).tolist()):
        length = max(0, min(int(length), time))
        best = _beam_search(table[b][:length], blank, beam_width)[:top_paths]
        for k, (score, labels) in enumerate(best):
            scores[b, k], sizes[b, k] = score, len(labels)
            paths[b, k, :len(labels)] = torch.tensor(labels, dtype=torch.float64)
    return tuple(t.to(probs.dtype) for t in (scores, sizes, paths))


def _cost(beam_width):
    """The declared cost of a decoder of ``beam_width`` beams: every time
    step of every batch entry scores ``beam_width * num_classes``
    extensions (about 6 worker cycles each) and keeps the best
    ``beam_width`` of them (a log2 factor); the beams' scores are its
    temporary memory."""
    def cycles(input_shapes, output_shapes):
        (time, batch, classes), _ = input_shapes
        candidates = beam_width * classes
        return time * batch * candidates * (6 + math.log2(max(candidates, 2)))

    def temp_bytes(input_shapes, output_shapes):
        (time, batch, classes), _ = input_shapes
        return batch * beam_width * (classes + time) * 8
    return _ir_custom.CustomCost(cycles=cycles, temp_bytes=temp_bytes)


_DECODERS = {}        # beam width -> the op (one per width: its cost depends on it)


def _decoder(beam_width):
    if beam_width not in _DECODERS:
        qualname = f"ai_graphcore_CtcBeamSearchDecoder_beam{beam_width}"
        _DECODERS[beam_width] = _custom_ops.define(qualname, _decode, None)
        _ir_custom.COSTS[qualname] = _ir_custom.COSTS[f"{qualname}_grad"] = _cost(beam_width)
    return _DECODERS[beam_width]


def ctc_beam_search_decoder(probs, lengths, blank=0, beam_width=100, top_paths=1):
    """The ``top_paths`` most likely label sequences of ``probs`` (log
    probabilities ``[input_length, batch_size, num_classes]``), each batch
    entry read up to its ``lengths`` entry: three tensors, the paths' log
    probabilities ``[batch_size, top_paths]``, their lengths and the
    decoded paths ``[batch_size, top_paths, input_length]``."""
    if not isinstance(probs, torch.Tensor):
        raise createPoptorchError("ctc_beam_search_decoder: probs must be a torch.tensor "
                                  f"argument. {type(probs)} is not supported.")
    if not isinstance(lengths, torch.Tensor):
        raise createPoptorchError("ctc_beam_search_decoder: lengths must be a torch.tensor "
                                  f"argument. {type(lengths)} is not supported.")
    if probs.dim() != 3:
        raise createPoptorchError("Input probablities tensor must be rank-3 for "
                                  f"`ctc_beam_search_decoder` (got shape {list(probs.shape)}).")
    time, batch, classes = probs.shape
    if lengths.dim() != 1 or lengths.shape[0] != batch:
        raise createPoptorchError(f"ctc_beam_search_decoder: lengths must have shape "
                                  f"[batch_size] = [{batch}], got {list(lengths.shape)}.")
    if not 0 <= blank < classes:
        raise createPoptorchError(f"ctc_beam_search_decoder: blank ({blank}) must be a class "
                                  f"index in [0, {classes}).")
    if not 1 <= top_paths <= beam_width:
        raise createPoptorchError(f"ctc_beam_search_decoder: top_paths ({top_paths}) must be "
                                  f"between 1 and beam_width ({beam_width}).")
    examples = [probs.new_empty((batch, top_paths)), probs.new_empty((batch, top_paths)),
                probs.new_empty((batch, top_paths, time))]
    return tuple(_custom_ops.call(_decoder(beam_width), [probs.detach(), lengths], examples,
                                  {"blank": blank, "beam_width": beam_width,
                                   "top_paths": top_paths}))
