"""poptorchsim: PopTorch's API on a simulated IPU.

``import poptorchsim as poptorch`` runs PopTorch programs: models are traced
with torch.fx, lowered to an IPU graph IR, mapped onto a simulated tile array
and run with PyTorch's own kernels.
"""
import logging
import os
import sys
import weakref

import torch

from . import _impl, _logging, enums, optim, profiling  # poptorch._impl, ._logging, .profiling
from ._api import op_library as _op_library  # defines torch.ops.poptorch
from ._api.arg_parsers import ICustomArgParser, registerCustomArgParser
from ._api.control_flow import cond, for_loop
from ._api.ctc import ctc_beam_search_decoder
from ._api.graph_ops import (
    Attribute,
    CustomOp,
    MultiConv,
    NameScope,
    custom_op,
    dynamic_slice,
    dynamic_update,
    nop,
    register_custom_op,
    serializedMatMul,
)
from ._api.overlap import set_overlap_for_input, set_overlap_for_output
from ._api.printing import module_repr, print  # PopTorch's poptorch.print
from .annotations import (
    BeginBlock,
    Block,
    BlockFunction,
    BlockId,
    LegacyBeginBlockFn,
    ParallelPhasedExecution,
    Phase,
    PipelinedExecution,
    SerialPhasedExecution,
    ShardedExecution,
    Stage,
    recomputationCheckpoint,
    removeBlocks,
)
from .data import AsynchronousDataAccessor, DataLoader
from .enums import *  # PopTorch re-exports its enums
from .errors import (
    BatchDimensionError,
    DataDependentError,
    DtypeError,
    Error,
    InputError,
    InputMismatchError,
    LossError,
    ModelWrappedError,
    NoWeightsError,
    OutOfMemoryError,
    RecoverableError,
    UnrecoverableError,
    UnsupportedOperationError,
    createPoptorchError,
)
from .machine.host_device import choose as setHostDevice  # docs/host_device.md
from .machine.host_device import current as hostDevice
from .ops import (  # docs/observing.md
    CPU,
    identity_loss,
    ipu_print_tensor,
    ipuHardwareIsAvailable,
    ipuHardwareVersion,
    isRunningOnIpu,
    set_available_memory,
)
from .options import ConfigFileError, Options, TensorLocationSettings
from .runtime.executor.executor import PoplarExecutor
from .version import __version__  # re-exported

logger = logging.getLogger("poptorchsim")

WRAPPED_ERR = ("Model has already been wrapped in 'poptorch.trainingModel'. Call "
               "model.destroy() on the model to unwrap before wrapping again.")


def _options_or_default(options):
    if options is None:
        return Options()
    if not isinstance(options, Options):
        raise Error(f"Invalid type: 'options' is of type {type(options)} "
                    "(Expected poptorch.Options)")
    return options


def _check_no_sparse_gradients(model):
    """An embedding with ``sparse=True`` makes a sparse gradient, which the
    IPU does not have (PopTorch leaves sparse gradients unsupported)."""
    for name, module in model.named_modules():
        if isinstance(module, (torch.nn.Embedding, torch.nn.EmbeddingBag)) \
                and getattr(module, "sparse", False):
            raise UnsupportedOperationError(
                f"{type(module).__name__} {name or '(the model)'} has sparse=True: its "
                "gradient would be a sparse tensor, which the IPU does not support "
                "(PopTorch trains embeddings with dense gradients). Build it with "
                "sparse=False (or set its .sparse = False before wrapping): SGD then makes the "
                "same update, and Adam-type optimizers, which refuse sparse gradients, work.")


def trainingModel(model, options=None, optimizer=None):
    """Wraps ``model`` for training on the simulated IPU.

    The user's model keeps sharing its parameters: after each call it holds
    the trained weights.  The default optimizer is SGD with lr 0.01.
    """
    if isinstance(model, PoplarExecutor):
        model = model.model
    if _wrapper_of(model) is not None:
        raise ModelWrappedError(WRAPPED_ERR)
    options = _options_or_default(options)
    if optimizer is None:
        optimizer = optim.SGD(model.parameters(), lr=0.01)
    from .capture.optimizer_checks import optimizer_kind
    optimizer_kind(optimizer)
    _check_optimizer_params(model, optimizer)
    _check_no_sparse_gradients(model)
    options._freeze()
    executor = PoplarExecutor(model, _frozen_clone(options, True), training=True,
                              optimizer=optimizer)
    model._poptorchsim_wrapper = _WrapperRef(executor)
    model.destroy = _Destroy(model._poptorchsim_wrapper)
    return executor


