"""``python -m poptorchsim.run``: run a PopTorch program as several processes.

The shape of Graphcore's ``poprun``::

    python -m poptorchsim.run --num-instances 2 --num-replicas 4 [--] train.py --epochs 1

(``python -m poptorchsim.run train.py --epochs 1``, with no launcher
option, runs the script in this process, as ``python train.py`` would,
with its imports aliased as below and no popdist environment;
``python -m poptorchsim.run -m pytest tests/x.py`` runs a module the same
way, as ``python -m pytest tests/x.py`` would) starts 2
processes through torch.distributed's launcher (a gloo process
group on this machine), each with 4 / 2 = 2 local replicas.  Each process
sees ``OMPI_COMM_WORLD_RANK``/``OMPI_COMM_WORLD_SIZE`` (read by
``poptorch.Options().Distributed``) and poprun's ``POPDIST_NUM_INSTANCES``,
``POPDIST_INSTANCE_INDEX``, ``POPDIST_NUM_TOTAL_REPLICAS`` and
``POPDIST_NUM_LOCAL_REPLICAS`` (and ``POPDIST_NUM_IPUS_PER_REPLICA`` with
``--ipus-per-replica``); a script sets its replication factor from the
last one, or through ``popdist.poptorch.Options()``.  ``import poptorch``
and ``import popdist`` in the script import poptorchsim and
``poptorchsim.popdist`` (``distributed/aliases.py``), so a PopTorch program
runs unchanged.  If a process fails, the others are stopped and the launcher
exits with 1, printing one line per failed process, the cause first.
"""
import argparse
import os
import sys


def parse(argv):
    p = argparse.ArgumentParser(
        prog="python -m poptorchsim.run",
        usage="%(prog)s [--num-instances P] [--num-replicas R] [--ipus-per-replica N] "
              "[--master-port PORT] [--device DEVICE] [--ipu-hardware IPUS] [--] script.py "
              "[args ...]\n"
              "       %(prog)s [--device DEVICE] [--ipu-hardware IPUS] -m module [args ...]",
        description="Run a PopTorch program as several processes sharing its replicas "
                    "(the shape of poprun).")
    p.add_argument("--num-instances", type=int, default=None, metavar="P",
                   help="processes to start (poprun's --num-instances; default 1). Without "
                        "--num-instances and --num-replicas the script runs in this "
                        "process, as `python script.py` would, outside any launch")
    p.add_argument("--num-replicas", type=int, default=None, metavar="R",
                   help="replicas in all processes together, a multiple of P "
                        "(default: one per process)")
    p.add_argument("--ipus-per-replica", type=int, default=None, metavar="N",
                   help="IPUs each replica spans, read by popdist.getNumIpusPerReplica() "
                        "and popdist.poptorch.Options (default: unset, which reads as 1)")
    p.add_argument("--master-port", type=int, default=None, metavar="PORT",
                   help="TCP port on localhost for the processes to meet "
                        "(default: a free one)")
    p.add_argument("--device", default=None, metavar="DEVICE",
                   help="the host device the simulator computes on: cpu (the default) or "
                        "cuda (cuda:N); sets POPTORCHSIM_DEVICE for the program")
    p.add_argument("--ipu-hardware", default=None, metavar="IPUS",
                   help="report the simulated IPUs as hardware: on (64 IPUs) or a number "
                        "of IPUs, for programs that run only where "
                        "poptorch.ipuHardwareIsAvailable() is True; their models then "
                        "follow PopTorch's rules for hardware (sets "
                        "POPTORCHSIM_IPU_HARDWARE for the program)")
    p.add_argument("script", help="the Python program to run; the words after it are "
                                  "its arguments, passed on unchanged")
    p.add_argument("-m", dest="module", action="store_true",
                   help="run the library module SCRIPT as a script (python -m module), "
                        "in this process, e.g. -m pytest tests/")
    options, rest = _split(argv)
    args = p.parse_args(options + rest[:1])
    args.args = rest[1:]
    if args.device is not None:
        from .errors import Error
        from .machine.host_device import parse_device
        try:
            parse_device(args.device, "--device")
        except Error as e:
            p.error(str(e))
    if args.ipu_hardware is not None:
        from .errors import Error
        from .estimate.targets import parse_hardware
        try:
            if parse_hardware(args.ipu_hardware, "--ipu-hardware ") is None:
                p.error(f"--ipu-hardware {args.ipu_hardware} reports no hardware: use on "
                        "or a number of IPUs (or leave the option out)")
        except Error as e:
            p.error(str(e))
    if args.module:
        others = [o for o in _without_in_process(options) if o != "-m"]
        if others:
            p.error("-m runs a module in this process: it takes no launcher option "
                    f"but --device and --ipu-hardware (got {' '.join(others)})")
        args.here = True
        return args
    args.here = args.num_instances is None and args.num_replicas is None \
        and args.ipus_per_replica is None and args.master_port is None
    if args.num_instances is None:
        args.num_instances = 1
    if args.num_instances < 1:
        p.error(f"--num-instances must be at least 1 (got {args.num_instances})")
    if args.num_replicas is None:
        args.num_replicas = args.num_instances
    if args.num_replicas < 1 or args.num_replicas % args.num_instances:
        p.error(f"--num-replicas ({args.num_replicas}) must be a positive multiple of "
                f"--num-instances ({args.num_instances}): each process holds the same "
                f"number of replicas. Try --num-replicas "
                f"{max(1, args.num_replicas // args.num_instances + 1) * args.num_instances}.")
    if args.ipus_per_replica is not None and args.ipus_per_replica < 1:
        p.error(f"--ipus-per-replica must be at least 1 (got {args.ipus_per_replica})")
    if args.master_port is not None and not 0 < args.master_port < 65536:
        p.error(f"--master-port must be between 1 and 65535 (got {args.master_port})")
    if not os.path.isfile(args.script):
        p.error(f"no such script: {args.script}")
    return args


