"""poptorchsim.DataLoader: combined-batch algebra and Options freezing."""
import copy

import pytest
import torch
from conftest import ClassifierWithLoss, assert_state_close, quiet_options, reference_call

import poptorchsim

FROZEN = "Can't modify frozen Options"


class IndexDataset(torch.utils.data.Dataset):
    """Sample i is (a 6-feature vector filled with i, label i % 4)."""

    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return torch.full((6,), float(i)), torch.tensor(i % 4)


def make_options(di=1, rf=1, ga=1):
    opts = quiet_options().deviceIterations(di).replicationFactor(rf)
    opts.Training.gradientAccumulation(ga)
    return opts


@pytest.mark.parametrize("batch_size,di,rf,ga", [
    (1, 1, 1, 1), (4, 1, 1, 1), (2, 3, 1, 1), (2, 1, 2, 1), (2, 1, 1, 3), (3, 2, 2, 2)])
def test_combined_batch_size_and_length(batch_size, di, rf, ga):
    dataset = IndexDataset(100)
    loader = poptorchsim.DataLoader(make_options(di, rf, ga), dataset, batch_size=batch_size)
    combined = batch_size * di * rf * ga
    assert loader.combinedBatchSize == combined
    assert len(loader) == len(dataset) // combined
    items = list(loader)
    assert len(items) == len(loader)
    for k, (x, y) in enumerate(items):
        assert x.shape == torch.Size([combined, 6])
        assert y.shape == torch.Size([combined])
        # No shuffle: consecutive samples, in order.
        first = k * combined
        assert torch.equal(x[:, 0], torch.arange(first, first + combined, dtype=torch.float32))


def test_drop_last_false_keeps_the_remainder():
    dataset = IndexDataset(10)
    loader = poptorchsim.DataLoader(make_options(di=2), dataset, batch_size=2,
                                    drop_last=False)
    assert loader.combinedBatchSize == 4
    sizes = [x.shape[0] for x, _ in loader]
    assert sizes == [4, 4, 2]


def test_shuffle_covers_the_dataset_once():
    dataset = IndexDataset(24)
    loader = poptorchsim.DataLoader(make_options(di=2), dataset, batch_size=3, shuffle=True)
    seen = torch.cat([x[:, 0] for x, _ in loader])
    assert sorted(seen.tolist()) == [float(i) for i in range(24)]


def test_batch_sampler_batches_are_combined():
    dataset = IndexDataset(20)
    sampler = torch.utils.data.BatchSampler(torch.utils.data.SequentialSampler(dataset), 2,
                                            drop_last=True)
    loader = poptorchsim.DataLoader(make_options(di=3), dataset, batch_sampler=sampler)
    assert len(loader) == 10 // 3
    items = [x[:, 0].tolist() for x, _ in loader]
    assert items == [[0, 1, 2, 3, 4, 5], [6, 7, 8, 9, 10, 11], [12, 13, 14, 15, 16, 17]]


def test_options_property():
    opts = make_options(di=2)
    loader = poptorchsim.DataLoader(opts, IndexDataset(8), batch_size=2)
    assert loader.options is opts
    assert loader.options.device_iterations == 2


def test_options_rejects_non_options():
    with pytest.raises(TypeError, match="Invalid type: 'options' is of type"):
        poptorchsim.DataLoader({"device_iterations": 2}, IndexDataset(8))


def test_empty_dataset():
    with pytest.raises(ValueError, match="The Dataset is empty"):
        poptorchsim.DataLoader(make_options(), IndexDataset(0), batch_size=2)


# ---------------------------------------------------------------------------
# Freezing
# ---------------------------------------------------------------------------
def test_options_frozen_by_dataloader():
    opts = make_options(di=2)
    poptorchsim.DataLoader(opts, IndexDataset(8), batch_size=2)
    with pytest.raises(AttributeError, match=FROZEN):
        opts.deviceIterations(4)
    with pytest.raises(AttributeError, match=FROZEN):
        opts.replicationFactor(2)
    with pytest.raises(AttributeError, match=FROZEN):
        opts.Training.gradientAccumulation(2)
    with pytest.raises(AttributeError, match=FROZEN):
        opts._Popart.set("enableOutlining", False)
    assert opts.device_iterations == 2


@pytest.mark.parametrize("wrapper", ["training", "inference"])
def test_options_frozen_by_wrappers(wrapper):
    opts = quiet_options()
    model = ClassifierWithLoss()
    if wrapper == "training":
        poptorchsim.trainingModel(model, opts)
    else:
        poptorchsim.inferenceModel(model, opts)
    with pytest.raises(AttributeError, match=FROZEN):
        opts.deviceIterations(2)
    with pytest.raises(AttributeError, match=FROZEN):
        opts.outputMode(poptorchsim.OutputMode.All)


