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
        processes = o.Distributed.numProcesses
        partition = processes > 1 and auto_distributed_partitioning
        if partition and isinstance(dataset, torch.utils.data.IterableDataset):
            raise AssertionError(
                "auto_distributed_partitioning not supported for IterableDataset: pass "
                "auto_distributed_partitioning=False and give each process its own "
                "samples (Options.Distributed.processId says which process this is).")
        if batch_size is None:
            if partition:
                raise AssertionError(
                    "batch_size=None not allowed when using auto_distributed_partitioning. "
                    "Each of the processes takes whole combined batches of the dataset: "
                    "pass a batch_size, or auto_distributed_partitioning=False and give each "
                    "process its part yourself.")
            self._combined = None
            super().__init__(dataset, batch_size=None, shuffle=bool(shuffle),
                             num_workers=num_workers, **kwargs)
            return
        self._combined = batch_size * self._combine
        n = len(dataset) if hasattr(dataset, "__len__") else None
        if n == 0:
            raise ValueError("The Dataset is empty")
        step = self._combined * (processes if partition else 1)
        if n is not None and not drop_last and n % step:
            logger.warning(
                "The number of elements in the dataset (%d) is not divisible by the "
                "number of elements processed per step (%d) and drop_last=False. The "
                "last incomplete batch will fail the model's batch check.", n, step)
        if partition and n is not None:
            if "sampler" in kwargs:
                raise ValueError(
                    "A sampler cannot be combined with auto_distributed_partitioning=True: "
                    "the DataLoader already gives each process its own part of the dataset. "
                    "Pass auto_distributed_partitioning=False and let your sampler choose "
                    "each process's samples.")
            kwargs["sampler"] = _process_part(o, n, self._combined, bool(shuffle), drop_last)
            shuffle = False
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


def _process_part(options, n, combined, shuffle, drop_last):
    """The sampler of process ``processId``: PopTorch's partition of a dataset
    of ``n`` samples among the processes.

    With ``drop_last`` each process gets ``per_process = combined * (n //
    (combined * processes))`` consecutive samples, process p those from
    ``p * per_process``, so every process runs the same number of steps;
    without it the samples are split as evenly as they go.  With ``shuffle``
    the indices are those of one permutation of the whole dataset, the same in
    every process, drawn again each epoch from a generator seeded once with
    ``options.randomSeed``; every other epoch the slices start ``n % per_process``
    further on, so that the samples left over get their turn (PopTorch's rules).
    """
    d = options.Distributed
    if shuffle:
        assert options.exists("random_seed"), (
            "When using auto_distributed_partitioning you must set "
            "poptorch.Options.randomSeed() to ensure that tensors are in the same order "
            "in all processes.")
    if drop_last:
        per_process = combined * (n // (combined * d.numProcesses))
        if per_process == 0:
            raise ValueError(
                f"The dataset has {n} samples, fewer than one combined batch ({combined}) "
                f"for each of the {d.numProcesses} processes. Use a larger dataset or a "
                "smaller batch.")
        start, length, leftover = d.processId * per_process, per_process, n % per_process
    else:
        sizes = [n // d.numProcesses + (p < n % d.numProcesses)
                 for p in range(d.numProcesses)]
        start, length, leftover = sum(sizes[:d.processId]), sizes[d.processId], 0
    seed = options.random_seed if shuffle else None
    return _ProcessPart(n, start, length, leftover, seed)


class _ProcessPart(torch.utils.data.Sampler):
    """Indices ``[start, start + length)`` of the dataset or, with a seed, of a
    permutation of it redrawn at each epoch (each ``iter``)."""

    def __init__(self, n, start, length, leftover, seed=None):
        self.n, self.start, self.length, self.leftover = n, start, length, leftover
        self.offset = start
        self.generator = None
        if seed is not None:
            self.generator = torch.Generator().manual_seed(seed)

    def __iter__(self):
        if self.generator is None:
            return iter(range(self.start, self.start + self.length))
        order = torch.randperm(self.n, generator=self.generator)
        # alternate between two windows so that leftovers are used too
        self.offset = self.start + self.leftover if self.offset == self.start else self.start
        return iter(order[self.offset:self.offset + self.length].tolist())

    def __len__(self):
        return self.length


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
