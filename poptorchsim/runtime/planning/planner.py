"""Beyond PopTorch: which IPU configuration should a model train in?

``Planner(model, example_inputs, optimizer, ipus=16, ...)`` searches the
configurations a Graphcore engineer would try by hand: IPUs per replica and
the split of the model's layers over them, replication, micro-batch,
gradient accumulation for a target global batch, the available memory
proportion, the recomputation mode, where the optimizer state lives (on
chip, off chip, off chip sharded over the replicas) and the partials type.
Each configuration is compiled by the same passes as ``trainingModel``
(``runtime.compiler.compile_training``), so what the planner says fits is
what the report of that configuration would say, in the same units (the
peak tile of every IPU, cycles of the machine model).

It is fast because the model is traced once per micro-batch, with every
candidate layer (a "unit": ``units_of``) its own block; a layer
split is then a placement of those blocks (no new trace), and the
optimizer's update rules are traced once for all configurations.  Each
configuration re-runs only lowering, placement, tile mapping, costs, the
memory plan and the estimate, with no numerics and no code.

``search`` evaluates, for every micro-batch and split, the settings from
the fastest (optimizer state on chip, the largest memory proportion) to the
most frugal, and stops a split's micro-batches once even its most frugal
settings do not fit.
"""
import logging
import math
import time
from dataclasses import dataclass, replace

import torch
from tqdm.auto import tqdm

from ...capture import blocks as _blocks
from ...errors import Error
from .. import compiler
from ..settings.config import CompileConfig
from .plan_result import Configuration, Evaluated, PlanResult  # the planner's API
from .split import OneStagePerBlock, partition

#: where the optimizer state lives -> TensorLocations settings
OPTIMIZER_STATE = {
    "on chip": {},
    "off chip": {"optimizer": {"onChip": 0}},
    "sharded": {"optimizer": {"onChip": 0, "useReplicatedTensorSharding": 1}},
}
#: recomputation -> PopART's autoRecomputation (None: PopTorch's default,
#: Pipeline recomputation for a pipeline over several IPUs)
RECOMPUTATION = {"default": None, "none": 0, "standard": 1, "pipeline": 3, "all": 4}


@dataclass
class UnitPlacement:
    """A layer split as an execution strategy (shaped as
    ``passes.stages.StagedSpec``): each unit's block on its IPU, a new
    pipeline stage wherever the IPU changes; ops before the first unit stay
    with it."""
    ipu_of: dict                      # unit name -> IPU
    pipelined: bool = True
    phased = False

    def assign(self, blocks, default=False):
        out, stage, last = {}, -1, None
        for name, _ in dict.fromkeys(blocks):
            if name in out or name not in self.ipu_of:
                continue
            ipu = self.ipu_of[name]
            if ipu != last:
                stage, last = stage + 1, ipu
            out[name] = (stage, ipu)
        return out


def stages_of(ipu_of_unit):
    """Pipeline stages of a split: one more wherever the IPU changes."""
    return 1 + sum(a != b for a, b in zip(ipu_of_unit, ipu_of_unit[1:]))


def _rebatched(example_inputs, micro):
    """The example inputs as a micro-batch of ``micro`` samples: the first
    sample repeated (compiling reads only shapes and types)."""
    return tuple(x[:1].expand(micro, *x.shape[1:]).contiguous()
                 if isinstance(x, torch.Tensor) and x.dim() else x for x in example_inputs)


