"""Writes ``tests/data/poptorch_surface.json``: PopTorch's Python surface,
name by name, read from PopTorch's own sources with ``ast``.

    python tools/poptorch_surface.py [--mirror PATH] [--commit REV] [--out FILE]

The sources are read from a bare git mirror of graphcore/poptorch
(``git show REV:python/<module>.py``); nothing is imported.  The JSON holds:

* ``modules``: the public names of ``poptorch`` and of its public submodules
  (``poptorch.optim``, ``poptorch.enums``, ``poptorch.options``, ...);
* ``classes``: for each class applications touch (``Options`` and its
  sub-option groups, ``DataLoader``, ``AsynchronousDataAccessor``,
  ``PoplarExecutor``, the ``poptorch.optim`` classes, ...) its public
  methods, properties and instance attributes, with those inherited from
  PopTorch's own base classes, plus the semi-public names in ``SEMI_PUBLIC``
  (private by spelling, read by Graphcore's applications).

``tests/test_api_surface.py`` checks poptorchsim against this file.
"""
import argparse
import ast
import json
import os
import subprocess
import sys
import warnings

DEFAULT_MIRROR = "/work/.mirror/graphcore+poptorch/repo"
HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_OUT = os.path.join(HERE, os.pardir, "tests", "data", "poptorch_surface.json")

# poptorch's ``__init__.py`` star-imports these modules (no ``__all__``):
# their public top-level definitions become ``poptorch.<name>``.
STAR_MODULES = ["enums", "ops", "options", "_printing"]
# Public submodules an application reaches as ``poptorch.<module>.<name>``.
SUBMODULES = ["optim", "enums", "options", "profiling"]

# (module, class name) -> the key the JSON uses for it.
CLASSES = {
    ("options", "Options"): "Options",
    ("options", "_TrainingOptions"): "Options.Training",
    ("options", "_DistributedOptions"): "Options.Distributed",
    ("options", "_PrecisionOptions"): "Options.Precision",
    ("options", "_TensorLocationOptions"): "Options.TensorLocations",
    ("options", "_JitOptions"): "Options.Jit",
    ("options", "_PopartOptions"): "Options._Popart",
    ("options", "TensorLocationSettings"): "TensorLocationSettings",
    ("options", "PipelinedExecution"): "PipelinedExecution",
    ("options", "ShardedExecution"): "ShardedExecution",
    ("options", "SerialPhasedExecution"): "SerialPhasedExecution",
    ("options", "ParallelPhasedExecution"): "ParallelPhasedExecution",
    ("options", "Stage"): "Stage",
    ("options", "Phase"): "Phase",
    ("__init__", "DataLoader"): "DataLoader",
    ("__init__", "AsynchronousDataAccessor"): "AsynchronousDataAccessor",
    ("_poplar_executor", "PoplarExecutor"): "PoplarExecutor",
    ("optim", "VariableAttributes"): "optim.VariableAttributes",
    ("optim", "SGD"): "optim.SGD",
    ("optim", "Adam"): "optim.Adam",
    ("optim", "AdamW"): "optim.AdamW",
    ("optim", "RMSprop"): "optim.RMSprop",
    ("optim", "LAMB"): "optim.LAMB",
    ("ops", "Block"): "Block",
    ("ops", "MultiConv"): "MultiConv",
    ("ops", "CPU"): "CPU",
}
# PopTorch base classes, so inherited methods are listed with each class.
BASES = {
    "_options_impl.OptionsDict": ("_options_impl", "OptionsDict"),
    "_options_impl.IStageManager": ("_options_impl", "IStageManager"),
    "Optimizer": ("optim", "Optimizer"),
    "_IExecutionStrategy": ("options", "_IExecutionStrategy"),
    "_IPhasedExecution": ("options", "_IPhasedExecution"),
    "PipelinedExecution": ("options", "PipelinedExecution"),
}
DEFAULT_EXAMPLES = "/work/.mirror/graphcore+examples/repo"
# Private by spelling, read by Graphcore's applications: found by
# ``app_private_names`` in a mirror of graphcore/examples (a member of a
# class here whose name starts with one underscore, read as ``obj._name``
# with ``obj`` not ``self``); these are kept when no mirror is given.
# speech/fastpitch and speech/conformer read ``loader._combined_batch_size``,
# vision/cnns ``inference_model._executable``, yolo_v4 ``model._optimizer``.
SEMI_PUBLIC = {
    "DataLoader": ["_combined_batch_size"],
    "Options": ["_Popart"],
    "PoplarExecutor": ["_executable", "_optimizer"],
}


def read_source(mirror, commit, module):
    return subprocess.run(
        ["git", "-C", mirror, "show", f"{commit}:python/{module}.py"],
        check=True, capture_output=True, text=True).stdout


def _public(name):
    return not name.startswith("_")


def top_level_names(tree):
    """Names a module defines itself (classes, functions, assignments)."""
    names = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef, ast.AsyncFunctionDef)):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            for target in node.targets:
                if isinstance(target, ast.Name):
                    names.add(target.id)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
    return {n for n in names if _public(n)}


