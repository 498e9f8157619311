"""Repeated code compiled once: a graph's runs of ops that are copies of one
rule (the optimizer update's copy of its rule for each parameter,
``Op.rule_copy``) become calls of one Python function per distinct text.

``codegen.compile_graph`` writes one line per op; Python's ``compile()``
takes about 7 microseconds a line, and BERT-Large's LAMB update is 17,000
ops (27,000 lines with the ``del`` lines): 0.2-0.3 s of every compile,
for 400 copies of a few texts.  Here each run of a copy's lines is
written as a function of the tensors it reads from outside, its kernels and
constants passed in as one tuple, returning the tensors that later lines
read; runs with the same text (their names renumbered in order of
appearance) share the function.  The calls run the same kernels on the same
tensors in the same order, and free each intermediate after its last use
as the flat code does (inside the function, or after the call for a tensor
read from outside).
"""
import re

# names in generated lines: tensors (v12), kernels and what they hold (_op3,
# _op3_fp, _op3_body), constants (_c7)
_NAME = re.compile(r"\b(v\d+|_op\d+\w*|_c\d+)\b")

MIN_OPS = 8         # a shorter run is written inline


def assemble(body, free, groups, keep, glb):
    """The function body's lines for ``body`` (per line: (text, names read,
    names made)); ``free[i]``: the names whose last use is line ``i``;
    ``groups[i]``: the rule copy line ``i`` belongs to (-1: none); ``keep``:
    names never freed (the graph's inputs and outputs); ``glb``: the
    globals of the generated code, which gain the shared functions (``_s0``,
    ...) and each call's tuple of kernels and constants (``_k0``, ...).
    Returns (lines, the shared functions' source)."""
    last_use = {n: i for i, names in enumerate(free) for n in names}
    lines: list = []
    shared: dict = {}          # a run's text -> its function's name
    defs: list = []
    calls = [0]                # calls written so far (their tuples' names)
    i = 0
    while i < len(body):
        j = i + 1
        while j < len(body) and groups[j] == groups[i]:
            j += 1
        run = body[i:j]
        if groups[i] < 0 or j - i < MIN_OPS or any("'" in b[0] or '"' in b[0] for b in run):
            for k in range(i, j):
                _inline(lines, body[k][0], free[k])
        else:
            _call(lines, range(i, j), body, free, keep, last_use, glb, shared, defs,
                  calls)
        i = j
    return lines, "\n".join(defs)


def _inline(lines, text, dead):
    lines.append(text)
    if dead:
        lines.append("    del " + ", ".join(sorted(dead)))


def _call(lines, span, body, free, keep, last_use, glb, shared, defs, calls):
    """The lines of ``span`` as one call of a shared function."""
    order = {n: m for m, n in enumerate(n for k in span for n in body[k][2])}
    made = set(order)
    end = span[-1]
    # made here and read after (or kept): returned to the caller
    returned = [n for k in span for n in body[k][2]
                if n in keep or last_use.get(n, end) > end]
    raw = []
    outside_dead = []
    for k in span:
        raw.append(body[k][0])
        inside = sorted((n for n in free[k] if n in made), key=order.__getitem__)
        outside_dead += [n for n in free[k] if n not in made]
        if inside:
            raw.append("    del " + ", ".join(inside))
    # the text split at its names (odd items), each renamed in order of appearance
    parts = _NAME.split("\n".join(raw))
    rename: dict = {}
    reads: list = []           # names from outside, the function's arguments
    globals_: list = []        # kernels and constants, its first argument
    n_made = 0
    for n in dict.fromkeys(parts[1::2]):
        if n in made:
            rename[n] = f"t{n_made}"
            n_made += 1
        elif n in glb:
            rename[n] = f"k{len(globals_)}"
            globals_.append(n)
        else:
            rename[n] = f"a{len(reads)}"
            reads.append(n)
    parts[1::2] = [rename[n] for n in parts[1::2]]
    text = "".join(parts)
    out = [rename[n] for n in returned]
    head = "(K" + "".join(", " + rename[n] for n in reads) + "):"
    unpack = "    " + "".join(rename[n] + ", " for n in globals_) + "= K" if globals_ else ""
    tail = "    return (" + "".join(n + ", " for n in out) + ")"
    source = "\n".join(part for part in (head, unpack, text, tail) if part)
    fn = shared.get(source)
    if fn is None:
        fn = shared[source] = f"_s{len(shared)}"
        defs.append(f"def {fn}{source}")
    key = f"_k{calls[0]}"
    calls[0] += 1
    glb[key] = tuple(glb[n] for n in globals_)
    call = f"{fn}({key}" + "".join(", " + n for n in reads) + ")"
    if returned:
        lines.append("    " + "".join(n + ", " for n in returned) + "= " + call)
    else:
        lines.append("    " + call)
    if outside_dead:
        lines.append("    del " + ", ".join(sorted(outside_dead)))
