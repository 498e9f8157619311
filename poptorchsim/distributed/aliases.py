"""``import poptorch`` in a program that ``python -m poptorchsim.run`` runs:
the names Graphcore's programs import, answered by poptorchsim.

    poptorch[.x]  ->  poptorchsim[.x]          (poptorch.optim, poptorch.enums, ...)
    popdist[.x]   ->  poptorchsim.popdist[.x]  (popdist.poptorch)
    popart[.x]    ->  poptorchsim.popart[.x]   (only where poptorchsim has popart)

``install()`` puts a finder at the front of ``sys.meta_path``; an aliased
name is the very module object of its target (``poptorch is poptorchsim``),
so state, classes and ``isinstance`` are shared.  A name that a real,
installed package answers is left alone: poptorchsim never shadows the real
PopTorch, PopDist or PopART (``install`` says which it left, and where);
a bare directory of that name (a namespace package, such as a checkout's
``popart/`` folder) is not a package and does not count.
The launcher's worker calls it before running the script; a test or a
notebook may call it too (``uninstall()`` undoes it).

Processes the program starts with a fresh interpreter (multiprocessing's
``spawn`` and ``forkserver``: an asynchronous DataLoader's worker) import
the program again; ``export`` writes a small module per alias into a
directory put first on PYTHONPATH, which installs the same aliases there.

The module names its targets as strings and imports them only when the
program imports an alias, so it sits below the face with the launcher.
"""
import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys

ALIASES = {"poptorch": "poptorchsim", "popdist": "poptorchsim.popdist",
           "popart": "poptorchsim.popart"}


class AliasFinder(importlib.abc.MetaPathFinder):
    """Finds ``alias[.sub]`` as the module ``target[.sub]`` for each
    ``alias -> target`` in ``aliases``."""

    def __init__(self, aliases):
        self.aliases = dict(aliases)

    def target_of(self, fullname):
        top, dot, rest = fullname.partition(".")
        if top not in self.aliases:
            return None
        return self.aliases[top] + dot + rest

    def find_spec(self, fullname, path=None, target=None):
        name = self.target_of(fullname)
        if name is None:
            return None
        if importlib.util.find_spec(name) is None:
            top = fullname.partition(".")[0]
            raise ModuleNotFoundError(
                f"No module named {fullname!r}: under python -m poptorchsim.run, {top!r} is "
                f"{self.aliases[top]!r}, which has no module {name!r}", name=fullname)
        return importlib.machinery.ModuleSpec(fullname, _AliasLoader(name))


class _AliasLoader(importlib.abc.Loader):
    """Loads an alias as its target's module object, imported as usual.
    The import system sets the module's ``__spec__`` to the alias's between
    the two steps; ``exec_module`` puts the target's back."""

    def __init__(self, target):
        self.target = target
        self._spec = None

    def create_module(self, spec):
        module = importlib.import_module(self.target)
        self._spec = module.__spec__
        return module

    def exec_module(self, module):
        module.__spec__ = self._spec    # the target ran when it was imported


class Installed:
    """What ``install`` did: ``aliased`` {alias: target}, and ``left``
    {alias: why it was left alone} (a real package, or no target)."""

    def __init__(self, finder, aliased, left):
        self.finder, self.aliased, self.left = finder, aliased, left
        self.exported = None        # the directory ``export`` wrote

    def notes(self):
        """One line per real package left alone, for the program's output."""
        return [f"poptorchsim: {why}" for alias, why in self.left.items()
                if why.startswith("a real")]

    def export(self, directory):
        """Give processes started from here the same aliases: a module per
        alias in ``directory`` (``poptorch.py``: it installs the aliases and
        becomes its target), ``directory`` on PYTHONPATH and last on
        ``sys.path`` (multiprocessing hands its children this process's
        ``sys.path``; here the finder answers first), and the aliases in
        POPTORCHSIM_ALIASES."""
        os.makedirs(directory, exist_ok=True)
        files = {MARKER: ""}
        files.update({alias + ".py": _SHIM.format(alias=alias, target=target)
                      for alias, target in self.aliased.items()})
        for name, text in files.items():     # whole files only: others may read them now
            part = os.path.join(directory, f".{name}.{os.getpid()}")
            with open(part, "w") as f:
                f.write(text)
            os.replace(part, os.path.join(directory, name))
        os.environ[ENV] = ",".join(f"{a}={t}" for a, t in self.aliased.items())
        path = os.environ.get("PYTHONPATH")
        os.environ["PYTHONPATH"] = os.pathsep.join(([path] if path else []) + [directory])
        if directory not in sys.path:
            sys.path.append(directory)
        self.exported = directory


