"""PopTorch's Python surface, name by name, against poptorchsim's.

``tests/data/poptorch_surface.json`` lists every public name of the
``poptorch`` module and its public submodules, and every public method,
property and attribute of the classes applications touch (``Options`` and
its option groups, ``DataLoader``, ``AsynchronousDataAccessor``,
``PoplarExecutor``, the ``poptorch.optim`` classes, ...), plus the private
names Graphcore's applications read.  ``tools/poptorch_surface.py`` wrote it
from PopTorch's sources with ``ast``; where the PopTorch mirror exists,
``test_data_file_matches_poptorch_sources`` checks it is still what the tool
writes.

Each name must exist in poptorchsim unless ``ABSENT``
(``tests/data/poptorch_surface_notes.json``) gives the reason it does not;
an ``ABSENT`` entry for a name poptorchsim has fails too, so the list says
exactly what is missing.  ``docs/api_surface.md`` is written from the same
two lists.
"""
import importlib.util
import json
import os
import pathlib

import pytest
import torch

import poptorchsim

ROOT = pathlib.Path(__file__).parents[1]
DATA = ROOT / "tests" / "data" / "poptorch_surface.json"
SURFACE = json.loads(DATA.read_text())
MIRROR = "/work/.mirror/graphcore+poptorch/repo"

# "<module or class key>.<name>": why poptorchsim does not have it ("absent"), and
# "<key>.<function>": why its parameters differ from PopTorch's ("signature_exempt");
# tools/api_surface_doc.py writes docs/api_surface.md from the same file
NOTES = json.loads((ROOT / "tests" / "data" / "poptorch_surface_notes.json").read_text())
ABSENT = NOTES["absent"]
SIGNATURE_EXEMPT = NOTES["signature_exempt"]


def _dataset(n=8):
    return torch.utils.data.TensorDataset(torch.arange(2. * n).reshape(n, 2))


def _loaders():
    sampler = torch.utils.data.BatchSampler(torch.utils.data.SequentialSampler(_dataset()),
                                            2, drop_last=False)
    return [poptorchsim.DataLoader(poptorchsim.Options(), _dataset(), batch_size=2),
            poptorchsim.DataLoader(poptorchsim.Options(), _dataset(), batch_sampler=sampler),
            # PopTorch sets rebatched_drop_last in the rebatched mode only
            poptorchsim.DataLoader(poptorchsim.Options(), _dataset(), batch_size=2,
                                   mode=poptorchsim.DataLoaderMode.AsyncRebatched)]


def _optimizer(name):
    return getattr(poptorchsim.optim, name)([torch.nn.Parameter(torch.zeros(2))], lr=0.1)


# class key -> instances to look the names up on (an attribute PopTorch sets
# in one mode only may be on one of them)
INSTANCES = {
    "Options": lambda: [poptorchsim.Options()],
    "Options.Training": lambda: [poptorchsim.Options().Training],
    "Options.Distributed": lambda: [poptorchsim.Options().Distributed],
    "Options.Precision": lambda: [poptorchsim.Options().Precision],
    "Options.TensorLocations": lambda: [poptorchsim.Options().TensorLocations],
    "Options.Jit": lambda: [poptorchsim.Options().Jit],
    "Options._Popart": lambda: [poptorchsim.Options()._Popart],
    "TensorLocationSettings": lambda: [poptorchsim.TensorLocationSettings()],
    "PipelinedExecution": lambda: [poptorchsim.PipelinedExecution()],
    "ShardedExecution": lambda: [poptorchsim.ShardedExecution()],
    "SerialPhasedExecution": lambda: [
        poptorchsim.SerialPhasedExecution(poptorchsim.Phase("A"))],
    "ParallelPhasedExecution": lambda: [
        poptorchsim.ParallelPhasedExecution(poptorchsim.Phase("A"))],
    "Stage": lambda: [poptorchsim.Stage("A")],
    "Phase": lambda: [poptorchsim.Phase("A")],
    "DataLoader": _loaders,
    "AsynchronousDataAccessor": lambda: [
        poptorchsim.AsynchronousDataAccessor(
            poptorchsim.DataLoader(poptorchsim.Options(), _dataset(), batch_size=2))],
    "PoplarExecutor": lambda: [poptorchsim.inferenceModel(torch.nn.Linear(2, 2))],
    "optim.VariableAttributes": lambda: [_optimizer("SGD").variable_attrs],
    **{f"optim.{name}": (lambda name=name: [_optimizer(name)])
       for name in ("SGD", "Adam", "AdamW", "RMSprop", "LAMB")},
    "Block": lambda: [poptorchsim.Block("A")],
    "MultiConv": lambda: [poptorchsim.MultiConv()],
    "CPU": lambda: [poptorchsim.CPU(lambda x: x, "id")],
}


