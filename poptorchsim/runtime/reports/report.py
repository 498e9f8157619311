"""The simulation report: one plain dict (JSON-ready) per compiled model.

``PoplarExecutor.simulationReport()`` returns it; ``profiling`` writes it to
disk as JSON, PNG plots and an HTML page.  Arrays over tiles are lists.
"""
import numpy as np

from ...machine.precision import HALF, rounds_stochastically, uses_half_partials
from ...passes.memory import dtype_name


def _calls_per_call(program, graph_name):
    """How many times one call of the model runs a graph (per replica)."""
    di, ga = program.device_iterations, program.accumulation
    if graph_name in ("training_step", "inference_forward"):
        return di * ga
    return di


def rounding(op, graph):
    """How ``op`` rounds its result: "half partials" (a matmul or convolution
    marked by ``Precision.setPartialsType(torch.half)``), "stochastic" (an
    fp16 result while ``enableStochasticRounding(True)``), else "nearest"."""
    if uses_half_partials(op):
        return "half partials"
    if graph.rounding is not None and rounds_stochastically(op) and \
            any(t is not None and t.dtype == HALF for t in op.outputs):
        return "stochastic"
    return "nearest"


def build_report(compiled, name, samples_per_call):
    program, target, memory = compiled.program, compiled.target, compiled.memory
    total = memory.total
    peak_tile = int(np.argmax(total))
    ops = []
    for gname, graph in program.graphs.items():
        times = _calls_per_call(program, gname)
        for op, cost in zip(graph.ops, compiled.costs[gname]):
            out = next((t for t in op.outputs if t is not None), None)
            ops.append({
                "graph": gname, "name": op.name, "op": str(op.target),
                "class": op.cost_class, "shape": list(out.shape) if out is not None else [],
                "dtype": dtype_name(out.dtype) if out is not None else "",
                "rounding": rounding(op, graph),
                "role": op.role or ("host scalar" if op.host_scalar else ""),
                "compute": cost.compute, "exchange": cost.exchange, "sync": cost.sync,
                "host": cost.host,
                "cycles": cost.total, "calls_per_call": times,
                "cycles_per_call": cost.total * times,
                "macs": int(cost.macs), "flops": int(cost.flops),
            })
    ops.sort(key=lambda r: -r["cycles_per_call"])
    cycles = dict(compiled.cycles)
    seconds = cycles["seconds"]
    reports = memory.ipus or [memory]
    ipus = [ipu_memory(r, program) for r in reports]
    liveness = {g: np.sum([ipu["liveness"][g] for ipu in ipus], axis=0).astype(np.int64).tolist()
                for g in program.graphs}
    worst = max(ipus, key=lambda r: (r["peak_bytes"], -r["ipu"]))
    by_dtype = {}
    for r in reports:
        for d, b in r.bytes_by_dtype().items():
            by_dtype[d] = by_dtype.get(d, 0) + b
    return {
        "model": name,
        "kind": program.kind,
        "target": target.as_dict(),
        "batching": {"device_iterations": program.device_iterations,
                     "gradient_accumulation": program.accumulation,
                     "replicas": program.replicas, "samples_per_call": samples_per_call},
        "memory": {
            "capacity": memory.capacity,
            "always_live": memory.always_live.tolist(),
            "not_always_live": memory.not_always_live.tolist(),
            "total": total.tolist(),
            "peak_tile": peak_tile,
            "peak_bytes": int(total[peak_tile]),
            # the verdict covers every IPU; the arrays above are IPU 0's
            "fits": all(r["fits"] for r in ipus),
            "tiles_over": sum(r["tiles_over"] for r in ipus),
            "peak_ipu": worst["ipu"], "peak_ipu_tile": worst["peak_tile"],
            "peak_ipu_bytes": worst["peak_bytes"],
            "largest_on_peak_tile": [[n, b] for b, n in memory.largest_on(peak_tile, 10)],
            "peak_tile_tensors": [{"name": n, "dtype": d, "bytes": b}
                                  for n, d, b in memory.tensors_on(peak_tile, 10)],
            "always_live_bytes": int(memory.always_live.sum()),
            "always_live_by_dtype": dict(sorted(by_dtype.items(),
                                                key=lambda kv: (-kv[1], kv[0]))),
            "saved_per_tile": memory.saved_per_tile.tolist(),
            "recomputation": _recomputation(memory, cycles),
        },
        "replication": {"replicas": program.total_replicas, "processes": program.processes,
                        "replicas_per_process": program.replicas,
                        "ipus_per_replica": program.n_ipus,
                        "ipus": program.n_ipus * program.total_replicas,
                        "collective_cycles_per_call": cycles.get("collective", 0.0)},
        "tensor_locations": _locations(program, memory),
        "cycles": {
            "per_call": {k: cycles.get(k, 0.0) for k in CYCLE_KINDS + ("total",)},
            "seconds_per_call": seconds,
            "samples_per_second": samples_per_call / seconds if seconds else 0.0,
        },
        "ops": ops,
        "liveness": liveness,
        "pipeline": _pipeline(program, compiled.schedule, target),
        "ipus": ipus,
        "program_text": program_text(program),
    }


