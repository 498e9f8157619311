"""AsynchronousDataAccessor and DataLoader's Async / AsyncRebatched modes.

The worker is a real process: tests use SharingStrategy.Fork (fast to start)
except where a strategy itself is under test.
"""
import multiprocessing
import time

import pytest
import torch
from conftest import quiet_options
from torch.utils.data import TensorDataset

import poptorchsim as poptorch

FORK = {"sharing_strategy": poptorch.SharingStrategy.Fork}
ASYNC = poptorch.DataLoaderMode.Async


def dataset(n=20):
    return TensorDataset(torch.arange(2. * n).reshape(n, 2), torch.arange(n))


def batches(loader):
    """The loader's items, cloned (async items live in shared memory)."""
    return [[t.clone() for t in item] for item in loader]


def assert_same(got, want):
    assert len(got) == len(want)
    for a, b in zip(got, want):
        assert all(torch.equal(x, y) for x, y in zip(a, b))


class Counted:
    """An iterable of ``n`` tensors that counts, across processes, how many
    items it has produced."""

    def __init__(self, n, counter, fail_at=None):
        self.n, self.counter, self.fail_at = n, counter, fail_at

    def __iter__(self):
        for i in range(self.n):
            if i == self.fail_at:
                raise ValueError(f"corrupt sample {i}")
            with self.counter.get_lock():
                self.counter.value += 1
            yield torch.full((2,), float(i))

    def __len__(self):
        return self.n


def counter():
    return multiprocessing.get_context("fork").Value("i", 0)


def wait_for(predicate, timeout=10.0):
    end = time.monotonic() + timeout
    while not predicate() and time.monotonic() < end:
        time.sleep(0.01)
    return predicate()


def test_async_loader_gives_the_sync_batches_in_order_every_epoch():
    o = quiet_options().deviceIterations(2)
    want = batches(poptorch.DataLoader(o, dataset(), batch_size=2))
    loader = poptorch.DataLoader(o, dataset(), batch_size=2, mode=ASYNC, async_options=FORK)
    assert len(loader) == len(want) == 5
    for _ in range(3):
        assert_same(batches(loader), want)
    assert next(iter(loader))[0].is_shared()   # handed over in shared memory
    loader.terminate()


def test_default_forkserver_strategy():
    o = quiet_options()
    want = batches(poptorch.DataLoader(o, dataset(), batch_size=4))
    loader = poptorch.DataLoader(o, dataset(), batch_size=4, mode=ASYNC)
    assert_same(batches(loader), want)
    loader.terminate()


def test_worker_runs_ahead_up_to_the_buffer():
    count = counter()
    accessor = poptorch.AsynchronousDataAccessor(Counted(10, count), buffer_size=3,
                                                 early_preload=True, **FORK)
    # the first item, 3 queued ... and one waiting for room: then it stops
    assert wait_for(lambda: count.value == 4)
    time.sleep(0.2)
    assert count.value == 4
    it = iter(accessor)
    assert next(it)[0] == 0
    assert wait_for(lambda: count.value == 5)
    accessor.terminate()


def test_without_early_preload_only_the_first_item_loads_before_iter():
    count = counter()
    accessor = poptorch.AsynchronousDataAccessor(Counted(10, count), **FORK)
    time.sleep(0.2)
    assert count.value == 1
    assert [int(t[0]) for t in accessor] == list(range(10))
    accessor.terminate()


@pytest.mark.parametrize("indefinitely", [True, False])
def test_an_epoch_stopped_early_restarts_from_the_beginning(indefinitely):
    accessor = poptorch.AsynchronousDataAccessor(Counted(6, counter()),
                                                 load_indefinitely=indefinitely, **FORK)
    for _ in accessor:
        break
    first = [int(t[0]) for _, t in zip(range(3), accessor)]
    assert first == [0, 1, 2]
    assert [int(t[0]) for t in accessor] == list(range(6))
    assert [int(t[0]) for t in accessor] == list(range(6))
    accessor.terminate()


