"""Start the processes of a distributed run with torch.distributed's elastic
launcher (what ``torchrun`` uses), on this machine.

Each process runs ``python -m poptorchsim.distributed._worker script args``
with torchrun's RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT, plus poprun's
POPDIST_NUM_INSTANCES, POPDIST_NUM_TOTAL_REPLICAS and
POPDIST_NUM_LOCAL_REPLICAS (and POPDIST_NUM_IPUS_PER_REPLICA when given);
the worker adds the rest.  If one process fails
the launcher stops the others; ``launch`` then returns 1 and prints one line
per failed process, the cause first.
"""
import logging
import os
import shutil
import signal
import socket
import sys
import tempfile
import uuid

from . import PEER_LOST


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(script, args, num_instances, num_replicas, master_port=None, out=sys.stderr,
           ipus_per_replica=None):
    """Run ``script args`` as ``num_instances`` processes holding
    ``num_replicas`` replicas in all; the exit code for the launcher."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    _quiet_torch_elastic()
    os.environ.update({
        "POPDIST_NUM_INSTANCES": str(num_instances),
        "POPDIST_NUM_TOTAL_REPLICAS": str(num_replicas),
        "POPDIST_NUM_LOCAL_REPLICAS": str(num_replicas // num_instances),
    })
    if ipus_per_replica is not None:
        os.environ["POPDIST_NUM_IPUS_PER_REPLICA"] = str(ipus_per_replica)
    os.environ.setdefault("OMP_NUM_THREADS", "1")   # P processes share the cores
    port = master_port or free_port()
    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=num_instances,
                          run_id=str(uuid.uuid4()), rdzv_backend="static",
                          rdzv_endpoint=f"127.0.0.1:{port}",
                          rdzv_configs={"rank": 0, "timeout": 60}, max_restarts=0,
                          monitor_interval=0.1)
    from ._worker import ALIAS_DIR
    os.environ[ALIAS_DIR] = tempfile.mkdtemp(prefix="poptorchsim-aliases-")
    try:
        elastic_launch(config, sys.executable)(
            "-u", "-m", "poptorchsim.distributed._worker", script, *args)
    except ChildFailedError as e:
        for line in summarize(e.failures, num_instances):
            print(line, file=out)
        return 1
    finally:
        shutil.rmtree(os.environ.pop(ALIAS_DIR), ignore_errors=True)
    return 0


def summarize(failures, num_instances):
    """One line per failed process ({rank: torch ProcessFailure}): first those
    that failed by themselves, then those that lost a peer, then those the
    launcher stopped."""
    rows = []
    for rank, f in failures.items():
        why, kind = _why(f)
        rows.append((kind, f.timestamp, rank, why))
    rows.sort()
    lines = []
    for i, (_, _, rank, why) in enumerate(rows):
        head = "poptorchsim.run: " if i == 0 else "poptorchsim.run:   then "
        lines.append(f"{head}process {rank} of {num_instances} failed: {why}")
    return lines


def _why(failure):
    """(a one-line cause, 0 failed by itself / 1 lost a peer / 2 stopped)."""
    from ._worker import STOPPED
    code = failure.exitcode
    message = failure.message
    if isinstance(message, dict):
        message = message.get("message", "")
    recorded = isinstance(failure.error_file_data, dict) and \
        failure.error_file_data.get("message") not in (None, "<NONE>")
    if recorded and isinstance(message, str) and message.strip():
        first = message.strip().splitlines()[0]
        first = first if len(first) <= 400 else first[:397] + "..."
        return first, 1 if PEER_LOST in first else 0
    if code in (STOPPED, -signal.SIGTERM):
        return "stopped by the launcher (SIGTERM) when another process failed", 2
    if code is not None and code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"killed by {name}", 0
    return f"exit code {code}, with no Python exception (it exited or was killed)", 0


def _quiet_torch_elastic():
    """torch's launcher logs each failure as a long ERROR record; the summary
    says it in one line."""
    for name in list(logging.Logger.manager.loggerDict):
        if name.startswith("torch.distributed.elastic") or \
                name.startswith("torch.distributed.launcher"):
            logging.getLogger(name).setLevel(logging.CRITICAL)