def init_names(tree, star_names):
    """``poptorch.<name>``: ``__init__.py``'s own definitions, the names it
    imports by name from its own modules, and its star imports."""
    names = top_level_names(tree)
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").startswith(
                "poptorch")):
            for alias in node.names:
                if alias.name == "*":
                    module = (node.module or "").split(".")[-1]
                    names |= star_names.get(module, set())
                elif _public(alias.asname or alias.name):
                    names.add(alias.asname or alias.name)
    return names


def _decorator_names(func):
    out = set()
    for dec in func.decorator_list:
        if isinstance(dec, ast.Name):
            out.add(dec.id)
        elif isinstance(dec, ast.Attribute):
            out.add(dec.attr)
    return out


def signature(func):
    """PopTorch's parameters of a function: ``[name, ...]`` in order,
    ``*name``/``**name`` for the catch-alls, ``name=`` for those with a
    default; ``self``/``cls`` left out."""
    args = func.args
    out = []
    positional = args.posonlyargs + args.args
    first_default = len(positional) - len(args.defaults)
    for k, arg in enumerate(positional):
        out.append(arg.arg + ("=" if k >= first_default else ""))
    if args.vararg:
        out.append("*" + args.vararg.arg)
    for arg, default in zip(args.kwonlyargs, args.kw_defaults):
        out.append(arg.arg + ("=" if default is not None else ""))
    if args.kwarg:
        out.append("**" + args.kwarg.arg)
    if out and out[0] in ("self", "cls"):
        out = out[1:]
    return out


def class_members(cls):
    """{name: kind} for a class body: methods, properties, class attributes
    and ``self.<name> = ...`` instance attributes."""
    members = {}
    for node in cls.body:
        if isinstance(node, ast.FunctionDef):
            decorators = _decorator_names(node)
            if "setter" in decorators:
                continue
            kind = "property" if "property" in decorators else "method"
            members[node.name] = kind
            for sub in ast.walk(node):
                targets = []
                if isinstance(sub, ast.Assign):
                    targets = sub.targets
                elif isinstance(sub, (ast.AnnAssign, ast.AugAssign)):
                    targets = [sub.target]
                for target in targets:
                    if isinstance(target, ast.Attribute) and isinstance(
                            target.value, ast.Name) and target.value.id == "self":
                        members.setdefault(target.attr, "attribute")
        elif isinstance(node, ast.Assign):
            for target in node.targets:
                if isinstance(target, ast.Name):
                    members[target.id] = "classattr"
    return members


def _base_name(expr):
    if isinstance(expr, ast.Name):
        return expr.id
    if isinstance(expr, ast.Attribute) and isinstance(expr.value, ast.Name):
        return f"{expr.value.id}.{expr.attr}"
    return None


def find_class(trees, module, name):
    for node in trees[module].body:
        if isinstance(node, ast.ClassDef) and node.name == name:
            return node
    raise KeyError(f"{module}.{name}")


def all_signatures(trees, module, name):
    """``{method: signature}`` for a class, ``__init__`` included, with the
    methods of its PopTorch base classes."""
    cls = find_class(trees, module, name)
    out = {}
    for base in cls.bases:
        key = _base_name(base)
        if key in BASES:
            out.update(all_signatures(trees, *BASES[key]))
    for node in cls.body:
        if isinstance(node, ast.FunctionDef) and not _decorator_names(node) & {
                "property", "setter", "staticmethod"}:
            out[node.name] = signature(node)
    return out


def module_signatures(trees, surface):
    """``{"poptorch.<function>": signature}`` for the surface's functions."""
    defined = {}
    for module in ["__init__", "ops", "options", "_printing", "_poplar_executor", "optim",
                   "profiling"]:
        for node in trees[module].body:
            if isinstance(node, ast.FunctionDef):
                defined.setdefault(node.name, signature(node))
    return {f"{key}.{n}": defined[n] for key, names in surface.items() for n in names
            if n in defined and key in ("poptorch",)}


def enum_members(tree):
    """``{enum: {member: value}}`` for the enums of ``enums.py`` (a value
    that is not a literal is None)."""
    out = {}
    for node in tree.body:
        if isinstance(node, ast.ClassDef):
            members = {}
            for item in node.body:
                if isinstance(item, ast.Assign) and isinstance(item.targets[0], ast.Name) \
                        and _public(item.targets[0].id):
                    try:
                        members[item.targets[0].id] = ast.literal_eval(item.value)
                    except ValueError:
                        members[item.targets[0].id] = None
            out[node.name] = members
    return out


def all_members(trees, module, name):
    cls = find_class(trees, module, name)
    members = {}
    for base in cls.bases:
        key = _base_name(base)
        if key in BASES:
            members.update(all_members(trees, *BASES[key]))
    members.update(class_members(cls))
    return members


def _dotted(expr):
    """``a.b.c`` for a chain of names, else None."""
    if isinstance(expr, ast.Name):
        return expr.id
    if isinstance(expr, ast.Attribute):
        head = _dotted(expr.value)
        return None if head is None else f"{head}.{expr.attr}"
    return None


