"""Exported executables: PopTorch's ``compileAndExport``, ``save``,
``loadExecutable`` and ``poptorch.load``.

A file holds a header line and one pickle: the poptorchsim version, the
compiled program as the executable cache stores it (``cache.pack``), the
shapes of the inputs it was compiled for, the options, and (with
``export_model``) the model, its optimizer with its state, and the host RNG
state (poptorchsim's device RNG is torch's).  Loading checks the version,
rebuilds the model's wrapper and takes the stored program instead of
compiling, when it was compiled for this very model, options and inputs.
"""
import logging
import os
import pickle

import torch
import torch.utils._pytree as pytree

from ... import enums
from ...errors import Error, ExecutableFileError
from ...version import __version__
from . import cache

logger = logging.getLogger("poptorchsim")

HEADER = b"poptorchsim executable\n"
_WRAPPER_ATTRS = ("_poptorchsim_wrapper", "destroy")   # set while a trainingModel wraps
EXPORT_MODEL_FALSE = (
    "{0} is a valid PopTorch file but was created with 'export_model=False' which "
    "means you need to re-create the PopTorch model using poptorch.inferenceModel or "
    "poptorch.trainingModel then call poptorch_model.loadExecutable(\"{0}\").")


def _destination(filename):
    """PopTorch's rules: missing folders are made; a folder gets model.poptorch."""
    folder = os.path.dirname(filename)
    if folder:
        if os.path.exists(folder):
            assert os.path.isdir(folder), f"Destination folder {folder} is not a directory"
        else:
            os.makedirs(folder)
    if os.path.isdir(filename):
        path = os.path.join(filename, "model.poptorch")
        logger.warning("save(): %s is a directory, saving model to %s", filename, path)
        return path
    return filename


def _pickled_model(model, optimizer):
    """The model and optimizer pickled together (they share the parameters),
    without the wrapper's weak references."""
    hidden = {k: model.__dict__.pop(k) for k in _WRAPPER_ATTRS if k in model.__dict__}
    try:
        return pickle.dumps((model, optimizer), protocol=pickle.HIGHEST_PROTOCOL)
    except (pickle.PicklingError, AttributeError, TypeError) as exc:
        raise Error(f"save(): the model or its optimizer cannot be pickled ({exc}). "
                    "Make them picklable (no lambdas or local classes), or save with "
                    "export_model=False and re-create the model before "
                    "loadExecutable().") from None
    finally:
        model.__dict__.update(hidden)


def save(executor, filename, export_model=True, save_rng_state=True):
    """Writes ``executor``'s executable (and, with ``export_model``, its model
    and optimizer) to ``filename``."""
    compiled = executor._compiled
    if executor._training and executor.isAttachedToDevice():
        executor.copyWeightsToHost()          # the device holds the optimizer state
    leaves, spec, _ = executor._inputs.template
    options = executor.options
    data = {
        "version": __version__,
        "executable": cache.pack(compiled, executor._executable_key),
        "inputs": ([("tensor", tuple(t.shape), t.dtype) if isinstance(t, torch.Tensor)
                    else ("value", t) for t in leaves], spec),
        "options": options,
        "training": executor._training if export_model else None,
        "model": _pickled_model(executor.model, executor._opt.optimizer) if export_model else None,
        "random_seed": getattr(options, "random_seed", None),
        "rng_state": torch.get_rng_state() if save_rng_state else None,
    }
    path = _destination(str(filename))
    cache.write_atomically(path, HEADER + pickle.dumps(data, protocol=pickle.HIGHEST_PROTOCOL))
    return path


def read(filename):
    """The contents of an exported file, its version checked."""
    with open(filename, "rb") as f:
        raw = f.read()
    if not raw.startswith(HEADER):
        raise ExecutableFileError(f"Invalid file {filename}: not a file written by "
                                  "poptorchsim's compileAndExport() or save().")
    try:
        data = pickle.loads(raw[len(HEADER):])
        version = data["version"]
    except Exception as exc:       # noqa: BLE001 - a damaged file can raise anything
        raise ExecutableFileError(f"Invalid file {filename}: it cannot be read "
                                  f"({type(exc).__name__}: {exc}).") from None
    if version != __version__:
        raise ExecutableFileError(
            f"Invalid file {filename}: poptorchsim version mismatch: File was created "
            f"with version: {version} and this is version {__version__}. Export the "
            "model again with this version (compileAndExport).")
    return data


def executable_inputs(data):
    """(args, kwargs) shaped as the inputs the executable was compiled for."""
    described, spec = data["inputs"]
    leaves = [torch.zeros(d[1], dtype=d[2]) if d[0] == "tensor" else d[1] for d in described]
    return pytree.tree_unflatten(leaves, spec)


def source(data, filename):
    """What ``PoplarExecutor`` compiles through instead of the cache: the
    file's program when it was compiled for this model, options and inputs."""
    def obtain(key, compile_fn):
        try:
            return cache.unpack(data["executable"], key)
        except cache.StaleExecutable as exc:
            if exc.kind != "build":
                raise Error(
                    f"The executable in {filename} cannot be used for this model: it was "
                    f"{exc}. Re-create the model, options and optimizer as they were "
                    "when it was exported (poptorch.load() does), or compile it with "
                    "compile() instead.") from None
            logger.warning("The executable in %s was %s: compiling the model again.",
                           filename, exc)
            return compile_fn()
    return obtain


def load(filename, edit_opts_fn, training_model, inference_model):
    """``poptorch.load``: the model, options, optimizer, RNG state and
    executable of ``filename``, wrapped again by ``training_model`` or
    ``inference_model`` (the face's ``trainingModel``/``inferenceModel``)."""
    data = read(filename)
    assert data["model"] is not None and data["training"] is not None, (
        EXPORT_MODEL_FALSE.format(filename))
    options = data["options"]
    options._unfreeze()
    options.deleteIfExists("ipu_version")      # PopTorch drops the offline-target flags
    if options.connection_type == enums.ConnectionType.Never.value:
        options.connectionType(enums.ConnectionType.Always)
    if edit_opts_fn:
        edit_opts_fn(options)
    model, optimizer = pickle.loads(data["model"])
    if data["training"]:
        executor = training_model(model, options, optimizer)
    else:
        executor = inference_model(model, options)
    load_executable(executor, data, filename)
    return executor


def load_executable(executor, data, filename):
    """Gives ``executor`` the file's executable for the inputs it was compiled for."""
    if executor.isCompiled():
        raise Error(f"loadExecutable({filename!r}): this model is already compiled. "
                    "Call destroy() on it, or wrap the model again, before loading an "
                    "executable.")
    args, kwargs = executable_inputs(data)
    executor._compile(*executor._inputs.prepare(args, kwargs),
                      source=source(data, filename))
    if data["rng_state"] is not None:
        torch.set_rng_state(data["rng_state"])
