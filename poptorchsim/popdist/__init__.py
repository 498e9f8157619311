"""PopDist's Python API (``import popdist``), answered from what
``python -m poptorchsim.run`` (poprun's shape) tells each process.

The launcher starts ``--num-instances`` processes; each one reads::

    POPDIST_NUM_INSTANCES       --num-instances          getNumInstances()
    POPDIST_INSTANCE_INDEX      this process's rank      getInstanceIndex()
    POPDIST_NUM_TOTAL_REPLICAS  --num-replicas           getNumTotalReplicas()
    POPDIST_NUM_LOCAL_REPLICAS  replicas / instances     getNumLocalReplicas()
    POPDIST_NUM_IPUS_PER_REPLICA  --ipus-per-replica     getNumIpusPerReplica()

Outside a launch (none of them set) a program is one instance holding every
replica: ``isPopdistEnvSet()`` is False, one instance, index 0, one local
replica.  ``init()`` joins the gloo process group that ``Options.Distributed``
uses (``poptorchsim.distributed``), so that a launch that went wrong fails
at once rather than at the first weight update.  ``popdist.poptorch.Options``
is ``poptorch.Options`` configured for this instance.

Used as ``import popdist`` when the program runs under
``python -m poptorchsim.run`` (``poptorchsim.distributed.aliases``), or as
``import poptorchsim.popdist as popdist``.
"""
import os

from ..errors import Error

NUM_INSTANCES = "POPDIST_NUM_INSTANCES"
INSTANCE_INDEX = "POPDIST_INSTANCE_INDEX"
NUM_TOTAL_REPLICAS = "POPDIST_NUM_TOTAL_REPLICAS"
NUM_LOCAL_REPLICAS = "POPDIST_NUM_LOCAL_REPLICAS"
NUM_IPUS_PER_REPLICA = "POPDIST_NUM_IPUS_PER_REPLICA"
LOCAL_INSTANCE_INDEX = "POPDIST_LOCAL_INSTANCE_INDEX"
_ENV = (NUM_INSTANCES, INSTANCE_INDEX, NUM_TOTAL_REPLICAS, NUM_LOCAL_REPLICAS)
LAUNCH = ("python -m poptorchsim.run --num-instances P --num-replicas R script.py [args]")

__all__ = ["init", "isPopdistEnvSet", "isUsingPoprun", "getNumInstances", "getInstanceIndex",
           "getLocalInstanceIndex", "getNumTotalReplicas", "getNumLocalReplicas",
           "getReplicaIndexOffset", "getNumIpusPerReplica", "checkNumIpusPerReplica",
           "getDeviceId", "execute_on_instances"]


def _int(var, default, minimum):
    """The whole number in environment variable ``var`` (``default`` when
    unset), at least ``minimum``."""
    text = os.environ.get(var)
    if text is None:
        return default
    try:
        value = int(text.strip())
    except ValueError:
        value = None
    if value is None or value < minimum:
        raise Error(f"popdist: {var}={text!r} is not a whole number of at least {minimum}. "
                    f"The launcher sets it ({LAUNCH}); unset it to run as one instance, or "
                    f"set it to a number such as {max(minimum, 1)}.")
    return value


def isPopdistEnvSet():
    """Whether this process was started by the launcher (poprun): the
    POPDIST_* variables that describe the instances are all set."""
    return all(var in os.environ for var in _ENV)


isUsingPoprun = isPopdistEnvSet


def getNumInstances():
    """The number of instances (processes) of the run; 1 outside a launch."""
    return _int(NUM_INSTANCES, 1, 1)


def getInstanceIndex():
    """This process's index in ``[0, getNumInstances())``; 0 outside a launch."""
    index, n = _int(INSTANCE_INDEX, 0, 0), getNumInstances()
    if index >= n:
        raise Error(f"popdist: {INSTANCE_INDEX}={index}, but there are only {n} instances "
                    f"({NUM_INSTANCES}={n}): an index runs from 0 to {n - 1}. The launcher "
                    f"sets both ({LAUNCH}); do not set them by hand.")
    return index


def getLocalInstanceIndex():
    """This process's index among the instances on its host.  The launcher
    starts every instance on this machine, so it is the instance index
    unless POPDIST_LOCAL_INSTANCE_INDEX says otherwise."""
    return _int(LOCAL_INSTANCE_INDEX, getInstanceIndex(), 0)


def getNumLocalReplicas():
    """The replicas this instance holds (its ``replicationFactor``); 1 when
    POPDIST_NUM_LOCAL_REPLICAS is unset."""
    return _int(NUM_LOCAL_REPLICAS, 1, 1)


def getNumTotalReplicas():
    """The replicas of all instances together (poprun's ``--num-replicas``).
    Every instance holds the same number, so it is local replicas times
    instances; a POPDIST_NUM_TOTAL_REPLICAS that disagrees is an error."""
    local, n = getNumLocalReplicas(), getNumInstances()
    total = _int(NUM_TOTAL_REPLICAS, local * n, 1)
    if total != local * n:
        raise Error(f"popdist: {NUM_TOTAL_REPLICAS}={total}, but {n} instances of "
                    f"{local} replicas each ({NUM_INSTANCES}, {NUM_LOCAL_REPLICAS}) make "
                    f"{local * n}: every instance holds the same number of replicas. Let "
                    f"the launcher set them ({LAUNCH}, R a multiple of P).")
    return total