def app_names(examples, commit="HEAD"):
    """What the Python files of graphcore/examples that mention poptorch
    use: ``(private, module_names, called, read)``: ``{name: [files]}`` for
    ``obj._name`` reads (``obj`` not ``self``/``cls``), the set of
    ``(module, name)`` for ``poptorch.optim.<name>`` and ``from poptorch.optim
    import <name>`` (any poptorch module), the set of ``.<name>(...)``
    method calls and the set of all ``.<name>`` attribute names."""
    files = subprocess.run(["git", "-C", examples, "grep", "-l", "poptorch", commit, "--",
                            "*.py"], capture_output=True, text=True).stdout.split()
    found, module_names, called, read = {}, set(), set(), set()
    for entry in files:
        path = entry.split(":", 1)[1]
        source = subprocess.run(["git", "-C", examples, "show", entry],
                                capture_output=True, text=True).stdout
        try:
            with warnings.catch_warnings():     # old files' invalid escapes
                warnings.simplefilter("ignore")
                tree = ast.parse(source)
        except SyntaxError:
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
                called.add(node.func.attr)
            if isinstance(node, ast.Attribute):
                read.add(node.attr)
                dotted = _dotted(node.value)
                if dotted is not None and dotted.split(".")[0] == "poptorch":
                    module_names.add((dotted, node.attr))
            if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] \
                    == "poptorch":
                module_names.update((node.module, alias.name) for alias in node.names)
            if isinstance(node, ast.Attribute) and node.attr.startswith("_") \
                    and not node.attr.startswith("__") and not (
                        isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):
                found.setdefault(node.attr, set()).add(path)
    return ({name: sorted(paths) for name, paths in found.items()}, module_names, called,
            read)


def build(mirror, commit, examples=None):
    modules = ["__init__", "enums", "ops", "options", "optim", "_printing",
               "_poplar_executor", "_options_impl", "profiling"]
    trees = {m: ast.parse(read_source(mirror, commit, m)) for m in modules}
    star = {m: top_level_names(trees[m]) for m in STAR_MODULES}
    surface = {"poptorch": sorted(init_names(trees["__init__"], star))}
    for module in SUBMODULES:
        surface[f"poptorch.{module}"] = sorted(top_level_names(trees[module]))
    used, module_names, called, read = (app_names(examples) if examples
                                        else ({}, set(), set(), set()))
    classes, semi_public = {}, {}
    signatures = module_signatures(trees, surface)
    for (module, name), key in CLASSES.items():
        members = all_members(trees, module, name)
        for method, params in all_signatures(trees, module, name).items():
            if method in members or method == "__init__":
                if _public(method) or method == "__init__":
                    signatures[f"{key}.{method}"] = params
        private = sorted(n for n in members if n in used and not n.startswith("__"))
        semi = sorted(set(SEMI_PUBLIC.get(key, [])) | set(private))
        keep = {n: k for n, k in members.items() if _public(n) or n in semi}
        for n in semi:
            keep.setdefault(n, "attribute")
        if semi:
            semi_public[key] = {n: used.get(n, ["(SEMI_PUBLIC)"])[:3] for n in semi}
        classes[key] = dict(sorted(keep.items()))
    head = subprocess.run(["git", "-C", mirror, "rev-parse", commit], check=True,
                          capture_output=True, text=True).stdout.strip()
    return {"source": f"graphcore/poptorch@{head} python/",
            "generated_by": "tools/poptorch_surface.py",
            "modules": surface, "classes": classes,
            "semi_public_used_by": semi_public,
            "used_by_applications": _used(surface, classes, module_names, called, read),
            "signatures": dict(sorted(signatures.items())),
            "enums": enum_members(trees["enums"])}


def _used(surface, classes, module_names, called, read):
    """The surface names applications use by name: ``poptorch.<name>``,
    ``poptorch.optim.<name>`` (or imported from there), methods called as
    ``.<name>(...)`` and properties and attributes read as ``.<name>`` (on any
    object: a name counts wherever it appears, so this over-counts)."""
    out = [f"{module}.{n}" for module, names in surface.items() for n in names
           if (module, n) in module_names]
    out += [f"{key}.{n}" for key, members in classes.items()
            for n, kind in members.items()
            if (n in called if kind == "method" else n in read)]
    return sorted(out)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mirror", default=DEFAULT_MIRROR)
    parser.add_argument("--commit", default="HEAD")
    parser.add_argument("--examples", default=DEFAULT_EXAMPLES,
                        help="mirror of graphcore/examples, for the private names "
                             "applications read ('' to skip)")
    parser.add_argument("--out", default=DEFAULT_OUT)
    args = parser.parse_args(argv)
    examples = args.examples if args.examples and os.path.isdir(args.examples) else None
    data = build(args.mirror, args.commit, examples)
    with open(args.out, "w") as f:
        json.dump(data, f, indent=1, sort_keys=False)
        f.write("\n")
    count = sum(len(v) for v in data["modules"].values()) + sum(
        len(v) for v in data["classes"].values())
    print(f"wrote {os.path.normpath(args.out)}: {count} names", file=sys.stderr)


if __name__ == "__main__":
    main()
