"""``PoplarExecutor``: what ``trainingModel`` and ``inferenceModel`` return.

It compiles on the first call (or ``compile``), keeps the device copy of the
weights, optimizer state and buffers (``weights.DeviceWeights``), feeds each
call's combined batch to the
engine in PopTorch's layout ``[deviceIterations, gradientAccumulation,
replicas, micro-batch, ...]`` and returns outputs shaped as PopTorch does for
the output mode.

It is built by composition: it holds its parts and calls them with what they
need, none reads its attributes.  The device weights (``state/weights.py``),
the inputs (``inputs.py``), the observation (``observe.py``: anchors, cycle
counts), the optimizer (``optimizer_handling.DeviceOptimizer``), the
simulation's results (``results.SimulationResults``, with the report
functions there), the engine (``machine/engine.py``, set up by
``engine_setup.py``), the random-number state (``host_copies.py``).
"""
import logging

import torch

from ... import enums
from ...errors import Error, FloatingPointException
from ...machine import host_device
from ...machine.call_state import OutputCollector
from ...passes.precision import GradientMonitor, keep_running_statistics_float
from .. import compiler
from ..executables import cache, export
from ..reports import popart_log
from ..reports.popart_ir import popart_ir
from ..settings.config import CompileConfig, output_mode
from ..settings.engine_options import profiling_directory
from ..settings.session_options import parse as parse_options
from ..state import lazy_weights
from ..state.host_memory import give_back_freed_memory
from ..state.no_weights import has_meta_state, require_weights
from ..state.weights import DeviceWeights
from . import host_copies, observe, replica_grouping, results
from .engine_setup import build_engine, configure_batching, configure_update, process_group
from .inputs import ModelInputs
from .optimizer_handling import DeviceOptimizer
from .outputs import assemble, check_output_period, input_independent_outputs

logger = logging.getLogger("poptorchsim")

