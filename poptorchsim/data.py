"""``poptorchsim.DataLoader``: a torch DataLoader that returns combined batches.

Each item holds ``batch_size * deviceIterations * (replicationFactor /
input_group_size) * gradientAccumulation`` samples: everything one call of
the model consumes.  ``drop_last`` is True by default, as in PopTorch.

``AsynchronousDataAccessor`` loads the items in a worker process
(``_api/data_worker.py``) ahead of the model; ``DataLoader(mode=DataLoaderMode.Async)``
uses one, and ``AsyncRebatched`` lets the worker read smaller batches and
join them into combined batches.
"""
import atexit
import logging
import warnings
import weakref

import torch
import torch.utils._pytree as pytree

from ._api.data_worker import Worker
from .enums import DataLoaderMode, SharingStrategy
from .errors import Error
from .options import Options

logger = logging.getLogger("poptorchsim")


class DataLoader(torch.utils.data.DataLoader):
    """PopTorch's ``poptorch.DataLoader``."""

    def __init__(self, options, dataset, batch_size=1, shuffle=None, num_workers=0,
                 drop_last=True, persistent_workers=None,
                 auto_distributed_partitioning=True, mode=DataLoaderMode.Sync,
                 async_options=None, rebatched_worker_size=None, batch_sampler=None,
                 **kwargs):
        if not isinstance(options, Options):
            raise TypeError(f"Invalid type: 'options' is of type {type(options)} "
                            "(Expected poptorch.Options)")
        mode = _check_mode(mode, async_options, rebatched_worker_size)
        options._freeze()
        self._options = options
        self._accessor = None
        o = options
        ga = o.Training.gradient_accumulation
        # PopTorch's attribute names: applications read _combined_batch_size
        self._num_batches_to_combine = (o.device_iterations * ga
                                        * (o.replication_factor // o.input_group_size))
        if batch_sampler is not None:
            if batch_size != 1 or shuffle:
                raise ValueError("`batch_sampler` option is mutually exclusive with "
                                 "batch_size, shuffle.")
            # PopTorch's rule: the sampler's batch_size (1 if it has none)
            # times the batches combined per call
            batch_size = getattr(batch_sampler, "batch_size", batch_size)
            self._combined_batch_size = (None if batch_size is None
                                         else batch_size * self._num_batches_to_combine)
            self.batch_sampler_drop_last = drop_last
            # each of the sampler's batches collated on its own (a collate_fn
            # may pad it), then combined (PopTorch's combined_batch_generator)
            self._is_user_batch_sampler_set = True
            super().__init__(dataset, batch_sampler=batch_sampler, num_workers=num_workers,
                             **kwargs)
            self._start_async(mode, async_options, None)
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
            self._combined_batch_size = None
            super().__init__(dataset, batch_size=None, shuffle=bool(shuffle),
                             num_workers=num_workers, **kwargs)
            self._start_async(mode, async_options, None)
            return
        self._combined_batch_size = batch_size * self._num_batches_to_combine
        # Async with drop_last=False rebatches too: the worker then returns
        # the last, smaller batch itself (PopTorch's rule)
        rebatched = mode == DataLoaderMode.AsyncRebatched or (
            mode == DataLoaderMode.Async and not drop_last and self._combined_batch_size > 1)
        n = len(dataset) if hasattr(dataset, "__len__") else None
        if n == 0:
            raise ValueError("The Dataset is empty")
        step = self._combined_batch_size * (processes if partition else 1)
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
            kwargs["sampler"] = _process_part(o, n, self._combined_batch_size, bool(shuffle),
                                              drop_last)
            shuffle = False
        if persistent_workers is None:
            persistent_workers = num_workers > 0
        loader_batch, loader_drop_last = self._combined_batch_size, drop_last
        if rebatched:
            self.rebatched_drop_last = drop_last
            loader_batch, loader_drop_last = self._combined_batch_size, False
            if rebatched_worker_size is not None:
                assert rebatched_worker_size <= self._combined_batch_size, (
                    f"The rebatched_worker_size ({rebatched_worker_size}) must be <= to "
                    f"the combined batch size ({self._combined_batch_size})")
                loader_batch = rebatched_worker_size
        super().__init__(dataset, batch_size=loader_batch, shuffle=bool(shuffle),
                         num_workers=num_workers, drop_last=loader_drop_last,
                         persistent_workers=persistent_workers, **kwargs)
        self._start_async(mode, async_options,
                          self._combined_batch_size if rebatched else None)

    def _start_async(self, mode, async_options, rebatched_size):
        """Async modes: an ``AsynchronousDataAccessor`` over this loader."""
        if mode == DataLoaderMode.Sync:
            return
        async_options = dict(async_options or {})
        assert "rebatched_size" not in async_options, (
            "You cannot use DataLoaderMode.AsyncRebatched and manually specify the "
            "rebatched_size in async_options")
        self._accessor = AsynchronousDataAccessor(self, **async_options,
                                                  rebatched_size=rebatched_size)

    def __len__(self):
        accessor = self.__dict__.get("_accessor")
        if self.__dict__.get("_is_user_batch_sampler_set"):
            whole, rest = divmod(super().__len__(), self._num_batches_to_combine)
            return whole + (1 if rest and not self.batch_sampler_drop_last else 0)
        if accessor is None or not accessor.rebatched_size:
            return super().__len__()
        n = len(self.dataset)
        length = n // accessor.rebatched_size
        if not self.rebatched_drop_last and n % accessor.rebatched_size:
            length += 1
        return length

    def __iter__(self):
        accessor = self.__dict__.get("_accessor")
        if accessor is not None:
            return iter(accessor)
        n = self._num_batches_to_combine
        if self.__dict__.get("_is_user_batch_sampler_set") and n > 1:
            return _combined(super().__iter__(), n, self.batch_sampler_drop_last)
        return super().__iter__()

    @property
    def combinedBatchSize(self):
        """Samples per item: batch_size x deviceIterations x replicas x accumulation."""
        return self._combined_batch_size

    @property
    def options(self):
        return self._options

    def terminate(self):
        """Stops the worker process of an async mode; nothing to do otherwise."""
        accessor = self.__dict__.get("_accessor")
        if accessor is not None:
            accessor.terminate()

    def __del__(self):
        self.terminate()


def _check_mode(mode, async_options, rebatched_worker_size):
    if mode is None:
        mode = DataLoaderMode.Sync
    if not isinstance(mode, DataLoaderMode):
        raise Error(f"mode must be a poptorch.DataLoaderMode (Sync, Async or "
                    f"AsyncRebatched), got {mode!r}")
    if mode == DataLoaderMode.Sync and async_options:
        logger.warning("DataLoader: async_options %s have no effect with "
                       "DataLoaderMode.Sync: pass mode=DataLoaderMode.Async to load "
                       "in a worker process.", async_options)
    if mode == DataLoaderMode.Sync and rebatched_worker_size is not None:
        logger.warning("DataLoader: rebatched_worker_size=%d has no effect with "
                       "DataLoaderMode.Sync: it applies to DataLoaderMode.AsyncRebatched.",
                       rebatched_worker_size)
    return mode


def _sharing_strategy(value):
    """PopTorch compares ``sharing_strategy`` with the enum's members and
    spawns with shared memory when none is equal: a member's name as a
    string (a YAML config's ``sharing_strategy: "SharedMemory"``, as
    Graphcore's Conformer passes it) runs as ``SharedMemory``.  Any other
    value is refused, naming the members."""
    if isinstance(value, SharingStrategy):
        return value
    if isinstance(value, str) and value in SharingStrategy.__members__:
        if value != "SharedMemory":
            warnings.warn(f"sharing_strategy={value!r} is a string: PopTorch compares it with "
                          f"poptorch.SharingStrategy's members, none is equal, so it runs as "
                          f"SharedMemory. Pass poptorch.SharingStrategy.{value} for {value}.",
                          stacklevel=3)
        return SharingStrategy.SharedMemory
    raise Error(f"sharing_strategy must be a poptorch.SharingStrategy (one of "
                f"{', '.join(SharingStrategy.__members__)}), got {value!r}")


class AsynchronousDataAccessor:
    """Loads ``dataset``'s items in a worker process, up to ``buffer_size``
    ahead of the consumer (PopTorch's ``poptorch.AsynchronousDataAccessor``).

    ``dataset``: any iterable, usually a ``poptorchsim.DataLoader``.  The
    items' tensors arrive in shared memory.  ``load_indefinitely``: the
    worker starts the next epoch as soon as one ends; ``early_preload``: it
    fills the buffer before the first ``iter()``.  ``sharing_strategy`` is
    how the worker process gets the dataset (``Fork``, ``ForkServer``,
    ``SharedMemory``: pickled to a spawned process, ``FileSystem``: through
    a file).  ``rebatched_size``: the worker joins (or cuts) the dataset's
    batches into batches of that many samples.
    """

    def __init__(self, dataset, buffer_size=3, miss_sleep_time_in_ms=0.1,
                 load_indefinitely=True, early_preload=False,
                 sharing_strategy=SharingStrategy.ForkServer, rebatched_size=None):
        self._worker = None
        if isinstance(dataset, DataLoader) and dataset.__dict__.get("_accessor") is not None:
            raise Error("The DataLoader already uses an AsynchronousDataAccessor internally. "
                        "Either use the existing one or set "
                        "mode='poptorch.DataLoaderMode.Sync' in the DataLoader.")
        if isinstance(dataset, DataLoader) and not dataset.drop_last \
                and not dataset.__dict__.get("_is_user_batch_sampler_set") \
                and dataset.combinedBatchSize not in (None, 1) and rebatched_size is None:
            raise AssertionError("The 'drop_last=False' option from the DataLoader only works "
                                 "if 'rebatched_size' is specified too.")
        if rebatched_size is not None:
            assert rebatched_size > 1, "rebatched_size must be None or greater than 1"
        if not isinstance(buffer_size, int) or buffer_size < 1:
            raise Error(f"buffer_size must be a positive integer, got {buffer_size!r}")
        sharing_strategy = _sharing_strategy(sharing_strategy)
        self._dataset = dataset
        self.rebatched_size = rebatched_size
        self._epoch, self._started, self._used, self._eof = 0, False, False, False
        self._worker = Worker(dataset, buffer_size, miss_sleep_time_in_ms, load_indefinitely,
                              early_preload, sharing_strategy, rebatched_size,
                              getattr(dataset, "rebatched_drop_last", True))
        # stop the worker at exit even if the accessor is still referenced
        atexit.register(_terminate_ref, weakref.ref(self))

    def terminate(self):
        """Stops the worker process."""
        if self._worker is not None:
            self._worker.terminate()
            self._worker = None

    def __del__(self):
        self.terminate()

    def __len__(self):
        length = len(self._dataset)
        if self.rebatched_size and getattr(self._dataset, "_accessor", None) is not self:
            samples = length * (getattr(self._dataset, "batch_size", 1) or 1)
            length = samples // self.rebatched_size
        return length

    def __iter__(self):
        if self._worker is None:
            raise Error("The AsynchronousDataAccessor was terminated: create a new one "
                        "to load data again.")
        if self._used or self._eof:
            # an epoch was (partly) consumed: the worker moves to the next one,
            # restarting the dataset's iterator unless it already has
            self._epoch += 1
            self._worker.start(self._epoch)
        elif not self._started:
            self._worker.start(self._epoch)
        self._started, self._used, self._eof = True, False, False
        return self

    def __next__(self):
        if self._worker is None:
            raise Error("The AsynchronousDataAccessor was terminated: create a new one "
                        "to load data again.")
        if self._eof:
            raise StopIteration
        while True:
            message = self._worker.next_message()
            kind = message[1]
            if kind == "error":
                self.terminate()
                raise Error(message[2])
            if message[0] != self._epoch:
                continue                   # an abandoned epoch's item
            if kind == "eof":
                self._eof = True
                raise StopIteration
            self._used = True
            return message[2]


def _terminate_ref(ref):
    accessor = ref()
    if accessor is not None:
        accessor.terminate()


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

    def __getstate__(self):
        # the generator's state as bytes: torch.multiprocessing would hand its
        # state tensor to an asynchronous worker through shared memory, which
        # failed to map there ("unable to resize file ... Invalid argument")
        state = dict(self.__dict__)
        if self.generator is not None:
            state["generator"] = bytes(self.generator.get_state().numpy())
        return state

    def __setstate__(self, state):
        generator = state.get("generator")
        if isinstance(generator, bytes):
            state["generator"] = torch.Generator()
            state["generator"].set_state(torch.frombuffer(bytearray(generator),
                                                          dtype=torch.uint8))
        self.__dict__.update(state)


def _combined(batches, n, drop_last):
    """``n`` consecutive collated batches at a time, each tensor of them
    concatenated along dim 0 (tuples, lists, dicts and types with a custom
    argument parser taken apart; other values from the last batch); fewer
    than ``n`` left at the end make one last, smaller batch unless
    ``drop_last`` (PopTorch's ``combined_batch_generator``)."""
    pending = []

    def join():
        leaves = [pytree.tree_flatten(b)[0] for b in pending]
        spec = pytree.tree_flatten(pending[-1])[1]
        return pytree.tree_unflatten(
            [torch.cat(column) if isinstance(column[-1], torch.Tensor) else column[-1]
             for column in zip(*leaves)], spec)
    for batch in batches:
        pending.append(batch)
        if len(pending) == n:
            yield join()
            pending = []
    if pending and not drop_last:
        yield join()
