"""The device copy of a model's weights, buffers and optimizer state, and
its transfers to and from the host model (PopTorch's ``copyWeightsToDevice``
and ``copyWeightsToHost``).

A training model's device weights live in the host parameters' memory: the
update writes them in place, so nothing is copied back after a call.  The
optimizer state is held as the compiled update graph reads it (one list of
slots per trainable parameter, sharded where the program shards it); the
hyperparameters are float64 device scalars, so a new learning rate needs no
recompilation.
"""
import torch

from .. import enums
from ..capture import optimizers as opt_rules
from ..machine.engine import shard, unshard
from .host_memory import keep_freed_memory


class DeviceState:
    """The device copy of everything a training program reads and writes."""
    n_trainable = 0
    params = buffers = opt_state = steps = hyper = None
    grad_scale = None


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

    def _replicas(self):
        o = self.options
        return o.replication_factor // o.input_group_size

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
        st.params = [p.detach() if self.training else p.detach().clone() for p in host_params]
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

    def upload_buffers(self, compiled, names):
        """Host -> device: the buffers ``names`` alone, on every replica
        (``copyNamedBuffersToDevice``); weights, other buffers and the
        optimizer state stay as the device has them."""
        order = compiled.capture.buffer_names
        host = dict(self.model.named_buffers())
        for name in names:
            value = host[name].detach()
            for replica in self.state.buffers:
                replica[order.index(name)] = value.clone()

    def load_optimizer_state(self, compiled, optimizer):
        c = compiled
        st = self.state
        params = dict(self.model.named_parameters())
        state_names, _, _ = opt_rules.RULES[c.optimizer_kind]
        st.opt_state, st.steps = [], []
        for n in c.capture.trainable_names:
            p = params[n]
            torch_state = optimizer.state.get(p, {})
            slots = []
            for s in state_names:
                v = torch_state.get(s)
                slots.append(v.detach().clone().float() if isinstance(v, torch.Tensor)
                             else torch.zeros_like(p.detach()))
            step = torch_state.get("step")
            if step is None:
                step = 1.0 if "momentum_buffer" in torch_state and \
                    torch_state["momentum_buffer"] is not None else 0.0
            if n in c.shards:       # each replica holds its shard
                slots = [shard(v, c.shards[n]) for v in slots]
            st.opt_state.append(slots)
            st.steps.append(torch.tensor(float(step), dtype=torch.float32))
        self.load_hyperparameters(compiled, optimizer)

    def load_hyperparameters(self, compiled, optimizer):
        o = self.options
        hyper = []
        for group in optimizer.param_groups:
            values, _ = opt_rules.group_settings(compiled.optimizer_kind, group)
            hyper += [torch.tensor(values[h], dtype=torch.float64)
                      for h in opt_rules.RULES[compiled.optimizer_kind][1]]
        self.state.hyper = hyper
        ga = o.Training.gradient_accumulation
        mean = (o.Training.accumulation_and_replication_reduction_type
                == enums.ReductionType.Mean)
        replicas = self._replicas() * o.Distributed.numProcesses    # in all processes
        self.state.grad_scale = torch.tensor(1.0 / (ga * replicas) if mean else 1.0)

    def download(self, compiled, fresh=True):
        """Device -> host: weights and buffers.  ``fresh``: look the host
        tensors up by name (the user may have replaced one); after a training
        call, those of the last upload."""
        cap = compiled.capture
        if fresh or self._host_tensors is None:
            self._host_tensors = self._host(cap)
        host_params, host_buffers = self._host_tensors
        st = self.state
        with torch.no_grad():
            for i, (host, v) in enumerate(zip(host_params, st.params)):
                if not same_memory(host, v):
                    host.copy_(v)
                    if self.training:
                        st.params[i] = host.detach()
            for host, v in zip(host_buffers, st.buffers[0]):
                host.copy_(v)
        m = self.model
        m._poptorchsim_version = getattr(m, "_poptorchsim_version", 0) + 1
        self.uploaded_version = m._poptorchsim_version

    def optimizer_state_to_host(self, compiled, optimizer):
        c = compiled
        params = dict(self.model.named_parameters())
        state_names, _, _ = opt_rules.RULES[c.optimizer_kind]
        for n, slots, step in zip(c.capture.trainable_names, self.state.opt_state,
                                  self.state.steps):
            entry = optimizer.state[params[n]]
            for s, v in zip(state_names, slots):
                entry[s] = (unshard(v, params[n].shape) if n in c.shards else v).clone()
            if c.optimizer_kind != "sgd":
                entry["step"] = step.clone()
