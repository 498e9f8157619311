"""One process of ``python -m poptorchsim.run``: maps torch.distributed's
RANK and WORLD_SIZE onto the variables PopTorch programs read (Open MPI's,
which ``Options.Distributed`` reads, and poprun's POPDIST_*), then runs the
user's script as ``__main__``, with ``import poptorch``, ``import popdist``
(and ``import popart``, where poptorchsim has it) answered by poptorchsim
unless a real package of that name is installed (``aliases.py``).

An exception is recorded for the launcher (torch's ``record``), which prints
its first line in the run's summary.  When another process fails the
launcher stops this one with SIGTERM; this process takes up to
``GRACE_S`` seconds more to exit, so that an error it is raising at that
moment (typically "Replica process N of P stopped responding ...") is
recorded rather than cut off.
"""
import atexit
import os
import runpy
import shutil
import signal
import stat
import sys
import tempfile
import threading
import time

from . import aliases, torch_compat

GRACE_S = 3.0
STOPPED = 128 + signal.SIGTERM     # the exit code after the grace period
ALIAS_DIR = "POPTORCHSIM_ALIAS_DIR"  # set by launch.py


def set_environment(env=os.environ):
    rank, size = env["RANK"], env["WORLD_SIZE"]
    env["OMPI_COMM_WORLD_RANK"] = rank
    env["OMPI_COMM_WORLD_SIZE"] = size
    env["POPDIST_INSTANCE_INDEX"] = rank
    env.setdefault("POPDIST_NUM_INSTANCES", size)
    env.setdefault("POPDIST_NUM_LOCAL_REPLICAS", "1")
    env.setdefault("POPDIST_NUM_TOTAL_REPLICAS",
                   str(int(env["POPDIST_NUM_LOCAL_REPLICAS"]) * int(size)))


def _exit_late_on_sigterm(grace_s=GRACE_S):
    """SIGTERM ends the process ``grace_s`` later (or sooner, if it exits by
    itself).  Call before any other thread starts: they inherit the mask."""
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})

    def wait():
        signal.sigwait({signal.SIGTERM})
        time.sleep(grace_s)
        os._exit(STOPPED)

    threading.Thread(target=wait, name="poptorchsim-sigterm", daemon=True).start()


def _alias_directory(names):
    """Where this process writes the modules that alias ``names`` in the
    processes it starts: under the launcher's directory (it removes it at
    the end of the run); started by hand, in a directory of this user's that
    later runs reuse (a process stopped abruptly cannot remove its own)."""
    base = os.environ.get(ALIAS_DIR)
    if base:
        return os.path.join(base, f"process{os.environ['RANK']}")
    mine = os.path.join(tempfile.gettempdir(), f"poptorchsim-aliases-{os.getuid()}")
    try:
        os.makedirs(mine, mode=0o700, exist_ok=True)
        st = os.lstat(mine)
        if stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid() and not st.st_mode & 0o077:
            return os.path.join(mine, "+".join(sorted(names)) or "none")
    except OSError:
        pass
    directory = tempfile.mkdtemp(prefix="poptorchsim-aliases-")     # not safely ours
    atexit.register(shutil.rmtree, directory, ignore_errors=True)
    return directory


def main(argv=None):
    script, *args = sys.argv[1:] if argv is None else argv
    _exit_late_on_sigterm()
    from torch.distributed.elastic.multiprocessing.errors import record

    set_environment()
    sys.argv = [script, *args]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    installed = aliases.install()       # import poptorch, popdist -> poptorchsim
    torch_compat.install()              # PyTorch as PopTorch's programs call it
    # ... and in processes the script starts
    installed.export(_alias_directory(installed.aliased))
    if os.environ["RANK"] == "0":
        for note in installed.notes():
            print(note, file=sys.stderr)
    record(runpy.run_path)(script, run_name="__main__")


def run_here(script, args, module=False):
    """``script args`` in this process, as ``python script args`` runs it
    (with ``module``, ``script`` is a module run as ``python -m script
    args``), with ``import poptorch``, ``import popdist`` (and ``import
    popart``) answered by poptorchsim, here and in the processes it starts;
    outside any launch (popdist answers as one instance).  Returns the
    exit status the script gives ``SystemExit`` (0 when it ends without
    one, as pytest's ``main`` does not); other exceptions propagate."""
    sys.argv = [script, *args]
    sys.path.insert(0, os.getcwd() if module else os.path.dirname(os.path.abspath(script)))
    installed = aliases.install()
    torch_compat.install()
    installed.export(_alias_directory(installed.aliased))
    for note in installed.notes():
        print(note, file=sys.stderr)
    try:
        if module:
            runpy.run_module(script, run_name="__main__", alter_sys=True)
        else:
            runpy.run_path(script, run_name="__main__")
    except SystemExit as stop:
        if stop.code is None or isinstance(stop.code, int):
            return stop.code or 0
        raise
    return 0


if __name__ == "__main__":
    main()
