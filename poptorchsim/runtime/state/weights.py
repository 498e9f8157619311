"""The device copy of a model's weights, buffers and optimizer state, and
its transfers to and from the host model (PopTorch's ``copyWeightsToDevice``
and ``copyWeightsToHost``).

A training model's device weights live in the host parameters' memory: the
update writes them in place, so nothing is copied back after a call.  On a
CUDA host device (``machine/host_device.py``) the device state is a copy on
that device; after a training call the user's model is out of date until it
is read (``lazy_weights.py``: its modules' parameters, buffers, ``forward``,
``state_dict``) or ``copyWeightsToHost()`` is called, as in PopTorch.  The
optimizer state is held as the compiled update graph reads it (one list of
slots per trainable parameter, sharded where the program shards it); the
hyperparameters are float64 device scalars, so a new learning rate needs no
recompilation.  The loss scaling is one more device scalar, read by the
training step (the loss is multiplied by it before the backward pass) and
folded into ``grad_scale`` (the update divides the gradients by it).
"""
import logging

import torch

from ... import enums
from ...capture.optimizer_checks import read_settings
from ...machine import host_device
from ...machine.call_state import shard, unshard
from ...machine.precision import LossScale
from ...passes import optimizer_state as opt_layout
from .host_memory import keep_freed_memory

_log = logging.getLogger("poptorchsim")


class DeviceState:
    """The device copy of everything a training program reads and writes."""
    n_trainable = 0
    params = buffers = opt_state = steps = hyper = None
    grad_scale = None
    step_extra = ()             # the training step's extra inputs: the loss scaling
    combined_scale = None       # per trainable param: SGD1's gradient scale into the velocity
    loss_scale = None           # automatic loss scaling: a machine.precision.LossScale

    def snapshot(self):
        """What a call may change, to put back if it fails: the lists that
        hold the device tensors (with floating-point checks on, the engine
        runs every op out of place, so the tensors themselves are not
        written) and automatic loss scaling's counters."""
        scale = self.loss_scale
        return (list(self.params or ()), [list(b) for b in self.buffers or ()],
                [list(s) for s in self.opt_state] if self.opt_state is not None else None,
                list(self.steps) if self.steps is not None else None,
                self.grad_scale, list(self.step_extra),
                list(self.combined_scale) if self.combined_scale is not None else None,
                None if scale is None else (scale.factor, scale.counter, scale.statistics,
                                            list(scale.history)))

    def restore(self, snapshot):
        """The state as ``snapshot`` took it (a failed call leaves the device
        as it was before the call)."""
        (params, buffers, opt_state, steps, self.grad_scale, step_extra,
         self.combined_scale, scale) = snapshot
        self.params[:] = params
        self.buffers[:] = buffers
        self.opt_state, self.steps, self.step_extra = opt_state, steps, step_extra
        if scale is not None:
            ls = self.loss_scale
            ls.factor, ls.counter, ls.statistics, ls.history = scale


def separate_copy(device):
    """Does the device state live apart from the user's model (a CUDA host
    device), rather than in its parameters' memory (the CPU)?"""
    return device.type != "cpu"


def same_memory(a, b):
    return a.data_ptr() == b.data_ptr() and a.stride() == b.stride() \
        and a.shape == b.shape and a.dtype == b.dtype


