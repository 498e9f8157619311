"""The pipeline schedule: the timeline of one weight update or inference call.

PopTorch's pipeline has N forward stages and N-1 backward stages (the last
forward stage fused with the first backward one), so S = 2N-1 stages in
training and N in inference.  Each pipeline cycle every IPU runs its
forward stage for one micro-batch and its backward stage for an earlier
one; a weight update over G micro-batches takes G + S - 1 cycles of the
slowest IPU, and for balanced stages the idle share is (S-1)/(G+S-1).
Sharded execution runs one stage after another, one IPU at a time.
"""
from dataclasses import dataclass, field


@dataclass
class Schedule:
    kind: str                          # "pipelined", "sharded" or "single"
    n_stages: int                      # pipeline stages S
    micro_batches: int                 # G per weight update (or per call in inference)
    cycles: float                      # one weight update (or inference call), updates excluded
    bubble: float                      # idle share of IPU time
    events: list = field(default_factory=list)   # (ipu, name, start, duration) in cycles


def schedule(fwd, bwd, ipu_of_stage, micro_batches, pipelined, training):
    """The timeline of one weight update (training) or one call (inference).

    ``fwd[s]``/``bwd[s]``: cycles of forward/backward stage ``s`` for one
    micro-batch; ``ipu_of_stage[s]``: its IPU.
    """
    n = len(fwd)
    g = micro_batches
    events = []
    if n <= 1 or not pipelined:
        t = 0.0
        for m in range(g):
            for s in range(n):
                events.append((ipu_of_stage[s], f"F{s} mb{m}", t, fwd[s]))
                t += fwd[s]
            for s in reversed(range(n)) if training else ():
                events.append((ipu_of_stage[s], f"B{s} mb{m}", t, bwd[s]))
                t += bwd[s]
        busy = sum(fwd) + (sum(bwd) if training else 0)
        n_ipus = len(set(ipu_of_stage)) or 1
        bubble = 1 - busy * g / (t * n_ipus) if t else 0.0
        return Schedule("single" if n <= 1 else "sharded", n, g, t, bubble, events)
    depth = 2 * n - 1 if training else n
    slot = max(fwd[s] + (bwd[s] if training else 0) for s in range(n))
    for c in range(g + depth - 1):
        start = c * slot
        for s in range(n):
            m = c - s
            if 0 <= m < g:
                events.append((ipu_of_stage[s], f"F{s} mb{m}", start, fwd[s]))
            if training:
                mb = c - (depth - 1 - s)
                if 0 <= mb < g:
                    events.append((ipu_of_stage[s], f"B{s} mb{mb}", start + fwd[s], bwd[s]))
    total = (g + depth - 1) * slot
    busy = sum(d for _, _, _, d in events)
    bubble = 1 - busy / (total * n) if total else 0.0
    return Schedule("pipelined", depth, g, total, bubble, events)