_IN_PROCESS = ("--device", "--ipu-hardware")     # options that also apply in this process


def _without_in_process(options):
    """The launcher's options less ``--device``, ``--ipu-hardware`` and their values."""
    out, skip = [], False
    for o in options:
        if skip:
            skip = False
        elif o in _IN_PROCESS:
            skip = True
        elif not o.startswith(tuple(f"{name}=" for name in _IN_PROCESS)):
            out.append(o)
    return out


def _split(argv):
    """(the launcher's options, [script, its arguments...]): the script is
    the first word that is not an option or an option's value; a ``--``
    just before it is dropped, and everything after it is the script's."""
    i = 0
    while i < len(argv) and argv[i].startswith("-") and argv[i] != "--":
        i += 1 if "=" in argv[i] or argv[i] in ("-h", "--help", "-m") else 2
    i = min(i, len(argv))
    rest = argv[i:]
    if rest[:1] == ["--"]:
        rest = rest[1:]
    return argv[:i], rest


def main(argv=None):
    args = parse(sys.argv[1:] if argv is None else list(argv))
    if args.device is not None:     # the program's processes compute there
        os.environ["POPTORCHSIM_DEVICE"] = args.device
    if args.ipu_hardware is not None:   # ... and see the simulated IPUs as hardware
        from .estimate.targets import HARDWARE_ENV
        os.environ[HARDWARE_ENV] = args.ipu_hardware
    if args.here:       # no launch: this process runs the script, its imports aliased
        from .distributed._worker import run_here
        return run_here(args.script, args.args, module=args.module)
    from .distributed.launch import launch
    return launch(args.script, args.args, args.num_instances, args.num_replicas,
                  master_port=args.master_port, ipus_per_replica=args.ipus_per_replica)


if __name__ == "__main__":
    sys.exit(main())
