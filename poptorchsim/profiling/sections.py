"""Parts of the HTML page: tables that fold, the per-IPU memory sections,
the liveness sparkline (inline SVG) and the program tree."""
from html import escape

from .text import CATEGORIES, dtype_text, fmt_bytes, fmt_count, fullest_tiles

FOLD_ROWS = 25          # a table longer than this shows its first rows, the rest folded
FOLD_LINES = 60         # a program longer than this is folded


def _breakable(text):
    """Escaped ``text`` that may wrap after "/" and "." (op names, ATen ops)."""
    return escape(text).replace("/", "/<wbr>").replace(".", ".<wbr>")


def table(headers, rows, numeric=(), limit=FOLD_ROWS):
    """An HTML table in a wrapper that scrolls sideways rather than widen
    the page; rows past ``limit`` are folded in a <details> that says how
    many there are."""
    head = "".join(f'<th class="n">{escape(h)}</th>' if i in numeric else f"<th>{escape(h)}</th>"
                   for i, h in enumerate(headers))

    def body(part):
        return "".join(
            "<tr>" + "".join(f'<td class="n">{escape(str(c))}</td>' if i in numeric
                             else f"<td>{_breakable(str(c))}</td>" for i, c in enumerate(row))
            + "</tr>" for row in part)

    rows = list(rows)
    shown, rest = (rows, []) if limit is None or len(rows) <= limit else \
        (rows[:limit], rows[limit:])
    html = (f"<div class='wrap'><table><thead><tr>{head}</tr></thead>"
            f"<tbody>{body(shown)}</tbody></table></div>")
    if rest:
        html += (f"<details class='more'><summary>{len(rest)} more rows "
                 f"({len(rows)} in all)</summary><div class='wrap'><table><thead><tr>{head}"
                 f"</tr></thead><tbody>{body(rest)}</tbody></table></div></details>")
    return html


def fold(rows, key):
    """Rows that share ``key(row)`` as one: (first row, count, rows), in the
    order each key first appears."""
    groups = {}
    for row in rows:
        groups.setdefault(key(row), []).append(row)
    return [(group[0], len(group), group) for group in groups.values()]


def names(group, n=3):
    """The first ``n`` names of a folded group, and how many more."""
    shown = ", ".join(r for r in group[:n])
    return shown + (f" + {len(group) - n} more" if len(group) > n else "")


def ipu_summary_table(ipus):
    """One row per IPU: its fullest tile and bytes, total bytes, fits."""
    return table(
        ["IPU", "peak tile", "peak tile bytes", "% of capacity", "always-live (all tiles)",
         "total (all tiles)", "fits"],
        [(f"IPU {r['ipu']}", r["peak_tile"], fmt_bytes(r["peak_bytes"]),
          f"{100 * r['peak_bytes'] / r['capacity']:.1f}%",
          fmt_bytes(r.get("always_live_bytes", sum(r["always_live"]))),
          fmt_bytes(r["total_bytes"]),
          "yes" if r["fits"] else f"NO: {r['tiles_over']} tiles over") for r in ipus],
        numeric=(1, 2, 3, 4, 5), limit=None)


def category_table(ipu):
    """The IPU's memory by category: on its peak tile, on its fullest tile
    for that category, and over all its tiles."""
    cats = ipu.get("categories") or {}
    rows = []
    for key, label in CATEGORIES:
        c = cats.get(key)
        if c is None:
            continue
        if c["modelled"]:
            rows.append((label, fmt_bytes(c["peak_tile_bytes"]), fmt_bytes(c["max_tile_bytes"]),
                         fmt_bytes(c["bytes"]), c["note"]))
        else:
            rows.append((label, "not modelled", "", "", c["note"]))
    if not rows:
        return ""
    rows.append(("total", fmt_bytes(ipu["peak_bytes"]), fmt_bytes(max(ipu["total"])),
                 fmt_bytes(ipu["total_bytes"]), ""))
    return table(["category", f"on peak tile {ipu['peak_tile']}", "largest on one tile",
                  "all tiles", "what it is"], rows, numeric=(1, 2, 3), limit=None)


