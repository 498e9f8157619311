"""Reports a person reads: a compiled model's simulation report written out as
``profile.json``, three PNG plots and one ``index.html`` page, and as text.

``Channel`` is PopTorch's ``poptorch.profiling.Channel`` (tracepoints).

The report itself (a JSON-ready dict) comes from
``PoplarExecutor.simulationReport()``; this package only presents it.
matplotlib is optional: without it the JSON and the page are still written,
and the page says why it has no plots.
"""
import json
import os

from .channel import Channel  # poptorch.profiling.Channel
from .page import render
from .text import op_table, summary

__all__ = ["Channel", "write_report", "summary", "op_table", "load_reports", "find_reports"]

REPORT_FILE = "profile.json"


def _jsonable(value):
    """numpy scalars and arrays, should a report hold any."""
    if hasattr(value, "tolist"):
        return value.tolist()
    raise TypeError(f"{type(value).__name__} is not JSON serializable")


def write_report(report, directory):
    """Writes ``profile.json``, ``memory.png`` (IPU 0; ``memory_ipuK.png``
    for every other IPU K), ``cycles_by_op.png``,
    ``liveness.png``, ``timeline.png``, ``timeline.json`` (Chrome trace of the
    pipeline schedule) and ``index.html`` into ``directory`` (created if need
    be); returns {"json", "memory", "cycles_by_op", "liveness", "timeline",
    "trace", "html"} -> path of each file written (no PNG keys without
    matplotlib)."""
    os.makedirs(directory, exist_ok=True)
    written = {"json": os.path.join(directory, REPORT_FILE)}
    with open(written["json"], "w") as f:
        json.dump(report, f, default=_jsonable)

    images, missing = {}, None
    try:
        import matplotlib  # noqa: F401 - probe only; plots import its parts lazily

        from . import plots
    except ImportError:
        missing = "matplotlib is not installed (pip install matplotlib)."
    else:
        for key, (name, draw) in plots.PLOTS.items():
            path = os.path.join(directory, name)
            draw(report, path)
            written[key], images[key] = path, name
        # IPU 0's memory is memory.png; every other IPU's its own plot
        for entry in (report.get("ipus") or [])[1:plots.MAX_PANELS]:
            if "always_live" not in entry:
                continue
            key = f"memory_ipu{entry['ipu']}"
            name = key + ".png"
            path = os.path.join(directory, name)
            plots.plot_memory(report, path, ipu=entry)
            written[key], images[key] = path, name

    if report.get("pipeline"):
        from .plots import chrome_trace
        written["trace"] = os.path.join(directory, "timeline.json")
        with open(written["trace"], "w") as f:
            json.dump(chrome_trace(report), f)

    written["html"] = os.path.join(directory, "index.html")
    with open(written["html"], "w", encoding="utf-8") as f:
        f.write(render(report, images, missing))
    return written


def find_reports(directory):
    """Paths of every ``profile.json`` in ``directory`` and its subdirectories."""
    found = []
    for root, dirs, files in os.walk(directory):
        dirs.sort()
        if REPORT_FILE in files:
            found.append(os.path.join(root, REPORT_FILE))
    return found


def load_reports(directory):
    """The report dicts of every ``profile.json`` under ``directory``."""
    reports = []
    for path in find_reports(directory):
        with open(path) as f:
            reports.append(json.load(f))
    return reports
