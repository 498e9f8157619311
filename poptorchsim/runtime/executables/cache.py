"""The executable cache: compiled programs kept on disk between processes.

PopTorch caches Poplar executables in ``Options.enableExecutableCaching(path)``
or ``POPTORCH_CACHE_DIR``.  poptorchsim caches its ``compiler.Compiled``: the
lowered, placed and planned IR program with its costs, memory report and
cycle estimate.  The engine's step and update functions are generated Python
code, so they are not stored: they are generated again from the stored IR
graphs (``machine.codegen.compile_graph``, milliseconds).  The traced fx
graph is not stored either; nothing reads it once the program is lowered.

The key is computed without tracing, because tracing is most of the work a
hit saves (ResNet-18 training: 1.2 s of 1.7 s).  It is a SHA-256 over:

* the model: for every submodule its class, the code of its class (methods,
  and the functions, classes and constants of the user's modules they name;
  code of installed packages is named with the package's version instead),
  its attributes (hyperparameters, hooks such as ``BeginBlock``, tensor
  constants by value, its own parameters and buffers by name), and, for
  training, its train/eval mode;
* the parameters and buffers: names, shapes, dtypes, ``requires_grad``;
* the inputs of one micro-batch: structure, shapes, dtypes, non-tensor values;
* what the compiler is given from the options (batching factors, memory
  proportion, strategy, tensor locations, output mode, ...) and the target;
* the optimizer's type, structural flags, state types, loss scaling and
  parameter groups (not its learning rate or other hyperparameter values:
  those are device scalars);
* the versions of Python, torch and poptorchsim, and a digest of
  poptorchsim's own source files.

A stale or unreadable cache file is logged and compiled again, never fatal.
"""
import dataclasses
import enum
import functools
import gc
import hashlib
import io
import logging
import os
import pickle
import sys
import sysconfig
import tempfile
import types

import torch
import torch.utils._pytree as pytree

from ...ir.graph import all_ops
from ...machine.codegen import compile_graph
from ...version import __version__

logger = logging.getLogger("poptorchsim")

FORMAT = 1                      # of the stored executable; bump when Compiled changes
SUFFIX = ".poptorchsim_exe"
_SKIPPED_ATTRS = ("_parameters", "_buffers", "_modules", "_poptorchsim_wrapper",
                  "destroy", "_poptorchsim_version")
_OURS = ("torch", "poptorchsim")     # code covered by the versions part of the key


