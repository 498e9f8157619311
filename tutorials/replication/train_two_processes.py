"""Data-parallel training in several processes, launched by poptorchsim.run.

Run it from the repository root (section 4 of README.md):

    python -m poptorchsim.run --num-instances 2 --num-replicas 4 \\
        tutorials/replication/train_two_processes.py --steps 4 --save weights.pt

The launcher (poprun's shape) starts 2 copies of this script.  Each one reads
its rank and the process count from OMPI_COMM_WORLD_RANK and
OMPI_COMM_WORLD_SIZE (``Options.Distributed``) and its number of local
replicas, 4 / 2 = 2, from POPDIST_NUM_LOCAL_REPLICAS.  ``poptorch.DataLoader``
gives each process its own contiguous slice of the data set, and the
gradients are reduced across all 4 replicas of both processes, so every
process holds the same weights after each step.

Without the launcher the script is one process with 1 replica, or with
POPDIST_NUM_LOCAL_REPLICAS=4 one process with 4 replicas.
"""
import argparse
import os

import torch

import poptorchsim as poptorch  # PopTorch programs say `import poptorch`
from mnist_mlp import ACCUMULATION, LR, MICRO_BATCH, MLP, training_set


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=4, help="weight updates (default 4)")
    parser.add_argument("--save", metavar="FILE", help="process 0 saves the weights here")
    args = parser.parse_args()

    opts = poptorch.Options().showCompilationProgressBar(False)
    opts.replicationFactor(int(os.environ.get("POPDIST_NUM_LOCAL_REPLICAS", "1")))
    opts.Training.gradientAccumulation(ACCUMULATION)
    rank, size = opts.Distributed.processId, opts.Distributed.numProcesses

    # All replicas of all processes: one weight update per step consumes
    # micro-batch x accumulation x replicas x processes samples.
    per_step = MICRO_BATCH * ACCUMULATION * opts.replication_factor * size
    dataset = training_set(args.steps * per_step)
    loader = poptorch.DataLoader(opts, dataset, batch_size=MICRO_BATCH)   # this process' slice

    torch.manual_seed(0)                # every process starts from the same weights
    model = MLP()
    training_model = poptorch.trainingModel(model, opts,
                                            poptorch.optim.Adam(model.parameters(), lr=LR))
    losses = [training_model(x, y)[1].mean().item() for x, y in loader]

    if rank == 0:
        print(f"process {rank} of {size}: {opts.replication_factor} local replica(s), "
              f"{len(losses)} steps of {per_step} samples, "
              f"loss {losses[0]:.3f} -> {losses[-1]:.3f}")
        rep = training_model.simulationReport()["replication"]
        print(f"simulationReport()['replication']: {rep['replicas']} replicas in "
              f"{rep['processes']} processes ({rep['replicas_per_process']} each) = "
              f"{rep['ipus']} IPUs")
        if args.save:
            torch.save(model.state_dict(), args.save)     # the trained weights
            print(f"process {rank} saved the weights to {args.save}")
    training_model.destroy()


if __name__ == "__main__":
    main()
