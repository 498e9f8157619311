"""The report's three PNG plots, drawn with matplotlib's Agg canvas.

Figures are made with ``matplotlib.figure.Figure`` and an Agg canvas, never
pyplot, so drawing a report leaves the user's own pyplot state and backend
alone.  Per-tile data is drawn as one filled step outline per layer, never one
bar per tile, so 1472 tiles draw as fast as 4.
"""
import numpy as np

from .text import byte_unit, fmt_bytes, op_label

ALWAYS = "#4C72B0"
NOT_ALWAYS = "#DD8452"
OVER = "#C44E52"
COMPUTE, EXCHANGE, SYNC = "#4C72B0", "#DD8452", "#8C8C8C"
DPI = 100


def _figure(width, height):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    fig = Figure(figsize=(width, height), dpi=DPI)
    FigureCanvasAgg(fig)
    return fig


def _margins(fig, left=0.75, right=0.25, top=0.45, bottom=0.55, hspace=0.45):
    """Fixed margins in inches: a cheaper layout than tight_layout for plots
    whose labels do not change width."""
    w, h = fig.get_size_inches()
    fig.subplots_adjust(left=left / w, right=1 - right / w, top=1 - top / h,
                        bottom=bottom / h, hspace=hspace / h * 2)


def _save(fig, path):
    fig.savefig(path, dpi=DPI, pil_kwargs={"compress_level": 3})


def _count_formatter():
    from matplotlib.ticker import FuncFormatter

    def fmt(x, _pos):
        for suffix, size in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
            if abs(x) >= size:
                return f"{x / size:g}{suffix}"
        return f"{x:g}"
    return FuncFormatter(fmt)


def _runs(mask):
    """(start, length) of every run of True in ``mask``."""
    padded = np.concatenate([[False], mask, [False]]).astype(np.int8)
    edges = np.flatnonzero(np.diff(padded))
    return list(zip(edges[0::2], edges[1::2] - edges[0::2]))