# -- versions ----------------------------------------------------------------------
@functools.lru_cache(maxsize=None)
def build_id():
    """A digest of poptorchsim's source files: a program cached by one build
    is never served to another, even under the same version number."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    h = hashlib.sha256()
    for folder, dirs, files in sorted(os.walk(root)):
        dirs.sort()
        for name in sorted(f for f in files if f.endswith(".py")):
            path = os.path.join(folder, name)
            h.update(os.path.relpath(path, root).encode())
            with open(path, "rb") as f:
                h.update(f.read())
    return h.hexdigest()[:16]


def full_version():
    """``0.1.0+<build digest>``: the version an exported file must match."""
    return f"{__version__}+{build_id()}"


# -- describing objects deterministically --------------------------------------------
def _library(obj):
    """The version of the installed package ``obj`` comes from ("" for
    torch, poptorchsim and the standard library), or None for the user's own
    code, which is hashed."""
    top = (getattr(obj, "__module__", None) or "").split(".")[0]
    return _installed_version(top)


@functools.lru_cache(maxsize=None)
def _installed_version(top):
    if top in _OURS:
        return ""
    module = sys.modules.get(top)
    path = getattr(module, "__file__", None)
    if path is None:
        return None if top == "__main__" else ""      # python -c code, or a builtin
    path = os.path.realpath(path)
    roots = {os.path.realpath(p) for k, p in sysconfig.get_paths().items()
             if k in ("purelib", "platlib", "stdlib", "platstdlib")}
    if not any(path.startswith(root + os.sep) for root in roots):
        return None
    return str(getattr(module, "__version__", ""))


class _Describer:
    """Turns objects into strings that are equal across processes when the
    objects would trace the same: no ids, no memory addresses."""

    def __init__(self, known=None):
        self.seen_code = {}
        self.known = known or {}         # id of a parameter or buffer -> its name

    def __call__(self, x, depth=0):
        if depth > 8:
            return "..."
        if x is None or isinstance(x, (bool, int, float, str, bytes, complex)):
            return repr(x)
        if isinstance(x, enum.Enum):
            return f"{type(x).__qualname__}.{x.name}"
        if isinstance(x, (torch.dtype, torch.device, torch.layout, torch.memory_format)):
            return str(x)
        if isinstance(x, torch.Tensor):
            return self.known.get(id(x)) or self.tensor(x)
        if isinstance(x, torch.nn.Module):
            return f"module:{type(x).__module__}.{type(x).__qualname__}"
        if isinstance(x, (list, tuple)):
            return f"{type(x).__name__}[" + ",".join(self(y, depth + 1) for y in x) + "]"
        if isinstance(x, (set, frozenset)):
            return "set{" + ",".join(sorted(self(y, depth + 1) for y in x)) + "}"
        if isinstance(x, dict):
            items = [f"{self(k, depth + 1)}:{self(v, depth + 1)}" for k, v in x.items()]
            return "{" + ",".join(items) + "}"
        if isinstance(x, types.FunctionType):
            return self.function(x, depth)
        if isinstance(x, types.MethodType):
            return f"method({self(x.__func__, depth + 1)} of {type(x.__self__).__qualname__})"
        if isinstance(x, type):
            return self.cls(x, depth)
        if isinstance(x, (types.BuiltinFunctionType, types.ModuleType)) or callable(x) \
                and not hasattr(x, "__dict__"):
            return f"{getattr(x, '__module__', '')}.{getattr(x, '__qualname__', type(x))}"
        state = getattr(x, "__dict__", None)
        name = f"{type(x).__module__}.{type(x).__qualname__}"
        if state is None:
            return name
        return name + "(" + self(state, depth + 1) + ")"

    def tensor(self, t):
        head = f"tensor{tuple(t.shape)}{t.dtype}"
        if t.is_meta or t.layout != torch.strided:
            return head
        data = t.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes()
        return head + hashlib.sha256(data).hexdigest()[:16]

    def code(self, code, fn_globals, depth):
        """A code object: bytecode, names and constants, and what it names in
        its globals (helpers of the user's own modules, constants)."""
        if code in self.seen_code:
            return self.seen_code[code]
        self.seen_code[code] = "recursive"
        parts = [code.co_code.hex(), repr(code.co_names), repr(code.co_varnames)]
        for c in code.co_consts:
            parts.append(self.code(c, fn_globals, depth) if isinstance(c, types.CodeType)
                         else self(c, depth + 1))
        for name in code.co_names:
            if fn_globals is not None and name in fn_globals:
                value = fn_globals[name]
                if isinstance(value, (types.FunctionType, type)) and _library(value) is None:
                    parts.append(f"{name}={self(value, depth + 1)}")
                elif isinstance(value, (bool, int, float, str, tuple, enum.Enum)):
                    parts.append(f"{name}={self(value, depth + 1)}")
        digest = hashlib.sha256("|".join(parts).encode()).hexdigest()[:16]
        self.seen_code[code] = digest
        return digest

    def function(self, fn, depth):
        version = _library(fn)
        if version is not None:
            return f"{fn.__module__}.{fn.__qualname__}@{version}"
        closure = [c.cell_contents for c in fn.__closure__ or () if _cell_full(c)]
        return (f"fn:{fn.__qualname__}:{self.code(fn.__code__, fn.__globals__, depth)}"
                f":{self(fn.__defaults__, depth + 1)}:{self(closure, depth + 1)}")

    def cls(self, cls, depth):
        name = f"{cls.__module__}.{cls.__qualname__}"
        version = _library(cls)
        if version is not None:
            return f"{name}@{version}"
        if cls in self.seen_code:
            return self.seen_code[cls]
        self.seen_code[cls] = name
        parts = []
        for base in cls.__mro__:
            if _library(base) is not None:
                continue
            for attr, value in sorted(vars(base).items()):
                if isinstance(value, (staticmethod, classmethod)):
                    value = value.__func__
                if isinstance(value, property):
                    value = (value.fget, value.fset)
                if attr.startswith("__") and not isinstance(value, types.FunctionType):
                    continue
                parts.append(f"{base.__qualname__}.{attr}={self(value, depth + 1)}")
        digest = name + ":" + hashlib.sha256("|".join(parts).encode()).hexdigest()[:16]
        self.seen_code[cls] = digest
        return digest


def _cell_full(cell):
    try:
        cell.cell_contents  # noqa: B018 - reading an empty cell raises ValueError
    except ValueError:
        return False
    return True


# -- the key ----------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Key:
    """A cache key: one digest per part (so a mismatch can name the part) and
    the digest of them all."""
    parts: tuple                     # ((name, digest), ...)

    @property
    def digest(self):
        return hashlib.sha256(repr(self.parts).encode()).hexdigest()

    def differences(self, other):
        mine, theirs = dict(self.parts), dict(other.parts)
        return [n for n in mine if mine[n] != theirs.get(n)]


def _module_text(model, describe, training):
    lines = []
    for name, m in model.named_modules():
        attrs = []
        for attr, value in vars(m).items():
            if attr in _SKIPPED_ATTRS or (attr == "training" and not training):
                continue
            if "hooks" in attr and isinstance(value, dict):
                value = list(value.values())       # keys are process-wide counters
            attrs.append(f"{attr}={describe(value)}")
        lines.append(f"{name}: {describe(type(m))} " + " ".join(attrs))
    return "\n".join(lines)


def _state_text(model):
    params = [f"{n}{tuple(p.shape)}{p.dtype}{p.requires_grad}"
              for n, p in model.named_parameters()]
    buffers = [f"{n}{tuple(b.shape)}{b.dtype}" for n, b in model.named_buffers()]
    return "\n".join(params + buffers)


def _inputs_text(inputs, describe):
    leaves, spec = pytree.tree_flatten(inputs)
    described = [f"{tuple(x.shape)}{x.dtype}" if isinstance(x, torch.Tensor) else describe(x)
                 for x in leaves]
    return str(spec) + "\n" + "\n".join(described)


def _optimizer_text(model, optimizer):
    if optimizer is None:
        return "none"
    from ...capture.optimizer_checks import read_settings
    from ...capture.update_rules import plan_update
    # the structure of the update (type, flags, state types, loss scaling,
    # clipping); gradient accumulation and the reduction are in the options
    plan = plan_update(optimizer, read_settings(optimizer))
    names = {id(p): n for n, p in model.named_parameters()}
    groups = [[names.get(id(p), "?") for p in g["params"]] for g in optimizer.param_groups]
    return f"{plan!r} {groups!r}"


def _versions_text():
    return (f"python {sys.version_info[:2]} torch {torch.__version__} poptorchsim "
            f"{full_version()} default_dtype {torch.get_default_dtype()} "
            f"mkldnn {torch.backends.mkldnn.is_available()}")


def executable_key(model, optimizer, training, inputs, settings):
    """The cache key of compiling ``model`` for ``inputs`` (one micro-batch,
    ``(args, kwargs)``) with the compiler ``settings`` (the keyword arguments
    the compiler is given, plus anything else that shapes the program)."""
    known = {id(t): f"state:{n}" for named in (model.named_parameters(remove_duplicate=False),
                                                model.named_buffers(remove_duplicate=False))
             for n, t in named}
    describe = _Describer(known)
    texts = {
        "model code and attributes": _module_text(model, describe, training),
        "parameters and buffers": _state_text(model),
        "inputs": _inputs_text(inputs, describe),
        "options": f"training={training} " + describe(dict(sorted(settings.items()))),
        "optimizer": _optimizer_text(model, optimizer if training else None),
        "versions": _versions_text(),
    }
    return Key(tuple((n, hashlib.sha256(t.encode()).hexdigest()) for n, t in texts.items()))


def key_for_compiler(training, args, kwargs, extra):
    """The key of ``compiler.compile_training(model, optimizer, args, kwargs,
    config)`` or ``compile_inference(model, args, kwargs, config)``: every
    field of the ``CompileConfig`` that shapes the program is covered, so a
    new compiler setting is in the key at once.  ``extra``: what else shapes
    it (module name scopes)."""
    model, optimizer = args[0], (args[1] if training else None)
    config = args[-1]           # a runtime.settings.config.CompileConfig: what shapes the program
    settings = config.key()
    return executable_key(model, optimizer, training, tuple(args[-3:-1]),
                          {**settings, **extra})


# -- storing a compiled program ------------------------------------------------------
def _op_overload(qualified, overload):
    namespace, name = qualified.split("::")
    return getattr(getattr(getattr(torch.ops, namespace), name), overload)


class _Pickler(pickle.Pickler):
    """Pickles ATen overloads (the IR ops' targets) by name."""

    def reducer_override(self, obj):
        if isinstance(obj, torch._ops.OpOverload):
            return _op_overload, (obj._schema.name, obj._overloadname)
        return NotImplemented


def dumps(compiled):
    """The bytes of a ``Compiled``, without what is rebuilt at load: the
    engine functions, the traced fx graph and the example inputs' values."""
    capture = dataclasses.replace(
        compiled.capture, graph=None,
        example_inputs=[torch.empty(t.shape, dtype=t.dtype, device="meta")
                        for t in compiled.capture.example_inputs])
    stored = dataclasses.replace(compiled, capture=capture, step_fn=None, update_fn=None)
    buffer = io.BytesIO()
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(max(limit, 100_000))    # IR tensors point at their producers
    try:
        _Pickler(buffer, protocol=pickle.HIGHEST_PROTOCOL).dump(stored)
    finally:
        sys.setrecursionlimit(limit)
    return buffer.getvalue()


def loads(data):
    """A ``Compiled`` from ``dumps``' bytes, its engine functions generated."""
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(max(limit, 100_000))
    collecting = gc.isenabled()
    gc.disable()        # the many small IR objects would trigger full collections
    try:
        compiled = pickle.loads(data)
    finally:
        sys.setrecursionlimit(limit)
        if collecting:
            gc.enable()
    cap = compiled.capture
    cap.example_inputs = [torch.zeros(t.shape, dtype=t.dtype) for t in cap.example_inputs]
    graphs = compiled.program.graphs
    if compiled.program.kind == "training":
        compiled.step_fn = compile_graph(graphs["training_step"])
        compiled.update_fn = compile_graph(graphs["optimizer_update"])
    else:
        compiled.step_fn = compile_graph(graphs["inference_forward"])
    return compiled


def pack(compiled, key):
    """A stored executable: format, build and key, then the program."""
    return pickle.dumps({"format": FORMAT, "version": full_version(), "key": key.parts,
                         "compiled": dumps(compiled)}, protocol=pickle.HIGHEST_PROTOCOL)


class StaleExecutable(Exception):
    """A stored executable that cannot serve this model.  ``kind``:
    "unreadable", "build" (another poptorchsim build wrote it) or "key"
    (compiled for another model, options or inputs); the message says more."""

    def __init__(self, kind, message):
        super().__init__(message)
        self.kind = kind


def unpack(data, key=None):
    """The ``Compiled`` in ``pack``'s bytes; ``StaleExecutable`` when it was
    written by another build, for another key, or cannot be read."""
    try:
        entry = pickle.loads(data)
        fmt, version = entry["format"], entry["version"]
    except Exception as exc:      # noqa: BLE001 - a damaged file can raise anything
        raise StaleExecutable("unreadable", f"unreadable ({type(exc).__name__}: {exc})") from None
    if fmt != FORMAT or version != full_version():
        raise StaleExecutable("build", f"written by poptorchsim {version} (format {fmt}); this is "
                              f"{full_version()} (format {FORMAT})")
    if key is not None and tuple(entry["key"]) != key.parts:
        changed = key.differences(Key(tuple(entry["key"])))
        raise StaleExecutable("key", "compiled for different " + ", ".join(changed))
    try:
        return loads(entry["compiled"])
    except Exception as exc:      # noqa: BLE001 - any unpickling failure: a stale entry
        raise StaleExecutable("unreadable", f"unreadable ({type(exc).__name__}: {exc})") from None


# -- the cache directory -----------------------------------------------------------------
def cache_directory(options):
    """``Options.enableExecutableCaching``'s path (or POPTORCH_CACHE_DIR's), or None."""
    popart = options._Popart.options
    if not popart.get("enableEngineCaching", False):
        return None
    return popart.get("cachePath") or None


def cache_path(directory, key):
    return os.path.join(directory, key.digest[:32] + SUFFIX)


def write_atomically(path, data):
    """Writes ``data`` to ``path`` through a temporary file in the same folder,
    so that a process reading the cache never sees half a file."""
    folder = os.path.dirname(path) or "."
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=".tmp-", suffix=SUFFIX)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.chmod(tmp, 0o644)            # mkstemp makes it private
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def compile_cached(directory, key, compile_fn):
    """``compile_fn()``'s ``Compiled``, read from ``directory`` when an entry
    for ``key`` is there, else compiled and stored.  ``directory`` None:
    no cache."""
    if directory is None:
        return compile_fn()
    path = cache_path(directory, key)
    if os.path.exists(path):
        compiled = _read(path, key)
        if compiled is not None:
            return compiled
    compiled = compile_fn()
    if _calls_host_functions(compiled):
        logger.info("Not caching the executable: it calls Python functions on the host "
                    "(poptorch.CPU), which another process could not reach.")
        return compiled
    try:
        write_atomically(path, pack(compiled, key))
        logger.info("Saved the executable to the cache: %s", path)
    except (OSError, pickle.PicklingError, TypeError, AttributeError) as exc:
        # a full disk, a read-only folder, or a program part that cannot be
        # pickled: the run goes on, uncached
        logger.warning("Could not write the executable cache file %s (%s): the model "
                       "will be compiled again next time.", path, exc)
    return compiled