class DeviceWeights:
    """Moves weights, buffers and optimizer state between the user's model
    and the device state of one compiled program."""

    def __init__(self, model, options, training):
        self.model = model
        self.options = options
        self.training = training
        self.state = DeviceState()
        self.uploaded_version = -1
        self._host_tensors = None       # (params, buffers) of the user's model, by name
        self.group = None               # distributed: the gloo process group
        self._broadcast_done = False
        self.device = torch.device("cpu")   # the host device (set when compiled)
        self.dirty = False              # the device holds weights the model lacks
        self.grouped = ()               # replica-grouped parameters (a row per group)

    @property
    def apart(self):
        """Does the device state live apart from the user's model?"""
        return separate_copy(self.device)

    def release(self):
        """Forgets the device copy (the executor's ``destroy()``)."""
        self.state = DeviceState()
        self._host_tensors = None
        self.uploaded_version = -1
        self.dirty = False
        self._broadcast_done = False

    def _replicas(self):
        o = self.options
        return o.replication_factor

    def _host(self, cap):
        params = dict(self.model.named_parameters())
        buffers = dict(self.model.named_buffers())
        return ([params[n] for n in cap.param_names], [buffers[n] for n in cap.buffer_names])

    def stale(self):
        """Has the host model changed since the last upload (inference)?"""
        return getattr(self.model, "_poptorchsim_version", 0) != self.uploaded_version

    def upload(self, compiled, optimizer, keep_optimizer_state=False):
        """Host -> device: weights and buffers, and the optimizer state unless
        ``keep_optimizer_state``."""
        keep_freed_memory()             # the host process is about to run steps
        cap = compiled.capture
        host_params, host_buffers = self._host(cap)
        st = self.state
        st.params = [p.detach().to(self.device, copy=True) if self.apart or not self.training
                     else p.detach() for p in host_params]
        first = [b.detach().clone() for b in host_buffers]
        if self.group is not None and not self._broadcast_done:
            # every process starts from process 0's weights and buffers (as popdist does)
            both = self.group.broadcast_from_first([p.clone() for p in st.params] + first)
            first = both[len(st.params):]
            with torch.no_grad():
                for p, v in zip(st.params, both):
                    p.copy_(v)
            self._broadcast_done = True
        st.buffers = [[b.clone() for b in first] for _ in range(self._replicas())]
        if self.training:
            st.n_trainable = len(cap.trainable_names)
            if not keep_optimizer_state:
                self.load_optimizer_state(compiled, optimizer)
        self.uploaded_version = getattr(self.model, "_poptorchsim_version", 0)
        self._host_tensors = (host_params, host_buffers)
        self.dirty = False
        self._place()

    def _place(self):
        """The device state's tensors onto the host device (those already
        there are kept)."""
        st, device = self.state, self.device
        if device.type == "cpu":
            return
        for name in ("params", "buffers", "opt_state", "steps", "hyper", "grad_scale",
                     "step_extra", "combined_scale"):
            value = getattr(st, name)
            if value is not None:
                setattr(st, name, host_device.to(value, device))
        scale = st.loss_scale
        if scale is not None:
            scale.factor, scale.counter, scale.statistics = host_device.to(
                (scale.factor, scale.counter, scale.statistics), device)

    def upload_buffers(self, compiled, names):
        """Host -> device: the buffers ``names`` alone, on every replica
        (``copyNamedBuffersToDevice``); weights, other buffers and the
        optimizer state stay as the device has them."""
        order = compiled.capture.buffer_names
        host = dict(self.model.named_buffers())
        for name in names:
            value = host[name].detach()
            for replica in self.state.buffers:
                replica[order.index(name)] = value.to(self.device, copy=True)

    def _settings(self, optimizer):
        return read_settings(optimizer, self.options.Training.auto_loss_scaling)

    def load_optimizer_state(self, compiled, optimizer):
        """Host -> device: the optimizer state, from torch's state of each
        parameter (true values, as torch.optim keeps them) or its initial
        value; then, if ``optimizer.load_state_dict`` was given a saved device
        state, that."""
        c = compiled
        st = self.state
        params = dict(self.model.named_parameters())
        settings = self._settings(optimizer)
        values = [opt_layout.group_values(c.plan, settings, g) for g in range(settings.groups)]
        ls = opt_layout.loss_scale(settings)
        st.opt_state, st.steps = [], []
        for n, grp, (_, written) in zip(c.capture.trainable_names, c.group_of, c.slots):
            p = params[n]
            torch_state = optimizer.state.get(p, {})
            slots = [opt_layout.initial_slot(c.plan, s, p, torch_state, values[grp], grp, ls,
                                             opt_layout.slot_dtype(c.plan, s, p.dtype))
                     for s in written]
            step = torch_state.get("step")
            if step is None:
                step = 1.0 if "momentum_buffer" in torch_state and \
                    torch_state["momentum_buffer"] is not None else 0.0
            if n in c.shards:       # each replica holds its shard
                slots = [shard(v, c.shards[n]) for v in slots]
            st.opt_state.append(slots)
            st.steps.append(torch.tensor(float(step), dtype=torch.float32))
        self.load_hyperparameters(compiled, optimizer)
        if getattr(optimizer, "ipu_state_is_dirty", False):
            self.write_device_state(compiled, optimizer)
        self._place()

    def load_hyperparameters(self, compiled, optimizer):
        """Host -> device: the hyperparameters (float64 scalars), the loss
        scaling and the gradient scale (the mean reduction and 1 / loss
        scaling)."""
        o = self.options
        plan = compiled.plan
        settings = self._settings(optimizer)
        values = [opt_layout.group_values(plan, settings, g) for g in range(settings.groups)]
        base = opt_layout.loss_scale(settings)
        ls = self._final_loss_scale(compiled, base)     # times automatic loss scaling's factor
        hyper = [torch.tensor(v[h], dtype=torch.float64) for v in values for h in plan.hyper]
        # SGD's velocity is kept multiplied by the optimizer's loss scaling
        hyper += [torch.tensor(base, dtype=torch.float64) for _ in plan.globals]
        self.state.hyper = hyper
        ga = o.Training.gradient_accumulation
        mean = (o.Training.accumulation_and_replication_reduction_type
                == enums.ReductionType.Mean)
        processes = o.Distributed.numProcesses
        replicas = self._replicas() * processes    # in all processes
        mean_factor = 1.0 / (ga * replicas) if mean else 1.0
        if mean and plan.running_mean:      # a running mean in each process, then summed
            grad_factor = 1.0 / processes
        else:
            grad_factor = mean_factor
        self.state.grad_scale = torch.tensor(grad_factor / ls if plan.loss_scaling
                                             else grad_factor)
        self.state.step_extra = ([torch.tensor(ls, dtype=torch.float32)]
                                 if compiled.capture.loss_scaling else [])
        self.state.combined_scale = (
            [opt_layout.combined_scale(plan, values[g], g, mean_factor, ls)
             for g in compiled.group_of] if plan.into_state else None)
        self._place()

    def _final_loss_scale(self, compiled, loss_scaling):
        """The loss scale the device uses: ``loss_scaling``, times the update
        factor of automatic loss scaling (kept across optimizer changes, as
        PopART keeps its factor tensor)."""
        als = compiled.auto_loss_scaling
        if not als:
            self.state.loss_scale = None
            return loss_scaling
        ls = self.state.loss_scale
        if ls is None:
            ls = self.state.loss_scale = LossScale(loss_scaling, 1.0, als.update_period)
        ls.loss_scaling = float(loss_scaling)
        return ls.final

    # -- state_dict(): the device's optimizer state, PopTorch's way -------------------------
    def read_device_state(self, compiled, optimizer):
        """``{"ipu_state": {name: tensor}, "ipu_param": {name: tensor}}``: the
        device's optimizer state as it holds it (stored types, SGD's velocity
        scaled), under PopART's names (``Accl___<param>``, ``Accl1___``,
        ``Accl2___``, ``Accl3___``, ``Step___``), and the hyperparameters."""
        c = compiled
        _log.info("Writing optimiser state tensors from IPU to host.")     # PopTorch's line
        params = dict(self.model.named_parameters())
        ipu_state = {}
        for n, (_, written), slots, step in zip(c.capture.trainable_names, c.slots,
                                                self.state.opt_state, self.state.steps):
            for s, v in zip(written, slots):
                v = unshard(v, params[n].shape) if n in c.shards else v
                ipu_state[s.ipu_name + n] = v.detach().to("cpu", copy=True)
            if n in self.grouped:       # a grouped weight's state: a value per group
                step = step.expand(params[n].shape[0])
            ipu_state["Step___" + n] = step.to("cpu", copy=True)
        ipu_param = self._popart_params(c, optimizer)
        if self.state.loss_scale is not None:
            ipu_state["lossScaleUpdateFactor"] = self.state.loss_scale.factor.to("cpu", copy=True)
        return {"ipu_state": ipu_state, "ipu_param": ipu_param}

    def optimizer_tensor_names(self, compiled, optimizer):
        """PopART's names of the optimizer's tensors (``ipu_param``'s keys)."""
        return list(self._popart_params(compiled, optimizer))

    def _popart_params(self, compiled, optimizer):
        """``ipu_param``: PopART's optimizer tensors (``learningRate___specific___fc.weight``,
        SGD's ``scaledLearningRate0___specific___...``, ``lossScaling_FLOAT``) with
        the values the device holds."""
        c, o = compiled, self.options
        n_h = len(c.plan.hyper)
        values = [dict(zip(c.plan.hyper, (float(v) for v in self.state.hyper[g * n_h:
                                                                            (g + 1) * n_h])))
                  for g in range(len(c.flags))]
        ls = self._device_loss_scale()
        reduction = (o.Training.gradient_accumulation,
                     self._replicas() * o.Distributed.numProcesses,
                     o.Training.accumulation_and_replication_reduction_type
                     == enums.ReductionType.Mean,
                     not c.plan.running_mean)
        settings = self._settings(optimizer)
        ipu_param = {}
        for n, grp in zip(c.capture.trainable_names, c.group_of):
            for prefix, value in opt_layout.popart_params(c.plan, settings, grp, values[grp],
                                                          ls, reduction):
                ipu_param[f"{prefix}specific___{n}"] = torch.tensor(value)
        ipu_param["lossScaling_FLOAT"] = torch.tensor(ls)
        return ipu_param

    def _device_loss_scale(self):
        """The optimizer's loss scaling as the device holds it (automatic loss
        scaling's factor apart: SGD's velocity is kept multiplied by this)."""
        if self.state.loss_scale is not None:
            return self.state.loss_scale.loss_scaling
        extra = self.state.step_extra
        return float(extra[0]) if extra else 1.0

    def write_device_state(self, compiled, optimizer):
        """The ``ipu_state`` that ``optimizer.load_state_dict`` was given, onto
        the device (entries it lacks keep their values, as in PopTorch).  The
        hyperparameters come from the optimizer's param_groups, which
        ``load_state_dict`` restored."""
        c = compiled
        _log.info("Writing optimiser state tensors from host to IPU memory.")
        saved = optimizer._state_dict.get("ipu_state") or {}
        for i, (n, (_, written)) in enumerate(zip(c.capture.trainable_names, c.slots)):
            for k, s in enumerate(written):
                v = saved.get(s.ipu_name + n)
                if not isinstance(v, torch.Tensor):
                    continue
                old = self.state.opt_state[i][k]
                dtype = old[0].dtype if n in c.shards else old.dtype
                v = v.detach().to(dtype).clone()
                self.state.opt_state[i][k] = shard(v, c.shards[n]) if n in c.shards else v
            step = saved.get("Step___" + n)
            if isinstance(step, torch.Tensor):
                step = step.reshape(-1)[0] if step.dim() else step     # a grouped weight's
                self.state.steps[i] = step.detach().float().clone()
        factor = saved.get("lossScaleUpdateFactor")
        if isinstance(factor, torch.Tensor) and self.state.loss_scale is not None:
            scale = self.state.loss_scale
            old = scale.final
            scale.factor = factor.detach().float().reshape(()).clone()
            scale.set_scale(self.state, old)
        optimizer.ipu_state_is_dirty = False
        self._place()

    def optimizer_state_to_host(self, compiled, optimizer):
        """Device -> host: torch's state of each parameter (``host_slot``;
        SGD1's combined tensor as ``velocity``)."""
        c = compiled
        params = dict(self.model.named_parameters())
        # the values the device holds (the optimizer's may have been changed since)
        n_h = len(c.plan.hyper)
        values = [dict(zip(c.plan.hyper, (float(v) for v in self.state.hyper[g * n_h:
                                                                            (g + 1) * n_h])))
                  for g in range(len(c.flags))]
        ls = self._device_loss_scale()
        for n, grp, (_, written), slots, step in zip(
                c.capture.trainable_names, c.group_of, c.slots, self.state.opt_state,
                self.state.steps):
            p = params[n]
            entry = optimizer.state[p]
            for s, v in zip(written, slots):
                v = unshard(v, p.shape) if n in c.shards else v
                key, value = opt_layout.host_slot(c.plan, s, v.cpu(), values[grp], grp, ls)
                entry[key] = value
            if c.plan.kind not in ("sgd", "sgd_combined"):
                entry["step"] = step.to("cpu", copy=True)

    def download_if_dirty(self, compiled):
        """Device -> host when the host's weights are out of date: True if
        they were copied.  On the CPU the trained weights are the model's own
        after every call (never dirty); on a CUDA host device they are copied
        when the model is read (``lazy_weights.py``) or here."""
        if not self.dirty or compiled is None:
            return False
        self.download(compiled, fresh=False)
        return True

    def download(self, compiled, fresh=True):
        """Device -> host: weights and buffers.  ``fresh``: look the host
        tensors up by name (the user may have replaced one); after a training
        call, those of the last upload."""
        cap = compiled.capture
        self.dirty = False              # first: reading the model below must not recurse
        if fresh or self._host_tensors is None:
            self._host_tensors = self._host(cap)
        host_params, host_buffers = self._host_tensors
        st = self.state
        with torch.no_grad():
            for i, (host, v) in enumerate(zip(host_params, st.params)):
                if not same_memory(host, v):
                    host.copy_(v)
                    if self.training and host.device == v.device:
                        st.params[i] = host.detach()
            for host, v in zip(host_buffers, st.buffers[0]):
                host.copy_(v)
        m = self.model
        m._poptorchsim_version = getattr(m, "_poptorchsim_version", 0) + 1
        self.uploaded_version = m._poptorchsim_version
