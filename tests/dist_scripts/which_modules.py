"""Prints, as JSON, which modules a PopTorch program's imports give it:
run by tests/test_popdist.py under ``python -m poptorchsim.run`` to check
that ``import poptorch`` and ``import popdist`` (and their submodules)
resolve to poptorchsim, also in a DataLoader's worker process, and that a
real installed package is left alone.

    python which_modules.py OUT
"""
import json
import sys

import popdist
import popdist.poptorch
import poptorch
import poptorch.optim
import torch
from poptorch import DataLoader
from poptorch.enums import DataLoaderMode


class Numbers(torch.utils.data.Dataset):
    def __len__(self):
        return 8

    def __getitem__(self, i):
        return torch.tensor([float(i)])


def async_sum():
    """The sum of an asynchronous DataLoader's batches: its worker process
    (multiprocessing's forkserver) imports this script, ``import poptorch``
    included."""
    loader = DataLoader(poptorch.Options(), Numbers(), batch_size=2, num_workers=1,
                        mode=DataLoaderMode.Async)
    return sum(float(b.sum()) for b in loader)


def main():
    import poptorchsim
    import poptorchsim.popdist
    found = {
        "poptorch": poptorch.__name__,
        "poptorch_is_poptorchsim": poptorch is poptorchsim,
        "poptorch.optim": poptorch.optim.__name__,
        "DataLoader": DataLoader is poptorchsim.DataLoader,
        "DataLoaderMode": DataLoaderMode is poptorchsim.enums.DataLoaderMode,
        "popdist": popdist.__name__,
        "popdist_file": popdist.__file__,
        "popdist_is_ours": popdist is poptorchsim.popdist,
        "popdist.poptorch": popdist.poptorch.__name__,
        "instances": popdist.getNumInstances(),
        "ipus_per_replica": popdist.getNumIpusPerReplica(),
        "popdist_env": popdist.isPopdistEnvSet(),
        "async_sum": async_sum(),
        "modules": sorted(m for m in sys.modules
                          if m.split(".")[0] in ("poptorch", "popdist", "popart")),
    }
    with open(sys.argv[1], "w") as f:
        json.dump(found, f)


if __name__ == "__main__":
    main()
