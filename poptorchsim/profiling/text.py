"""A simulation report as short text, and the number formats the page shares."""
import numpy as np

UNITS = (("GiB", 1024 ** 3), ("MiB", 1024 ** 2), ("KiB", 1024), ("B", 1))


def byte_unit(largest):
    """The (name, divisor) that shows bytes up to ``largest`` best."""
    for name, size in UNITS:
        if largest >= size:
            return name, size
    return "B", 1


def fmt_bytes(n):
    name, size = byte_unit(abs(n))
    if size == 1:
        return f"{int(n)} B"
    x = n / size
    return f"{x:.0f} {name}" if x >= 100 else f"{x:.1f} {name}" if x >= 10 else f"{x:.2f} {name}"


def fmt_seconds(s):
    if s >= 1:
        return f"{s:.3g} s"
    if s >= 1e-3:
        return f"{s * 1e3:.3g} ms"
    return f"{s * 1e6:.3g} µs"


def fmt_count(x):
    return f"{x:,.0f}"


def fullest_tiles(report, n=5, ipu=None):
    """The ``n`` tiles holding the most bytes, fullest first: (tile, bytes),
    of IPU 0 (the report's ``memory``) or of ``ipu`` (an entry of ``ipus``)."""
    total = np.asarray((ipu or report["memory"])["total"])
    order = np.argsort(-total, kind="stable")[:n]
    return [(int(t), int(total[t])) for t in order]


def ipus(report):
    """Every IPU's memory entry (older reports: IPU 0's from ``memory``)."""
    found = report.get("ipus") or []
    if found and "always_live" in found[0]:
        return found
    mem = report["memory"]
    return [{"ipu": 0, "capacity": mem["capacity"], "peak_tile": mem["peak_tile"],
             "peak_bytes": mem["peak_bytes"], "total_bytes": sum(mem["total"]),
             "fits": mem["fits"], "tiles_over": mem["tiles_over"],
             "always_live": mem["always_live"], "not_always_live": mem["not_always_live"],
             "total": mem["total"], "categories": {},
             "peak_tile_tensors": mem.get("peak_tile_tensors", []),
             "always_live_by_dtype": mem.get("always_live_by_dtype", {}),
             "liveness": report.get("liveness", {})}]


def fit_line(report):
    mem, target = report["memory"], report["target"]
    if mem["fits"]:
        return "fits"
    many = len(ipus(report)) > 1
    return (f"DOES NOT FIT: {mem['tiles_over']} of {target['tiles']} tiles"
            f"{' x ' + str(len(ipus(report))) + ' IPUs' if many else ''} over capacity")


CATEGORIES = (("code", "code"), ("vertex_state", "vertex state"),
              ("exchange_buffers", "exchange buffers"),
              ("variables", "variables (always-live)"),
              ("stream_buffers", "input stream buffers (always-live)"),
              ("not_always_live", "not-always-live (peak)"))


def category_line(ipu):
    """The IPU's peak tile split by category ("code 5.05 KiB, vertex state
    144 B, ..., exchange buffers not modelled")."""
    cats = ipu.get("categories") or {}
    parts = []
    for key, label in CATEGORIES:
        c = cats.get(key)
        if c is None:
            continue
        parts.append(f"{label} {fmt_bytes(c['peak_tile_bytes'])}" if c["modelled"]
                     else f"{label} not modelled")
    return ", ".join(parts)


def ipu_lines(report):
    """A table of every IPU's fullest tile (when the program uses several)
    and each IPU's peak tile split by category."""
    rows = ipus(report)
    lines = []
    if len(rows) > 1:
        lines.append("  memory per IPU:")
        lines.append(f"    {'IPU':>3}  {'peak tile':>9}  {'peak bytes':>10}  {'% cap':>6}  "
                     f"{'total bytes':>11}  fits")
        for r in rows:
            lines.append(f"    {r['ipu']:>3}  {r['peak_tile']:>9}  "
                         f"{fmt_bytes(r['peak_bytes']):>10}  "
                         f"{100 * r['peak_bytes'] / r['capacity']:5.1f}%  "
                         f"{fmt_bytes(r['total_bytes']):>11}  "
                         f"{'yes' if r['fits'] else 'NO (%d tiles over)' % r['tiles_over']}")
    for r in rows:
        if category_line(r):
            lines.append(f"  IPU {r['ipu']} peak tile {r['peak_tile']} by category: "
                         f"{category_line(r)}")
        if len(rows) > 1 and r.get("always_live_by_dtype"):
            lines.append(f"  IPU {r['ipu']} always-live variables by dtype: "
                         f"{dtype_text(r['always_live_by_dtype'])}")
    return lines


def op_label(op):
    return f"{op['graph']}/{op['name']}"


