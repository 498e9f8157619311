"""Writes ``docs/api_surface.md`` from ``tests/data/poptorch_surface.json``
(PopTorch's surface) and ``ABSENT`` in ``tests/test_api_surface.py`` (what
poptorchsim lacks, and why).

    python tools/api_surface_doc.py

``tests/test_api_surface.py`` checks the page is what this writes.
"""
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.normpath(os.path.join(HERE, os.pardir))
DATA = os.path.join(ROOT, "tests", "data", "poptorch_surface.json")
PAGE = os.path.join(ROOT, "docs", "api_surface.md")

# Names poptorchsim accepts, validates and records, whose effect on hardware
# is inside Poplar's compiler or runtime: on the simulator they change
# nothing (written by hand; each has a test in tests/test_surface_additions.py
# or tests/test_options_compat.py).
RECORDED_ONLY = {
    "Options.enableStableNorm": (
        "stored as `_Popart.options[\"enableStableNorm\"]`; norms run through "
        "PyTorch's kernels, which are already stable"),
    "Options.Training.setConvolutionDithering": (
        "stored as `Training.convolution_dithering`; the tile mapping does not model "
        "dithering"),
    "Options.sourceLocationExcludes / appendToLocationExcludes": (
        "stored (`options.source_location_excludes`, PopTorch's defaults); the IR "
        "already names the first frame outside torch and poptorchsim"),
    "Options.useIpuModel, useIpuId": "stored; poptorchsim always simulates",
    "profiling.Channel": (
        "tracepoints time their block on the host and log it at DEBUG level instead "
        "of writing PopVision trace events"),
    "PoplarExecutor.copyWeightsToHostIfNeeded": (
        "always False: weights are copied into the model after every call"),
}

INTRO = """\
# PopTorch's API surface in poptorchsim

<!-- Written by tools/api_surface_doc.py from tests/data/poptorch_surface.json
     and ABSENT in tests/test_api_surface.py: edit those, then run
     `python tools/api_surface_doc.py`. -->

Which of PopTorch's Python names poptorchsim has, name by name.
`tools/poptorch_surface.py` read PopTorch's own sources ({source}) with
Python's `ast` and listed every public name of the `poptorch` module and of
its public submodules, and every public method, property and attribute of the
classes applications touch (with the methods they inherit from PopTorch's base
classes), plus the private names Graphcore's applications
(`graphcore/examples`) read. `tests/test_api_surface.py` checks each name
against poptorchsim: a name must exist, or be listed below with the reason it
does not. The test fails when a name goes missing without a reason, and when a
reason is left for a name that is now provided.

**{provided} of {total} names are provided; {absent} are absent.** None of
the absent names is used by name in Graphcore's applications: the tool also
lists the names the applications use (`poptorch.<name>`, names imported from
`poptorch`, methods called as `.<name>(...)` and attributes read as
`.<name>`, on any object, so it over-counts: {called} of the {total}), and
the test checks that none of them is absent.

Parameters are compared too: each of the {signatures} functions and methods
PopTorch defines (constructors included) must take a call written for
PopTorch's: the same parameter names, a default wherever PopTorch has one, no
extra required parameter, and the positional parameters in PopTorch's order.
{exempt} constructors that only poptorchsim itself calls are exempt (listed
at the end). The {members} members of PopTorch's {enums} enums all exist, with
PopTorch's values.
"""


def _load_lists():
    """(absent, signature_exempt): tests/data/poptorch_surface_notes.json."""
    with open(os.path.join(ROOT, "tests", "data", "poptorch_surface_notes.json")) as f:
        notes = json.load(f)
    return notes["absent"], notes["signature_exempt"]


def render(surface, absent, exempt):
    groups = [(key, names) for key, names in surface["modules"].items()]
    groups += [(key, list(members)) for key, members in surface["classes"].items()]
    total = sum(len(names) for _, names in groups)
    called = set(surface["used_by_applications"])
    lines = [INTRO.format(source=surface["source"], provided=total - len(absent),
                          total=total, absent=len(absent), called=len(called),
                          signatures=len(surface["signatures"]), exempt=len(exempt),
                          enums=len(surface["enums"]),
                          members=sum(len(m) for m in surface["enums"].values()))]
    lines += ["## Per module and class", "",
              "| PopTorch | names | provided | absent | used by applications |",
              "| --- | ---: | ---: | ---: | ---: |"]
    for key, names in groups:
        label = key if key.startswith("poptorch") else f"poptorch.{key}"
        missing = sum(f"{key}.{n}" in absent for n in names)
        used = sum(f"{key}.{n}" in called for n in names)
        lines.append(f"| `{label}` | {len(names)} | {len(names) - missing} | {missing} "
                     f"| {used} |")
    lines += ["", "## Absent, and why", "",
              "| name | why |", "| --- | --- |"]
    for name, why in sorted(absent.items()):
        lines.append(f"| `{name}` | {why} |")
    lines += ["", "## Private names applications read (all provided)", "",
              "| name | read by |", "| --- | --- |"]
    for key, names in surface["semi_public_used_by"].items():
        for name, files in names.items():
            lines.append(f"| `{key}.{name}` | {', '.join(f'`{f}`' for f in files)} |")
    lines += ["", "## Accepted and recorded, no effect on the simulator", "",
              "PopTorch applies these inside Poplar; poptorchsim validates them "
              "with PopTorch's checks and texts, chains, and records them.", "",
              "| name | what the simulator does |", "| --- | --- |"]
    for name, what in RECORDED_ONLY.items():
        lines.append(f"| `{name}` | {what} |")
    lines += ["", "## Parameters not compared", "", "| function | why |", "| --- | --- |"]
    for name, why in exempt.items():
        lines.append(f"| `{name}` | {why} |")
    lines += ["", "## Regenerating", "",
              "```bash",
              "python tools/poptorch_surface.py   # needs the PopTorch (and examples) mirrors",
              "python tools/api_surface_doc.py",
              "```", ""]
    return "\n".join(lines)


def main():
    with open(DATA) as f:
        surface = json.load(f)
    with open(PAGE, "w") as f:
        f.write(render(surface, *_load_lists()))
    print(f"wrote {os.path.relpath(PAGE, ROOT)}", file=sys.stderr)


if __name__ == "__main__":
    main()