_OPTION_GROUPS = {"Training": "_TrainingOptions", "Distributed": "_DistributedOptions",
                  "Precision": "_PrecisionOptions", "TensorLocations": "_TensorLocationOptions",
                  "Jit": "_JitOptions", "_Popart": "_PopartOptions"}


def _class(key):
    """poptorchsim's class for a class key of the surface."""
    if key.startswith("Options."):
        return getattr(poptorchsim.options, _OPTION_GROUPS[key.split(".", 1)[1]])
    owner = poptorchsim
    for part in key.split("."):
        owner = getattr(owner, part)
    return owner


def _has(obj, name):
    """``name`` on ``obj``'s class (methods, properties: not evaluated) or
    on the instance; a property that raises counts as present."""
    if hasattr(type(obj), name):
        return True
    try:
        getattr(obj, name)
    except AttributeError:
        return False
    except Exception:       # noqa: BLE001 - the name exists, its value needs a compile
        return True
    return True


def _module(key):
    return poptorchsim if key == "poptorch" else importlib.import_module(
        "poptorchsim." + key.split(".", 1)[1])


def _close(objects):
    for obj in objects:
        terminate = getattr(obj, "terminate", None)
        if callable(terminate):
            terminate()


def _missing_classes(keys=None):
    out = []
    for key, members in SURFACE["classes"].items():
        if keys is not None and key not in keys:
            continue
        objects = INSTANCES[key]()
        try:
            out += [f"{key}.{n}" for n in members if not any(_has(o, n) for o in objects)]
        finally:
            _close(objects)
    return out


@pytest.fixture(scope="module")
def missing():
    """Every name of PopTorch's surface that poptorchsim lacks."""
    out = [f"{key}.{n}" for key, names in SURFACE["modules"].items()
           for n in names if not hasattr(_module(key), n)]
    return out + _missing_classes()


def test_every_class_has_instances():
    assert set(INSTANCES) == set(SURFACE["classes"])


def test_every_name_is_provided_or_absent_with_a_reason(missing):
    unexplained = [name for name in missing if name not in ABSENT]
    assert not unexplained, (
        "PopTorch names poptorchsim lacks, with no reason in ABSENT:\n  "
        + "\n  ".join(unexplained))


def test_absent_lists_only_missing_names(missing):
    """An ABSENT entry for a name poptorchsim now has, or one PopTorch does
    not have, is stale."""
    known = {f"{key}.{n}" for key, names in SURFACE["modules"].items() for n in names}
    known |= {f"{key}.{n}" for key, members in SURFACE["classes"].items() for n in members}
    assert not set(ABSENT) - known, sorted(set(ABSENT) - known)
    stale = sorted(set(ABSENT) - set(missing))
    assert not stale, f"ABSENT lists names poptorchsim has: {stale}"


def test_a_name_gone_missing_is_caught(monkeypatch):
    """The check can fail: remove a setter and it is reported."""
    monkeypatch.delattr(poptorchsim._api.option_extras._CompilerOptions, "enableStableNorm")
    assert "Options.enableStableNorm" in _missing_classes(["Options"])
    monkeypatch.delattr(poptorchsim, "setLogLevel")
    assert not hasattr(_module("poptorch"), "setLogLevel")


def test_applications_private_names_are_provided():
    """The private names Graphcore's applications read are all provided."""
    for key, names in SURFACE["semi_public_used_by"].items():
        for name in names:
            assert f"{key}.{name}" not in ABSENT, (key, name)


def _resolve(key):
    owner, _, name = key.rpartition(".")
    if owner in SURFACE["classes"]:
        cls = _class(owner)
        return cls if name == "__init__" else getattr(cls, name)
    return getattr(_module(owner), name)


