"""Replica-grouped weights and input groups: which replicas hold which value.

PopTorch's ``replicaGrouping`` (called on a weight through the wrapped model,
``poptorch_model.W.replicaGrouping(CommGroupType.Orthogonal, 2,
VariableRetrievalMode.OnePerGroup)``) gives groups of replicas their own
value of that weight.  The host tensor holds one value per group along its
first dimension; every replica computes with its group's row, so the
program is traced with the shape of one row.  The gradients of a grouped
weight are reduced within its group (summed into that group's row, scaled
by the mean over all replicas as the other gradients are), and each group
runs the optimizer update on its own row and optimizer state
(``machine/replica_groups.py``).  With ``OnePerGroup`` and ``AllReplicas``
alike the host tensor keeps a row per group: the replicas of a group hold
the same value.

``Options.inputReplicaGrouping(k, type)`` gives groups of ``k`` replicas the
same input: every replica still runs, and returns its own outputs, as on the
IPU; replica ``r`` reads the inputs of its input group (``input_rows``).

Group layouts (``CommGroupType``, N replicas, ``shards`` replicas a group):
``All`` one group; ``Consecutive`` replica r in group r // shards;
``Orthogonal`` replica r in group r % (N / shards); ``NoGrouping`` a group
per replica."""
import contextlib
from typing import NamedTuple

import torch

from ... import enums
from ...errors import Error


class ReplicaGrouping(NamedTuple):
    """One weight's ``replicaGrouping`` call: the tuple PopTorch keeps in
    ``PoplarExecutor.per_replica_params``."""
    comm_group_type: enums.CommGroupType
    shards: int
    retrieval_mode: enums.VariableRetrievalMode

    def count(self, replicas: int) -> int:
        """How many values (groups) the weight has over ``replicas``."""
        if self.comm_group_type == enums.CommGroupType.All:
            return 1
        if self.comm_group_type == enums.CommGroupType.NoGrouping:
            return replicas
        return replicas // self.shards

    def groups(self, replicas: int) -> list:
        """The group (row of the host tensor) each replica computes with."""
        return layout(self.comm_group_type, self.shards, replicas)


