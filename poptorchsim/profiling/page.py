"""The report as one self-contained HTML page (plots are the PNGs beside it)."""
from html import escape

from .sections import fold, ipu_section, ipu_summary_table, names, program_block, table
from .text import (
    dtype_line,
    fit_line,
    fmt_bytes,
    fmt_count,
    fmt_seconds,
    locations_lines,
    op_label,
    precision_lines,
    recomputation_line,
)
from .text import ipus as ipu_entries

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
h3 { font-size: 1em; margin: 1.2em 0 0.4em; }
.note { background: #fff6d6; border: 1px solid #e6cf7a; padding: 0.6em 0.9em; border-radius: 6px; }
img { max-width: 100%; height: auto; border: 1px solid #eee; }
.wrap { max-width: 100%; overflow-x: auto; }
table { border-collapse: collapse; font-size: 0.88em; max-width: 100%; }
th, td { padding: 0.25em 0.7em; border-bottom: 1px solid #eee; text-align: left;
         overflow-wrap: break-word; }
td.n, th.n { text-align: right; font-variant-numeric: tabular-nums; overflow-wrap: normal;
             word-break: normal; white-space: nowrap; }
code { font-size: 0.95em; overflow-wrap: anywhere; }
section.ipu { border-top: 3px solid #4C72B0; margin-top: 2em; }
svg.spark { display: block; width: 100%; max-width: 640px; height: 90px;
            border: 1px solid #eee; }
pre { max-width: 100%; overflow-x: auto; }
pre.scroll { max-height: 36em; overflow: auto; background: #fafafa; border: 1px solid #eee;
             padding: 0.5em; font-size: 0.8em; }
details summary { cursor: pointer; color: #444; }
#selftest { display: none; }
"""

# Run when the page is opened with #selftest (tests/test_report_browser.py):
# writes what the browser measured into the DOM, for --dump-dom to show.
SELFTEST = """<script>
window.addEventListener('load', function () {
  if (location.hash !== '#selftest') return;
  var d = document.documentElement, out = document.createElement('div');
  out.id = 'selftest';
  var wide = [];
  document.querySelectorAll('body *').forEach(function (e) {
    var r = e.getBoundingClientRect();
    if (r.right > window.innerWidth + 1 && !e.closest('.wrap, pre, details:not([open])'))
      wide.push(e.tagName.toLowerCase() + (e.id ? '#' + e.id : ''));
  });
  out.setAttribute('data-scroll-width', d.scrollWidth);
  out.setAttribute('data-inner-width', window.innerWidth);
  out.setAttribute('data-ipu-sections', document.querySelectorAll('section.ipu').length);
  out.setAttribute('data-overflowing', wide.slice(0, 10).join(' '));
  var images = Array.prototype.slice.call(document.images);
  out.setAttribute('data-images', images.length);
  out.setAttribute('data-broken-images', images.filter(function (i) {
    return !i.complete || i.naturalWidth === 0; }).map(function (i) {
    return i.getAttribute('src'); }).join(' '));
  document.body.appendChild(out);
});
</script>"""


def _card(key, value, cls=""):
    return (f'<div class="card"><div class="k">{escape(key)}</div>'
            f'<div class="v {cls}">{escape(value)}</div></div>')


_table = table


def render(report, images, missing_plots=None, top_ops=20):
    """The page's HTML.  ``images``: plot key -> PNG file name beside the page;
    ``missing_plots``: why the plots are absent, when they are."""
    mem, cyc, target = report["memory"], report["cycles"], report["target"]
    batching = report.get("batching", {})
    cap = mem["capacity"]
    per_call = cyc["per_call"]
    total = per_call["total"] or 1.0
    title = f"poptorchsim report: {report['model']}"

    entries = ipu_entries(report)
    many = len(entries) > 1
    worst = max(entries, key=lambda r: (r["peak_bytes"], -r["ipu"]))
    cards = [
        _card("target", f"{target['name']}: {target['tiles']} tiles x "
                        f"{fmt_bytes(target['bytes_per_tile'])}"
                        + (f", {len(entries)} IPUs" if many else "")),
        _card("memory", fit_line(report), "ok" if mem["fits"] else "bad"),
        _card(f"{'IPU ' + str(worst['ipu']) + ', ' if many else ''}peak tile "
              f"{worst['peak_tile']}",
              f"{fmt_bytes(worst['peak_bytes'])} / {fmt_bytes(cap)} "
              f"({100 * worst['peak_bytes'] / cap:.1f}%)", "ok" if worst["fits"] else "bad"),
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
             "<meta name='viewport' content='width=device-width, initial-scale=1'>",
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

    parts.append("<h2>Memory" + (f" of the {len(entries)} IPUs" if many else "") + "</h2>")
    if not mem["fits"]:
        parts.append(
            f"<p class='note'>{mem['tiles_over']} of {target['tiles'] * len(entries)} tiles"
            f"{' (all IPUs)' if many else ''} need more than "
            f"their {escape(fmt_bytes(cap))}: this program would not load on a real IPU. "
            "Reduce the micro-batch size or the model, or split the model over more "
            "IPUs.</p>")
    parts.append("<p>Always-live memory is held for the whole program (control code, vertex "
                 "state, weights, optimizer state, stream buffers); not-always-live memory is "
                 "each tile's peak of intermediate tensors and temporary buffers while a "
                 "graph runs. Exchange buffers are not modelled apart: the operands an op "
                 "receives over the exchange count among its temporaries.</p>")
    if many:
        parts.append(ipu_summary_table(entries))
    by_dtype = mem.get("always_live_by_dtype") or {}
    if by_dtype:
        parts.append(f"<p>Always-live variables by dtype{' (all IPUs)' if many else ''}: "
                     f"{escape(dtype_line(report))}.</p>")
    if recomputation_line(report):
        rec = recomputation_line(report)
        parts.append(f"<p>{escape(rec[0].upper() + rec[1:])}.</p>")
    for entry in entries:
        key = "memory" if entry["ipu"] == 0 else f"memory_ipu{entry['ipu']}"
        parts.append(ipu_section(entry, images.get(key), many))
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
    parts.append("<p>Not-always-live bytes after each step (op) of each graph, summed over "
                 "the tiles of each IPU" + (" (one panel per IPU)" if many else "") + ".</p>")
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
    if report.get("program_text"):
        parts.append("<h2>Program</h2>")
        parts.append("<p>The compiled program as <code>getIR()</code> prints it.</p>")
        parts.append(program_block(report["program_text"]))
    parts.append(SELFTEST)
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
        # ops of one role, ATen op, dtype and rounding as one row with a count
        groups = fold(roles, lambda op: (op["role"], op["op"], op.get("dtype", ""),
                                         op.get("rounding", "")))
        parts.append(_table(["role", "ops", "count", "ATen op", "dtype", "rounding",
                             "cycles per call (all)"],
                            [(op["role"], names([op_label(o) for o in group]), n, op["op"],
                              op.get("dtype", ""), op.get("rounding", ""),
                              fmt_count(sum(o["cycles_per_call"] for o in group)))
                             for op, n, group in groups], numeric=(2, 6)))
