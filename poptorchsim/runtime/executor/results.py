"""``PoplarExecutor``'s simulation results: memory per tile, the cycle
estimate, the fp16 report, sensitivity, the JSON report, PopTorch's
performance counters and latencies, the compilation time.  ``executor.py``
mixes ``_SimulationResults`` into ``PoplarExecutor``."""
from ...errors import Error
from .. import compiler
from ..reports.perf import call_timeline, latency


class _SimulationResults:
    """Needs ``_require_compiled``, ``_compiled``, ``_options``, ``_training``,
    ``_factors``, ``_gradients``, ``_state``, ``_output_mode``, ``_perf`` and
    ``_sim_clock`` from the executor."""

    def memoryReport(self):
        """The compiled program's memory per tile (``passes.memory.MemoryReport``)."""
        self._require_compiled()
        return self._compiled.memory

    def cycleEstimate(self):
        """Estimated cycles of one call, split compute/exchange/sync/host.
        A program with conditionals (``poptorch.cond``) pays the longer
        branch until it has run; then, the branches its last call took."""
        self._require_compiled()
        taken = self._branches_taken()
        if taken:
            return dict(compiler.estimate_with_branches(self._compiled, taken))
        return dict(self._compiled.cycles)

    def _branches_taken(self):
        """{conditional op: [then, else] counts} of the last call, or None."""
        engine = getattr(self, "_engine", None)
        branches = getattr(getattr(engine, "step_fn", None), "branches", None)
        return branches if branches and any(sum(v) for v in branches.values()) else None

    def precisionReport(self):
        """fp16 in the last training call: the loss scale (and, with automatic
        loss scaling, its update factor and the scale after each weight
        update), and how many fp16 values the backward pass computed
        underflowed to zero or overflowed to infinity (against the same op
        in fp32), with the ops that lost the most."""
        self._require_compiled()
        if not self._training:
            return {"loss_scale": 1.0, "automatic_loss_scaling": None, "gradients": None}
        return self._gradients.report(self._compiled, self._state)

    def estimateSensitivity(self, top=None):
        """How far to trust the throughput estimate: per cost-model constant
        (``estimate.constants``), the relative change of the samples/s
        estimate with it x0.8 (``low``) and x1.2 (``high``), the constants
        that move it most first (``top`` of them, or all).  Only the costs
        are recomputed, not the graph."""
        from ..planning.sensitivity import sensitivity
        self._require_compiled()
        amp = self._options.available_memory_proportion.get("IPU0", 0.6)
        rows = [r.as_dict() for r in sensitivity(self._compiled, amp)]
        return rows[:top] if top else rows

    def simulationReport(self, sensitivity=False):
        """Memory per tile, cycles per call and per op, liveness: a JSON-ready dict
        (with ``sensitivity=True`` also ``estimateSensitivity()``'s rows)."""
        from ..reports.report import build_report
        self._require_compiled()
        di, ga, rf = self._input_factors()        # the samples one call takes
        micro = self._compiled.capture.example_inputs
        batch = micro[0].shape[0] if micro and micro[0].dim() else 1
        report = build_report(self._compiled, self._model_name(), batch * di * ga * rf)
        report["precision"] = self.precisionReport()
        if sensitivity:
            report["sensitivity"] = self.estimateSensitivity()
        return report

    def _model_name(self):
        return getattr(self._options, "model_name",
                       "training" if self._training else "inference")

    def _record_perf(self, n_inputs, di, ga, rf):
        c = self._compiled
        program = c.program
        if program.synthetic_data:        # no host IO, no perf counters (PopTorch)
            self._perf = None
            return
        self._perf, self._sim_clock = call_timeline(
            c.cycles, c.target, di, ga, rf, n_inputs, c.capture.n_tensor_outputs,
            program.in_bytes, program.out_bytes, self._output_mode.name,
            self._options.output_return_period, self._sim_clock)

    def getPerfCounters(self):
        """Simulated timestamps (seconds) of the last call: per tensor, per step."""
        if self._perf is None:
            return {k: [[]] for k in ("input", "input_complete", "output", "output_complete")}
        return {k: [list(v) for v in rows] for k, rows in self._perf.items()}

    def getHostIpuLatency(self):
        """(min, max, avg) seconds from input to input_complete."""
        return latency(self.getPerfCounters(), "input", "input_complete")

    def getComputeLatency(self):
        """(min, max, avg) seconds from input_complete to output."""
        return latency(self.getPerfCounters(), "input_complete", "output")

    def getIpuHostLatency(self):
        """(min, max, avg) seconds from output to output_complete."""
        return latency(self.getPerfCounters(), "output", "output_complete")

    def getLatency(self):
        """(min, max, avg) seconds from input to output_complete."""
        return latency(self.getPerfCounters(), "input", "output_complete")

    def compilationTime(self):
        import datetime
        if self._compiled is None:
            raise Error("Please compile the model before obtaining compilation time.")
        if not self._options.show_compilation_progress_bar:
            raise Error("Please set showCompilationProgressBar option to obtain "
                        "compilation time.")
        return datetime.timedelta(seconds=self._compiled.compile_seconds)
