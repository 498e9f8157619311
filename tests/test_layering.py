"""The house rules of ARCHITECTURE.md, checked on the source.

Imports run downward: each layer below the face imports only the layers
below it (``RANK``), and no module there imports another's private names.
Nothing under capture/, ir/, passes/, machine/,
runtime/, profiling/ or distributed/ imports the face (the PopTorch API
modules at the top level and their private machinery in ``_api/``), except
its shared vocabulary (``errors``, ``enums``, ``version``).  Nothing below
the face reads an ``Options`` object's private ``_values``: the runtime
resolves options once into ``runtime.settings.config.CompileConfig``.  The compiler
driver stays a short, ordered list of passes.
"""
import ast
import pathlib

import pytest

import poptorchsim

PACKAGE = pathlib.Path(poptorchsim.__file__).parent
BELOW_FACE = ("capture", "ir", "passes", "machine", "estimate", "runtime", "profiling",
              "distributed")
SHARED = {"errors", "enums", "version"}


def _modules():
    for layer in BELOW_FACE:
        for path in sorted((PACKAGE / layer).rglob("*.py")):
            yield path


def _face_imports(path, root=PACKAGE):
    """(line, module) for each import of a face module in ``path`` (a file
    of the package at ``root``)."""
    tree = ast.parse(path.read_text(), str(path))
    depth = len(path.relative_to(root).parts) - 1      # packages below the top
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            names = [node.module or ""]
        elif isinstance(node, ast.ImportFrom):
            if node.level != depth + 1:
                continue                 # within its layer
            top = (node.module or "").split(".")[0]
            names = ([f"poptorchsim.{top}"] if top
                     else [f"poptorchsim.{a.name}" for a in node.names])
        else:
            continue
        for name in names:
            parts = name.split(".")
            if parts[0] != "poptorchsim":
                continue
            if len(parts) == 1 or (parts[1] not in SHARED and parts[1] not in BELOW_FACE):
                found.append((node.lineno, parts[1] if len(parts) > 1 else name))
    return found


def test_nothing_below_the_face_imports_it():
    offenders = [f"{path.relative_to(PACKAGE)}:{line} imports {name}"
                 for path in _modules() for line, name in _face_imports(path)]
    assert not offenders, "\n".join(offenders)


def test_the_checker_sees_a_face_import(tmp_path):
    """The check above can fail: a runtime module importing the options is caught."""
    (tmp_path / "runtime").mkdir()
    fake = tmp_path / "runtime" / "probe.py"
    fake.write_text("from ..options import Options\nfrom .. import errors, optim\n"
                    "from . import cache\nfrom ..passes import memory\n"
                    "import poptorchsim.annotations\n")
    assert [n for _, n in _face_imports(fake, tmp_path)] == ["options", "optim",
                                                            "annotations"]


def test_nothing_below_the_face_reads_options_private_values():
    offenders = []
    for path in _modules():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Attribute) and node.attr == "_values":
                offenders.append(f"{path.relative_to(PACKAGE)}:{node.lineno}")
    assert not offenders, "options._values read below the face: " + ", ".join(offenders)


@pytest.mark.parametrize("name, limit", [("passes/compile.py", 500), ("runtime/compiler.py", 60)])
def test_the_compiler_driver_stays_short(name, limit):
    lines = (PACKAGE / name).read_text().count("\n")
    assert lines <= limit, f"{name} has {lines} lines: split it by job"


def test_the_two_wings_never_import_each_other():
    """One program, walked twice: the estimate (``estimate/``) and the host
    execution (``machine/``) read the IR and never each other."""
    offenders = []
    for wing, other in (("estimate", "machine"), ("machine", "estimate")):
        for path in sorted((PACKAGE / wing).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.ImportFrom):
                    module = node.module or ""
                    names = [module] + [f"{module}.{a.name}" for a in node.names]
                    if any(n.split(".")[0] == other or f".{other}" in f".{n}" for n in names
                           if n) and (node.level > 0 or module.startswith("poptorchsim")):
                        offenders.append(f"{path.relative_to(PACKAGE)}:{node.lineno}")
                elif isinstance(node, ast.Import):
                    if any(f"poptorchsim.{other}" in a.name for a in node.names):
                        offenders.append(f"{path.relative_to(PACKAGE)}:{node.lineno}")
    assert not offenders, offenders


# the layers below the face, bottom first: a layer imports only layers of a lower
# rank (and the shared vocabulary); layers of one rank never import each other
RANK = {"ir": 0, "profiling": 0, "distributed": 0, "capture": 1, "machine": 2,
        "estimate": 2, "passes": 3, "runtime": 4}


def _layer_imports(path, root=PACKAGE):
    """(line, layer) for each import of another layer of the package in
    ``path``, at module level or inside functions."""
    depth = len(path.relative_to(root).parts) - 1
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.level == depth + 1:
            top = (node.module or "").split(".")[0]
            names = [top] if top else [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            names = (node.module or "").split(".")[1:2] \
                if (node.module or "").startswith("poptorchsim.") else []
        elif isinstance(node, ast.Import):
            names = [a.name.split(".")[1] for a in node.names
                     if a.name.startswith("poptorchsim.")]
        else:
            continue
        found += [(node.lineno, n) for n in names if n in RANK]
    return found


def test_layers_import_only_the_layers_below_them():
    offenders = []
    for layer, rank in RANK.items():
        for path in sorted((PACKAGE / layer).rglob("*.py")):
            for line, other in _layer_imports(path):
                if other != layer and RANK[other] >= rank:
                    offenders.append(f"{path.relative_to(PACKAGE)}:{line} ({layer}) imports "
                                     f"{other}")
    assert not offenders, "\n".join(offenders)


def test_the_order_checker_sees_an_upward_import(tmp_path):
    (tmp_path / "passes").mkdir()
    probe = tmp_path / "passes" / "probe.py"
    probe.write_text("from ..ir import graph\nfrom ..machine import engine\nfrom . import lower\n"
                     "def f():\n    from ..estimate.cost import op_cost\n"
                     "import poptorchsim.runtime.settings.config\n")
    # passes/ may import machine and estimate, not runtime
    assert sorted(n for _, n in _layer_imports(probe, tmp_path)) == [
        "estimate", "ir", "machine", "runtime"]


def test_no_private_names_cross_modules_below_the_face():
    offenders = []
    for path in _modules():
        name = str(path.relative_to(PACKAGE))
        for node in ast.walk(ast.parse(path.read_text(), name)):
            if isinstance(node, ast.ImportFrom) and (
                    node.level > 0 or (node.module or "").startswith("poptorchsim")):
                offenders += [f"{name}:{node.lineno} imports {a.name}" for a in node.names
                              if a.name.startswith("_") and not a.name.startswith("__")]
    assert not offenders, "\n".join(offenders)
