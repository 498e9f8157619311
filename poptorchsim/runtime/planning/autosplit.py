"""Beyond PopTorch: where to put the ``BeginBlock``s for N IPUs.

``suggest_split(model, num_ipus, *example_inputs)`` compiles the model once
with every layer tagged as its own block (the trace finds the order the
model calls them in; the model never runs), reads each layer's cycles
(forward and backward) and memory (its parameters, optimizer state,
gradients and activations) from the machine model, and splits the layers, in
execution order, into ``num_ipus`` contiguous groups that balance the cycles
within the memory.  The split is then compiled as a pipeline (the planner's
``runtime.planning.planner.Planner``, reusing the trace) and every IPU's fullest tile
checked; where it does not fit, the plan names how many IPUs do
(``num_ipus=None``: the fewest that fit).  The plan explains itself and
applies in one line: ``suggest_split(...).apply(model)``.
"""
from dataclasses import dataclass, field, replace

from ...capture import blocks as _blocks
from ...errors import Error
from ...estimate.targets import default_target


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
    peak_tile: list = field(default_factory=list)   # bytes of each IPU's fullest tile
    capacity: int = 0                 # bytes per tile
    ipus_needed: int = None           # the fewest IPUs (1, 2, 4, ...) that fit; None: none

    @property
    def fits(self):
        return bool(self.peak_tile) and max(self.peak_tile) <= self.capacity

    @property
    def layers_per_ipu(self):
        return [len(g) for g in self.groups]

    @property
    def boundaries(self):
        """(module name, ipu) wherever the IPU changes, in execution order
        (an IPU's layers need not be contiguous: embeddings and the head
        tied to them both on IPU 0)."""
        ipu_of = {i: ipu for ipu, g in enumerate(self.groups) for i in g}
        out, last = [], None
        for i, layer in enumerate(self.layers):
            if ipu_of.get(i) is not None and ipu_of[i] != last:
                out.append((layer.name, ipu_of[i]))
                last = ipu_of[i]
        return out

    @property
    def needs_auto_increment(self):
        """An IPU comes back after a later one: the blocks' stages must be
        numbered in execution order (``PipelinedExecution(AutoStage.
        AutoIncrement)``), not by IPU."""
        ipus = [ipu for _, ipu in self.boundaries]
        return any(b < a for a, b in zip(ipus, ipus[1:]))

    def apply(self, model):
        """Adds ``BeginBlock(layer, user_id=name, ipu_id=i)`` at every boundary."""
        seen = set()
        for k, (name, ipu) in enumerate(self.boundaries):
            _blocks.begin_block(model.get_submodule(name),
                                f"ipu{ipu}" + (f".{k}" if ipu in seen else ""), ipu)
            seen.add(ipu)
        return model

    def explain(self):
        total_c = sum(layer.cycles for layer in self.layers) or 1.0
        lines = [f"Split over {self.num_ipus} {self.target_name} IPUs (layers per IPU "
                 f"{self.layers_per_ipu}): the slowest IPU's share of the cycles made as small "
                 "as it can be, then the split compiled as a pipeline and its memory checked "
                 "tile by tile, as trainingModel does:"]
        for ipu, g in enumerate(self.groups):
            c = sum(self.layers[i].cycles for i in g)
            names = ", ".join(self.layers[i].name for i in g)
            peak = (f"peak tile {self.peak_tile[ipu] / 1024:.1f} KiB of "
                    f"{self.capacity / 1024:.0f} KiB"
                    + ("" if self.peak_tile[ipu] <= self.capacity else " (does not fit)")
                    if ipu < len(self.peak_tile) else "")
            lines.append(f"  IPU {ipu}: {c / total_c:6.1%} of cycles, {peak}  <- {names}")
        worst = max(sum(self.layers[i].cycles for i in g) / total_c
                    for g in self.groups if g)
        lines.append(f"The slowest IPU does {worst:.1%} of the work; a perfect split would "
                     f"do {1 / self.num_ipus:.1%}, so pipelining gains about "
                     f"{1 / worst:.1f}x over one IPU before bubbles.")
        if self.fits:
            lines.append(f"It fits: {self.num_ipus} IPU{'s are' if self.num_ipus > 1 else ' is'}"
                         " enough per replica at this micro-batch.")
        lines.append("Apply it with: plan.apply(model)  # BeginBlock at "
                     + ", ".join(f"{n} -> IPU {i}" for n, i in self.boundaries))
        if self.needs_auto_increment:
            lines.append("  and options.setExecutionStrategy(poptorch.PipelinedExecution("
                         "poptorch.AutoStage.AutoIncrement)): IPU 0 comes back after the "
                         "others, so stages follow execution order.")
        lines.extend(self.notes)
        return "\n".join(lines)

    __str__ = explain