def getReplicaIndexOffset():
    """The global index of this instance's first replica: instance ``i``
    holds replicas ``[i * local, (i + 1) * local)`` of ``getNumTotalReplicas()``."""
    getNumTotalReplicas()       # checks that the numbers agree
    return getInstanceIndex() * getNumLocalReplicas()


def getNumIpusPerReplica():
    """IPUs per replica (poprun's ``--ipus-per-replica``); 1 when unset."""
    return _int(NUM_IPUS_PER_REPLICA, 1, 1)


def checkNumIpusPerReplica(ipus_per_replica):
    """False when the launcher gave each replica a different number of IPUs
    than ``ipus_per_replica``; True when it agrees or did not say."""
    if NUM_IPUS_PER_REPLICA not in os.environ:
        return True
    return getNumIpusPerReplica() == ipus_per_replica


def getDeviceId(ipus_per_replica=0):
    """The id of the device that spans this instance's IPUs: its local
    replicas times ``ipus_per_replica`` of them (``getNumIpusPerReplica()``
    when 0), rounded up to a power of two as IPU devices are.

    Each instance sees its own partition, where devices are numbered as
    ``gc-info`` lists them: the n single IPUs first (0 to n-1), then the
    pairs, the groups of four, ...; the device spanning all n IPUs is the
    last, ``2n - 2``.  (The simulator does not select IPUs by id:
    ``useIpuId`` records it.)"""
    if not isinstance(ipus_per_replica, int) or ipus_per_replica < 0:
        raise Error(f"popdist.getDeviceId(ipus_per_replica={ipus_per_replica!r}): give a "
                    "whole number of IPUs per replica, or 0 for the launcher's "
                    f"({NUM_IPUS_PER_REPLICA}, 1 when unset).")
    ipus_per_replica = ipus_per_replica or getNumIpusPerReplica()
    if not checkNumIpusPerReplica(ipus_per_replica):
        raise Error(_ipus_disagree(ipus_per_replica))
    ipus = getNumLocalReplicas() * ipus_per_replica
    n = 1 << (ipus - 1).bit_length()
    return 2 * n - 2


def _ipus_disagree(ipus_per_replica):
    launched = getNumIpusPerReplica()
    return (f"popdist: the program asks for {ipus_per_replica} IPUs per replica, but the "
            f"launcher gave each replica {launched} ({NUM_IPUS_PER_REPLICA}={launched}). "
            f"Start it with python -m poptorchsim.run --ipus-per-replica {ipus_per_replica} "
            f"..., or ask for {launched}.")


def init():
    """Join the other instances: with more than one instance, the gloo
    process group of the launch (the one ``Options.Distributed`` trains
    with).  One instance has nothing to join.  Every instance must call it
    (Graphcore's applications do, when ``isPopdistEnvSet()``)."""
    n = getNumInstances()
    index = getInstanceIndex()
    getNumTotalReplicas()
    if n == 1:
        return
    missing = [v for v in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE")
               if v not in os.environ]
    if missing:
        raise Error(f"popdist.init(): {NUM_INSTANCES}={n} says this is one of {n} instances, "
                    f"but this process was not started by the launcher ({', '.join(missing)} "
                    f"not set), so there are no other instances to join. Run it with "
                    f"python -m poptorchsim.run --num-instances {n} --num-replicas "
                    f"{getNumTotalReplicas()} script.py [args], or unset the POPDIST_* "
                    "variables to run as one instance.")
    from ..distributed import process_group
    process_group(index, n)


def execute_on_instances(instances, fn, *args, **kwargs):
    """``fn(*args, **kwargs)`` on the instances whose index is in
    ``instances`` (a set of indices), its result there; None on the others,
    which do not wait for it.  Graphcore's applications save checkpoints
    this way: ``popdist.execute_on_instances({0}, save, model)``."""
    if not callable(fn):
        raise Error(f"popdist.execute_on_instances: fn must be callable, not "
                    f"{type(fn).__name__}. Call it as execute_on_instances({{0}}, fn, *args).")
    try:
        chosen = set(instances)
    except TypeError:
        chosen = None
    n = getNumInstances()
    bad = None if chosen is None else sorted(
        (i for i in chosen if not isinstance(i, int) or isinstance(i, bool)
         or not 0 <= i < n), key=repr)
    if chosen is None or bad:
        what = f"{instances!r} is not a set of indices" if chosen is None else \
            f"{', '.join(map(repr, bad))} " + \
            ("is not an instance" if len(bad) == 1 else "are not instances")
        raise Error(f"popdist.execute_on_instances: {what}: this run has {n} "
                    f"instance{'s' if n > 1 else ''}, indices 0 to {n - 1}. Pass a set such "
                    "as {0}.")
    if getInstanceIndex() in chosen:
        return fn(*args, **kwargs)
    return None
