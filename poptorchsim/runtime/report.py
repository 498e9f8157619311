"""The simulation report: one plain dict (JSON-ready) per compiled model.

``PoplarExecutor.simulationReport()`` returns it; ``profiling`` writes it to
disk as JSON, PNG plots and an HTML page.  Arrays over tiles are lists.
"""
import numpy as np

from ..machine.precision import HALF, rounds_stochastically, uses_half_partials
from ..passes.liveness import graph_liveness_profile
from ..passes.memory import dtype_name


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
    liveness = {g: graph_liveness_profile(graph, target.tiles).tolist()
                for g, graph in program.graphs.items()}
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
            "fits": bool(total.max() <= memory.capacity),
            "tiles_over": int((total > memory.capacity).sum()),
            "largest_on_peak_tile": [[n, b] for b, n in memory.largest_on(peak_tile, 10)],
            "peak_tile_tensors": [{"name": n, "dtype": d, "bytes": b}
                                  for n, d, b in memory.tensors_on(peak_tile, 10)],
            "always_live_bytes": int(memory.always_live.sum()),
            "always_live_by_dtype": memory.bytes_by_dtype(),
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
        "ipus": [{"ipu": r.ipu, "peak_tile": int(np.argmax(r.total)),
                  "peak_bytes": int(r.total.max()), "fits": bool(r.total.max() <= r.capacity),
                  "total": r.total.tolist()}
                 for r in (memory.ipus or [memory])],
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
