"""The simulation's results as ``PoplarExecutor`` reports them: memory per
tile, the cycle estimate, the fp16 report, sensitivity, the JSON report,
PopTorch's performance counters and latencies, the compilation time.

``SimulationResults`` holds what the calls leave behind (the last call's
simulated timestamps and the simulated clock); the functions read a
compiled program given to them.  The executor owns one ``SimulationResults``
and calls these with its compiled program (composition: nothing here reads
the executor's attributes)."""
import datetime

from ...errors import Error
from .. import compiler
from ..reports.perf import call_timeline, latency

NO_COUNTERS = ("input", "input_complete", "output", "output_complete")


class SimulationResults:
    """PopTorch's performance counters: the simulated timestamps (seconds)
    of the last call, on a clock that runs on from call to call."""

    def __init__(self, output_mode, return_period):
        self.output_mode, self.return_period = output_mode, return_period
        self.perf = None            # {counter: rows of timestamps}, or None
        self.clock = 0.0            # the simulated device clock (seconds)

    def record_call(self, compiled, n_inputs, di, ga, rf):
        """The timestamps of a call of ``compiled`` with ``n_inputs`` inputs
        over ``di`` x ``ga`` x ``rf`` micro-batches (none with synthetic data,
        as in PopTorch)."""
        program = compiled.program
        if program.synthetic_data:
            self.perf = None
            return
        self.perf, self.clock = call_timeline(
            compiled.cycles, compiled.target, di, ga, rf, n_inputs,
            compiled.capture.n_tensor_outputs, program.in_bytes, program.out_bytes,
            self.output_mode.name, self.return_period, self.clock)

    def counters(self):
        """``getPerfCounters()``: per counter, per tensor, per step."""
        if self.perf is None:
            return {k: [[]] for k in NO_COUNTERS}
        return {k: [list(v) for v in rows] for k, rows in self.perf.items()}

    def latency(self, start, end):
        """(min, max, avg) seconds from counter ``start`` to ``end``."""
        return latency(self.counters(), start, end)


def model_name(options, training):
    """The report's name for the model (``Options.modelName``, else its kind)."""
    return getattr(options, "model_name", "training" if training else "inference")


def cycle_estimate(compiled, engine=None):
    """Estimated cycles of one call, split compute/exchange/sync/host.  A
    program with conditionals (``poptorch.cond``) pays the longer branch
    until it has run; then, the branches its last call took (``engine``'s)."""
    branches = getattr(getattr(engine, "step_fn", None), "branches", None)
    if branches and any(sum(v) for v in branches.values()):
        return dict(compiler.estimate_with_branches(compiled, branches))
    return dict(compiled.cycles)


def precision_report(compiled, training, gradients, state):
    """fp16 in the last training call (``passes.precision.GradientMonitor``)."""
    if not training:
        return {"loss_scale": 1.0, "automatic_loss_scaling": None, "gradients": None}
    return gradients.report(compiled, state)


def sensitivity_rows(compiled, options, top=None):
    """Per cost-model constant, the relative change of the samples/s
    estimate with it x0.8 and x1.2, the constants that move it most first."""
    from ..planning.sensitivity import sensitivity
    amp = options.available_memory_proportion.get("IPU0", 0.6)
    rows = [r.as_dict() for r in sensitivity(compiled, amp)]
    return rows[:top] if top else rows


def simulation_report(compiled, name, samples, precision, sensitivity=None):
    """The JSON-ready report (``reports/report.py``) of ``samples`` per call."""
    from ..reports.report import build_report
    report = build_report(compiled, name, samples)
    report["precision"] = precision
    if sensitivity is not None:
        report["sensitivity"] = sensitivity
    return report


def compilation_time(compiled, options):
    """PopTorch's ``compilationTime()``: how long the compile took."""
    if compiled is None:
        raise Error("Please compile the model before obtaining compilation time.")
    if not options.show_compilation_progress_bar:
        raise Error("Please set showCompilationProgressBar option to obtain "
                    "compilation time.")
    return datetime.timedelta(seconds=compiled.compile_seconds)
