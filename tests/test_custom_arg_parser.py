"""ICustomArgParser / registerCustomArgParser: models taking (and returning)
a user-defined type holding tensors, in inference and training."""
import copy

import pytest
import torch
from conftest import quiet_options
from torch import nn

import poptorchsim as poptorch


class Batch:
    """A user's input type: tensors in attributes plus a non-tensor field."""

    def __init__(self, features=None, labels=None, name="batch"):
        self.features, self.labels, self.name = features, labels, name


class BatchParser(poptorch.ICustomArgParser):
    def yieldTensors(self, struct):
        yield struct.features
        yield struct.labels

    def reconstruct(self, original_structure, tensor_iterator):
        return Batch(next(tensor_iterator), next(tensor_iterator), original_structure.name)


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(6, 3)

    def forward(self, batch):
        out = self.fc(batch.features)
        if not self.training:
            return out
        return out, nn.functional.cross_entropy(out, batch.labels)


class Echo(nn.Module):
    """Returns a Batch: outputs of the custom type are rebuilt too."""

    def forward(self, batch):
        return Batch(batch.features * 2, batch.labels + 1, batch.name)


@pytest.fixture
def parser():
    poptorch.registerCustomArgParser(Batch, BatchParser())
    yield
    poptorch.registerCustomArgParser(Batch, None)


def data(n=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return Batch(torch.randn(n, 6, generator=g), torch.randint(0, 3, (n,), generator=g))


def test_inference_with_a_custom_input_type(parser):
    torch.manual_seed(0)
    model = Model().eval()
    pm = poptorch.inferenceModel(model, quiet_options().deviceIterations(2))
    for seed in range(2):
        b = data(seed=seed)
        torch.testing.assert_close(pm(b), model(b), rtol=0, atol=0)


def test_training_with_a_custom_input_type_matches_eager(parser):
    torch.manual_seed(0)
    model = Model()
    reference = copy.deepcopy(model)
    pm = poptorch.trainingModel(model, quiet_options(),
                                poptorch.optim.SGD(model.parameters(), lr=0.1))
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    for seed in range(3):
        b = data(seed=seed)
        _, loss = pm(b)
        ref_opt.zero_grad()
        _, ref_loss = reference(b)
        ref_loss.backward()
        ref_opt.step()
        torch.testing.assert_close(loss, ref_loss.detach())
    torch.testing.assert_close(model.fc.weight, reference.fc.weight)


def test_custom_output_type_is_rebuilt(parser):
    b = data()
    out = poptorch.inferenceModel(Echo(), quiet_options())(b)
    assert isinstance(out, Batch) and out.name == "batch"
    torch.testing.assert_close(out.features, b.features * 2)
    assert torch.equal(out.labels, (b.labels + 1).int())


def test_a_changed_tensor_shape_is_a_mismatch(parser):
    pm = poptorch.inferenceModel(Model().eval(), quiet_options())
    pm(data(8))
    with pytest.raises(poptorch.Error, match=r"Shape mismatch for batch\[0\]"):
        pm(data(4))


def test_without_a_parser_the_type_is_rejected():
    pm = poptorch.inferenceModel(Model().eval(), quiet_options())
    with pytest.raises(poptorch.Error, match=r"Input batch is a Batch holding tensors.*"
                                             r"registerCustomArgParser\(Batch, parser\)"):
        pm(data())


def test_register_validates_and_removes():
    with pytest.raises(poptorch.Error, match="arg_parser must inherit from ICustomArgParser"):
        poptorch.registerCustomArgParser(Batch, object())
    with pytest.raises(TypeError):
        poptorch.ICustomArgParser()
    poptorch.registerCustomArgParser(Batch, BatchParser())
    poptorch.registerCustomArgParser(Batch, BatchParser())     # replaces
    poptorch.registerCustomArgParser(Batch, None)
    poptorch.registerCustomArgParser(Batch, None)              # nothing to remove
    with pytest.raises(poptorch.Error, match="already has a torch.utils._pytree"):
        poptorch.registerCustomArgParser(tuple, BatchParser())
