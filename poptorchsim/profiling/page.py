"""The report as one self-contained HTML page (plots are the PNGs beside it)."""
from html import escape

from .text import (dtype_line, fit_line, precision_lines, recomputation_line, fmt_bytes,
                   fmt_count, fmt_seconds, fullest_tiles,
                   locations_lines, op_label)

STYLE = """
body { font-family: system-ui, -apple-system, "Segoe UI", sans-serif; margin: 2em auto;
       max-width: 1150px; color: #222; padding: 0 1em; }
h1 { font-size: 1.5em; margin-bottom: 0.2em; }
h2 { font-size: 1.15em; margin-top: 1.8em; border-bottom: 1px solid #ddd; }
.sub { color: #666; margin-top: 0; }
.cards { display: flex; flex-wrap: wrap; gap: 0.8em; margin: 1em 0; }
.card { border: 1px solid #ddd; border-radius: 6px; padding: 0.6em 0.9em; min-width: 11em; }
.card .k { color: #666; font-size: 0.85em; }
.card .v { font-size: 1.25em; font-weight: 600; }
.ok { color: #2a7a2a; } .bad { color: #b22; }
.note { background: #fff6d6; border: 1px solid #e6cf7a; padding: 0.6em 0.9em; border-radius: 6px; }
img { max-width: 100%; border: 1px solid #eee; }
table { border-collapse: collapse; font-size: 0.88em; }
th, td { padding: 0.25em 0.7em; border-bottom: 1px solid #eee; text-align: left; }
td.n, th.n { text-align: right; font-variant-numeric: tabular-nums; }
code { font-size: 0.95em; }
"""


def _card(key, value, cls=""):
    return (f'<div class="card"><div class="k">{escape(key)}</div>'
            f'<div class="v {cls}">{escape(value)}</div></div>')


