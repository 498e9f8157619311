"""poptorchsim.DataLoader with several processes (Options.Distributed):
each process reads its own contiguous part of the dataset, PopTorch's rules
and texts.  No processes are started: a process is its Options."""
import pytest
import torch

import poptorchsim


class IndexDataset(torch.utils.data.Dataset):
    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return torch.tensor(i)


def _loader(process, processes=2, shuffle=False, seed=None, n=100, batch=2, di=2, rf=1,
            **kw):
    opts = poptorchsim.Options().deviceIterations(di).replicationFactor(rf)
    opts.Distributed.configureProcessId(process, processes)
    if seed is not None:
        opts.randomSeed(seed)
    return poptorchsim.DataLoader(opts, IndexDataset(n), batch_size=batch, shuffle=shuffle,
                                  **kw)


def _epoch(loader):
    return [int(i) for b in loader for i in b.reshape(-1)]


@pytest.mark.parametrize("processes,n,batch,di,rf", [
    (2, 100, 2, 2, 1), (3, 100, 2, 2, 1), (4, 64, 1, 2, 2), (2, 7, 1, 1, 1)])
def test_each_process_reads_its_own_contiguous_slice(processes, n, batch, di, rf):
    combined = batch * di * rf
    per_process = combined * (n // (combined * processes))
    seen = [_epoch(_loader(p, processes, n=n, batch=batch, di=di, rf=rf))
            for p in range(processes)]
    for p, indices in enumerate(seen):
        assert indices == list(range(p * per_process, (p + 1) * per_process))
        assert len(_loader(p, processes, n=n, batch=batch, di=di, rf=rf)) == \
            per_process // combined
    # disjoint, and together the first processes * per_process samples
    assert sorted(i for s in seen for i in s) == list(range(processes * per_process))


def test_every_batch_is_a_whole_combined_batch():
    loader = _loader(1, rf=2)               # combined = 2 * 2 * 2 = 8
    assert loader.combinedBatchSize == 8
    assert [len(b) for b in loader] == [8] * 6
    assert [int(i) for i in next(iter(loader))] == list(range(48, 56))


def test_shuffle_is_one_permutation_shared_by_the_processes():
    first = [_epoch(_loader(p, shuffle=True, seed=7)) for p in range(2)]
    assert not set(first[0]) & set(first[1])
    assert len(first[0]) == len(first[1]) == 48
    assert first[0] != sorted(first[0])                    # shuffled
    # one permutation of the whole dataset, cut into the processes' slices
    # (the first epoch starts n % per_process = 4 further on)
    order = torch.randperm(100, generator=torch.Generator().manual_seed(7)).tolist()
    assert first == [order[4:52], order[52:100]]


def test_shuffle_is_deterministic_per_seed_and_redrawn_each_epoch():
    loaders = [_loader(p, shuffle=True, seed=7) for p in range(2)]
    epoch1 = [_epoch(ld) for ld in loaders]
    assert [_epoch(_loader(p, shuffle=True, seed=7)) for p in range(2)] == epoch1
    assert [_epoch(_loader(p, shuffle=True, seed=8)) for p in range(2)] != epoch1
    epoch2 = [_epoch(ld) for ld in loaders]
    assert epoch2 != epoch1
    assert not set(epoch2[0]) & set(epoch2[1])
    # the samples left over in one epoch are used in the next: over the two
    # epochs the windows [4, 100) and [0, 96) of the permutations cover all
    g = torch.Generator().manual_seed(7)
    perms = [torch.randperm(100, generator=g).tolist() for _ in range(2)]
    assert epoch1 == [perms[0][4:52], perms[0][52:100]]
    assert epoch2 == [perms[1][0:48], perms[1][48:96]]


def test_drop_last_false_shares_every_sample():
    seen = [_epoch(_loader(p, processes=3, n=10, batch=1, di=2, drop_last=False))
            for p in range(3)]
    assert seen == [[0, 1, 2, 3], [4, 5, 6], [7, 8, 9]]


def test_opting_out_keeps_the_whole_dataset_in_every_process():
    assert _epoch(_loader(1, auto_distributed_partitioning=False)) == list(range(100))
    assert _epoch(_loader(1, batch=None, auto_distributed_partitioning=False)) == \
        list(range(100))


def test_one_process_is_not_partitioned():
    assert _epoch(_loader(0, processes=1)) == list(range(100))


def test_shuffle_needs_a_random_seed():
    with pytest.raises(AssertionError, match=r"When using auto_distributed_partitioning you "
                       r"must set poptorch.Options.randomSeed\(\) to ensure that tensors are "
                       r"in the same order in all processes."):
        _loader(0, shuffle=True)


def test_batch_size_none_is_not_allowed():
    with pytest.raises(AssertionError, match="batch_size=None not allowed when using "
                                             "auto_distributed_partitioning."):
        _loader(0, batch=None)


def test_iterable_datasets_are_not_partitioned():
    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            return iter(range(10))

    opts = poptorchsim.Options()
    opts.Distributed.configureProcessId(0, 2)
    with pytest.raises(AssertionError, match="auto_distributed_partitioning not supported "
                                             "for IterableDataset"):
        poptorchsim.DataLoader(opts, Stream())
    loader = poptorchsim.DataLoader(opts, Stream(), auto_distributed_partitioning=False)
    assert [int(i) for b in loader for i in b] == list(range(10))


def test_too_small_a_dataset_and_a_sampler_are_clear_errors():
    with pytest.raises(ValueError, match=r"fewer than one combined batch \(4\) for each of "
                                         r"the 2 processes"):
        _loader(0, n=6)
    with pytest.raises(ValueError, match="auto_distributed_partitioning=False"):
        _loader(0, sampler=torch.utils.data.SequentialSampler(range(100)))