def signature_problems(poptorch_params, fn):
    """How ``fn`` fails to take a call written for PopTorch's parameters
    (``signatures`` in the data file: ``name``, ``name=`` with a default,
    ``*args``, ``**kwargs``): a parameter it lacks, a default it lacks, or
    positional parameters in another order."""
    import inspect
    params = list(inspect.signature(fn).parameters.values())
    if params and params[0].name in ("self", "cls") and inspect.isfunction(fn):
        params = params[1:]
    by_name = {p.name: p for p in params}
    var_kw = any(p.kind == p.VAR_KEYWORD for p in params)
    var_pos = any(p.kind == p.VAR_POSITIONAL for p in params)
    problems, positional, keyword_only = [], [], False
    for entry in poptorch_params:
        if entry.startswith("**"):
            problems += [] if var_kw else [f"no {entry}"]
            continue
        if entry.startswith("*"):
            keyword_only = True
            problems += [] if var_pos else [f"no {entry}"]
            continue
        name = entry.rstrip("=")
        param = by_name.get(name)
        if param is None:
            problems += [] if var_kw else [f"no parameter {name}"]
            continue
        if entry.endswith("=") and param.default is inspect.Parameter.empty \
                and param.kind not in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            problems.append(f"{name} has no default")
        if not keyword_only:
            positional.append(name)
    theirs = {entry.lstrip("*").rstrip("=") for entry in poptorch_params}
    problems += [f"requires {p.name}" for p in params
                 if p.default is inspect.Parameter.empty and p.name not in theirs
                 and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    ours = [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if ours[:len(positional)] != positional and not var_pos:
        problems.append(f"positional parameters {ours} where PopTorch has {positional}")
    return problems


def test_functions_take_poptorchs_parameters():
    """Every provided function and method takes a call written for
    PopTorch's: its parameter names, defaults and positional order."""
    bad = {}
    for key, params in SURFACE["signatures"].items():
        if key in ABSENT or key in SIGNATURE_EXEMPT:
            continue
        problems = signature_problems(params, _resolve(key))
        if problems:
            bad[key] = problems
    assert not bad, "\n".join(f"{k}: {v}" for k, v in bad.items())


def test_the_signature_check_can_fail():
    def setter(self, value, extra):
        return self
    assert signature_problems(["enabled"], setter) == [
        "no parameter enabled", "requires value", "requires extra"]
    assert signature_problems(["value=", "extra"], setter) == ["value has no default"]
    assert signature_problems(["extra", "value"], setter) == [
        "positional parameters ['value', 'extra'] where PopTorch has ['extra', 'value']"]
    assert not set(SIGNATURE_EXEMPT) - set(SURFACE["signatures"])


def test_enums_have_poptorchs_members_and_values():
    """Applications pass enum values to the backend and compare them: every
    member of every PopTorch enum exists, with PopTorch's value."""
    wrong = []
    for name, members in SURFACE["enums"].items():
        enum = getattr(poptorchsim.enums, name)
        for member, value in members.items():
            if member not in enum.__members__:
                wrong.append(f"{name}.{member} missing")
            elif value is not None and enum[member].value != value:
                wrong.append(f"{name}.{member} = {enum[member].value!r}, PopTorch {value!r}")
    assert not wrong, wrong


def test_no_name_applications_use_is_absent():
    """``used_by_applications``: PopTorch names Graphcore's applications use
    by name (tools/poptorch_surface.py)."""
    used_but_absent = sorted(set(SURFACE["used_by_applications"]) & set(ABSENT))
    assert not used_but_absent, used_but_absent


def _tool(name):
    """``tools/<name>.py`` loaded from its file (no ``sys.path`` change)."""
    spec = importlib.util.spec_from_file_location(f"tools_{name}", ROOT / "tools" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_docs_page_is_current():
    """docs/api_surface.md is what tools/api_surface_doc.py writes."""
    page = (ROOT / "docs" / "api_surface.md").read_text()
    assert page == _tool("api_surface_doc").render(SURFACE, ABSENT, SIGNATURE_EXEMPT), (
        "docs/api_surface.md is stale: run python tools/api_surface_doc.py")


@pytest.mark.skipif(not os.path.isdir(MIRROR), reason="no PopTorch mirror on this machine")
def test_data_file_matches_poptorch_sources():
    poptorch_surface = _tool("poptorch_surface")
    examples = poptorch_surface.DEFAULT_EXAMPLES
    fresh = poptorch_surface.build(MIRROR, SURFACE["source"].split("@")[1].split()[0],
                                   examples if os.path.isdir(examples) else None)
    assert fresh["modules"] == SURFACE["modules"]
    if os.path.isdir(examples):
        assert fresh["classes"] == SURFACE["classes"]
    else:       # the private members applications read are found in graphcore/examples
        assert fresh["classes"].keys() == SURFACE["classes"].keys()
        for key, members in fresh["classes"].items():
            assert members.items() <= SURFACE["classes"][key].items(), key
    if os.path.isdir(examples):
        assert fresh["used_by_applications"] == SURFACE["used_by_applications"]
        assert fresh["semi_public_used_by"] == SURFACE["semi_public_used_by"]
    assert fresh["signatures"] == SURFACE["signatures"]
    assert fresh["enums"] == SURFACE["enums"]