def _calls_host_functions(compiled):
    """Does the program call ``poptorch.CPU`` functions (registered in this
    process only, when the model is traced)?"""
    return any(getattr(getattr(op.target, "overloadpacket", op.target), "__name__", "")
               == "host_call"
               for graph in compiled.program.graphs.values() for op in all_ops(graph))


def _read(path, key):
    import time
    t0 = time.perf_counter()
    try:
        with open(path, "rb") as f:
            compiled = unpack(f.read(), key)
    except (OSError, StaleExecutable) as exc:
        logger.warning("Ignoring the executable cache file %s: %s. Compiling the model "
                       "again; the file will be replaced.", path, exc)
        return None
    compiled.compile_seconds = time.perf_counter() - t0
    compiled.loaded_from = path
    logger.info("Loaded the executable from the cache: %s", path)
    return compiled


def through_cache(options, training, model, source, compile_fn, args, kwargs):
    """``(compiled, key)``: ``compile_fn(*args, **kwargs)``, or the cache's
    program for the key of ``args``/``kwargs`` (``source``: where
    ``loadExecutable`` takes it from instead of the cache directory).  The
    IR's op names follow the model's module names unless the options turn
    them off."""
    from ...capture.scopes import module_name_scopes
    from ...passes.pipeline import reserve_ipus
    namescopes = vars(options).get("_module_namescope_enabled", True)
    extra = {} if namescopes else {"module_namescope": False}
    key = key_for_compiler(training, args, kwargs, extra)
    obtain = source or functools.partial(compile_cached, cache_directory(options))
    with module_name_scopes(model, namescopes):
        compiled = obtain(key, lambda: compile_fn(*args, **kwargs))
    config = args[-1]
    if config.hardware is not None:     # PopTorch's reservation, on this system's IPUs
        program = compiled.program
        reserve_ipus(program.n_ipus * program.replicas, config.auto_round,
                     config.hardware)
    return compiled, key