PROGRAM_TEXT_LINES = 3000


def program_text(program, limit=PROGRAM_TEXT_LINES):
    """The program as ``getIR()`` prints it, cut after ``limit`` lines."""
    lines = str(program).splitlines()
    if len(lines) > limit:
        lines = lines[:limit] + [f"... {len(lines) - limit} more lines (print(getIR()))"]
    return "\n".join(lines)


NOT_MODELLED = {
    "exchange_buffers": "not modelled separately: the operand slices a matmul or "
                        "convolution receives over the exchange are counted among its "
                        "temporaries (not-always-live)",
}


def _category(per_tile, peak, note, modelled=True):
    per_tile = np.asarray(per_tile, dtype=np.int64)
    return {"modelled": modelled, "note": note, "bytes": int(per_tile.sum()),
            "peak_tile_bytes": int(per_tile[peak]) if len(per_tile) else 0,
            "max_tile_bytes": int(per_tile.max(initial=0)), "per_tile": per_tile.tolist()}


def memory_categories(r, peak):
    """Memory per tile of one IPU split into PopVision's categories, as far
    as the memory model knows them (``passes/memory.py``): the parts of
    always-live memory (control code, vertex state, variables, input stream
    buffers) and the not-always-live peak; a category the model does not
    hold is marked ``modelled: False`` with no bytes."""
    tiles = len(r.total)
    code = r.code_bytes_per_tile + (0 if r.control_code is None else r.control_code)
    code = np.broadcast_to(np.asarray(code, dtype=np.int64), (tiles,))
    state = r.vertex_state if r.vertex_state is not None else np.zeros(tiles, np.int64)
    variables = np.zeros(tiles, dtype=np.int64)
    streams = np.zeros(tiles, dtype=np.int64)
    for name, per_tile in r.by_tensor.items():
        if getattr(r, "roles", {}).get(name) == "input":
            streams += np.asarray(per_tile, dtype=np.int64)
        else:
            variables += np.asarray(per_tile, dtype=np.int64)
    out = {
        "code": _category(code, peak, "runtime and control code: the target's "
                                      "code_bytes_per_tile on every tile, and "
                                      "control_code_bytes_per_step for each compute set "
                                      "a tile takes part in (identical ops share theirs)"),
        "vertex_state": _category(state, peak, "48 B per op on each tile its results "
                                               "live on (identical ops share theirs)"),
        "variables": _category(variables, peak, "always-live: weights, buffers, optimizer "
                                                "state, accumulators, hyperparameters"),
        "stream_buffers": _category(streams, peak, "always-live: input stream buffers "
                                                   "the host writes"),
        "not_always_live": _category(r.not_always_live, peak,
                                     "each tile's peak of live intermediate tensors and "
                                     "temporary buffers"),
    }
    for key, note in NOT_MODELLED.items():
        out[key] = {"modelled": False, "note": note}
    return out