def locations_lines(report):
    """What replicated tensor sharding and Streaming Memory do to the program."""
    loc = report.get("tensor_locations") or {}
    rows = loc.get("variables") or []
    rep = report.get("replication") or {}
    out = []
    if rep.get("replicas", 1) > 1:
        us = 1e6 / report["target"]["clock_hz"]
        procs = (f" in {rep['processes']} processes" if rep.get("processes", 1) > 1 else "")
        out.append(f"Replication: {rep['replicas']} replicas{procs} x "
                   f"{rep['ipus_per_replica']} IPU(s) = {rep['ipus']} IPUs; gradient "
                   f"collectives over IPU-Links {rep['collective_cycles_per_call'] * us:.0f} "
                   "us per call")
    if not rows:
        return out
    sharded = sum(1 for r in rows if r["shards"] > 1)
    off = sum(1 for r in rows if r["off_chip"])
    per_call = report["cycles"]["per_call"]
    us = 1e6 / report["target"]["clock_hz"]
    return out + [f"Tensor locations: {sharded} variable(s) sharded over {loc['replicas']} "
            f"replicas, {off} in Streaming Memory; saves "
            f"{fmt_bytes(loc['saved_bytes_per_replica'])} per replica on chip (up to "
            f"{fmt_bytes(loc['saved_bytes_max_tile'])} on one tile); costs "
            f"{per_call.get('collective', 0) * us:.0f} us of collectives and "
            f"{per_call.get('streaming', 0) * us:.0f} us of Streaming Memory transfers "
            "per call"]


def dtype_text(by):
    """{dtype: bytes} as "float16 12 KiB, float32 3 KiB"."""
    return ", ".join(f"{d or '?'} {fmt_bytes(b)}" for d, b in by.items())


def dtype_line(report):
    """Always-live variable bytes per dtype over every IPU ("float16 12 KiB,
    float32 3 KiB"), or "" when the report has none."""
    return dtype_text(report["memory"].get("always_live_by_dtype") or {})


def recomputation_line(report):
    """What recomputation saves and costs, or "" when it is off."""
    r = report["memory"].get("recomputation")
    if not r:
        return ""
    total = report["cycles"]["per_call"].get("total") or 1.0
    return (f"recomputation {r['mode']}: {r['recomputed_ops']} ops recomputed; peak "
            f"not-always-live {fmt_bytes(r['peak_not_always_live_bytes'])} per tile "
            f"(without: {fmt_bytes(r['peak_not_always_live_bytes_without'])}), "
            f"{fmt_count(r['cycles_per_call'])} cycles per call "
            f"({100 * r['cycles_per_call'] / total:.1f}%)")


def precision_lines(precision):
    """The loss scale and the fp16 gradients' losses of the last training
    call (``precisionReport()``), as sentences."""
    if not precision:
        return []
    lines = []
    als = precision.get("automatic_loss_scaling")
    if als:
        history = ", ".join(f"{v:g}" for v in als["history"])
        lines.append(f"Automatic loss scaling: loss scale {als['final_loss_scale']:g} "
                     f"(loss_scaling {als['loss_scaling']:g} x factor "
                     f"{als['update_factor']:g}); after each update of the last call: "
                     f"{history or 'none'}.")
    elif precision.get("loss_scale", 1.0) != 1.0:
        lines.append(f"Loss scale {precision['loss_scale']:g}.")
    grads = precision.get("gradients")
    if grads and grads["values"]:
        lines.append(f"fp16 values the backward pass computed in the last call: "
                     f"{grads['values']:,}, {grads.get('nonzero', 0):,} of them non-zero in "
                     f"fp32; underflowed to zero {grads['underflowed']:,} (at most "
                     f"{100 * grads.get('underflowed_magnitude', 0.0):.1f}% of an op's "
                     f"magnitude), "
                     f"overflowed to infinity {grads['overflowed']:,}, non-finite "
                     f"{grads['nonfinite']:,}.")
        for row in grads["ops"]:
            lines.append(f"  {row['op']}: {row['underflowed']:,} underflowed, "
                         f"{row['overflowed']:,} overflowed of {row['values']:,}.")
    return lines


def sensitivity_lines(rows, top=5):
    """The ``top`` cost-model constants the estimate leans on most (the report's
    ``sensitivity`` rows, ``executor.estimateSensitivity()``)."""
    rows = [r for r in rows if r["swing"] > 0][:top]
    if not rows:
        return []
    lines = ["Estimate depends most on (samples/s with each constant x0.8 / x1.2):"]
    width = max(len(r["name"]) for r in rows)
    for r in rows:
        lines.append(f"  {r['name']:<{width}}  {r['low']:+6.1%} / {r['high']:+6.1%}  "
                     f"({r['kind']}: {r['value']:g} {r['unit']})")
    return lines