def plot_memory(report, path, zoom_below=0.4, ipu=None):
    """Always-live and not-always-live bytes per tile, stacked, against the
    tile's capacity; tiles over it shaded red.  When the fullest tile uses
    less than ``zoom_below`` of capacity a second panel zooms in on the data.
    ``ipu``: an entry of the report's ``ipus`` (default: IPU 0)."""
    mem, target = ipu or report["memory"], report["target"]
    always = np.asarray(mem["always_live"], dtype=float)
    total = np.asarray(mem["total"], dtype=float)
    saved = np.asarray(mem.get("saved_per_tile", np.zeros(len(total))), dtype=float)
    cap = float(mem["capacity"])
    over_n = int((total > cap).sum())
    verdict = "fits" if not over_n else f"DOES NOT FIT: {over_n} tiles over capacity"
    n = len(total)
    peak = mem["peak_tile"]
    top = (total + saved).max(initial=0)
    zoom = 0 < top < zoom_below * cap
    unit, div = byte_unit(max(cap, top))
    edges = np.arange(n + 1) - 0.5
    over = total > cap
    parts = _always_live_parts(report, mem, always)

    fig = _figure(11, 7.2 if zoom else 4.6)
    axes = fig.subplots(2, 1, sharex=True, gridspec_kw={"height_ratios": [1, 1.2]}) \
        if zoom else [fig.add_subplot()]

    for i, ax in enumerate(axes):
        def layer(lower, upper, ax=ax, **kw):
            # one step polygon per layer; stairs() is ~10x slower on 1472 tiles
            ax.fill_between(edges, np.append(lower, lower[-1:]) / div,
                            np.append(upper, upper[-1:]) / div, step="post", linewidth=0,
                            **kw)

        if over.any():
            # at least ~0.4% of the axis wide, so a lone tile over capacity shows
            least = max(1.0, n / 250)
            spans = [(s - 0.5 - max(0, least - w) / 2, max(w, least)) for s, w in _runs(over)]
            ax.broken_barh(spans, (0, 1), transform=ax.get_xaxis_transform(),
                           facecolor=OVER, alpha=0.12, edgecolor=OVER, linewidth=0.6,
                           zorder=0, label=f"tiles over capacity ({int(over.sum())})")
        lower = np.zeros(n)
        for label, part, color in parts:
            layer(lower, lower + part, color=color, label=label, zorder=2)
            lower = lower + part
        layer(always, total, color=NOT_ALWAYS, label="not-always-live (peak)", zorder=2)
        if saved.any():
            layer(total, total + saved, facecolor="none", edgecolor=ALWAYS, hatch="..",
                  label="saved by sharding / Streaming Memory", zorder=2)
        if over.any():
            layer(np.full(n, cap), np.maximum(total, cap), facecolor="none",
                  edgecolor=OVER, hatch="////", label="over capacity", zorder=3)
        ax.axhline(cap / div, color="black", linestyle="--", linewidth=1.2, zorder=4,
                   label=f"capacity {fmt_bytes(cap)}")
        ax.plot([peak], [total[peak] / div], marker="v", color="black", markersize=7,
                linestyle="none", zorder=5)
        ax.annotate(f"peak: tile {peak}, {fmt_bytes(total[peak])} "
                    f"({100 * total[peak] / cap:.1f}% of capacity)",
                    (peak, total[peak] / div), xytext=(0, 9), textcoords="offset points",
                    ha="left" if peak < n / 2 else "right", fontsize=9, zorder=5)
        ax.set_ylim(0, (top * 1.25 if i else max(cap, top) * 1.15) / div)
        ax.set_ylabel(f"memory ({unit})")
        ax.grid(axis="y", alpha=0.3)
        pct = ax.secondary_yaxis("right", functions=(lambda v: v * div * 100 / cap,
                                                     lambda p: p * cap / 100 / div))
        pct.set_ylabel("% of capacity")
        if i:
            ax.set_title("zoomed to the data", fontsize=10)

    ax = axes[0]
    ax.set_xlim(-0.5, n - 0.5)
    if n <= 32:
        axes[-1].set_xticks(range(n))
    axes[-1].set_xlabel("tile")
    many = len(report.get("ipus") or []) > 1
    which = f"IPU {mem.get('ipu', 0)} of " if many else ""
    ax.set_title(f"Memory per tile: {which}'{report['model']}' on {target['name']} "
                 f"({n} tiles), {verdict}")
    handles, labels = ax.get_legend_handles_labels()
    ncol = min(len(labels), 4)
    rows = -(-len(labels) // ncol)
    _margins(fig, right=0.8, bottom=0.75 + 0.2 * rows)
    # below the tile axis and its label: 0.5 in down, whatever the figure's height
    below = 0.5 / (axes[-1].get_position().height * fig.get_size_inches()[1])
    axes[-1].legend(handles, labels, loc="upper center", bbox_to_anchor=(0.5, -below),
                    ncol=ncol, fontsize=8, frameon=False)
    _save(fig, path)


CODE, STATE, VARIABLES = "#27466F", "#8FAADC", ALWAYS


def _always_live_parts(report, mem, always):
    """(label, bytes per tile, colour) of the always-live layers: code, vertex
    state and variables (with input stream buffers) where the report splits
    them by category, else one always-live layer."""
    cats = mem.get("categories")
    if cats is None and report.get("ipus"):
        cats = report["ipus"][0].get("categories")        # memory is IPU 0's
    if not cats or len(cats.get("code", {}).get("per_tile", [])) != len(always):
        return [("always-live", always, ALWAYS)]
    code = np.asarray(cats["code"]["per_tile"], dtype=float)
    state = np.asarray(cats["vertex_state"]["per_tile"], dtype=float)
    return [("code (always-live)", code, CODE),
            ("vertex state (always-live)", state, STATE),
            ("variables and stream buffers (always-live)", always - code - state, VARIABLES)]


def plot_cycles_by_op(report, path, top=20):
    ops = report["ops"][:top]
    total_call = report["cycles"]["per_call"]["total"] or 1.0
    fig = _figure(11, 1.4 + 0.3 * max(len(ops), 3))
    ax = fig.add_subplot()
    if not ops:
        ax.text(0.5, 0.5, "no ops", ha="center", va="center", transform=ax.transAxes)
        ax.set_axis_off()
        _save(fig, path)
        return
    y = np.arange(len(ops))
    parts = {k: np.array([op[k] * op["calls_per_call"] for op in ops], dtype=float)
             for k in ("compute", "exchange", "sync")}
    left = np.zeros(len(ops))
    for key, color in (("compute", COMPUTE), ("exchange", EXCHANGE), ("sync", SYNC)):
        ax.barh(y, parts[key], left=left, color=color, label=key, height=0.7)
        left += parts[key]
    for yi, op, width in zip(y, ops, left):
        ax.text(width, yi, f" {100 * op['cycles_per_call'] / total_call:.1f}%",
                va="center", fontsize=8)
    labels = [f"{op_label(op)}  [{op['class']}]  {'x'.join(map(str, op['shape']))}"
              for op in ops]
    ax.set_yticks(y)
    ax.set_yticklabels(labels, fontsize=8)
    ax.set_ylim(len(ops) - 0.4, -0.6)     # costliest at the top
    ax.set_xlim(0, left.max() * 1.1)
    ax.set_xlabel("cycles per call (all runs of the op in one call of the model)")
    ax.set_title(f"Costliest {len(ops)} of {len(report['ops'])} ops; "
                 "% = share of the call's cycles")
    ax.xaxis.set_major_formatter(_count_formatter())
    ax.legend(loc="lower right", fontsize=8)
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    _save(fig, path)


MAX_PANELS = 16


def plot_liveness(report, path):
    """Live (not-always-live) bytes after each op of each graph, summed over
    tiles: one panel per IPU when the program uses several."""
    entries = [r for r in report.get("ipus") or [] if "liveness" in r][:MAX_PANELS]
    if len(entries) < 2:
        fig = _figure(11, 4.2)
        _liveness_panel(fig.add_subplot(), report["liveness"])
        fig.axes[0].set_title("Not-always-live memory over the program (summed over tiles)")
        _margins(fig)
        _save(fig, path)
        return
    fig = _figure(11, 1.0 + 2.2 * len(entries))
    axes = fig.subplots(len(entries), 1, sharex=True)
    for ax, entry in zip(axes, entries):
        _liveness_panel(ax, entry["liveness"], xlabel=ax is axes[-1])
        ax.set_title(f"IPU {entry['ipu']}", fontsize=10, loc="left")
    fig.suptitle("Not-always-live memory over the program (summed over each IPU's tiles)")
    _margins(fig, top=0.7)
    fig.subplots_adjust(hspace=0.3)
    _save(fig, path)


def _liveness_panel(ax, liveness, xlabel=True):
    live = {g: np.asarray(v, dtype=float) for g, v in liveness.items() if len(v)}
    largest = max((v.max() for v in live.values()), default=0.0)
    longest = max((len(v) for v in live.values()), default=0)
    unit, div = byte_unit(largest)
    for graph, values in live.items():
        # op k holds its live bytes from x = k to k + 1
        line, = ax.plot(np.arange(len(values) + 1), np.append(values, values[-1]) / div,
                        drawstyle="steps-post",
                        linewidth=1.6, label=f"{graph} ({len(values)} ops)")
        k = int(np.argmax(values))
        ax.plot([k], [values[k] / div], marker="o", color=line.get_color())
        right = k > 0.6 * longest
        ax.annotate(f"peak {fmt_bytes(values[k])} at op {k}", (k, values[k] / div),
                    xytext=(-4 if right else 4, 4), textcoords="offset points", fontsize=8,
                    ha="right" if right else "left", color=line.get_color())
    if not live:
        ax.text(0.5, 0.5, "no ops", ha="center", va="center", transform=ax.transAxes)
    ax.set_ylim(0, largest / div * 1.3 if largest else 1)
    ax.set_xlim(left=0)
    if xlabel:
        ax.set_xlabel("op index in the graph (program order)")
    ax.set_ylabel(f"live bytes ({unit})")
    if live:
        ax.legend(loc="upper left", fontsize=8, ncol=len(live))
    ax.grid(alpha=0.3)


def plot_timeline(report, path):
    """One row per IPU: forward and backward stages of each micro-batch over
    one weight update (or one inference call), with the bubble."""
    pipe = report.get("pipeline") or {}
    events = pipe.get("events", [])
    ipus = sorted({e["ipu"] for e in events}) or [0]
    fig = _figure(11, 1.2 + 0.55 * len(ipus))
    ax = fig.add_subplot()
    if len(events) > 4000:                      # keep drawing cheap
        events = events[:4000]
    for e in events:
        backward = e["name"].startswith("B")
        ax.broken_barh([(e["start_us"], e["duration_us"])], (e["ipu"] - 0.4, 0.8),
                       facecolors=NOT_ALWAYS if backward else ALWAYS,
                       edgecolors="white", linewidth=0.5)
        if e["duration_us"] > 0 and len(events) <= 200:
            ax.text(e["start_us"] + e["duration_us"] / 2, e["ipu"], e["name"].split()[1][2:],
                    ha="center", va="center", fontsize=6, color="white")
    ax.set_yticks(ipus)
    ax.set_yticklabels([f"IPU {i}" for i in ipus])
    ax.invert_yaxis()
    ax.set_xlabel("µs")
    kind = pipe.get("kind", "single")
    ax.set_title(f"{kind.capitalize()} schedule: {pipe.get('stages', 1)} stages, "
                 f"{pipe.get('micro_batches', 1)} micro-batches, bubble "
                 f"{pipe.get('bubble', 0.0):.1%}  (blue: forward, orange: backward; "
                 "numbers: micro-batch)")
    ax.grid(axis="x", alpha=0.3)
    _margins(fig, left=0.9, bottom=0.5, top=0.4)
    _save(fig, path)


def chrome_trace(report):
    """The timeline as Chrome trace events (chrome://tracing, Perfetto)."""
    pipe = report.get("pipeline") or {}
    events = [{"name": e["name"], "ph": "X", "ts": e["start_us"], "dur": e["duration_us"],
               "pid": 0, "tid": e["ipu"], "cat": "backward" if e["name"].startswith("B")
               else "forward"} for e in pipe.get("events", [])]
    names = [{"name": "thread_name", "ph": "M", "pid": 0, "tid": i,
              "args": {"name": f"IPU {i}"}} for i in sorted({e["tid"] for e in events})]
    return {"traceEvents": names + events, "displayTimeUnit": "ns"}


PLOTS = {"memory": ("memory.png", plot_memory),
         "cycles_by_op": ("cycles_by_op.png", plot_cycles_by_op),
         "liveness": ("liveness.png", plot_liveness),
         "timeline": ("timeline.png", plot_timeline)}
