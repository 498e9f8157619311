"""``python -m poptorchsim.run``: run a PopTorch program as several processes.

The shape of Graphcore's ``poprun``::

    python -m poptorchsim.run --num-instances 2 --num-replicas 4 train.py --epochs 1

starts 2 processes through torch.distributed's launcher (a gloo process
group on this machine), each with 4 / 2 = 2 local replicas.  Each process
sees ``OMPI_COMM_WORLD_RANK``/``OMPI_COMM_WORLD_SIZE`` (read by
``poptorch.Options().Distributed``) and poprun's ``POPDIST_NUM_INSTANCES``,
``POPDIST_INSTANCE_INDEX``, ``POPDIST_NUM_TOTAL_REPLICAS`` and
``POPDIST_NUM_LOCAL_REPLICAS``; a script sets its replication factor from
the last one.  If a process fails, the others are stopped and the launcher
exits non-zero naming the process that failed first.
"""
import argparse
import logging
import os
import sys
import uuid


def parse(argv):
    p = argparse.ArgumentParser(
        prog="python -m poptorchsim.run",
        description="Run a PopTorch program as several processes sharing its replicas.")
    p.add_argument("--num-instances", type=int, default=1,
                   help="processes to start (poprun's --num-instances)")
    p.add_argument("--num-replicas", type=int, default=None,
                   help="replicas in all processes together (default: one per process)")
    p.add_argument("script", help="the Python program to run")
    p.add_argument("args", nargs=argparse.REMAINDER, help="its arguments")
    args = p.parse_args(argv)
    if args.num_instances < 1:
        p.error(f"--num-instances must be at least 1 (got {args.num_instances})")
    if args.num_replicas is None:
        args.num_replicas = args.num_instances
    if args.num_replicas < 1 or args.num_replicas % args.num_instances:
        p.error(f"--num-replicas ({args.num_replicas}) must be a positive multiple of "
                f"--num-instances ({args.num_instances}): each process holds the same "
                "number of replicas")
    if not os.path.isfile(args.script):
        p.error(f"no such script: {args.script}")
    if args.args and args.args[0] == "--":
        args.args = args.args[1:]
    return args


def main(argv=None):
    args = parse(sys.argv[1:] if argv is None else argv)
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    logging.getLogger("torch.distributed.elastic").setLevel(logging.ERROR)
    os.environ.update({
        "POPDIST_NUM_INSTANCES": str(args.num_instances),
        "POPDIST_NUM_TOTAL_REPLICAS": str(args.num_replicas),
        "POPDIST_NUM_LOCAL_REPLICAS": str(args.num_replicas // args.num_instances),
    })
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=args.num_instances,
                          run_id=str(uuid.uuid4()), rdzv_backend="c10d",
                          rdzv_endpoint="localhost:0", max_restarts=0, monitor_interval=0.2,
                          start_method="spawn")
    try:
        elastic_launch(config, sys.executable)(
            "-m", "poptorchsim.distributed._worker", args.script, *args.args)
    except ChildFailedError as e:
        rank, failure = e.get_first_failure()
        code = failure.exitcode
        others = len(e.failures) - 1
        print(f"poptorchsim.run: process {rank} of {args.num_instances} failed first "
              f"(exit code {code}); "
              + (f"{others} other process(es) stopped too. " if others else "")
              + "Its own output above says why.", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