def sparkline(values, width=640, height=90, label=""):
    """Live bytes after each step as an inline SVG step line (scales to
    its box), with the peak marked."""
    if not values:
        return ""
    top = max(values) or 1
    n = len(values)
    points = []
    for k, v in enumerate(values):
        y = height - 4 - (height - 14) * v / top
        points += [f"{width * k / n:.1f},{y:.1f}", f"{width * (k + 1) / n:.1f},{y:.1f}"]
    k = max(range(n), key=lambda i: values[i])
    px, py = width * (k + 0.5) / n, height - 4 - (height - 14) * values[k] / top
    return (f"<svg class='spark' viewBox='0 0 {width} {height}' preserveAspectRatio='none' "
            f"role='img' aria-label='{escape(label)}'>"
            f"<polyline fill='none' stroke='#DD8452' stroke-width='1.5' "
            f"points='{' '.join(points)}'/>"
            f"<circle cx='{px:.1f}' cy='{py:.1f}' r='3' fill='#222'/></svg>")


def liveness_block(ipu):
    """Each graph's live bytes on the IPU over its steps: a sparkline and
    where it peaks."""
    out = []
    for graph, values in (ipu.get("liveness") or {}).items():
        if not values:
            continue
        peak = (ipu.get("peak_step") or {}).get(graph)
        where = (f"peak {fmt_bytes(peak['bytes'])} after step {peak['step']} "
                 f"(<code>{escape(peak['op'])}</code>)" if peak else "")
        out.append(f"<p><b>{escape(graph)}</b>: {len(values)} steps; {where}</p>")
        out.append(sparkline(values, label=f"live bytes of {graph} on IPU {ipu['ipu']}"))
    return "\n".join(out)


def ipu_section(ipu, image=None, many=False):
    """The memory section of one IPU."""
    cap = ipu["capacity"]
    k = ipu["ipu"]
    verdict = ("fits" if ipu["fits"] else
               f"DOES NOT FIT: {ipu['tiles_over']} tiles over capacity")
    parts = [f"<section class='ipu' id='ipu-{k}' data-ipu='{k}'>",
             f"<h2>IPU {k}: memory</h2>" if many else "<h2>Memory per tile</h2>",
             f"<p class='{'ok' if ipu['fits'] else 'bad'}'>{escape(verdict)}: peak tile "
             f"{ipu['peak_tile']} holds {escape(fmt_bytes(ipu['peak_bytes']))} of "
             f"{escape(fmt_bytes(cap))} ({100 * ipu['peak_bytes'] / cap:.1f}%); "
             f"{escape(fmt_bytes(ipu['total_bytes']))} over all tiles.</p>"]
    cats = category_table(ipu)
    if cats:
        parts += ["<h3>By category</h3>", cats]
    if image:
        parts.append(f"<p><img src='{escape(image)}' alt='memory per tile of IPU {k}'></p>")
    by_dtype = ipu.get("always_live_by_dtype") or {}
    if by_dtype and many:            # one IPU: the page's line above says it
        parts.append(f"<p>Always-live variables on IPU {k} by dtype (over all its tiles; "
                     f"code and vertex state are not tensors): "
                     f"{escape(dtype_text(by_dtype))}.</p>")
    parts.append("<h3>Fullest tiles</h3>")
    parts.append(table(["tile", "always-live", "not-always-live", "total", "% of capacity"],
                       [(t, fmt_bytes(ipu["always_live"][t]),
                         fmt_bytes(ipu["not_always_live"][t]), fmt_bytes(b),
                         f"{100 * b / cap:.1f}%") for t, b in fullest_tiles(None, 10, ipu)],
                       numeric=(0, 1, 2, 3, 4)))
    tensors = ipu.get("peak_tile_tensors") or []
    if tensors:
        parts.append(f"<h3>Largest tensors on the peak tile ({ipu['peak_tile']})</h3>")
        parts.append(table(["tensor", "dtype", "bytes on the tile", "% of capacity"],
                           [(r["name"], r["dtype"], fmt_count(r["bytes"]),
                             f"{100 * r['bytes'] / cap:.1f}%") for r in tensors],
                           numeric=(2, 3)))
    live = liveness_block(ipu)
    if live:
        parts += [f"<h3>Live bytes over the program (all tiles of IPU {k})</h3>", live]
    parts.append("</section>")
    return "\n".join(parts)


def program_block(text):
    """The program as ``getIR()`` prints it, in a scrolling <pre>, folded
    when long."""
    if not text:
        return ""
    n = len(text.splitlines())
    return (f"<details class='program'{' open' if n <= FOLD_LINES else ''}>"
            f"<summary>{n} lines</summary><pre class='scroll'>{escape(text)}</pre></details>")
