"""Replicas in several processes: the gloo process group behind
``Options.Distributed``.

``python -m poptorchsim.run`` starts the processes (see ``launch.py``); each
one compiles the same program for its local replicas.  The runtime asks this
layer for three things: a process group, the sum of every process's
gradients each weight update, and process 0's weights at the start.  A
process that dies makes the others fail here with an ``Error`` that says so,
instead of waiting forever.
"""
import atexit
import datetime
import os
import re

import torch
import torch.distributed as dist

from ..errors import Error

LAUNCH_HINT = ("Start the program with the launcher, one process per instance: "
               "python -m poptorchsim.run --num-instances P --num-replicas R script.py")
TIMEOUT_S = 60


class ProcessGroup:
    """This process's place among ``num_processes`` (gloo)."""

    def __init__(self, process_id, num_processes, timeout_s=TIMEOUT_S):
        missing = [v for v in ("MASTER_ADDR", "MASTER_PORT") if v not in os.environ]
        if missing:
            raise Error(
                f"Options.Distributed says this is process {process_id} of {num_processes}, "
                f"but {' and '.join(missing)} {'is' if len(missing) == 1 else 'are'} not "
                f"set, so there is no process group to join. {LAUNCH_HINT}")
        if not dist.is_initialized():
            dist.init_process_group("gloo", rank=process_id, world_size=num_processes,
                                    timeout=datetime.timedelta(seconds=timeout_s))
            atexit.register(_leave)
        if (dist.get_rank(), dist.get_world_size()) != (process_id, num_processes):
            raise Error(
                f"Options.Distributed says process {process_id} of {num_processes}, but the "
                f"process group has this process as {dist.get_rank()} of "
                f"{dist.get_world_size()}. Leave Options.Distributed to read "
                "OMPI_COMM_WORLD_RANK/SIZE, which the launcher sets.")
        self.process_id, self.num_processes = process_id, num_processes

    def all_reduce_sum(self, tensors):
        """The element-wise sum over all processes of each tensor (one message)."""
        flat = _flatten(tensors)
        self._collective(dist.all_reduce, flat, "gradient all-reduce")
        return _unflatten(flat, tensors)

    def broadcast_from_first(self, tensors):
        """Process 0's values of ``tensors``, in every process."""
        if not tensors:
            return tensors
        flat = _flatten(tensors)
        self._collective(lambda t: dist.broadcast(t, 0), flat, "weight broadcast")
        return _unflatten(flat, tensors)

    def _collective(self, fn, tensor, what):
        try:
            fn(tensor)
        except RuntimeError as e:   # gloo: a peer closed its connection or timed out
            text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            # gloo prefixes its source location and appends generic advice
            cause = re.sub(r"^\[[^\]]*\]\s*", "", text).split(". This is typically")[0]
            raise Error(
                f"Process {self.process_id} of {self.num_processes}: another replica process "
                f"stopped responding during the {what} (gloo: {cause}). The processes of a "
                "distributed run step together, so this one stops too; look at the other "
                "processes' output for the first error.") from None


def _flatten(tensors):
    """One buffer for one message (float64 when dtypes mix: exact for ints < 2**53)."""
    dtypes = {t.dtype for t in tensors}
    common = dtypes.pop() if len(dtypes) == 1 else torch.float64
    return torch.cat([t.detach().reshape(-1).to(common) for t in tensors])


def _unflatten(flat, like):
    out, start = [], 0
    for t in like:
        n = t.numel()
        out.append(flat[start:start + n].view(t.shape).to(t.dtype))
        start += n
    return out


def _leave():
    """Leave the group before the interpreter exits (gloo's threads otherwise
    abort the process at shutdown)."""
    if dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception:    # noqa: BLE001 - exiting anyway
            pass


_GROUP = None


def process_group(process_id, num_processes):
    """The process group of this run, joined once."""
    global _GROUP
    if _GROUP is None:
        _GROUP = ProcessGroup(process_id, num_processes)
    return _GROUP
