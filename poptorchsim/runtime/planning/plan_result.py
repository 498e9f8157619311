"""What the planner (``runtime/planning/planner.py``) finds: a ``Configuration``
(one way to train the model on the IPUs), its ``Evaluated`` compile, and the
ranked ``PlanResult`` with the table a person reads and its JSON."""
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Configuration:
    """One way to train the model on the IPUs."""
    micro_batch: int
    ipu_of_unit: tuple                # the IPU of each unit, in execution order
    replicas: int
    accumulation: int
    amp: object = 0.6                 # available memory proportion: one, or one per IPU
    optimizer_state: str = "on chip"  # a key of OPTIMIZER_STATE
    partials: str = "float"           # "float" or "half"
    recomputation: str = "default"    # a key of RECOMPUTATION

    @property
    def ipus_per_replica(self):
        return max(self.ipu_of_unit) + 1

    @property
    def ipus(self):
        return self.ipus_per_replica * self.replicas

    @property
    def global_batch(self):
        return self.micro_batch * self.replicas * self.accumulation

    def layers_per_ipu(self, repeated=None):
        """Units per IPU; ``repeated``: only the units whose indices it holds
        (the repeated layers, as Graphcore's ``layers_per_ipu`` counts them;
        empty or None: all units)."""
        counts = [0] * self.ipus_per_replica
        for i, ipu in enumerate(self.ipu_of_unit):
            if not repeated or i in repeated:
                counts[ipu] += 1
        return counts

    def describe(self, repeated=None, units=None):
        """One line; ``units`` (the unit names): where the units outside
        ``repeated`` sit too, since ``layers [..]`` counts only the repeated
        ones and two splits may differ only there."""
        split = f", layers {self.layers_per_ipu(repeated)}" if self.ipus_per_replica > 1 else ""
        if split and repeated and units:
            others = {}
            for i, ipu in enumerate(self.ipu_of_unit):
                if i not in repeated:
                    others.setdefault(ipu, []).append(units[i])
            split += "".join(f", {', '.join(names)} on IPU {ipu}"
                             for ipu, names in sorted(others.items()))
        return (f"{self.ipus_per_replica} IPU{'s' if self.ipus_per_replica > 1 else ''} x "
                f"{self.replicas} replica{'s' if self.replicas > 1 else ''}{split}, "
                f"micro-batch {self.micro_batch}, accumulation {self.accumulation}, "
                f"AMP {_amp_text(self.amp)}, optimizer state {self.optimizer_state}, "
                f"{self.partials} partials, recomputation {self.recomputation}")


@dataclass
class Evaluated:
    """A configuration compiled: does it fit, how fast would it train."""
    config: Configuration
    fits: bool
    peak_tile: list                   # bytes of the fullest tile, per IPU of a replica
    capacity: int                     # bytes per tile
    samples_per_second: float
    reason: str = ""                  # why it does not fit (or could not compile)
    seconds: float = 0.0              # host seconds the evaluation took

    @property
    def headroom(self):
        """Free share of the fullest tile of the fullest IPU."""
        if not self.peak_tile:
            return float("nan")
        return 1.0 - max(self.peak_tile) / self.capacity


def _amp_text(amp):
    return "[" + ", ".join(f"{a:g}" for a in amp) + "]" if isinstance(amp, tuple) else f"{amp:g}"


@dataclass
class PlanResult:
    """What ``Planner.search`` found, best first."""
    units: list                       # unit names, in execution order
    repeated: set                     # indices of the repeated layers (layers_per_ipu)
    ipus: int
    target_name: str
    results: list                     # Evaluated, ranked
    seconds: float = 0.0
    compiles: int = 0
    included: list = field(default_factory=list)   # the configurations given to evaluate

    @property
    def fitting(self):
        return [r for r in self.results if r.fits]

    @property
    def best(self):
        fit = self.fitting
        return fit[0] if fit else None

    def find(self, config):
        """The evaluation of ``config`` (None if it was not considered)."""
        return next((r for r in self.results if r.config == config), None)

    def table(self, limit=15, rejected=8):
        """The ranked table a person reads: the best fitting configurations,
        then the rejected ones with the reason."""
        each = self.seconds / max(len(self.results), 1)
        lines = [f"{len(self.results)} configurations of {self.ipus} {self.target_name} IPUs "
                 f"considered in {self.seconds:.1f} s ({each:.2f} s each, {self.compiles} "
                 f"traces); {len(self.fitting)} fit.",
                 f"{'rank':>4} {'samples/s':>10} {'headroom':>8}  {'peak tile per IPU (KiB)':<28} "
                 "configuration"]
        for k, r in enumerate(self.fitting[:limit]):
            peaks = ", ".join(f"{p / 1024:.0f}" for p in r.peak_tile)
            lines.append(f"{k + 1:>4} {r.samples_per_second:>10.1f} {r.headroom:>8.1%}  "
                         f"{peaks:<28} {r.config.describe(self.repeated, self.units)}")
        bad = [r for r in self.results if not r.fits]
        if bad:
            lines.append(f"rejected ({len(bad)}), for example:")
            for r in bad[:rejected]:
                lines.append(f"     {r.config.describe(self.repeated, self.units)}: "
                             + r.reason.splitlines()[0])
        return "\n".join(lines)

    __str__ = table

    def to_json(self):
        return {"ipus": self.ipus, "target": self.target_name, "units": self.units,
                "seconds": self.seconds, "results": [
                    {"config": {**r.config.__dict__,
                                "layers_per_ipu": r.config.layers_per_ipu(self.repeated)},
                     "fits": r.fits, "peak_tile": r.peak_tile, "capacity": r.capacity,
                     "samples_per_second": r.samples_per_second, "headroom": r.headroom,
                     "reason": r.reason, "seconds": r.seconds} for r in self.results]}

    def plot(self, path):
        """A PNG: estimated throughput against memory headroom, one point per
        configuration (fitting ones filled), the best and the included ones
        marked (``profiling.plan_plot``)."""
        from ...profiling.plan_plot import plot_plan
        return plot_plan(self, path)
