"""Beyond PopTorch: where to put the ``BeginBlock``s for N IPUs.

``suggest_split(model, num_ipus, *example_inputs)`` compiles the model once
with every layer tagged as its own block (the trace finds the order the
model calls them in), reads each layer's cycles (forward
and backward) and memory (its parameters, optimizer state, gradients and
activations) from the machine model, and splits the layers, in execution
order, into ``num_ipus`` contiguous groups that balance both: it minimises the
largest share a group has of the cycles or of the memory.  The plan explains
itself and applies in one line: ``suggest_split(...).apply(model)``.
"""
from dataclasses import dataclass, field

import torch

from ..capture import blocks as _blocks
from ..machine.targets import default_target
from . import compiler
from .config import CompileConfig


class _OneStagePerBlock:
    """A placement for measuring: every block its own stage, all on IPU 0
    (shaped as ``passes.stages.StagedSpec``)."""
    pipelined = False
    phased = False

    def assign(self, blocks, default=False):
        """Ops before the first block (``default``) are measured with it."""
        return {b: (i, 0) for i, (b, _) in enumerate(dict.fromkeys(blocks))}


@dataclass
class Layer:
    name: str
    cycles: float
    memory: int


@dataclass
class SplitPlan:
    num_ipus: int
    layers: list                      # Layers in execution order
    groups: list                      # lists of layer indices, one per IPU
    target_name: str = "Mk2"
    notes: list = field(default_factory=list)

    @property
    def boundaries(self):
        """(module name, ipu) where each IPU's first layer begins."""
        return [(self.layers[g[0]].name, ipu) for ipu, g in enumerate(self.groups) if g]

    def apply(self, model):
        """Adds ``BeginBlock(layer, user_id=name, ipu_id=i)`` at every boundary."""
        for name, ipu in self.boundaries:
            _blocks.begin_block(model.get_submodule(name), f"ipu{ipu}", ipu)
        return model

    def explain(self):
        total_c = sum(l.cycles for l in self.layers) or 1.0
        total_m = sum(l.memory for l in self.layers) or 1
        lines = [f"Split over {self.num_ipus} {self.target_name} IPUs: the slowest IPU's "
                 "share of the cycles made as small as it can be while each IPU's "
                 f"memory stays under {MEMORY_BUDGET:.0%} of its capacity (shares of the "
                 "whole model):"]
        for ipu, g in enumerate(self.groups):
            c = sum(self.layers[i].cycles for i in g)
            m = sum(self.layers[i].memory for i in g)
            names = ", ".join(self.layers[i].name for i in g)
            lines.append(f"  IPU {ipu}: {c / total_c:6.1%} of cycles, {m / total_m:6.1%} of "
                         f"memory ({m / 2**20:.1f} MiB)  <- {names}")
        worst = max(sum(self.layers[i].cycles for i in g) / total_c
                    for g in self.groups if g)
        lines.append(f"The slowest IPU does {worst:.1%} of the work; a perfect split would "
                     f"do {1 / self.num_ipus:.1%}, so pipelining gains about "
                     f"{1 / worst:.1f}x over one IPU before bubbles.")
        lines.append("Apply it with: plan.apply(model)  # BeginBlock at "
                     + ", ".join(f"{n} -> IPU {i}" for n, i in self.boundaries))
        lines.extend(self.notes)
        return "\n".join(lines)

    __str__ = explain


def _layers(model, num_ipus):
    """Candidate split points: modules in execution order, expanded from the
    top until there are enough of them to balance ``num_ipus`` ways."""
    units = [(n, m) for n, m in model.named_children()
             if not isinstance(m, torch.nn.modules.loss._Loss)]
    while len(units) < 3 * num_ipus:
        expandable = [(sum(p.numel() for p in m.parameters()), i) for i, (n, m)
                      in enumerate(units) if any(True for _ in m.children())]
        if not expandable:
            break
        _, i = max(expandable)
        name, module = units[i]
        children = [(f"{name}.{c}", m) for c, m in module.named_children()]
        units[i:i + 1] = children
    return units


MEMORY_BUDGET = 0.8     # share of an IPU's memory a group may fill (headroom for code)