class Planner:
    """Compiles ``model`` under many configurations from one trace per
    micro-batch.  ``options``: a ``poptorchsim.Options`` with the settings
    the search keeps (precision, loss scaling, target IPU, ...); the
    searched ones (replication, accumulation, strategy, memory proportion,
    optimizer location, partials, recomputation) are set per configuration."""

    def __init__(self, model, example_inputs, optimizer=None, options=None, ipus=16,
                 max_ipus_per_replica=8):
        annotated = [n or "the model" for n, m in model.named_modules() if _blocks.block_hooks(m)]
        if annotated:
            raise Error(f"The model already places its layers on IPUs (BeginBlock on "
                        f"{', '.join(annotated[:3])}{', ...' if len(annotated) > 3 else ''}); "
                        "the planner chooses the split itself. Plan the model without "
                        "BeginBlock (or poptorch.removeBlocks(model)), then apply the split "
                        "it suggests.")
        self.model = model
        self.example_inputs = tuple(example_inputs)
        self.optimizer = optimizer or torch.optim.SGD(model.parameters(), lr=0.01)
        base = CompileConfig.from_options(options, True) if options is not None \
            else CompileConfig(True)
        self.base = replace(base, show_progress=False, allow_oom=True, device_iterations=1)
        self.ipus = ipus
        self.max_ipus_per_replica = min(max_ipus_per_replica, ipus)
        self.units = [n for n, _ in units_of(model, self.max_ipus_per_replica)]
        self.repeated = _repeated(self.units)
        self._captures = {}           # micro-batch -> the trace
        self._traces = {}             # the optimizer's traced update rules
        self._costs = {}              # micro-batch -> (cycles, bytes) per unit
        self.compiles = 0

    # -- compiling ------------------------------------------------------------------------
    def _config(self, c):
        precision = dict(self.base.precision or {})
        precision["partials"] = c.partials
        ipu_of = dict(zip(self.units, c.ipu_of_unit))
        amp = dict(enumerate(c.amp)) if isinstance(c.amp, tuple) else c.amp
        return replace(
            self.base, replicas=c.replicas, accumulation=c.accumulation, amp=amp,
            locations={**(self.base.locations or {}), **OPTIMIZER_STATE[c.optimizer_state]},
            precision=precision, recomputation=RECOMPUTATION[c.recomputation],
            placement=UnitPlacement(ipu_of, pipelined=c.ipus_per_replica > 1))

    def _compile(self, config, micro):
        """``compile_training`` under ``config``: the trace of ``micro`` kept
        (made here the first time, with every unit its own block)."""
        handles = []
        capture = self._captures.get(micro)
        if capture is None:
            modules = dict(self.model.named_modules())
            handles = [modules[n].register_forward_pre_hook(
                lambda mod, args, n=n: _blocks.enter_block(n, 0, args)) for n in self.units]
            self.compiles += 1
        log = logging.getLogger("poptorchsim")
        level = log.level
        log.setLevel(logging.ERROR)   # out-of-memory configurations are reported, not logged
        try:
            compiled = compiler.compile_training(
                self.model, self.optimizer, _rebatched(self.example_inputs, micro), {}, config,
                capture=capture, traces=self._traces, estimate_only=True)
        finally:
            log.setLevel(level)
            for h in handles:
                h.remove()
        self._captures.setdefault(micro, compiled.capture)
        return compiled

    def evaluate(self, c):
        """``c`` compiled and costed."""
        start = time.perf_counter()
        try:
            compiled = self._compile(self._config(c), c.micro_batch)
        except Error as exc:
            return Evaluated(c, False, [], 0, 0.0, f"{type(exc).__name__}: {exc}",
                             time.perf_counter() - start)
        reports = compiled.memory.ipus or [compiled.memory]
        peaks = [int(r.total.max()) for r in reports]
        capacity = reports[0].capacity
        over = [i for i, p in enumerate(peaks) if p > capacity]
        seconds = compiled.cycles["seconds"]
        rate = c.micro_batch * c.accumulation * c.replicas / seconds if seconds else 0.0
        reason = ""
        if over:
            i = over[0]
            reason = (f"IPU {i} out of memory: peak tile {peaks[i] / 1024:.0f} KiB of "
                      f"{capacity / 1024:.0f} KiB"
                      + (f" ({len(over)} IPUs over)" if len(over) > 1 else ""))
        return Evaluated(c, not over, peaks, capacity, rate, reason,
                         time.perf_counter() - start)

    # -- splits -----------------------------------------------------------------------------
    def unit_costs(self, micro):
        """(cycles, bytes) of each unit at micro-batch ``micro``, from one
        compile with every unit its own stage on one IPU: its ops' cycles;
        its variables (weights, gradients, optimizer state) and activations."""
        if micro in self._costs:
            return self._costs[micro]
        compiled = self._compile(replace(self.base, placement=OneStagePerBlock(),
                                         replicas=1, accumulation=1), micro)
        blocks = list(dict.fromkeys(b for b, _ in compiled.capture.blocks))
        stage_of = {b: i for i, b in enumerate(blocks)}
        index = {stage_of[u]: k for k, u in enumerate(self.units) if u in stage_of}
        graph = compiled.program.graphs["training_step"]
        costs = compiled.costs["training_step"]
        cycles, nbytes = [0.0] * len(self.units), [0] * len(self.units)
        for op, cost in zip(graph.ops, costs):
            k = index.get(op.stage, 0)
            cycles[k] += cost.total
            nbytes[k] += sum(t.nbytes for t in op.outputs if t is not None and not op.backward)
        params = dict(self.model.named_parameters())
        state = 2 + len(compiled.slots[0][1]) if compiled.slots else 2
        seen = set()
        for k, u in enumerate(self.units):
            for n, p in params.items():
                if (n == u or n.startswith(u + ".")) and id(p) not in seen:
                    seen.add(id(p))
                    nbytes[k] += state * p.numel() * p.element_size()
        self._costs[micro] = (cycles, nbytes)
        return cycles, nbytes

    def splits(self, k, micro):
        """Candidate splits over ``k`` IPUs (tuples of each unit's IPU): the
        units cut in ``k`` contiguous groups balancing cycles within the
        memory; where the model has units before and after its repeated
        layers (embeddings, and heads often tied to them), those ends on IPU
        0 with the repeated layers spread over the IPUs (Graphcore's BERT and
        GPT-2 layout), IPU 0 taking as many of them as balances best, and
        none.  A split that leaves an IPU empty is dropped."""
        n = len(self.units)
        if k == 1:
            return [(0,) * n]
        if k > n:
            return []
        cycles, nbytes = self.unit_costs(micro)
        capacity = self.base.target.total_bytes
        out = [tuple(ipu for ipu, g in enumerate(partition(cycles, nbytes, k, capacity))
                     for _ in g)]
        first, last = (min(self.repeated), max(self.repeated)) if self.repeated else (0, n - 1)
        middle = list(range(first, last + 1))
        ends = [i for i in range(n) if i < first or i > last]
        if ends and len(middle) >= k - 1:
            end_cycles = sum(cycles[i] for i in ends)
            best = None
            for j in range(0, len(middle) - (k - 1) + 1):
                rest = middle[j:]
                groups = partition([cycles[i] for i in rest], [nbytes[i] for i in rest],
                                    k - 1, capacity)
                load = max([end_cycles + sum(cycles[i] for i in middle[:j])]
                           + [sum(cycles[rest[i]] for i in g) for g in groups])
                ipu = {i: 0 for i in ends + middle[:j]}
                ipu.update({rest[i]: g_i + 1 for g_i, g in enumerate(groups) for i in g})
                split = tuple(ipu[i] for i in range(n))
                if j == 0:
                    out.append(split)
                if best is None or load < best[0]:
                    best = (load, split)
            out.append(best[1])
        # every IPU holds a layer
        return [s for s in dict.fromkeys(out) if len(set(s)) == k]

    # -- the search ------------------------------------------------------------------------------
    def search(self, micro_batches=(1, 2, 4, 8, 16, 32), global_batch=None,
               ipus_per_replica=None, amps=(0.6, 0.45, 0.3, 0.15),
               optimizer_states=("on chip", "off chip", "sharded"), partials=None,
               recomputations=("default",), include=(), accumulation=None, progress=True):
        """Evaluate configurations; returns a ``PlanResult`` ranked by
        estimated throughput (fitting ones first).  ``global_batch``: the
        samples per weight update (accumulation = global batch / (micro-batch
        x replicas), rounded up); else ``accumulation`` (default: 4 x the
        pipeline stages, at least 1).  ``include``: configurations to
        evaluate whatever the search finds (a published one, to compare)."""
        start = time.perf_counter()
        half = any(p.dtype == torch.float16 for p in self.model.parameters())
        partials = partials or (("half", "float") if half else ("float",))
        ks = [k for k in (ipus_per_replica or [1, 2, 4, 8, 16, 32, 64])
              if self.ipus % k == 0 and k <= self.max_ipus_per_replica]
        if not ks:
            raise Error(f"No IPUs-per-replica count divides {self.ipus} IPUs; pass "
                        "ipus_per_replica= with a divisor of ipus=.")
        settings = [(o, p, a, r) for o in optimizer_states for p in partials for a in amps
                    for r in recomputations]
        results, done = [], set()
        bar = tqdm(desc="Planning", unit="config", disable=not progress)

        def run(c):
            if c in done:
                return next(r for r in results if r.config == c)
            done.add(c)
            r = self.evaluate(c)
            results.append(r)
            bar.update(1)
            bar.set_postfix(fit=sum(x.fits for x in results))
            return r

        for c in include:
            run(c)
        for k in ks:
            replicas = self.ipus // k
            dead = set()              # splits that did not fit at a smaller micro-batch
            for micro in sorted(micro_batches):
                fitted_any = False
                for split in self.splits(k, micro):
                    if split in dead:
                        continue
                    stages = stages_of(split)
                    if global_batch:
                        ga = max(1, math.ceil(global_batch / (micro * replicas)))
                    else:
                        ga = accumulation or (4 * stages if stages > 1 else 1)
                    if stages > 1:
                        ga = max(ga, 2 * stages)
                    fitted = False
                    for o, p, a, r in settings:
                        if o == "sharded" and replicas == 1:
                            continue
                        res = run(Configuration(micro, split, replicas, ga, a, o, p, r))
                        if res.fits:
                            fitted = True
                            break     # later settings only save memory at a cost in speed
                        if not res.peak_tile:
                            break     # it did not compile (a tied weight on two IPUs, ...)
                    if fitted:
                        fitted_any = True
                    else:
                        dead.add(split)
                if not fitted_any:
                    break             # nothing fits at this micro-batch: larger ones won't
        bar.close()
        results.sort(key=lambda r: (not r.fits, -r.samples_per_second))
        return PlanResult(self.units, self.repeated, self.ipus, self.base.target.name,
                          results, time.perf_counter() - start, self.compiles,
                          included=list(include))