class _WrapperRef:
    """The training executor wrapping a model, held weakly.  A pickled model
    (``torch.save(model)``) keeps no wrapper: it loads unwrapped."""

    def __init__(self, executor=None):
        self._ref = weakref.ref(executor) if executor is not None else None

    def __call__(self):
        return self._ref() if self._ref is not None else None

    def __reduce__(self):
        return (_WrapperRef, ())


def _check_optimizer_params(model, optimizer):
    """Every tensor the optimizer updates is a parameter of the model: the
    simulator (as PopTorch) trains the model's parameters, so an optimizer
    made from another module's would leave the weights unchanged."""
    own = {id(p) for p in model.parameters()}
    for k, group in enumerate(optimizer.param_groups):
        strangers = [p for p in group["params"] if id(p) not in own]
        if strangers:
            shapes = ", ".join(str(list(p.shape)) for p in strangers[:3])
            raise Error(
                f"The optimizer's parameter group {k} holds {len(strangers)} tensor(s) that "
                f"are not parameters of the model being wrapped (shapes {shapes}"
                f"{', ...' if len(strangers) > 3 else ''}), so they would never be "
                "trained. Create the optimizer from the wrapped model's parameters: "
                "optimizer = poptorch.optim.SGD(model.parameters(), lr=...), then "
                "poptorch.trainingModel(model, options, optimizer).")


def _wrapper_of(model):
    """The live training executor wrapping this very model object, if any."""
    ref = getattr(model, "_poptorchsim_wrapper", None)
    executor = ref() if ref is not None else None
    if executor is None or executor.model is not model or not executor.isWrapping():
        return None
    return executor


class _Destroy:
    """``model.destroy()`` while a trainingModel wraps the model.

    Copies of the model (``copy.deepcopy``) share this object but are not
    wrapped themselves."""

    def __init__(self, ref):
        self._ref = ref

    def __call__(self):
        executor = self._ref()
        if executor is None:
            raise Error("model was never wrapped")
        executor.destroy()

    def __deepcopy__(self, memo):
        return self

    def __reduce__(self):
        return (_Destroy, (_WrapperRef(),))


def inferenceModel(model, options=None):
    """Wraps ``model`` for inference (traced in eval mode) on the simulated IPU."""
    if isinstance(model, PoplarExecutor):
        model = model.model
    options = _options_or_default(options)
    if options.Training.gradient_accumulation != 1:
        message = ("You must set poptorch.Options().Training.gradientAccumulation to 1 or "
                   "leave it as its default value (1) when running a "
                   "poptorch.inferenceModel().")
        if options.execution_strategy.is_pipelined:
            message += (" Use poptorch.Options().deviceIterations to process a sufficient "
                        "number of batches each run for pipelined execution instead.")
        raise Error(message)
    options._freeze()
    return PoplarExecutor(model, _frozen_clone(options, False), training=False)


def _frozen_clone(options, training):
    """The model's own options: a frozen copy whose output mode says which
    mode the model runs with (``Default`` resolved, as PopTorch's
    ``model.options.output_mode`` does); the user's Options keep Default."""
    from .runtime.settings.config import output_mode
    clone = options.clone()
    mode = output_mode(clone, training)
    if mode != OutputMode(clone.output_mode):
        clone.outputMode(mode)
    clone._freeze()
    return clone


def load(filename, edit_opts_fn=None):
    """Restores the model, options, optimizer, RNG state and executable that
    ``compileAndExport`` or ``save`` wrote to ``filename``; the model runs
    without compiling.  ``edit_opts_fn(options)`` may edit the options first.

    >>> model = poptorch.inferenceModel(model)
    >>> model.compileAndExport("my_model.poptorch", my_input)
    >>> model = poptorch.load("my_model.poptorch")
    >>> model(my_input)
    """
    from .runtime.executables import export
    return export.load(filename, edit_opts_fn, trainingModel, inferenceModel)


def setLogLevel(level):
    levels = {"TRACE": 5, "DEBUG": logging.DEBUG, "INFO": logging.INFO,
              "WARN": logging.WARNING, "ERR": logging.ERROR, "OFF": logging.CRITICAL + 10}
    if isinstance(level, int):
        if level not in (0, 1, 2, 3, 4, 6):
            raise ValueError("Invalid log level integer")
        level = ["TRACE", "DEBUG", "INFO", "WARN", "ERR", None, "OFF"][level]
    if level not in levels:
        raise ValueError(f"Unknown log level: {level}. Valid values are DEBUG, ERR, INFO, "
                         "OFF, TRACE and WARN")
    logger.setLevel(levels[level])