NO_EXECUTABLE_ERR = "Model has not been compiled or has been destroyed."
class PoplarExecutor:
    """A model wrapped for the simulated IPU (PopTorch's ``PoplarExecutor``)."""

    def __init__(self, model, options, training, optimizer=None):
        self._user_model = model
        # PopTorch wraps a shallow copy of the model: its own ``training`` flag, as it
        # was when wrapped, while the submodules are shared (a later model.eval()
        # switches them, not the copy's forward): traced with this flag
        self._wrapped_training = model.training
        self._options = options
        self._training = training
        self._compiled = None
        self._weightless = False        # compiled with parameters on the meta device
        self._fp_checks = False         # enableFloatingPointExceptions, as compiled
        self._attached = False
        self._weights = DeviceWeights(model, options, training)
        self._destroyed = False
        self._inputs = ModelInputs(model)
        self._output_mode = output_mode(options, training)
        self._observe = observe.Observation(options, self._output_mode)    # anchors, cycles
        self._gradients = GradientMonitor()     # fp16 gradients, automatic loss scaling
        self._results = results.SimulationResults(self._output_mode,
                                                  options.output_return_period)
        self._opt = DeviceOptimizer(self, model, options, training, self._weights)
        self._opt.optimizer = optimizer
        self.per_replica_params = {}    # parameter name -> replica_grouping.ReplicaGrouping
        if training and optimizer is not None:
            self._opt.adopt(optimizer)

    # -- properties PopTorch has ------------------------------------------------
    @property
    def model(self):
        return self._user_model

    @property
    def options(self):
        return self._options

    @property
    def _optimizer(self):           # PopTorch's attribute: the optimizer it trains with
        return self._opt.optimizer

    def __getattr__(self, name):
        if name.startswith("_"):
            raise AttributeError(name)
        value = getattr(self._user_model, name)
        if isinstance(value, torch.nn.Parameter):       # PopTorch's wrapper: replicaGrouping
            return replica_grouping.GroupedParameter(self, name, value)
        return value

    def __repr__(self):
        return repr(self._user_model)

    # -- batching ------------------------------------------------------------------
    def _factors(self):
        """(device iterations, accumulation, replicas) of one call."""
        o = self._options
        ga = o.Training.gradient_accumulation if self._training else 1
        return o.device_iterations, ga, o.replication_factor

    def _input_factors(self):
        """``_factors`` with the replicas whose inputs differ
        (``inputReplicaGrouping``): how one call's inputs are cut."""
        di, ga, rf = self._factors()
        return di, ga, rf // self._options.input_group_size

    # -- compilation ------------------------------------------------------------------
    def compile(self, *args, **kwargs):
        """Traces and compiles for these (combined-batch) inputs; does not run."""
        if self._compiled is not None:
            logger.warning("Call to compile() ignored: the executable is already compiled")
            return
        with observe.compile_hooks():
            self._compile(*self._inputs.prepare(args, kwargs))

    def _compile(self, args, kwargs, leaves, spec, names, source=None):
        check_output_period(self._options, self._output_mode)
        self._observe.check(self._user_model)
        weightless = has_meta_state(self._user_model)
        micro = self._inputs.micro_batch(args, kwargs, leaves, *self._input_factors(),
                                         self._options)
        o = self._options
        config = CompileConfig.from_options(o, self._training)
        grouped = replica_grouping.for_compile(self.per_replica_params, self._user_model, o,
                                               config)
        # the host device its graphs are compiled for (their constants placed there)
        self._weights.device = host_device.current()
        if config.precision["running_statistics_always_float"]:
            keep_running_statistics_float(self._user_model)
        now, self._user_model.training = self._user_model.training, self._wrapped_training
        try:
            with replica_grouping.one_row_each(self._user_model, grouped):
                if self._training:
                    fn, fn_args = compiler.compile_training, (
                        self._user_model, self._opt.optimizer, micro[0], micro[1], config)
                else:
                    fn, fn_args = compiler.compile_inference, (
                        self._user_model, micro[0], micro[1], config)
                compiled, self._executable_key = cache.through_cache(
                    o, self._training, self._user_model, source, fn, fn_args, {})
        finally:
            self._user_model.training = now
        # PopTorch's backend reads the options (an unknown one is an error), logged
        parse_options(self._options._backend_dict(self._output_mode))
        popart_log.log_lowering(compiled, config.placement, logger, config.locations,
                                self._observe.anchors)
        if self._training:
            replica_grouping.check_buffer_broadcast(compiled, self._user_model, o)
        self._constant_outputs = input_independent_outputs(compiled)
        model_graph = compiled.program.graphs[compiled.program.model_graph]
        self._fp_checks = model_graph.floating_point_checks
        self._compiled = compiled
        directory = profiling_directory(o)
        if directory is not None:
            import os

            from ...profiling import write_report
            name = results.model_name(o, self._training)
            write_report(self.simulationReport(sensitivity=True), os.path.join(directory, name))
        step = next(iter(compiled.program.graphs.values()))
        self._inputs.input_writes = step.input_writes
        self._engine = build_engine(compiled, self._training, o, grouped)
        self._weights.grouped = tuple(grouped)
        self._opt.bind(compiled, config, weightless)
        if self._training:
            configure_update(self._engine, compiled)
        self._observe.attach(compiled, self._engine)
        configure_batching(self._engine, compiled, self._training, self._observe.tap is not None)
        # training in several processes
        group = self._weights.group = process_group(self._options, self._training)
        if group is not None:
            self._engine.reduce = group.all_reduce_sum
        self._inputs.remember(args, kwargs, leaves, spec, names)
        self._weightless = weightless
        if weightless:          # estimates only: nothing to upload (no_weights.py)
            return
        self._upload()
        self._attached = True
        if self._training and self._weights.apart:
            lazy_weights.install(self._user_model, self)

    def compileAndExport(self, filename, *args, export_model=True, **kwargs):
        """``compile`` for these inputs, then ``save`` to ``filename``."""
        self.compile(*args, **kwargs)
        self.save(filename, export_model)

    def save(self, filename, export_model=True, save_rng_state=True):
        """Writes the executable (and, with ``export_model``, the model, its
        optimizer and the RNG state) to ``filename`` for ``poptorch.load``."""
        self._require_compiled()
        export.save(self, filename, export_model, save_rng_state)

    def loadExecutable(self, filename):
        """Takes the executable that ``compileAndExport``/``save`` wrote to
        ``filename``, for a model and options like those it was exported with."""
        export.load_executable(self, export.read(filename), filename)

    def isCompiled(self):
        return self._compiled is not None

    def getIR(self):
        """The compiled IR ``Program``; ``print()`` it to read it."""
        self._require_compiled()
        return self._compiled.program

    def getTensorNames(self):
        """The IR's tensor names, ``Gradient___<param>`` and ``UpdatedVar___<param>``
        (which ``Options.anchorTensor`` accepts) and the optimizer's (PopART's)."""
        assert self._compiled is not None, \
            "Model must be compiled before calling getTensorNames"
        return observe.tensor_names(self._compiled) + self._opt.tensor_names()

    def getAnchoredTensor(self, short_name):
        """The value of anchor ``short_name`` after the last call."""
        return self._observe.anchored(short_name)

    def cycleCount(self):
        """Simulated cycles of the last call (needs ``Options.logCycleCount(True)``)."""
        return observe.cycle_count(self._options, self._compiled, self._observe.has_run)

    def _debugGetPopartIR(self):
        """The program as PopART's serialised IR, JSON (``popart_ir.py``)."""
        self._require_compiled()
        return popart_ir(self._compiled)

    def _require_compiled(self):
        if self._compiled is None:
            raise Error(NO_EXECUTABLE_ERR)

    def _require_weights(self, what):
        """``NoWeightsError`` for a model compiled (or about to be) without weights."""
        require_weights(self._user_model, what, self._weightless, self._compiled is None)

    # -- weights ------------------------------------------------------------------------
    @property
    def _state(self):
        return self._weights.state

    def copyWeightsToDevice(self):
        """Host -> device: weights and buffers (the device keeps its optimizer state)."""
        self._require_compiled()
        self._require_weights("copy the weights to the device (copyWeightsToDevice())")
        self._upload(keep_optimizer_state=self._state.opt_state is not None)

    def state_dict(self, *args, **kwargs):
        """The model's weights and buffers (those of the last call, which a
        training call leaves in the model).  A model without weights has no
        values to give: ``NoWeightsError``."""
        self._require_weights("read the weights (state_dict())")
        return self._user_model.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict, strict=True):
        """Loads into the user's model, then into the device when attached."""
        result = self._user_model.load_state_dict(state_dict, strict)
        if self.isAttachedToDevice():
            self.copyWeightsToDevice()
        return result

    def _upload(self, keep_optimizer_state=False):
        self._opt.has_run = self._opt.has_run and keep_optimizer_state
        self._weights.upload(self._compiled, self._opt.optimizer, keep_optimizer_state)

    def copyNamedBuffersToDevice(self):
        """Host -> device: only the buffers named in ``Options.updatableNamedBuffers``."""
        self._require_compiled()
        self._require_weights("copy buffers to the device (copyNamedBuffersToDevice())")
        names = observe.updatable_buffers(self._options)
        if names is None:
            raise Error(observe.NO_UPDATABLE_BUFFERS)
        self._weights.upload_buffers(self._compiled, names)

    def copyWeightsToHost(self):
        """Device -> host: the user's model gets the device weights and buffers."""
        self._require_compiled()
        self._require_weights("copy the weights to the host (copyWeightsToHost())")
        self._weights.download(self._compiled)
        if self._training:
            self._opt.keep_state(self._opt.optimizer)

    # -- the optimizer (optimizer_handling.DeviceOptimizer) -----------------------------------
    def setOptimizer(self, optimizer):
        """Uses ``optimizer`` from the next call on (``DeviceOptimizer.set``)."""
        def after_rebuild():
            c = self._compiled
            configure_update(self._engine, c)
            self._observe.attach(c, self._engine)   # anchors read the new update
            configure_batching(self._engine, c, self._training, self._observe.tap is not None)
        self._opt.set(optimizer, after_rebuild)

    def _read_optimizer_state(self, optimizer):
        """``optimizer.state_dict()`` reads the device state (``optim.py``)."""
        self._opt.read_state(optimizer)

    # -- attach / detach ----------------------------------------------------------------------
    def attachToDevice(self):
        self._require_compiled()
        if self._options.connection_type == enums.ConnectionType.Never:
            raise AssertionError("Trying to attach to an offline device (ConnectionType.Never)")
        self._require_weights("attach to the device (attachToDevice())")
        if self._attached:
            raise Error("Device is already attached")
        self._upload()
        self._attached = True

    def detachFromDevice(self):
        self._require_compiled()
        if not self._attached:
            raise Error("Device is not attached")
        if self._training:      # the weights are on the host after every call (CPU)
            self.copyWeightsToHostIfNeeded()    # or copied now (CUDA host device)
            self._opt.keep_state(self._opt.optimizer)
        self._attached = False

    def isAttachedToDevice(self):
        return self._compiled is not None and self._attached

    def isWrapping(self):
        return not self._destroyed

    def destroy(self):
        """Copies the optimizer state back (training, once a call has
        changed it), drops the executable and everything it held, unwraps
        the model.  The weights are not copied: every training call has
        already left them in the user's model, and copying again would
        overwrite weights the user changed since.  A model compiled and never
        run keeps its optimizer's host state as it was (the device's is the
        initial state it was given): no copy of it is made."""
        if self._compiled is not None and self._training and self._attached \
                and self._opt.has_run:
            self._opt.keep_state(self._opt.optimizer)
        if self._training and hasattr(self._opt.optimizer, "_use_on_device"):
            self._opt.optimizer._use_on_device(None)
        self.copyWeightsToHostIfNeeded()    # the model gets the trained weights first
        lazy_weights.remove(self._user_model)
        self._release()
        self._destroyed = True
        m = self._user_model
        ref = m.__dict__.get("_poptorchsim_wrapper")
        if ref is not None and ref() is self:
            del m.__dict__["_poptorchsim_wrapper"]
            m.__dict__.pop("destroy", None)

    def _release(self):
        """Drops what the executable held: the compiled program (traced graphs,
        IR, generated code), the engine, the device copy of the weights,
        buffers and optimizer state, the anchors' values, the gradient watch."""
        self._compiled = None
        self._opt.release()
        self._attached = False
        self._weightless = False
        self._inputs = ModelInputs(self._inputs._model)     # a new call compiles for its own
        self.__dict__.pop("_engine", None)
        self._weights.release()
        self._observe.tap, self._observe.values = None, {}
        self._gradients = GradientMonitor()
        self._inputs.call_tensors = []
        give_back_freed_memory()        # the heap keeps freed memory for steps otherwise

    # -- simulation results (results.py) -------------------------------------------------
    def memoryReport(self):
        """The compiled program's memory per tile (``passes.memory.MemoryReport``)."""
        self._require_compiled()
        return self._compiled.memory

    def cycleEstimate(self):
        """Estimated cycles of one call, split compute/exchange/sync/host
        (with conditionals, the branches the last call took)."""
        self._require_compiled()
        return results.cycle_estimate(self._compiled, vars(self).get("_engine"))

    def precisionReport(self):
        """fp16 in the last training call: the loss scale (and automatic loss
        scaling's factor and scales), and the fp16 values the backward pass
        lost to underflow or overflow, with the ops that lost the most."""
        self._require_compiled()
        return results.precision_report(self._compiled, self._training, self._gradients,
                                        self._state)

    def estimateSensitivity(self, top=None):
        """How far to trust the throughput estimate: per cost-model constant,
        the relative change of samples/s with it x0.8 (``low``) and x1.2
        (``high``), the constants that move it most first (``top`` of them)."""
        self._require_compiled()
        return results.sensitivity_rows(self._compiled, self._options, top)

    def simulationReport(self, sensitivity=False):
        """Memory per tile, cycles per call and per op, liveness: a JSON-ready dict
        (with ``sensitivity=True`` also ``estimateSensitivity()``'s rows)."""
        self._require_compiled()
        di, ga, rf = self._input_factors()        # the samples one call takes
        micro = self._compiled.capture.example_inputs
        batch = micro[0].shape[0] if micro and micro[0].dim() else 1
        return results.simulation_report(
            self._compiled, results.model_name(self._options, self._training),
            batch * di * ga * rf, self.precisionReport(),
            self.estimateSensitivity() if sensitivity else None)

    def getPerfCounters(self):
        """Simulated timestamps (seconds) of the last call: per tensor, per step."""
        return self._results.counters()

    # the latencies: (min, max, avg) seconds between two of the counters
    def getHostIpuLatency(self):
        return self._results.latency("input", "input_complete")

    def getComputeLatency(self):
        return self._results.latency("input_complete", "output")

    def getIpuHostLatency(self):
        return self._results.latency("output", "output_complete")

    def getLatency(self):
        return self._results.latency("input", "output_complete")

    def compilationTime(self):
        return results.compilation_time(self._compiled, self._options)

    # -- the random-number state and lazy copies (host_copies.py) -------------------------
    @property
    def rng_state(self):
        """The random generator's ``[seed, *state]`` (ints) of the compiled model."""
        self._require_compiled()
        return host_copies.rng_state(self._options)

    @rng_state.setter
    def rng_state(self, state):
        self._require_compiled()
        host_copies.set_rng_state(state)

    @property
    def _executable(self):
        """The compiled program, or None before compilation and after
        ``destroy()`` (PopTorch's handle on its Poplar executable; vision/cnns
        tests ``if inference_model._executable: attachToDevice()``)."""
        return vars(self).get("_compiled")

    def copyWeightsToHostIfNeeded(self):
        """True if the host's weights were out of date and have been updated
        (``DeviceWeights.download_if_dirty``), False if they were up to date."""
        weights = vars(self).get("_weights")
        return weights is not None and weights.download_if_dirty(vars(self).get("_compiled"))

    # -- running ---------------------------------------------------------------------------
    def __call__(self, *args, **kwargs):
        if self._options.connection_type == enums.ConnectionType.Never:
            raise AssertionError(
                "Trying to run a model on an offline device (ConnectionType.Never): use "
                "model.compile(inputs) instead of model(inputs)")
        if self._weightless or self._compiled is None:
            self._require_weights("run the model")
        prepared = self._inputs.prepare(args, kwargs)
        if self._compiled is None:
            with observe.compile_hooks():
                self._compile(*prepared)
        _, _, leaves, spec, names = prepared
        self._inputs.validate(leaves, spec, names)
        if not self._attached:
            self.attachToDevice()
        if not self._training and self._weights.stale():
            self.copyWeightsToDevice()
        di, ga, rf = self._factors()
        inputs = host_device.send(self._inputs.layout(leaves, *self._input_factors()),
                                  self._weights.device)
        mode = self._output_mode
        collector = OutputCollector(mode.name, self._options.output_return_period, di, ga, rf)
        self._results.record_call(self._compiled, len(inputs), di, ga, rf)
        for counts in getattr(self._engine.step_fn, "branches", {}).values():
            counts[:] = [0, 0]                      # this call's branches only
        self._observe.start(di, ga, rf)
        if self._training:
            self._opt.send_loaded_state()
        # floating-point checks on: an exception leaves the device as before the call
        before = self._state.snapshot() if self._fp_checks else None
        try:
            if self._training:
                self._gradients.start(self._compiled, self._state, di * ga * rf)
            result = self._engine.run(self._compiled.program, self._state, inputs, collector)
        except FloatingPointException:
            if before is not None:
                self._state.restore(before)
            raise
        if self._training:
            self._opt.has_run = True
            self._opt.state_changed()
            if self._weights.apart:
                self._weights.dirty = True      # copied back when the model is read
            else:
                self._weights.download(self._compiled, fresh=False)
            self._gradients.finish(self._compiled)
        self._inputs.write_back(self._engine.written)
        self._observe.finish(self._compiled)
        return assemble(self._compiled, result, self._constant_outputs)

