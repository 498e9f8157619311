"""The optimizer of a wrapped training model on the simulated device.

``DeviceOptimizer`` is one part of ``PoplarExecutor`` (held, not inherited):
it adopts the user's optimizer and its state, applies PopTorch's checks of
what may change once compiled (``setOptimizer``), keeps the device's
optimizer state and the host's in step (``state_dict()`` reads the device),
and logs PopTorch's optimizer lines.  It holds what it works on as declared
fields: the optimizer, the settings the compiled update has, the device
weights (``state/weights.py``) and, between a compile and ``destroy()``,
the compiled program and its config (``bind``/``release``)."""
import logging

from ... import enums
from ...capture import optimizer_checks as opt_checks
from ...passes.update import check_loss_scaling, update_plan
from .. import compiler
from ..reports import optimizer_log


class DeviceOptimizer:
    """The optimizer part of one executor (see the module's docstring).
    ``owner``: the executor, handed to a PopTorch optimizer so that its
    ``state_dict()`` reads the device state."""

    def __init__(self, owner, model, options, training, weights):
        self.owner, self.model, self.options = owner, model, options
        self.training, self.weights = training, weights
        self.optimizer = None
        self.settings = None            # the optimizer as the compiled update has it
        self.tracker = opt_checks.AttributeTracker(options.relax_optimizer_checks)
        self.has_run = False            # a training call ran since the state's upload
        self.compiled = None            # bound between a compile and destroy()
        self.config = None
        self.weightless = False

    # -- the compiled program it works on ---------------------------------------------
    def bind(self, compiled, config, weightless):
        """A compile made ``compiled``: the settings its update has, logged."""
        self.compiled, self.config, self.weightless = compiled, config, weightless
        if self.training:
            self.settings, _ = update_plan(self.optimizer, compiled.program.accumulation,
                                           config.running_mean, config.auto_loss_scaling)
            self.log(self.settings)
            self.state_changed()

    def release(self):
        self.compiled, self.config, self.weightless = None, None, False

    # -- adopting an optimizer -------------------------------------------------------------
    def adopt(self, optimizer):
        """``optimizer`` becomes the model's: its ``state_dict()`` reads the
        device state from now on, and, before compiling, a float16 gradient
        accumulator switches the mean reduction to a running mean (PopTorch)."""
        self.check_running_mean(optimizer)
        self.tracker.check(optimizer)
        if hasattr(optimizer, "_use_on_device"):
            optimizer._use_on_device(self.owner)

    def check_running_mean(self, optimizer):
        if opt_checks.needs_running_mean(optimizer):
            t = self.options.Training
            if self.compiled is None:
                self.options._unfreeze()
                t.setMeanAccumulationAndReplicationReductionStrategy(
                    enums.MeanReductionStrategy.Running)
                self.options._freeze()
            elif t.meanAccumulationAndReplicationReductionStrategy != \
                    enums.MeanReductionStrategy.Running:
                raise ValueError(
                    "Invalid optimizer: the new optimizer would require changing options."
                    "Training.meanAccumulationAndReplicationReductionStrategy to "
                    "poptorch.MeanReductionStrategy.Running but the executable is already "
                    "compiled.")

    def set(self, optimizer, engine_after_rebuild):
        """``setOptimizer``: uses ``optimizer`` from the next call on.

        A variable attribute (PopTorch's ``variable_attrs``) changes without
        recompiling; a constant one that changes is refused as PopART refuses
        it.  A new optimizer object brings its own state.  A different
        optimizer type, or the same type in another mode (Adam and AdamW,
        SGD's separate and combined variants), is refused as PopART refuses
        it, the model unchanged.  Where the update had to be rebuilt,
        ``engine_after_rebuild()`` sets the engine up for it."""
        opt_checks.optimizer_type(optimizer)
        self.check_running_mean(optimizer)     # PopTorch's ValueError comes first
        c = self.compiled
        if c is None:
            self.adopt(optimizer)
            self.optimizer = optimizer
            return
        settings, plan = update_plan(optimizer, c.program.accumulation,
                                     self.config.running_mean, self.config.auto_loss_scaling)
        opt_checks.check_same_type(self.settings.type, settings.type)
        opt_checks.check_replacement(self.settings, settings, self.group_tensor_names())
        check_loss_scaling(c, plan)
        self.adopt(optimizer)
        new_object = optimizer is not self.optimizer
        if new_object:
            old = self.optimizer
            self.keep_state(old)
            if hasattr(old, "_use_on_device"):
                old._use_on_device(None)
        self.optimizer = optimizer
        self.log(settings, self.settings)
        self.settings = settings
        self.state_changed()
        if plan != c.plan:
            compiler.rebuild_update(c, self.model, optimizer, self.config)
            engine_after_rebuild()
            self.load_state()
        elif new_object:
            self.load_state()
        else:
            self.weights.load_hyperparameters(c, self.optimizer)
            self.send_loaded_state()

    # -- the device's state and the host's -----------------------------------------------
    def read_state(self, optimizer):
        """``optimizer.state_dict()`` of the model's optimizer: the device state
        is read into it."""
        if self.options.connection_type == enums.ConnectionType.Never or self.weightless:
            return              # never on a device: no state to read (PopTorch's None)
        if optimizer is self.optimizer and self.compiled is not None and self.training:
            if getattr(optimizer, "host_state_is_dirty", True) is False and \
                    hasattr(optimizer, "has_state") and optimizer.has_state():
                # nothing ran since the last read: PopTorch's cached state dict
                logging.getLogger("poptorchsim").debug("Using cached optimiser state dict")
                return
            self.keep_state(optimizer)

    def state_changed(self):
        """The device's optimizer state changed (a call, a compilation, new
        hyperparameters): ``state_dict()`` reads it again."""
        if self.training and hasattr(self.optimizer, "host_state_is_dirty"):
            self.optimizer.host_state_is_dirty = True

    def keep_state(self, optimizer):
        """Device -> host: torch's state of ``optimizer``, and for a PopTorch
        optimizer the device state its ``state_dict()`` returns (a state it
        was loaded with and has not sent yet goes to the device first)."""
        if self.weightless:             # compiled without weights: no device state
            return
        if optimizer is self.optimizer:
            self.send_loaded_state()
        self.weights.optimizer_state_to_host(self.compiled, optimizer)
        if hasattr(optimizer, "_state_dict"):
            optimizer._state_dict = self.weights.read_device_state(self.compiled, optimizer)
            optimizer.ipu_state_is_dirty = optimizer.host_state_is_dirty = False

    def send_loaded_state(self):
        """A state given to ``optimizer.load_state_dict`` goes to the device
        before the next run."""
        if self.training and not self.weightless and \
                getattr(self.optimizer, "ipu_state_is_dirty", False):
            self.weights.write_device_state(self.compiled, self.optimizer)
            self.state_changed()

    def load_state(self):
        """Host -> device: the optimizer's state (none without weights)."""
        if not self.weightless:
            self.weights.load_optimizer_state(self.compiled, self.optimizer)

    def tensor_names(self):
        """PopART's names of the optimizer's tensors on the device
        (``scaledLearningRate0___specific___fc.weight``, ...), for
        ``getTensorNames()``; none in inference or before compiling."""
        if not self.training or self.compiled is None:
            return []
        return self.weights.optimizer_tensor_names(self.compiled, self.optimizer)

    # -- PopTorch's texts -------------------------------------------------------------------
    def log(self, settings, old=None):
        """PopTorch's debug lines for the optimizer the device now holds,
        when it holds other values than ``old`` (``optimizer_log``)."""
        if old is not None and (old.values, old.attrs) == (settings.values, settings.attrs):
            return
        c = self.compiled
        groups = [[] for _ in range(settings.groups)]
        for name, g in zip(c.capture.trainable_names, c.group_of):
            groups[g].append(name)
        optimizer_log.log(settings, groups)

    def group_tensor_names(self):
        """{param group: its first trainable parameter's name}, for PopART's texts."""
        c = self.compiled
        names = {}
        for n, g in zip(c.capture.trainable_names, c.group_of):
            names.setdefault(g, n)
        return names