def suggest_split(model, num_ipus, *example_inputs, optimizer=None, training=True,
                  target=None, options=None):
    """A ``SplitPlan`` placing ``model``'s layers on ``num_ipus`` IPUs (None:
    as few as fit, from 1, 2, 4, ... up to 64).

    ``example_inputs``: one micro-batch, as the model's forward takes it;
    ``options``: the settings the split is compiled with (precision, memory
    proportion, optimizer state location and sharding, replication).
    The layers' cycles and bytes come from one compile of the traced graph
    (every layer its own stage; the model never runs); the split is then
    compiled as a pipeline and checked as ``trainingModel`` would check it:
    ``plan.peak_tile`` holds each IPU's fullest tile, and where it does not
    fit, the plan says how many IPUs do (``plan.ipus_needed``)."""
    from .planner import Configuration, Planner, stages_of
    if not training:
        raise Error("suggest_split plans training programs (an inference program holds a "
                    "subset of their ops and memory): pass training=True.")
    target = target or default_target()
    asked = num_ipus
    first = num_ipus or 1
    planner = Planner(model, example_inputs, optimizer, options, ipus=max(first, 64),
                      max_ipus_per_replica=max(first, 8 if asked is None else first))
    planner.base = replace(planner.base, target=target)
    micro = example_inputs[0].shape[0] if example_inputs and hasattr(example_inputs[0], "shape") \
        and example_inputs[0].dim() else 1
    units = planner.units
    if asked is not None and len(units) < asked:
        raise Error(f"The model has {len(units)} layers to split but {asked} IPUs "
                    "were asked for; use fewer IPUs.")
    cycles, nbytes = planner.unit_costs(micro)

    def check(k):
        """The first of the planner's splits over ``k`` IPUs that fits, else
        the one closest to fitting (a split that cannot compile, e.g. a tied
        weight on two IPUs, last)."""
        tried = []
        base = planner.base
        amp = tuple(base.amp.get(i, 0.6) for i in range(k)) if isinstance(base.amp, dict) \
            else base.amp
        partials = (base.precision or {}).get("partials", "float")
        for split in planner.splits(k, micro):
            stages = stages_of(split)
            result = planner.evaluate(Configuration(
                micro, split, base.replicas, 2 * stages if stages > 1 else 1, amp,
                partials=partials))
            if result.fits:
                return split, result
            tried.append((max(result.peak_tile) if result.peak_tile else float("inf"),
                          split, result))
        _, split, result = min(tried, key=lambda t: t[0])
        return split, result

    split, result = check(first)
    first_reason = result.reason.splitlines()[0] if result.reason else ""
    plan = _plan_of(units, cycles, nbytes, split, first, target, result)
    k, closest = first, (max(result.peak_tile) if result.peak_tile else float("inf"), first,
                         result)
    while not result.fits and 2 * k <= min(64, len(units)):
        k *= 2
        _, result = check(k)
        if result.peak_tile and max(result.peak_tile) < closest[0]:
            closest = (max(result.peak_tile), k, result)
        if result.fits or asked is None:
            plan.ipus_needed = k if result.fits else None
        if result.fits:
            break
    if asked is None and plan.ipus_needed and plan.ipus_needed != first:
        split, result = check(plan.ipus_needed)
        plan = _plan_of(units, cycles, nbytes, split, plan.ipus_needed, target, result)
    elif not plan.fits:
        where = (f"IPU {plan.peak_tile.index(max(plan.peak_tile))} does not fit (peak tile "
                 f"{max(plan.peak_tile) / 1024:.0f} KiB of {plan.capacity / 1024:.0f} KiB)"
                 if plan.peak_tile else f"the split does not compile ({first_reason})")
        plan.notes.append(
            f"Warning: {where}; " + (f"{plan.ipus_needed} IPUs fit." if plan.ipus_needed else
                                     f"no split over up to {k} IPUs fits at this micro-batch"
                                     + _closest_text(closest) + ". Reduce the micro-batch, "
                                     "move the optimizer state off chip or lower the "
                                     "available memory proportion (options=), or search "
                                     "replicated configurations with poptorchsim.plan."))
    return plan


def _closest_text(closest):
    peak, k, result = closest
    if not result.peak_tile:
        return ""
    ipu = result.peak_tile.index(peak)
    return (f" (closest: {k} IPU{'s' if k > 1 else ''}, IPU {ipu}'s fullest tile at "
            f"{peak / 1024:.0f} KiB of {result.capacity / 1024:.0f} KiB)")


def _plan_of(units, cycles, nbytes, split, k, target, result):
    groups = [[i for i, ipu in enumerate(split) if ipu == g] for g in range(k)]
    layers = [Layer(n, c, m) for n, c, m in zip(units, cycles, nbytes)]
    plan = SplitPlan(k, layers, groups, target.name, peak_tile=list(result.peak_tile),
                     capacity=result.capacity)
    plan.ipus_needed = k if result.fits else None
    return plan