def suggest_split(model, num_ipus, *example_inputs, optimizer=None, training=True,
                  options=None):
    """Proposes where to put ``BeginBlock``s to run ``model`` on ``num_ipus``
    IPUs (None: the fewest that fit), balancing cycles from the traced graph
    (the model never runs), then checks the split's memory tile by tile as
    ``trainingModel`` would: ``plan.peak_tile`` per IPU, ``plan.fits``,
    ``plan.ipus_needed``, ``plan.layers_per_ipu``.  Print the plan to read
    why; ``.apply(model)`` adds the blocks.  ``example_inputs``: one
    micro-batch; ``options``: the IPU model to plan for
    (``Options.useIpuModelVersion``, else the environment's) and the
    settings the split is compiled with (memory proportion, optimizer state
    location, precision)."""
    from .estimate.targets import default_target
    from .runtime.planning.autosplit import suggest_split as _suggest
    version = options._values.get("ipu_model_version") if options is not None else None
    return _suggest(model, num_ipus, *example_inputs, optimizer=optimizer,
                    training=training, target=default_target(version), options=options)


def plan(model, example_inputs, ipus=16, optimizer=None, options=None, **search):
    """Beyond PopTorch: searches the configurations of ``ipus`` IPUs that
    ``model`` could train in (IPUs per replica and the layer split,
    replication, micro-batch, gradient accumulation for ``global_batch=``,
    available memory proportion, optimizer state on chip / off chip /
    sharded, partials, recomputation), compiling each from one trace per
    micro-batch. Returns a ``PlanResult``: print it for the ranked table
    (fits, peak tile per IPU, estimated samples/s, why the rejected ones
    fail); ``.best``, ``.plot(path)``, ``.to_json()``. ``example_inputs``:
    one micro-batch (its first sample is repeated to each micro-batch
    size); ``options``: the settings kept (precision, loss scaling, IPU
    model). Keyword arguments go to ``runtime.planning.planner.Planner.search``
    (``micro_batches``, ``global_batch``, ``ipus_per_replica``, ``amps``,
    ``optimizer_states``, ``partials``, ``recomputations``, ``include``).
    docs/sizing.md walks through it."""
    from .runtime.planning.planner import plan as _plan
    return _plan(model, example_inputs, ipus, optimizer, options, **search)


def registerPreCompileHook(hook):
    """Calls ``hook()`` before every model compilation (hooks run in the
    order they were registered); ``handle.remove()`` unregisters it."""
    from .runtime.executor import observe
    return observe.register_hook(observe.PRE_COMPILE_HOOKS, hook, "Pre")


def registerPostCompileHook(hook):
    """Calls ``hook()`` after every model compilation, also a failed one."""
    from .runtime.executor import observe
    return observe.register_hook(observe.POST_COMPILE_HOOKS, hook, "Post")


class _ConsoleHandler(logging.StreamHandler):
    """Writes to ``sys.stderr`` as it is when a record is logged (pytest's
    capsys and contextlib.redirect_stderr replace it)."""

    def __init__(self):
        logging.Handler.__init__(self)

    @property
    def stream(self):
        return sys.stderr


class _PoptorchFormat(logging.Formatter):
    """PopTorch's console lines: ``[12:00:00.000] [poptorch::python] [debug] ...``
    (its logger's name, the level in lower case; programs and PopTorch's
    tests read them)."""

    def format(self, record):
        record = logging.makeLogRecord(record.__dict__)     # the other handlers' is kept
        record.levelname = record.levelname.lower()
        return super().format(record)


def _install_log_handler():
    """PopTorch's console format for the package's logger, at the level that
    ``POPTORCH_LOG_LEVEL`` names (WARN by default; a bad name fails the
    import with setLogLevel's ValueError, as in PopTorch)."""
    handler = _ConsoleHandler()
    handler.setFormatter(_PoptorchFormat(
        "[%(asctime)s.%(msecs)03d] [poptorch::python] [%(levelname)s] %(message)s",
        datefmt="%H:%M:%S"))
    logger.addHandler(handler)
    logger.addFilter(_as_poptorch_logger_allows)
    setLogLevel(os.environ.get("POPTORCH_LOG_LEVEL", "WARN"))


POPTORCH_LOGGER = "poptorch::python"       # PopTorch's logger, which programs configure


def _as_poptorch_logger_allows(record):
    """A program that quietens PopTorch's logger
    (``logging.getLogger("poptorch::python").setLevel(logging.ERROR)``, as
    Graphcore's BERT does) quietens this package's too."""
    level = logging.getLogger(POPTORCH_LOGGER).level      # NOTSET unless a program set it
    return level == logging.NOTSET or record.levelno >= level


_install_log_handler()