ENV = "POPTORCHSIM_ALIASES"
MARKER = ".poptorchsim-aliases"     # in a directory that ``export`` wrote
_SHIM = '''"""Written by poptorchsim.distributed.aliases for a process that a program
run by python -m poptorchsim.run starts: ``import {alias}`` imports
{target!r} here too."""
from poptorchsim.distributed.aliases import _become

_become(__name__)
'''


def _become(alias):
    """In a process started by an aliased program: install the aliases of
    POPTORCHSIM_ALIASES (its parent checked them) and make ``alias`` its
    target in ``sys.modules``, so that the import under way returns it."""
    global _INSTALLED
    mapping = dict(item.split("=", 1) for item in os.environ.get(ENV, "").split(",")
                   if "=" in item)
    if alias not in mapping:
        raise ImportError(f"{alias!r} is answered by poptorchsim only in a program run by "
                          f"python -m poptorchsim.run ({ENV} does not name it)", name=alias)
    if _INSTALLED is None or _INSTALLED.finder.target_of(alias) is None:
        finder = AliasFinder(mapping)
        sys.meta_path.insert(0, finder)
        _INSTALLED = Installed(finder, mapping, {})
    sys.modules[alias] = importlib.import_module(mapping[alias])
    from . import torch_compat  # (PyTorch is imported by now)
    torch_compat.install()


_INSTALLED = None


def install(aliases=None):
    """Make ``import poptorch`` (and the other ``aliases``, ``ALIASES`` by
    default) import poptorchsim, where no real package of that name is
    importable and poptorchsim has the target.  Returns an ``Installed``;
    calling it again replaces the earlier finder."""
    global _INSTALLED
    uninstall()
    aliased, left = {}, {}
    for alias, target in (ALIASES if aliases is None else aliases).items():
        why = _why_not(alias, target)
        if why:
            left[alias] = why
        else:
            aliased[alias] = target
    finder = AliasFinder(aliased)
    if aliased:
        sys.meta_path.insert(0, finder)
    _INSTALLED = Installed(finder, aliased, left)
    return _INSTALLED


def _why_not(alias, target):
    """Why ``alias`` is not to be aliased to ``target`` (None: it is)."""
    loaded = sys.modules.get(alias)
    if loaded is not None:
        if loaded is sys.modules.get(target):
            return None
        return (f"a real {alias!r} is already imported ({_where(loaded)}); "
                f"'import {alias}' uses it, not {target!r}")
    try:
        real = importlib.util.find_spec(alias)
    except (ImportError, ValueError):
        real = None
    if real is not None and real.origin is not None and not os.path.exists(
            os.path.join(os.path.dirname(real.origin), MARKER)):    # a package, not ours
        return (f"a real {alias!r} is installed ({real.origin}); 'import {alias}' uses it, "
                f"not {target!r}")
    try:
        found = importlib.util.find_spec(target)
    except ImportError:
        found = None
    if found is None:
        return f"poptorchsim has no {target!r}: 'import {alias}' is not aliased"
    return None


def _where(module):
    return getattr(module, "__file__", None) or repr(module)


def uninstall():
    """Undo ``install`` (and ``export``): remove its finder, its directory
    from the paths, and forget the aliased modules (their targets stay
    imported)."""
    global _INSTALLED
    if _INSTALLED is None:
        return
    finder, exported, _INSTALLED = _INSTALLED.finder, _INSTALLED.exported, None
    if finder in sys.meta_path:
        sys.meta_path.remove(finder)
    if exported:
        while exported in sys.path:
            sys.path.remove(exported)
        path = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep)
                if p and p != exported]
        os.environ["PYTHONPATH"] = os.pathsep.join(path)
        os.environ.pop(ENV, None)
    for name in list(sys.modules):
        if finder.target_of(name) is not None and \
                sys.modules[name] is sys.modules.get(finder.target_of(name)):
            del sys.modules[name]