def layout(comm_group_type, size, replicas):
    """The group of each of ``replicas`` replicas under ``comm_group_type``
    with ``size`` replicas a group."""
    if comm_group_type == enums.CommGroupType.All:
        return [0] * replicas
    if comm_group_type == enums.CommGroupType.NoGrouping:
        return list(range(replicas))
    if comm_group_type == enums.CommGroupType.Consecutive:
        return [r // size for r in range(replicas)]
    count = replicas // size
    return [r % count for r in range(replicas)]


def input_rows(options):
    """The inputs' replica row each replica reads (``inputReplicaGrouping``),
    or None where every replica has its own."""
    k = options.input_group_size
    if k <= 1:
        return None
    return layout(options.input_cgt, k, options.replication_factor)


def make(comm_group_type, shards, variable_retrieval_mode):
    """A checked ``ReplicaGrouping`` of ``replicaGrouping``'s arguments."""
    try:
        cgt = enums.CommGroupType(comm_group_type)
        mode = enums.VariableRetrievalMode(variable_retrieval_mode)
    except ValueError as exc:
        raise Error(f"replicaGrouping: {exc}. Pass a poptorch.CommGroupType and a "
                    "poptorch.VariableRetrievalMode.") from None
    if isinstance(shards, bool) or not isinstance(shards, int):
        raise Error(f"replicaGrouping: shards must be an int (the number of replicas in "
                    f"each group), got {type(shards).__name__}.")
    return ReplicaGrouping(cgt, shards, mode)


def check(name, param, grouping, replicas, processes=1):
    """``grouping`` of parameter ``name`` is one the program can hold: the
    group size divides the replicas and the host tensor has a row per
    group."""
    if param.dim() == 0:
        raise Error("Scalars cannot be passed as per-replica weight tensor values")
    if processes > 1:
        raise Error(f"replicaGrouping of {name}: poptorchsim groups the replicas of one "
                    "process only; run with Options.Distributed.numProcesses 1.")
    cgt, shards = grouping.comm_group_type, grouping.shards
    if cgt in (enums.CommGroupType.Consecutive, enums.CommGroupType.Orthogonal) and (
            shards < 1 or replicas % shards):
        raise Error(f"replicaGrouping of {name}: {shards} replicas a group do not divide "
                    f"the {replicas} replicas (Options.replicationFactor). Choose a group "
                    "size that divides the replication factor.")
    count = grouping.count(replicas)
    if param.shape[0] != count:
        raise Error(
            f"replicaGrouping of {name}: the weight's first dimension holds one value per "
            f"replica group, and {cgt.name} groups of {shards} over {replicas} replicas make "
            f"{count} group(s), but {name} has shape {list(param.shape)}. Give it shape "
            f"[{count}, {', '.join(str(s) for s in param.shape[1:])}], each row one group's "
            "value.")


def checked(groupings, model, replicas, processes=1):
    """{parameter name: groups per replica} of the recorded groupings,
    each checked; {} where there are none."""
    if not groupings:
        return {}
    params = dict(model.named_parameters())
    out = {}
    for name, grouping in groupings.items():
        check(name, params[name], grouping, replicas, processes)
        out[name] = grouping.groups(replicas)
    return out


@contextlib.contextmanager
def one_row_each(model, names):
    """While compiling: the grouped parameters hold one group's row (the
    shape every replica computes with), as PopTorch traces them; the same
    parameter objects, so the optimizer still finds them."""
    params = dict(model.named_parameters())
    whole = {n: params[n].data for n in names}
    try:
        for n in names:
            params[n].data = whole[n][0]
        yield
    finally:
        for n in names:
            params[n].data = whole[n]


class GroupedParameter:
    """What ``poptorch_model.W`` gives where ``W`` is a parameter of the
    wrapped model, as PopTorch's wrapper gives: the parameter's attributes,
    and ``replicaGrouping`` recorded for this wrapper (a model wrapped twice
    can be grouped differently in each).  Torch functions take it as the
    parameter."""

    def __init__(self, executor, name, param):
        self._executor, self._name, self._param = executor, name, param

    def replicaGrouping(self, comm_group_type, shards, variable_retrieval_mode):
        """Gives groups of replicas their own value of this weight (see the
        module's text); before the model is compiled."""
        grouping = make(comm_group_type, shards, variable_retrieval_mode)
        if self._executor._compiled is not None:
            raise Error(f"replicaGrouping of {self._name} after the model was compiled: "
                        "call it before the first call (or compile()), or destroy() the "
                        "model first.")
        self._executor.per_replica_params[self._name] = grouping

    def __getattr__(self, attr):
        return getattr(self._param, attr)

    def __repr__(self):
        return repr(self._param)

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        def unwrap(x):
            return x._param if isinstance(x, GroupedParameter) else x
        args = torch.utils._pytree.tree_map(unwrap, args)
        kwargs = torch.utils._pytree.tree_map(unwrap, kwargs or {})
        return func(*args, **kwargs)


def for_compile(groupings, model, options, config):
    """{parameter name: group per replica} of ``groupings`` for a compile
    under ``config`` (a ``CompileConfig``), checked; {} where there are none."""
    if not groupings:
        return {}
    if config.running_mean:
        raise Error("replicaGrouping with MeanReductionStrategy.Running: poptorchsim sums "
                    "grouped weights' gradients per group; use MeanReductionStrategy.Post.")
    return checked(groupings, model, options.replication_factor,
                   options.Distributed.numProcesses)


def engine_groups(compiled, by_name):
    """``Engine.weight_groups``: the grouped parameters by their index in the
    step's parameter inputs."""
    if by_name and compiled.shards:
        raise Error("replicaGrouping with replicated tensor sharding of the optimizer "
                    "state is not modelled: turn sharding off with "
                    "TensorLocationSettings().useReplicatedTensorSharding(False).")
    names = compiled.capture.param_names
    return {names.index(n): rows for n, rows in by_name.items()}


def check_buffer_broadcast(compiled, model, options):
    """A replicated training model that changes a buffer in forward() (other
    than a norm's running statistics) needs ``broadcastBuffers(False)``, as
    PopTorch says: its replicas' buffers would part."""
    if options.replication_factor <= 1 or not options.broadcast_buffers:
        return
    step = compiled.program.graphs["training_step"]
    names = compiled.capture.buffer_names
    inputs = {t.id for t in step.inputs if t.role == "buffer"}
    norm_stats = {f"{m}.{b}" if m else b
                  for m, mod in model.named_modules()
                  if isinstance(mod, torch.nn.modules.batchnorm._NormBase)
                  for b, _ in mod.named_buffers(recurse=False)}
    end = len(step.outputs) - step.statistics_outputs
    outs = step.outputs[end - len(names):end] if names else []
    if any(t.id not in inputs and n not in norm_stats for n, t in zip(names, outs)):
        raise Error(
            "PopTorch does not support broadcasting buffers. If your model is able "
            "to tolerate buffers becoming out of sync between replicas, you can "
            "disable buffer broadcasting using "
            "poptorch.Options.broadcastBuffers(False).")


def _delegate(name):
    def method(self, *args, **kwargs):
        return getattr(self._param, name)(*args, **kwargs)
    method.__name__ = name
    return method


# operators and containers act on the parameter itself (beyond PopTorch's wrapper,
# which only forwards attributes): ``pt.W * 2``, ``pt.W[0]``, ``len(pt.W)``
for _name in ("__add__", "__radd__", "__sub__", "__rsub__", "__mul__", "__rmul__",
              "__truediv__", "__rtruediv__", "__matmul__", "__rmatmul__", "__pow__", "__neg__",
              "__abs__", "__eq__", "__ne__", "__lt__", "__le__", "__gt__", "__ge__",
              "__getitem__", "__len__", "__iter__", "__array__", "__float__", "__bool__",
              "__format__"):
    setattr(GroupedParameter, _name, _delegate(_name))
GroupedParameter.__hash__ = lambda self: hash(self._param)