def summary(report, top=5):
    """A few readable lines: model, target, memory, the costliest ops, throughput."""
    mem, cyc, target = report["memory"], report["cycles"], report["target"]
    cap = mem["capacity"]
    batching = report.get("batching", {})
    rows = ipus(report)
    worst = max(rows, key=lambda r: (r["peak_bytes"], -r["ipu"]))
    where = f"IPU {worst['ipu']} " if len(rows) > 1 else ""
    lines = [
        f"Model '{report['model']}' ({report['kind']}) on {target['name']}: "
        f"{target['tiles']} tiles x {fmt_bytes(target['bytes_per_tile'])}, "
        f"{target['clock_hz'] / 1e9:.2f} GHz" + (f", {len(rows)} IPUs" if len(rows) > 1 else ""),
        f"Memory: {fit_line(report)}; {where}peak tile {worst['peak_tile']} holds "
        f"{fmt_bytes(worst['peak_bytes'])} of {fmt_bytes(cap)} "
        f"({100 * worst['peak_bytes'] / cap:.1f}%)",
        f"  fullest {min(top, target['tiles'])} tiles{' of ' + where.strip() if where else ''}:",
    ]
    for tile, nbytes in fullest_tiles(report, top, worst if len(rows) > 1 else None):
        lines.append(f"    tile {tile:>5}  {fmt_bytes(nbytes):>10}  {100 * nbytes / cap:6.1f}%")
    lines.extend(ipu_lines(report))
    if dtype_line(report):
        lines.append(f"  always-live variables by dtype{' (all IPUs)' if where else ''}: "
                     f"{dtype_line(report)}")
    if recomputation_line(report):
        lines.append(f"  {recomputation_line(report)}")
    per_call = cyc["per_call"]
    total = per_call["total"] or 1.0
    split = ", ".join(f"{k} {100 * per_call[k] / total:.0f}%"
                      for k in ("compute", "exchange", "sync", "collective", "streaming", "host")
                      if per_call.get(k) or k in ("compute", "exchange", "sync", "host"))
    lines.append(f"Cycles per call: {fmt_count(per_call['total'])} ({split})")
    lines.extend(locations_lines(report))
    ops = report["ops"][:top]
    if ops:
        lines.append(f"  costliest {len(ops)} ops (cycles per call, share of the call):")
        width = max(len(op_label(op)) for op in ops)
        for op in ops:
            lines.append(f"    {op_label(op):<{width}}  {op['class']:<11} "
                         f"{fmt_count(op['cycles_per_call']):>13}  "
                         f"{100 * op['cycles_per_call'] / total:5.1f}%")
    samples = batching.get("samples_per_call")
    of = f" of {samples} samples" if samples else ""
    lines.append(f"Estimated {fmt_seconds(cyc['seconds_per_call'])} per call{of}: "
                 f"{fmt_count(cyc['samples_per_second'])} samples/s")
    lines.extend(precision_lines(report.get("precision")))
    lines.extend(sensitivity_lines(report.get("sensitivity") or []))
    return "\n".join(lines)


def op_table(report):
    """Every ATen operation the compiled model uses, once per operation,
    output dtype, rounding and role (loss scaling, gradient unscale, ...):
    how many times the program holds it, its cost class, and its cycles per
    call (all ops of that kind together), costliest first."""
    per_call = report["cycles"]["per_call"]["total"] or 1.0
    rows = {}
    for op in report["ops"]:
        key = (op["op"], op.get("dtype", ""), op.get("rounding", ""), op.get("role", ""))
        row = rows.setdefault(key, {"op": op["op"], "class": op["class"], "dtype": key[1],
                                    "rounding": key[2], "role": key[3] or "-", "count": 0,
                                    "cycles_per_call": 0.0})
        row["count"] += 1
        row["cycles_per_call"] += op["cycles_per_call"]
    rows = sorted(rows.values(), key=lambda r: -r["cycles_per_call"])
    width = max([len(r["op"]) for r in rows] + [len("operation")])
    role_w = max([len(r["role"]) for r in rows] + [len("role")])
    lines = [f"{'operation':<{width}}  {'class':<14} {'dtype':<8} {'rounding':<13} "
             f"{'role':<{role_w}} {'uses':>5}  {'cycles per call':>15}  share"]
    for r in rows:
        lines.append(f"{r['op']:<{width}}  {r['class']:<14} {r['dtype']:<8} "
                     f"{r['rounding']:<13} {r['role']:<{role_w}} {r['count']:>5}  "
                     f"{fmt_count(r['cycles_per_call']):>15}  "
                     f"{100 * r['cycles_per_call'] / per_call:5.1f}%")
    return "\n".join(lines)
