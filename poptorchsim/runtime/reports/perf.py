"""Simulated host-IPU timestamps of one call: PopTorch's perf counters.

The simulated clock advances by the machine's estimate: each device
iteration streams its micro-batches in over PCIe, computes, and streams the
outputs the output mode keeps back.  Timestamps are seconds on a clock that
starts at the executor's first call and runs on across calls.
"""


def call_timeline(cycles, target, di, ga, rf, n_inputs, n_outputs, in_bytes, out_bytes,
                  mode, period, start):
    """(perf counters dict, end time) of one call starting at ``start``."""
    clock = target.clock_hz
    device_s = (cycles["total"] - cycles["host"]) / clock / di
    micro = ga * rf
    in_s = target.host_latency_s * micro * n_inputs + in_bytes / di / target.host_bytes_per_s
    keep = {"All": lambda i: True, "EveryN": lambda i: (i + 1) % period == 0,
            "Final": lambda i: i == di - 1, "Sum": lambda i: i == di - 1}[mode]
    per_iter_out = micro if mode in ("All", "EveryN") else rf
    kept_iters = sum(1 for i in range(di) if keep(i)) or 1
    out_s = target.host_latency_s + out_bytes / kept_iters / target.host_bytes_per_s
    counters = {k: [[] for _ in range(n)] for k, n in
                (("input", n_inputs), ("input_complete", n_inputs),
                 ("output", n_outputs), ("output_complete", n_outputs))}
    t = start
    for i in range(di):
        for j in range(micro):
            for k in range(n_inputs):
                counters["input"][k].append(t + j * in_s / micro)
                counters["input_complete"][k].append(t + (j + 1) * in_s / micro)
        t += in_s + device_s
        if keep(i):
            for j in range(per_iter_out):
                for k in range(n_outputs):
                    counters["output"][k].append(t + j * out_s / per_iter_out)
                    counters["output_complete"][k].append(t + (j + 1) * out_s / per_iter_out)
            t += out_s
    return counters, t


def latency(counters, start_key, end_key):
    """(min, max, avg) seconds between two counters, over the first tensors."""
    starts = counters[start_key][0] if counters[start_key] else []
    ends = counters[end_key][0] if counters[end_key] else []
    if not starts or not ends:
        return (0.0, 0.0, 0.0)
    if len(starts) != len(ends):
        # outputs are fewer than inputs (Final, Sum, EveryN): pair each output
        # with the last input before it
        paired = []
        for e in ends:
            before = [s for s in starts if s <= e]
            paired.append(e - (before[-1] if before else starts[0]))
    else:
        paired = [e - s for s, e in zip(starts, ends)]
    return (min(paired), max(paired), sum(paired) / len(paired))