def test_a_worker_epochs_ahead_gives_each_epoch_once_in_order():
    """With load_indefinitely and a buffer larger than an epoch the worker runs
    whole epochs ahead; the host's ``start`` of an epoch already queued must not
    restart it (a second copy behind the next epoch's first item: that item
    twice, every later one shifted, as Graphcore's BERT demo_tiny_128 saw with
    2 batches an epoch and buffer_size 3 when the host ran slowly)."""
    count = counter()
    accessor = poptorch.AsynchronousDataAccessor(Counted(2, count), buffer_size=10,
                                                 early_preload=True, **FORK)
    # epochs 0-2 (2 items + eof each) and epoch 3's first item fill the
    # buffer; epoch 3's second item waits for room
    assert wait_for(lambda: count.value == 8)
    for _ in range(6):
        assert [int(t[0]) for t in accessor] == [0, 1]
    accessor.terminate()


def test_terminate_stops_the_worker():
    loader = poptorch.DataLoader(quiet_options(), dataset(), batch_size=2, mode=ASYNC,
                                 async_options=FORK)
    process = loader._accessor._worker.process
    next(iter(loader))
    loader.terminate()
    assert not process.is_alive()
    loader.terminate()                         # twice is harmless
    with pytest.raises(poptorch.Error, match="was terminated"):
        iter(loader)


def test_async_rebatched_joins_worker_batches():
    o = quiet_options().deviceIterations(3)
    want = batches(poptorch.DataLoader(o, dataset(), batch_size=2))
    loader = poptorch.DataLoader(o, dataset(), batch_size=2,
                                 mode=poptorch.DataLoaderMode.AsyncRebatched,
                                 rebatched_worker_size=1, async_options=FORK)
    assert loader.combinedBatchSize == 6 and len(loader) == 3
    assert_same(batches(loader), want)
    loader.terminate()


def test_async_without_drop_last_returns_the_last_smaller_batch():
    loader = poptorch.DataLoader(quiet_options(), dataset(10), batch_size=4, mode=ASYNC,
                                 drop_last=False, async_options=FORK)
    got = batches(loader)
    assert len(loader) == len(got) == 3
    assert [b[1].tolist() for b in got] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    loader.terminate()


def test_accessor_rebatches_a_loader():
    loader = poptorch.DataLoader(quiet_options(), dataset(10), batch_size=3)
    accessor = poptorch.AsynchronousDataAccessor(loader, rebatched_size=4, **FORK)
    assert len(accessor) == 2                  # 3 batches of 3 -> 9 samples -> 2 of 4
    assert [b[1].tolist() for b in batches(accessor)] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    accessor.terminate()


def test_training_from_an_async_loader_matches_sync():
    from conftest import ClassifierWithLoss
    o = quiet_options().deviceIterations(2)
    x = torch.randn(16, 6)
    y = torch.randint(0, 4, (16,))
    weights = []
    for mode in (poptorch.DataLoaderMode.Sync, ASYNC):
        torch.manual_seed(0)
        model = ClassifierWithLoss()
        pm = poptorch.trainingModel(model, o, poptorch.optim.SGD(model.parameters(), lr=0.1))
        loader = poptorch.DataLoader(o, TensorDataset(x, y), batch_size=2, mode=mode,
                                     async_options=FORK if mode == ASYNC else None)
        for data, labels in loader:
            pm(data, labels)
        loader.terminate()
        weights.append(model.fc1.weight.detach().clone())
    assert torch.equal(weights[0], weights[1])


def test_errors_in_the_worker_reach_the_host():
    # before the worker is ready: PopTorch's "failed to start", with the cause
    with pytest.raises(poptorch.Error, match="(?s)worker thread failed to start.*"
                                             "The Dataset is empty"):
        poptorch.AsynchronousDataAccessor(Counted(0, counter()), **FORK)
    accessor = poptorch.AsynchronousDataAccessor(Counted(5, counter(), fail_at=3), **FORK)
    with pytest.raises(poptorch.Error, match="An error occurred in the data fetcher: "
                                             "ValueError: corrupt sample 3"):
        list(accessor)
    with pytest.raises(poptorch.Error, match="Tensor at index 1 is not a torch tensor"):
        list(poptorch.AsynchronousDataAccessor([(torch.ones(2), "label")] * 3,
                                               rebatched_size=2, **FORK))


def test_a_worker_that_dies_is_an_error():
    import os
    import signal
    accessor = poptorch.AsynchronousDataAccessor(Counted(50, counter()), **FORK)
    it = iter(accessor)
    next(it)
    os.kill(accessor._worker.process.pid, signal.SIGKILL)
    with pytest.raises(poptorch.Error, match="An error occurred in the data fetcher: the "
                                             "worker process exited"):
        for _ in range(50):
            next(it)
    accessor.terminate()


