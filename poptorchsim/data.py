"""``poptorchsim.DataLoader``: a torch DataLoader that returns combined batches.

Each item holds ``batch_size * deviceIterations * (replicationFactor /
input_group_size) * gradientAccumulation`` samples: everything one call of
the model consumes.  ``drop_last`` is True by default, as in PopTorch.
"""
import logging

import torch

from .options import Options

logger = logging.getLogger("poptorchsim")


class DataLoader(torch.utils.data.DataLoader):
    """PopTorch's ``poptorch.DataLoader``."""

    def __init__(self, options, dataset, batch_size=1, shuffle=None, num_workers=0,
                 drop_last=True, persistent_workers=None,
                 auto_distributed_partitioning=True, mode=None, async_options=None,
                 rebatched_worker_size=None, batch_sampler=None, **kwargs):
        if not isinstance(options, Options):
            raise TypeError(f"Invalid type: 'options' is of type {type(options)} "
                            "(Expected poptorch.Options)")
        options._freeze()
        self._options = options
        o = options
        ga = o.Training.gradient_accumulation
        self._combine = o.device_iterations * (o.replication_factor // o.input_group_size) * ga
        if batch_sampler is not None:
            if batch_size != 1 or shuffle:
                raise ValueError("`batch_sampler` option is mutually exclusive with "
                                 "batch_size, shuffle.")
            self._combined = None
            super().__init__(dataset, batch_sampler=_Combine(batch_sampler, self._combine),
                             num_workers=num_workers, **kwargs)
            return
        if batch_size is None:
            if o.Distributed.numProcesses > 1 and auto_distributed_partitioning:
                raise ValueError(
                    "batch_size=None is not supported with distributed execution: the "
                    "DataLoader must know the combined batch to give each of the "
                    f"{o.Distributed.numProcesses} processes its part of the dataset. Pass a "
                    "batch_size, or auto_distributed_partitioning=False and split the data "
                    "yourself.")
            self._combined = None
            super().__init__(dataset, batch_size=None, shuffle=bool(shuffle),
                             num_workers=num_workers, **kwargs)
            return
        self._combined = batch_size * self._combine
        n = len(dataset) if hasattr(dataset, "__len__") else None
        if n == 0:
            raise ValueError("The Dataset is empty")
        processes = o.Distributed.numProcesses
        if processes > 1 and auto_distributed_partitioning and n is not None:
            kwargs["sampler"] = _process_slice(o, n, self._combined, bool(shuffle))
            shuffle = False
        if n is not None and not drop_last and n % self._combined:
            logger.warning(
                "The number of elements in the dataset (%d) is not divisible by the "
                "number of elements processed per step (%d) and drop_last=False. The "
                "last incomplete batch will fail the model's batch check.", n, self._combined)
        if persistent_workers is None:
            persistent_workers = num_workers > 0
        super().__init__(dataset, batch_size=self._combined, shuffle=bool(shuffle),
                         num_workers=num_workers, drop_last=drop_last,
                         persistent_workers=persistent_workers, **kwargs)

    @property
    def combinedBatchSize(self):
        """Samples per item: batch_size x deviceIterations x replicas x accumulation."""
        return self._combined

    @property
    def options(self):
        return self._options

    def terminate(self):
        """Nothing to stop: loading is synchronous."""


def _process_slice(options, n, combined, shuffle):
    """Process ``processId``'s contiguous part of the dataset: whole combined
    batches, the same number in every process."""
    d = options.Distributed
    per_process = combined * (n // (combined * d.numProcesses))
    if per_process == 0:
        raise ValueError(
            f"The dataset has {n} samples, fewer than one combined batch ({combined}) "
            f"for each of the {d.numProcesses} processes. Use a larger dataset or a "
            "smaller batch.")
    seed = options._values.get("random_seed")
    if shuffle:
        assert seed is not None, (
            "When using distributed execution with shuffle=True, the processes must agree "
            "on the order of the samples: set the same options.randomSeed(...) in every "
            "process.")
    return _ProcessSlice(n, per_process, d.processId, shuffle, seed)


class _ProcessSlice(torch.utils.data.Sampler):
    """Indices ``[p * per_process, (p + 1) * per_process)`` of the dataset, or
    of a permutation of it drawn from ``seed + epoch`` (the same in every
    process) when shuffling."""

    def __init__(self, n, per_process, process_id, shuffle, seed):
        self.n, self.per_process, self.process_id = n, per_process, process_id
        self.shuffle, self.seed, self.epoch = shuffle, seed, 0

    def __iter__(self):
        start = self.process_id * self.per_process
        if self.shuffle:
            g = torch.Generator().manual_seed(self.seed + self.epoch)
            order = torch.randperm(self.n, generator=g)[start:start + self.per_process]
        else:
            order = torch.arange(start, start + self.per_process)
        self.epoch += 1
        return iter(order.tolist())

    def __len__(self):
        return self.per_process


class _Combine(torch.utils.data.Sampler):
    """Concatenates ``n`` consecutive batches of a user's batch_sampler."""

    def __init__(self, batch_sampler, n):
        self.batch_sampler, self.n = batch_sampler, n

    def __iter__(self):
        pending = []
        for i, batch in enumerate(self.batch_sampler, 1):
            pending.extend(batch)
            if i % self.n == 0:
                yield pending
                pending = []

    def __len__(self):
        return len(self.batch_sampler) // self.n
