"""One process of ``python -m poptorchsim.run``: maps torch.distributed's
RANK and WORLD_SIZE onto the variables PopTorch programs read (Open MPI's,
which ``Options.Distributed`` reads, and poprun's POPDIST_*), then runs the
user's script as ``__main__``."""
import os
import runpy
import sys


def main():
    rank, size = os.environ["RANK"], os.environ["WORLD_SIZE"]
    os.environ["OMPI_COMM_WORLD_RANK"] = rank
    os.environ["OMPI_COMM_WORLD_SIZE"] = size
    os.environ["POPDIST_INSTANCE_INDEX"] = rank
    script, *args = sys.argv[1:]
    sys.argv = [script, *args]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