def _partition(costs, mems, n, capacity):
    """Contiguous groups minimising the slowest group's share of the cycles,
    with every group's memory within ``MEMORY_BUDGET`` of ``capacity``; where
    that cannot hold, the fullest group's memory is minimised instead."""
    k = len(costs)
    tc, tm = sum(costs) or 1.0, sum(mems) or 1
    pre_c, pre_m = [0.0], [0]
    for c, m in zip(costs, mems):
        pre_c.append(pre_c[-1] + c)
        pre_m.append(pre_m[-1] + m)

    budget = MEMORY_BUDGET * capacity

    def weight(i, j):
        mem = pre_m[j] - pre_m[i]
        if mem > budget:
            return 1.0 + mem / tm            # worse than any split that fits
        return (pre_c[j] - pre_c[i]) / tc

    inf = float("inf")
    best = [[inf] * (k + 1) for _ in range(n + 1)]
    cut = [[0] * (k + 1) for _ in range(n + 1)]
    best[0][0] = 0.0
    for g in range(1, n + 1):
        for j in range(1, k + 1):
            for i in range(g - 1, j):
                v = max(best[g - 1][i], weight(i, j))
                if v < best[g][j]:
                    best[g][j], cut[g][j] = v, i
    groups, j = [], k
    for g in range(n, 0, -1):
        i = cut[g][j]
        groups.append(list(range(i, j)))
        j = i
    return groups[::-1]


def suggest_split(model, num_ipus, *example_inputs, optimizer=None, training=True,
                  target=None):
    """A ``SplitPlan`` placing ``model``'s layers on ``num_ipus`` IPUs.

    ``example_inputs``: one micro-batch, as the model's forward takes it."""
    target = target or default_target()
    units = _layers(model, num_ipus)
    by_name = dict(units)
    # every candidate layer its own block: the trace records the layers in the
    # order the model calls them (no eager run of the model to find it)
    handles = [m.register_forward_pre_hook(
        lambda mod, args, n=n: _blocks.enter_block(n, 0, args)) for n, m in units]
    import logging
    log = logging.getLogger("poptorchsim")
    level = log.level
    log.setLevel(logging.ERROR)       # the whole model need not fit one IPU here
    try:
        config = CompileConfig(training, target=target, show_progress=False, allow_oom=True,
                               placement=_OneStagePerBlock())
        if training:
            optimizer = optimizer or torch.optim.SGD(model.parameters(), lr=0.01)
            compiled = compiler.compile_training(model, optimizer, example_inputs, {}, config)
        else:
            compiled = compiler.compile_inference(model, example_inputs, {}, config)
    finally:
        log.setLevel(level)
        for h in handles:
            h.remove()
    units = [(n, by_name[n]) for n, _ in compiled.capture.blocks if n in by_name]
    if len(units) < num_ipus:
        from ..errors import Error
        raise Error(f"The model has {len(units)} layers to split but {num_ipus} IPUs "
                    "were asked for; use fewer IPUs.")
    name = "training_step" if training else "inference_forward"
    graph, costs = compiled.program.graphs[name], compiled.costs[name]
    stage_of = _OneStagePerBlock().assign(compiled.capture.blocks)
    index = {stage: i for i, (n, _) in enumerate(units)
             for b, (stage, _) in stage_of.items() if b == n}
    cycles = [0.0] * len(units)
    memory = [0] * len(units)
    for op, cost in zip(graph.ops, costs):
        i = index.get(op.stage, 0)
        cycles[i] += cost.total
        memory[i] += sum(t.nbytes for t in op.outputs if t is not None)
    # weight, plus its gradient and optimizer state when training
    state_per_param = 1
    if training:
        slots = compiled.slots[0][1] if compiled.slots else ()
        state_per_param = 2 + len(slots)
    for i, (n, m) in enumerate(units):
        memory[i] += state_per_param * sum(p.numel() * p.element_size()
                                           for p in m.parameters())
    layers = [Layer(n, c, mem) for (n, _), c, mem in zip(units, cycles, memory)]
    groups = _partition(cycles, memory, num_ipus, target.total_bytes)
    plan = SplitPlan(num_ipus, layers, groups, target.name)
    if any(sum(memory[i] for i in g) > MEMORY_BUDGET * target.total_bytes for g in groups):
        plan.notes.append("Warning: some IPU still holds more than "
                          f"{MEMORY_BUDGET:.0%} of its memory; use more IPUs.")
    return plan