def test_clone_is_unfrozen_and_independent():
    opts = make_options(di=2)
    poptorchsim.DataLoader(opts, IndexDataset(8), batch_size=2)
    clone = opts.clone()
    clone.deviceIterations(5)
    clone.Training.gradientAccumulation(3)
    assert clone.device_iterations == 5
    assert clone.Training.gradient_accumulation == 3
    assert opts.device_iterations == 2
    assert opts.Training.gradient_accumulation == 1
    deep = copy.deepcopy(opts)
    deep.replicationFactor(2)
    assert deep.replication_factor == 2


def test_frozen_options_can_be_reused():
    opts = make_options(di=2)
    loader = poptorchsim.DataLoader(opts, IndexDataset(16), batch_size=2)
    model = ClassifierWithLoss()
    training_model = poptorchsim.trainingModel(model, opts)
    x, y = next(iter(loader))
    training_model(x, y)
    assert training_model.options.device_iterations == 2


def test_executor_keeps_its_own_frozen_clone():
    opts = quiet_options()
    training_model = poptorchsim.trainingModel(ClassifierWithLoss(), opts)
    assert training_model.options is not opts
    with pytest.raises(AttributeError, match=FROZEN):
        training_model.options.deviceIterations(2)


# ---------------------------------------------------------------------------
# Feeding a trainingModel
# ---------------------------------------------------------------------------
def test_loader_batches_train_like_pytorch():
    di, rf, ga, batch_size = 2, 2, 2, 2
    g = torch.Generator().manual_seed(0)
    xs = torch.randn(64, 6, generator=g)
    ys = torch.randint(0, 4, (64,), generator=g)
    dataset = torch.utils.data.TensorDataset(xs, ys)
    opts = make_options(di, rf, ga)
    loader = poptorchsim.DataLoader(opts, dataset, batch_size=batch_size)
    assert len(loader) == 64 // 16

    model = ClassifierWithLoss()
    ref_model = copy.deepcopy(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    ref_optimizer = torch.optim.SGD(ref_model.parameters(), lr=0.05, momentum=0.9)
    training_model = poptorchsim.trainingModel(model, loader.options, optimizer)
    for x, y in loader:
        out, loss = training_model(x, y)
        assert out.shape == torch.Size([rf * batch_size, 4])   # Final, per replica
        assert loss.shape == torch.Size([rf])
        reference_call(ref_model, ref_optimizer, (x, y), di, ga, rf)
    assert_state_close(model, ref_model)


def test_loader_batches_feed_inference():
    dataset = torch.utils.data.TensorDataset(torch.randn(40, 6))
    opts = quiet_options().deviceIterations(5)
    loader = poptorchsim.DataLoader(opts, dataset, batch_size=4)
    model = ClassifierWithLoss()
    inference_model = poptorchsim.inferenceModel(model, opts)
    for (x,) in loader:
        out = inference_model(x)
        with torch.no_grad():
            torch.testing.assert_close(out, model(x), rtol=1e-5, atol=1e-6)


class _Growing(torch.utils.data.Sampler):
    """Batches of 1, 2, 3, 1, 2, 3, ... indices (a dynamic batch sampler)."""

    def __init__(self, n):
        self.n = n

    def __iter__(self):
        start, size = 0, 1
        while start < self.n:
            yield list(range(start, min(start + size, self.n)))
            start, size = start + size, size % 3 + 1

    def __len__(self):
        return len(list(iter(self)))


def _pad_to_4(items):
    """Pads each sampler batch to 4 rows (zeros), as a dynamic-padding collate_fn does."""
    x = torch.stack([item[0] for item in items])
    return torch.cat([x, x.new_zeros(4 - len(items), *x.shape[1:])]), torch.tensor([len(items)])


@pytest.mark.parametrize("mode", [poptorchsim.DataLoaderMode.Sync,
                                  poptorchsim.DataLoaderMode.Async])
def test_a_batch_sampler_s_batches_are_collated_one_by_one_then_combined(mode):
    """As PopTorch: the collate_fn sees each of the sampler's batches (here it
    pads each to 4 rows), and the device iterations' batches are then
    concatenated; drop_last=False keeps the last, shorter combination."""
    dataset = IndexDataset(12)              # sampler batches of 1, 2, 3, 1, 2, 3
    loader = poptorchsim.DataLoader(make_options(di=4), dataset, batch_sampler=_Growing(12),
                                    collate_fn=_pad_to_4, drop_last=False, mode=mode)
    try:
        got = [(x[:, 0].tolist(), n.tolist()) for x, n in loader]
    finally:
        loader.terminate()
    assert len(loader) == 2
    assert got == [([0, 0, 0, 0, 1, 2, 0, 0, 3, 4, 5, 0, 6, 0, 0, 0], [1, 2, 3, 1]),
                   ([7, 8, 0, 0, 9, 10, 11, 0], [2, 3])]