def units_of(model, k):
    """The candidate layers of a split over up to ``k`` IPUs, in definition
    order: the model's children, the largest expanded into its own children
    until there are 3k of them, a numbered layer of a list
    (``encoder.layer.3``) kept whole once there are k."""
    units = [(n, m) for n, m in model.named_children()
             if not isinstance(m, torch.nn.modules.loss._Loss)]
    while len(units) < 3 * k:
        expandable = [(sum(p.numel() for p in m.parameters()), i) for i, (n, m)
                      in enumerate(units) if any(True for _ in m.children())
                      and not (n.rpartition(".")[2].isdigit() and len(units) >= k)]
        if not expandable:
            break
        _, i = max(expandable)
        name, module = units[i]
        units[i:i + 1] = [(f"{name}.{c}", m) for c, m in module.named_children()
                          if not isinstance(m, torch.nn.modules.loss._Loss)]
    return units


def _repeated(units):
    """Indices of the units that are numbered layers of one list
    (``encoder.layer.3``, ``transformer.h.11``): the longest such run."""
    runs = {}
    for i, u in enumerate(units):
        head, _, tail = u.rpartition(".")
        if tail.isdigit():
            runs.setdefault(head, []).append(i)
    best = max(runs.values(), key=len, default=[])
    return set(best) if len(best) > 1 else set()


def plan(model, example_inputs, ipus=16, optimizer=None, options=None, **search):
    """``Planner(...).search(**search)`` in one call."""
    max_k = search.pop("max_ipus_per_replica", 8)
    planner = Planner(model, example_inputs, optimizer, options, ipus, max_k)
    return planner.search(**search)