def ipu_memory(r, program):
    """One IPU's memory: per tile, by category, its fullest tile, its
    variables by dtype, and its live bytes after each op of each graph
    (summed over its tiles, and on its peak tile)."""
    total = r.total
    peak = int(np.argmax(total))
    liveness, at_peak, peak_step = {}, {}, {}
    for g, graph in program.graphs.items():
        usage = r.graphs.get(g, (np.zeros((0, len(total))),))[0]
        if len(usage):
            usage = np.asarray(usage)     # a liveness.Usage is swept again here
            summed = np.rint(usage.sum(axis=1)).astype(np.int64)
            on_peak = np.rint(usage[:, peak]).astype(np.int64)
            k = int(np.argmax(summed))
            peak_step[g] = {"step": k, "op": graph.ops[k].name, "bytes": int(summed[k])}
        else:
            summed = on_peak = np.zeros(0, dtype=np.int64)
        liveness[g], at_peak[g] = summed.tolist(), on_peak.tolist()
    return {
        "ipu": r.ipu, "capacity": r.capacity, "tiles": len(total),
        "peak_tile": peak, "peak_bytes": int(total[peak]),
        "total_bytes": int(total.sum()),
        "always_live_bytes": int(r.always_live.sum()),
        "fits": bool(total.max() <= r.capacity),
        "tiles_over": int((total > r.capacity).sum()),
        "always_live": r.always_live.tolist(),
        "not_always_live": r.not_always_live.tolist(),
        "total": total.tolist(),
        "categories": memory_categories(r, peak),
        "peak_tile_tensors": [{"name": n, "dtype": d, "bytes": b}
                              for n, d, b in r.tensors_on(peak, 10)],
        "always_live_by_dtype": r.bytes_by_dtype(),
        "liveness": liveness, "liveness_peak_tile": at_peak, "peak_step": peak_step,
    }


def _recomputation(memory, cycles):
    """The recomputation mode, the ops it recomputes, what it saves at the
    peak tile and what it costs (cycles per call), or None when off."""
    ops = memory.recomputed_ops or []
    if not ops:
        return None
    without = memory.not_always_live_without_recomputation
    return {"mode": memory.recomputation, "recomputed_ops": len(ops),
            "peak_not_always_live_bytes": int(memory.not_always_live.max()),
            "peak_not_always_live_bytes_without": int(without.max()),
            "cycles_per_call": float(cycles.get("recompute", 0.0))}


CYCLE_KINDS = ("compute", "exchange", "sync", "collective", "streaming", "host")


def _locations(program, memory):
    """Variables sharded across replicas or kept in Streaming Memory, and
    what that saves on chip (IPU 0 of a replica)."""
    saved = memory.saved_per_tile
    dtypes = {t.name: dtype_name(t.dtype) for g in program.graphs.values() for t in g.inputs}
    rows = [{"name": name, "dtype": dtypes.get(name, ""), "kind": loc.kind,
             "elements": loc.numel, "shards": loc.shards,
             "off_chip": loc.off_chip, "bytes": loc.nbytes,
             "on_chip_bytes_per_replica": loc.on_chip_bytes,
             "saved_bytes_per_replica": loc.saved_bytes}
            for name, loc in sorted(program.locations.items())]
    return {"replicas": program.total_replicas, "processes": program.processes,
            "variables": rows,
            "saved_bytes_per_replica": sum(r["saved_bytes_per_replica"] for r in rows),
            "saved_bytes_max_tile": int(saved.max()) if len(saved) else 0,
            "streaming_bytes_per_replica": int(memory.streaming_bytes)}


def _pipeline(program, sched, target):
    """Stages, IPUs and the timeline of one weight update (cycles -> µs)."""
    if sched is None:
        return None
    us = 1e6 / target.clock_hz
    return {
        "kind": sched.kind, "stages": sched.n_stages, "forward_stages": program.n_stages,
        "ipus": program.n_ipus, "ipu_of_stage": list(program.ipu_of_stage),
        "micro_batches": sched.micro_batches, "bubble": sched.bubble,
        "cycles": sched.cycles, "stage_map": program.stage_map,
        "events": [{"ipu": ipu, "name": name, "start_us": start * us, "duration_us": dur * us}
                   for ipu, name, start, dur in sched.events],
    }
