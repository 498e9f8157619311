"""Replicas in several processes: the gloo process group behind
``Options.Distributed``.

``python -m poptorchsim.run`` starts the processes (``launch.py``); each one
compiles the same program for its local replicas.  The runtime asks this
layer for three things: a process group, the sum of every process's
gradients at each weight update, and process 0's weights at the start.  A
process that dies makes the others fail here within moments, with an
``Error`` that names it, instead of waiting forever.
"""
import atexit
import datetime
import os
import re
import socket
import time
import zlib

import torch
import torch.distributed as dist

from ..errors import Error

TIMEOUT_S = 60          # a live peer that does not join a collective for this long
PEER_LOST = "stopped responding"    # in every message about a lost peer (launch.py looks)
_LAUNCHER_ENV = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE")


def launch_hint(num_processes=2):
    return (f"run it with python -m poptorchsim.run --num-instances {num_processes} "
            "--num-replicas R script.py [args], which starts the processes and their "
            "process group")


class ProcessGroup:
    """This process's place among ``num_processes`` (gloo), joined from the
    variables the launcher sets: MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE."""

    def __init__(self, process_id, num_processes, timeout_s=TIMEOUT_S):
        missing = [v for v in _LAUNCHER_ENV if v not in os.environ]
        if missing and not dist.is_initialized():
            raise Error(
                f"Options.Distributed says this is process {process_id} of {num_processes}, "
                f"but there is no process group to join ({', '.join(missing)} not set): "
                f"{launch_hint(num_processes)}. For one process, leave "
                "OMPI_COMM_WORLD_SIZE unset or call opts.Distributed.disable().")
        if not dist.is_initialized():
            rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
            if (rank, size) != (process_id, num_processes):
                raise Error(self._disagree(process_id, num_processes, rank, size))
            dist.init_process_group("gloo", init_method="env://", rank=rank,
                                    world_size=size,
                                    timeout=datetime.timedelta(seconds=timeout_s))
            atexit.register(_leave)
        rank, size = dist.get_rank(), dist.get_world_size()
        if (rank, size) != (process_id, num_processes):
            raise Error(self._disagree(process_id, num_processes, rank, size))
        self.process_id, self.num_processes = process_id, num_processes
        # who is who, to name a peer that dies: (pid, host) of every process
        me = torch.tensor([os.getpid(), _host_id()], dtype=torch.int64)
        everyone = [torch.empty_like(me) for _ in range(size)]
        self._collective(lambda t: dist.all_gather(everyone, t), me, "start-up")
        self._peers = [(int(t[0]), int(t[1])) for t in everyone]

    @staticmethod
    def _disagree(process_id, num_processes, rank, size):
        return (f"Options.Distributed says process {process_id} of {num_processes}, but the "
                f"launcher made this process {rank} of {size} (RANK/WORLD_SIZE). Leave "
                "Options.Distributed to read OMPI_COMM_WORLD_RANK/SIZE, which "
                "python -m poptorchsim.run sets, or configure the same numbers.")

    def all_reduce_sum(self, tensors):
        """The element-wise sum over all processes of each tensor: one
        flattened buffer, one all-reduce."""
        if not tensors:
            return tensors
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
        except RuntimeError as e:   # gloo: a peer closed its connection, or timed out
            raise Error(self._peer_lost_message(what, _gloo_cause(e))) from None

    def _peer_lost_message(self, what, cause):
        me, n = self.process_id, self.num_processes
        dead = self._dead_peers()
        if dead:
            who = (f"Replica process {dead[0]}" if len(dead) == 1 else
                   "Replica processes " + ", ".join(map(str, dead[:-1])) + f" and {dead[-1]}")
            look = f"Look at the output of process {dead[0]} for why it stopped."
        else:
            who = f"A replica process other than this one ({me})"
            look = "Look at the other processes' output for the first error."
        return (f"{who} of {n} {PEER_LOST} during the {what} (gloo: {cause}). The other "
                f"processes stop too: each weight update needs the gradients of all {n} "
                f"processes, so process {me} cannot go on. {look}")

    def _dead_peers(self, wait_s=1.0):
        """Peers on this machine whose process has ended (a closed connection
        arrives while the peer is still exiting, so look for up to ``wait_s``)."""
        peers = getattr(self, "_peers", None)
        if not peers:       # failed while learning who is who
            return [1 - self.process_id] if self.num_processes == 2 else []
        host = _host_id()
        local = [r for r, (pid, h) in enumerate(peers) if r != self.process_id and h == host]
        deadline = time.monotonic() + wait_s
        while True:
            dead = [r for r in local if not _alive(peers[r][0])]
            if dead or time.monotonic() > deadline:
                break
            time.sleep(0.02)
        if not dead and self.num_processes == 2 and len(local) == 0:
            dead = [1 - self.process_id]    # the only peer, on another machine
        return dead


def _gloo_cause(e):
    """gloo's message without its source location and generic advice."""
    text = str(e).strip()
    first = text.splitlines()[0] if text else type(e).__name__
    first = re.sub(r"^\[[^\]]*\]\s*", "", first)
    return first.split(". This is typically")[0].strip()


def _host_id():
    return zlib.crc32(socket.gethostname().encode()) & 0x7FFFFFFF


def _alive(pid):
    """Whether process ``pid`` still runs (a zombie has ended)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except FileNotFoundError:
        return False
    except OSError:
        pass
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


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
    """The process group of this run, joined once per process."""
    global _GROUP
    if _GROUP is None:
        _GROUP = ProcessGroup(process_id, num_processes)
    elif (_GROUP.process_id, _GROUP.num_processes) != (process_id, num_processes):
        raise Error(ProcessGroup._disagree(process_id, num_processes, _GROUP.process_id,
                                           _GROUP.num_processes))
    return _GROUP
