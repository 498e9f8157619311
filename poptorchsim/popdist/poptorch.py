"""``popdist.poptorch``: PopTorch options configured by the launcher.

``popdist.poptorch.Options()`` is a ``poptorch.Options`` already set for
this instance, as PopDist's is: ``replicationFactor`` is this instance's
local replicas, ``Distributed`` holds the instance index and count, and
``useIpuId`` the device spanning this instance's IPUs.  The launcher owns
those, so setting them again raises (PopTorch's texts: "Cannot call
`replicationFactor` with popdist.poptorch.Options"), saying what to change
instead.  Everything else (``deviceIterations``, ``Training``, ...) is set
as on ``poptorch.Options``.
"""
from .. import popdist as _popdist
from ..errors import Error
from ..options import Options as _Options
from ..options import _DistributedOptions

__all__ = ["Options", "initialize_poptorch_options", "PopdistOptionsError"]


class PopdistOptionsError(Error, RuntimeError):
    """A setting that the launcher owns, set on ``popdist.poptorch.Options``.

    PopDist raises ``RuntimeError`` here, so this class is both."""


_WHY = {
    "useIpuId": "the launcher picks the device: the one spanning this instance's IPUs "
                "(popdist.getDeviceId()). Leave it as it is",
    "replicationFactor": "the launcher gives this instance {local} of the {total} replicas "
                         "(--num-replicas {total} over --num-instances {n}). Change "
                         "--num-replicas to change it",
    "Distributed.disable": "this is instance {index} of {n}, as the launcher started it. To run "
                           "one instance, launch with --num-instances 1, or use "
                           "poptorch.Options()",
    "Distributed.setEnvVarNames": "the launcher sets the instance index and count. Leave "
                                  "them as they are",
    "Distributed.configureProcessId": "this is instance {index} of {n}, as the launcher "
                                      "started it. Leave it as it is, or use "
                                      "poptorch.Options() to configure it yourself",
}


def _blocked(name):
    why = _WHY[name].format(local=_popdist.getNumLocalReplicas(),
                            total=_popdist.getNumTotalReplicas(),
                            n=_popdist.getNumInstances(), index=_popdist.getInstanceIndex())
    if not _popdist.isPopdistEnvSet():
        why += (" (outside a launch, one instance holding one replica; start the program "
                "with python -m poptorchsim.run, or use poptorch.Options() to set it "
                "yourself)")
    return PopdistOptionsError(f"Cannot call `{name}` with popdist.poptorch.Options: {why}.")


class _LaunchedDistributedOptions(_DistributedOptions):
    """``Options.Distributed`` of an instance the launcher started: its index
    and count are the launcher's."""

    def __init__(self, process_id, num_processes):
        super(_DistributedOptions, self).__init__(num_distributed_processes=num_processes,
                                                  distributed_process_id=process_id)

    def setEnvVarNames(self, var_num_processes, var_process_id):
        raise _blocked("Distributed.setEnvVarNames")

    def configureProcessId(self, process_id, num_processes=None):
        raise _blocked("Distributed.configureProcessId")

    def disable(self):
        raise _blocked("Distributed.disable")


def initialize_poptorch_options(options, ipus_per_replica=None):
    """Set ``options`` (a ``poptorch.Options``) for this instance: its local
    replicas, its index among the instances and its device; ``options``."""
    if not isinstance(options, _Options):
        raise Error(f"popdist.poptorch.initialize_poptorch_options: expected a "
                    f"poptorch.Options, got {type(options).__name__}. Pass "
                    "poptorch.Options(), or use popdist.poptorch.Options().")
    if ipus_per_replica is None:
        ipus_per_replica = _popdist.getNumIpusPerReplica()
    if not isinstance(ipus_per_replica, int) or isinstance(ipus_per_replica, bool) \
            or ipus_per_replica < 1:
        raise Error(f"popdist.poptorch.Options(ipus_per_replica={ipus_per_replica!r}): give "
                    "a whole number of IPUs per replica, at least 1 (each pipeline stage "
                    "on its own IPU: the number of stages).")
    if not _popdist.checkNumIpusPerReplica(ipus_per_replica):
        raise Error(_popdist._ipus_disagree(ipus_per_replica))
    _popdist.getNumTotalReplicas()      # the launcher's numbers agree
    _Options.replicationFactor(options, _popdist.getNumLocalReplicas())
    index, n = _popdist.getInstanceIndex(), _popdist.getNumInstances()
    _DistributedOptions.configureProcessId(options.Distributed, index, n)
    _Options.useIpuId(options, _popdist.getDeviceId(ipus_per_replica))
    return options


class Options(_Options):
    """``poptorch.Options`` for this instance of a launch (PopDist's
    ``popdist.poptorch.Options``).

    >>> opts = popdist.poptorch.Options(ipus_per_replica=2)
    >>> opts.replication_factor == popdist.getNumLocalReplicas()
    True
    """

    def __init__(self, ipus_per_replica=None):
        super().__init__()
        initialize_poptorch_options(self, ipus_per_replica)
        object.__setattr__(self, "_distributed", _LaunchedDistributedOptions(
            self.Distributed.processId, self.Distributed.numProcesses))

    def useIpuId(self, ipu_id):
        raise _blocked("useIpuId")

    def replicationFactor(self, replication_factor):
        raise _blocked("replicationFactor")
