"""``PoplarExecutor``'s optimizer: adopting the user's optimizer and its
state, ``setOptimizer`` (PopTorch's checks of what may change once
compiled), and configuring the engine's update and batching from the
compiled update plan.  ``executor.py`` mixes ``_OptimizerHandling`` into
``PoplarExecutor``."""
import logging

import torch

from ... import enums
from ...capture import optimizer_checks as opt_checks
from ...machine.batching import batched_graph, serial_reason
from ...machine.call_state import Accumulation
from ...passes.update import check_loss_scaling, update_plan
from .. import compiler
from ..reports import optimizer_log


class _OptimizerHandling:
    """Needs the executor's compiled program, engine, weights, options and
    state (``_compiled``, ``_engine``, ``_weights``, ``_options``, ``_state``,
    ``_optimizer``, ...)."""

    def _adopt_optimizer(self, optimizer):
        """``optimizer`` becomes the model's: its ``state_dict()`` reads the
        device state from now on, and, before compiling, a float16 gradient
        accumulator switches the mean reduction to a running mean (PopTorch)."""
        self._check_running_mean(optimizer)
        self._attribute_tracker.check(optimizer)
        if hasattr(optimizer, "_use_on_device"):
            optimizer._use_on_device(self)

    def _check_running_mean(self, optimizer):
        if opt_checks.needs_running_mean(optimizer):
            t = self._options.Training
            if self._compiled is None:
                self._options._unfreeze()
                t.setMeanAccumulationAndReplicationReductionStrategy(
                    enums.MeanReductionStrategy.Running)
                self._options._freeze()
            elif t.meanAccumulationAndReplicationReductionStrategy != \
                    enums.MeanReductionStrategy.Running:
                raise ValueError(
                    "Invalid optimizer: the new optimizer would require changing options."
                    "Training.meanAccumulationAndReplicationReductionStrategy to "
                    "poptorch.MeanReductionStrategy.Running but the executable is already "
                    "compiled.")

    def _configure_batching(self):
        """The micro-batches of one weight update run as one batched call
        where the training step allows it (``batching.serial_reason``) and no
        anchor taps the step per micro-batch."""
        c, e = self._compiled, self._engine
        step = c.program.graphs[c.program.model_graph]
        serial = (not self._training or self._observe.tap is not None
                  or serial_reason(step) is not None)
        e.watch = step.watch if self._training else None
        if serial:
            e.batch_fn = None
            return
        # the gradients (summed over the micro-batches) end where the buffers
        # begin; fp32 ones summed at once, others added micro-batch by micro-batch
        stop = len(step.outputs) - sum(t.role == "buffer" for t in step.inputs)
        grads = step.outputs[stop - len(c.capture.trainable_names):stop]
        plain = e.accumulation is None and all(t.dtype == torch.float32 for t in grads)
        e.batch_fn = batched_graph(step, (stop - len(grads), stop), per_row=not plain)

    def _configure_update(self):
        """The engine runs the compiled update the way its plan says: state
        slots read and written, gradient accumulators' types, running mean,
        SGD1's accumulation into the velocity."""
        c, e = self._compiled, self._engine
        e.update_fn = c.update_fn
        e.shards = self._shard_index()
        plan = c.plan
        e.slot_counts = [(len(read), len(written)) for read, written in c.slots]
        into = list(range(len(c.slots))) if plan.into_state else []
        if plan.running_mean or into or any(lay.grad_dtype != lay.dtype for lay in c.layouts):
            e.accumulation = Accumulation([lay.grad_dtype for lay in c.layouts],
                                          plan.running_mean, into)
        else:
            e.accumulation = None

    def _read_optimizer_state(self, optimizer):
        """``optimizer.state_dict()`` of the model's optimizer: the device state
        is read into it."""
        if self._options.connection_type == enums.ConnectionType.Never or self._weightless:
            return              # never on a device: no state to read (PopTorch's None)
        if optimizer is self._optimizer and self._compiled is not None and self._training:
            if getattr(optimizer, "host_state_is_dirty", True) is False and \
                    hasattr(optimizer, "has_state") and optimizer.has_state():
                # nothing ran since the last read: PopTorch's cached state dict
                logging.getLogger("poptorchsim").debug("Using cached optimiser state dict")
                return
            self._keep_optimizer_state(optimizer)

    def _device_state_changed(self):
        """The device's optimizer state changed (a call, a compilation, new
        hyperparameters): ``state_dict()`` reads it again."""
        if self._training and hasattr(self._optimizer, "host_state_is_dirty"):
            self._optimizer.host_state_is_dirty = True

    def _keep_optimizer_state(self, optimizer):
        """Device -> host: torch's state of ``optimizer``, and for a PopTorch
        optimizer the device state its ``state_dict()`` returns (a state it
        was loaded with and has not sent yet goes to the device first)."""
        if self._weightless:            # compiled without weights: no device state
            return
        if optimizer is self._optimizer:
            self._send_loaded_optimizer_state()
        self._weights.optimizer_state_to_host(self._compiled, optimizer)
        if hasattr(optimizer, "_state_dict"):
            optimizer._state_dict = self._weights.read_device_state(self._compiled, optimizer)
            optimizer.ipu_state_is_dirty = optimizer.host_state_is_dirty = False

    def _send_loaded_optimizer_state(self):
        """A state given to ``optimizer.load_state_dict`` goes to the device
        before the next run."""
        if self._training and not self._weightless and \
                getattr(self._optimizer, "ipu_state_is_dirty", False):
            self._weights.write_device_state(self._compiled, self._optimizer)
            self._device_state_changed()

    def _log_optimizer(self, settings, old=None):
        """PopTorch's debug lines for the optimizer the device now holds,
        when it holds other values than ``old`` (``optimizer_log``)."""
        if old is not None and (old.values, old.attrs) == (settings.values, settings.attrs):
            return
        c = self._compiled
        groups = [[] for _ in range(settings.groups)]
        for name, g in zip(c.capture.trainable_names, c.group_of):
            groups[g].append(name)
        optimizer_log.log(settings, groups)

    def _group_tensor_names(self):
        """{param group: its first trainable parameter's name}, for PopART's texts."""
        c = self._compiled
        names = {}
        for n, g in zip(c.capture.trainable_names, c.group_of):
            names.setdefault(g, n)
        return names

    def setOptimizer(self, optimizer):
        """Uses ``optimizer`` from the next call on.

        A variable attribute (PopTorch's ``variable_attrs``) changes without
        recompiling; a constant one that changes is refused as PopART refuses
        it.  A new optimizer object brings its own state.  A different
        optimizer type, or the same type in another mode (Adam and AdamW,
        SGD's separate and combined variants), is refused as PopART refuses
        it, the model unchanged."""
        opt_checks.optimizer_type(optimizer)
        self._check_running_mean(optimizer)     # PopTorch's ValueError comes first
        if self._compiled is None:
            self._adopt_optimizer(optimizer)
            self._optimizer = optimizer
            return
        c = self._compiled
        settings, plan = update_plan(optimizer, c.program.accumulation,
                                     self._config.running_mean, self._config.auto_loss_scaling)
        opt_checks.check_same_type(self._opt_settings.type, settings.type)
        opt_checks.check_replacement(self._opt_settings, settings, self._group_tensor_names())
        check_loss_scaling(c, plan)
        self._adopt_optimizer(optimizer)
        new_object = optimizer is not self._optimizer
        if new_object:
            old = self._optimizer
            self._keep_optimizer_state(old)
            if hasattr(old, "_use_on_device"):
                old._use_on_device(None)
        self._optimizer = optimizer
        self._log_optimizer(settings, self._opt_settings)
        self._opt_settings = settings
        self._device_state_changed()
        if plan != c.plan:
            compiler.rebuild_update(c, self._user_model, optimizer, self._config)
            self._configure_update()
            self._observe.attach(c, self._engine)   # anchors read the new update
            self._configure_batching()
            self._load_optimizer_state()
        elif new_object:
            self._load_optimizer_state()
        else:
            self._weights.load_hyperparameters(c, self._optimizer)
            self._send_loaded_optimizer_state()

    # -- attach / detach ----------------------------------------------------------------