def test_argument_errors():
    o = quiet_options()
    with pytest.raises(AssertionError, match="rebatched_size must be None or greater than 1"):
        poptorch.AsynchronousDataAccessor(dataset(), rebatched_size=1)
    with pytest.raises(AssertionError, match="only works if 'rebatched_size' is specified"):
        poptorch.AsynchronousDataAccessor(
            poptorch.DataLoader(o, dataset(), batch_size=2, drop_last=False))
    with pytest.raises(AssertionError, match=r"rebatched_worker_size \(8\) must be <= to the "
                                             r"combined batch size \(2\)"):
        poptorch.DataLoader(o, dataset(), batch_size=2, rebatched_worker_size=8,
                            mode=poptorch.DataLoaderMode.AsyncRebatched)
    with pytest.raises(AssertionError, match="manually specify the rebatched_size"):
        poptorch.DataLoader(o, dataset(), batch_size=2, mode=ASYNC,
                            async_options={"rebatched_size": 4})
    with pytest.raises(poptorch.Error, match="mode must be a poptorch.DataLoaderMode"):
        poptorch.DataLoader(o, dataset(), mode="async")
    with pytest.raises(poptorch.Error, match="buffer_size must be a positive integer"):
        poptorch.AsynchronousDataAccessor(dataset(), buffer_size=0)
    loader = poptorch.DataLoader(o, dataset(), batch_size=2, mode=ASYNC, async_options=FORK)
    with pytest.raises(poptorch.Error, match="The DataLoader already uses an "
                                             "AsynchronousDataAccessor internally"):
        poptorch.AsynchronousDataAccessor(loader)
    loader.terminate()


def test_a_sharing_strategy_named_by_a_string_runs_as_poptorch_runs_it():
    """Graphcore's Conformer reads ``sharing_strategy: "SharedMemory"`` from
    YAML into ``async_options``: PopTorch runs any string as SharedMemory
    (it compares the value with the enum's members), so a member's name is
    accepted; another member's name warns that it runs as SharedMemory; an
    unknown string names the members."""
    from poptorchsim.data import _sharing_strategy
    assert _sharing_strategy("SharedMemory") is poptorch.SharingStrategy.SharedMemory
    with pytest.warns(UserWarning, match="runs as SharedMemory"):
        assert _sharing_strategy("Fork") is poptorch.SharingStrategy.SharedMemory
    with pytest.raises(poptorch.Error, match="one of SharedMemory, FileSystem, Fork"):
        _sharing_strategy("shared")
    loader = poptorch.DataLoader(quiet_options(), dataset(8), batch_size=2, mode=ASYNC,
                                 async_options={"sharing_strategy": "SharedMemory",
                                                "early_preload": True, "buffer_size": 3})
    try:
        assert_same(batches(loader), batches(torch.utils.data.DataLoader(dataset(8), batch_size=2)))
    finally:
        loader.terminate()


_METHODS = ("fork", "spawn", "forkserver")


class StartMethods(torch.utils.data.IterableDataset):
    """Yields the start method a DataLoader's own workers get in this process."""

    def __iter__(self):
        yield torch.tensor([_METHODS.index(multiprocessing.get_start_method())])


def test_a_fork_server_worker_starts_the_loaders_workers_as_the_host_would():
    """A worker the fork server started takes the host's default start method
    for the DataLoader it runs (with the fork server's, its DataLoader's own
    workers started a fork server of their own, importing PyTorch again)."""
    accessor = poptorch.AsynchronousDataAccessor(
        StartMethods(), sharing_strategy=poptorch.SharingStrategy.ForkServer)
    try:
        got = next(iter(accessor))
    finally:
        accessor.terminate()
    assert _METHODS[int(got)] == multiprocessing.get_start_method()


def test_a_shuffled_process_part_loads_asynchronously_as_synchronously():
    """A DataLoader partitioned among processes (its sampler holds a seeded
    generator) goes to the fork server's worker and gives the items the
    synchronous loader gives, epoch after epoch."""
    def loader(mode):
        opts = poptorch.Options().randomSeed(42)
        opts.Distributed.configureProcessId(1, 3)
        return poptorch.DataLoader(opts, dataset(30), batch_size=2, shuffle=True, mode=mode)
    sync, async_ = loader(poptorch.DataLoaderMode.Sync), loader(poptorch.DataLoaderMode.Async)
    try:
        for _ in range(2):
            assert_same(batches(async_), batches(sync))
    finally:
        async_.terminate()
