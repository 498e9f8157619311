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

The module names its targets as strings and imports them only when the
program imports an alias, so it sits below the face with the launcher.
"""
import importlib
import importlib.abc
import importlib.machinery
import importlib.util
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

    def notes(self):
        """One line per real package left alone, for the program's output."""
        return [f"poptorchsim: {why}" for alias, why in self.left.items()
                if why.startswith("a real")]


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
    if real is not None and real.origin is not None:    # not a bare directory
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
    """Undo ``install``: remove its finder and forget the aliased modules
    (their targets stay imported)."""
    global _INSTALLED
    if _INSTALLED is None:
        return
    finder, _INSTALLED = _INSTALLED.finder, None
    if finder in sys.meta_path:
        sys.meta_path.remove(finder)
    for name in list(sys.modules):
        if finder.target_of(name) is not None and \
                sys.modules[name] is sys.modules.get(finder.target_of(name)):
            del sys.modules[name]
