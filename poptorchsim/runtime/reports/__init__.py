"""runtime/reports/: what a compiled model reports: the simulation report, perf
counters, PopTorch's debug output."""