def _table(headers, rows, numeric=()):
    head = "".join(f'<th class="n">{escape(h)}</th>' if i in numeric else f"<th>{escape(h)}</th>"
                   for i, h in enumerate(headers))
    body = "".join(
        "<tr>" + "".join(f'<td class="n">{escape(str(c))}</td>' if i in numeric
                         else f"<td>{escape(str(c))}</td>" for i, c in enumerate(row)) + "</tr>"
        for row in rows)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def render(report, images, missing_plots=None, top_ops=20):
    """The page's HTML.  ``images``: plot key -> PNG file name beside the page;
    ``missing_plots``: why the plots are absent, when they are."""
    mem, cyc, target = report["memory"], report["cycles"], report["target"]
    batching = report.get("batching", {})
    cap = mem["capacity"]
    per_call = cyc["per_call"]
    total = per_call["total"] or 1.0
    title = f"poptorchsim report: {report['model']}"

    cards = [
        _card("target", f"{target['name']}: {target['tiles']} tiles x "
                        f"{fmt_bytes(target['bytes_per_tile'])}"),
        _card("memory", fit_line(report), "ok" if mem["fits"] else "bad"),
        _card(f"peak tile {mem['peak_tile']}",
              f"{fmt_bytes(mem['peak_bytes'])} / {fmt_bytes(cap)} "
              f"({100 * mem['peak_bytes'] / cap:.1f}%)", "ok" if mem["fits"] else "bad"),
        _card("time per call", fmt_seconds(cyc["seconds_per_call"])),
        _card("throughput", f"{fmt_count(cyc['samples_per_second'])} samples/s"),
        _card("cycles per call", fmt_count(per_call["total"])),
    ]
    rep = report.get("replication") or {}
    if rep:
        cards.append(_card("IPUs", f"{rep['ipus']} = {rep['replicas']} replica(s) x "
                                   f"{rep['ipus_per_replica']}"))
    split = _table(["", "cycles per call", "share"],
                   [(k, fmt_count(per_call[k]), f"{100 * per_call[k] / total:.1f}%")
                    for k in ("compute", "exchange", "sync", "collective", "streaming",
                              "host", "total") if k in per_call],
                   numeric=(1, 2))
    batch = ", ".join(f"{k.replace('_', ' ')} {v}" for k, v in batching.items())

    parts = [f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>{escape(title)}</title>",
             f"<style>{STYLE}</style></head><body>",
             f"<h1>{escape(title)}</h1>",
             f"<p class='sub'>{escape(report['kind'])} program on the simulated "
             f"{escape(target['name'])} IPU at {target['clock_hz'] / 1e9:.2f} GHz; "
             f"{escape(batch)}. Data: <a href='profile.json'>profile.json</a>.</p>",
             f"<div class='cards'>{''.join(cards)}</div>",
             "<h2>Where the cycles go</h2>", split]
    if missing_plots:
        parts.append(f"<p class='note'>Plots not drawn: {escape(missing_plots)}</p>")

    def image(key, alt):
        if key in images:
            parts.append(f"<p><img src='{escape(images[key])}' alt='{escape(alt)}'></p>")

    parts.append("<h2>Memory per tile</h2>")
    if not mem["fits"]:
        parts.append(
            f"<p class='note'>{mem['tiles_over']} of {target['tiles']} tiles need more than "
            f"their {escape(fmt_bytes(cap))}: this program would not load on a real IPU. "
            "Reduce the micro-batch size or the model, or split the model over more "
            "IPUs.</p>")
    parts.append("<p>Always-live memory is held for the whole program (weights, optimizer "
                 "state, code, stream buffers); not-always-live memory is each tile's peak "
                 "of intermediate tensors and temporary buffers while a graph runs.</p>")
    image("memory", "memory per tile")
    by_dtype = mem.get("always_live_by_dtype") or {}
    if by_dtype:
        parts.append(f"<p>Always-live variables by dtype: {escape(dtype_line(report))}.</p>")
    if recomputation_line(report):
        rec = recomputation_line(report)
        parts.append(f"<p>{escape(rec[0].upper() + rec[1:])}.</p>")
    loc = report.get("tensor_locations") or {}
    if loc.get("variables"):
        parts.append("<h2>Tensor locations</h2>")
        parts.append(f"<p>{escape(locations_lines(report)[-1])}.</p>")
        parts.append(_table(
            ["variable", "dtype", "kind", "elements", "shards", "location",
             "on chip per replica", "saved per replica"],
            [(r["name"], r.get("dtype", ""), r["kind"], fmt_count(r["elements"]), r["shards"],
              "Streaming Memory" if r["off_chip"] else "on chip",
              fmt_bytes(r["on_chip_bytes_per_replica"]),
              fmt_bytes(r["saved_bytes_per_replica"])) for r in loc["variables"]],
            numeric=(3, 4, 6, 7)))
    fullest = fullest_tiles(report, 10)
    parts.append(_table(["tile", "always-live", "not-always-live", "total", "% of capacity"],
                        [(t, fmt_bytes(mem["always_live"][t]),
                          fmt_bytes(mem["not_always_live"][t]), fmt_bytes(b),
                          f"{100 * b / cap:.1f}%") for t, b in fullest],
                        numeric=(0, 1, 2, 3, 4)))
    parts.append(f"<h2>Largest tensors on the peak tile ({mem['peak_tile']})</h2>")
    tensors = mem.get("peak_tile_tensors") or [
        {"name": name, "dtype": "", "bytes": b} for name, b in mem["largest_on_peak_tile"]]
    parts.append(_table(["tensor", "dtype", "bytes on the tile", "% of capacity"],
                        [(r["name"], r["dtype"], fmt_count(r["bytes"]),
                          f"{100 * r['bytes'] / cap:.1f}%") for r in tensors],
                        numeric=(2, 3)))

    ops = report["ops"][:top_ops]
    parts.append(f"<h2>Costliest ops ({len(ops)} of {len(report['ops'])})</h2>")
    image("cycles_by_op", "cycles per call of the costliest ops")
    parts.append(_table(
        ["#", "op", "ATen op", "class", "output shape", "dtype", "rounding", "role",
         "compute", "exchange", "sync", "cycles per run", "runs per call", "cycles per call",
         "share"],
        [(i + 1, op_label(op), op["op"], op["class"], "x".join(map(str, op["shape"])),
          op.get("dtype", ""), op.get("rounding", ""), op.get("role", ""),
          fmt_count(op["compute"]), fmt_count(op["exchange"]), fmt_count(op["sync"]),
          fmt_count(op["cycles"]), op["calls_per_call"], fmt_count(op["cycles_per_call"]),
          f"{100 * op['cycles_per_call'] / total:.1f}%") for i, op in enumerate(ops)],
        numeric=(0, 8, 9, 10, 11, 12, 13, 14)))

    _precision_section(report, parts)
    parts.append("<h2>Liveness</h2>")
    image("liveness", "live bytes over the program")
    pipe = report.get("pipeline") or {}
    if pipe:
        parts.append("<h2>Schedule</h2>")
        parts.append(f"<p>{escape(pipe['kind'])}: {pipe['stages']} pipeline stages on "
                     f"{pipe['ipus']} IPU(s), {pipe['micro_batches']} micro-batches, bubble "
                     f"{100 * pipe['bubble']:.1f}%. Chrome trace: "
                     '<a href="timeline.json">timeline.json</a> (open in chrome://tracing '
                     "or ui.perfetto.dev).</p>")
        if pipe.get("stage_map"):
            parts.append(f"<pre>{escape(pipe['stage_map'])}</pre>")
        image("timeline", "pipeline timeline per IPU")
    parts.append("</body></html>")
    return "\n".join(parts)


def _precision_section(report, parts):
    """How the ops round (counts) and every op with a role (loss scaling,
    gradient unscale, ...), whatever its cost."""
    counts = {}
    for op in report["ops"]:
        if op.get("rounding"):
            counts[op["rounding"]] = counts.get(op["rounding"], 0) + 1
    roles = [op for op in report["ops"] if op.get("role")]
    lines = precision_lines(report.get("precision"))
    if not counts and not roles and not lines:
        return
    parts.append("<h2>Precision</h2>")
    for line in lines:
        parts.append(f"<p>{escape(line)}</p>")
    if counts:
        parts.append("<p>Ops by rounding of their result: " + escape(", ".join(
            f"{k} {v}" for k, v in sorted(counts.items(), key=lambda kv: -kv[1]))) + ".</p>")
    if roles:
        parts.append(_table(["op", "role", "ATen op", "dtype", "rounding", "cycles per call"],
                            [(op_label(op), op["role"], op["op"], op.get("dtype", ""),
                              op.get("rounding", ""), fmt_count(op["cycles_per_call"]))
                             for op in roles], numeric=(5,)))
