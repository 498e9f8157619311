"""Replica-grouped weights (``poptorch_model.W.replicaGrouping``) and input
groups (``Options.inputReplicaGrouping``): each replica computes with its
group's row of a grouped weight and its input group's data, gradients are
reduced within the weight's group, and each group updates its own row."""
import numpy as np
import pytest
import torch
from conftest import quiet_options

import poptorchsim
from poptorchsim.enums import CommGroupType, VariableRetrievalMode


class Product(torch.nn.Module):
    def __init__(self, w):
        super().__init__()
        self.W = torch.nn.Parameter(w)

    def forward(self, x):
        z = x @ self.W
        return z, poptorchsim.identity_loss(z ** 2, reduction="mean")


def _problem(seed=3):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(24, 40, generator=g), torch.randn(40, 56, generator=g) * 0.1


def _eager(x, w, steps, lr=0.01):
    """The whole problem trained in plain PyTorch: its losses and weight."""
    w = torch.nn.Parameter(w.clone())
    opt = torch.optim.SGD([w], lr=lr)
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = ((x @ w) ** 2).mean()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return np.array(losses), w.detach()


@pytest.mark.parametrize("inputs,weights", [
    (CommGroupType.Consecutive, CommGroupType.Orthogonal),
    (CommGroupType.Orthogonal, CommGroupType.Consecutive)])
def test_column_blocks_on_groups_train_as_the_whole_problem(inputs, weights):
    """8 replicas: the weight's 56 columns cut into 4 blocks (one per weight
    group of 2 replicas), the 24 rows of data into 2 (one per input group of
    4 replicas). Each replica computes one block of one half; reduced within
    the weight's groups, the blocks train as the whole problem does."""
    x, w = _problem()
    blocks, halves, steps = 4, 2, 4
    ref_losses, ref_w = _eager(x, w, steps)
    model = Product(w.reshape(40, blocks, 56 // blocks).permute(1, 0, 2).contiguous())
    opts = quiet_options().replicationFactor(blocks * halves)
    opts.inputReplicaGrouping(blocks, inputs).outputMode(poptorchsim.OutputMode.All)
    pt = poptorchsim.trainingModel(model, opts, torch.optim.SGD(model.parameters(), lr=0.01))
    pt.W.replicaGrouping(weights, halves, VariableRetrievalMode.OnePerGroup)
    losses = []
    for _ in range(steps):
        z, loss = pt(x.reshape(halves, 12, 40))
        assert loss.shape == (8,)               # every replica returns its own
        losses.append(loss.sum().item() / (blocks * halves))
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    trained = model.W.detach().permute(1, 0, 2).reshape(40, 56)
    torch.testing.assert_close(trained, ref_w, rtol=1e-5, atol=1e-6)
    assert model.W.shape == (blocks, 40, 56 // blocks)     # a row per group on the host


def test_ungrouped_weight_is_the_mean_over_all_replicas():
    """The same program without replicaGrouping: the weight (one value for
    all replicas) gets the mean of all replicas' gradients."""
    x, w = _problem()
    model = Product(w[:, :14].clone())
    opts = quiet_options().replicationFactor(4).inputReplicaGrouping(2, CommGroupType.Consecutive)
    pt = poptorchsim.trainingModel(model, opts, torch.optim.SGD(model.parameters(), lr=0.01))
    pt(x.reshape(2, 12, 40))
    _, ref_w = _eager(x, w[:, :14].clone(), 1)
    torch.testing.assert_close(model.W.detach(), ref_w, rtol=1e-5, atol=1e-6)


def test_no_grouping_gives_each_replica_its_own_weight_and_state():
    """NoGrouping: replica r trains row r on its own data (its gradient
    scaled by the mean over the 4 replicas); Adam's state and step count
    hold a value per replica."""
    g = torch.Generator().manual_seed(5)
    x, w = torch.randn(4, 3, 6, generator=g), torch.randn(4, 6, 5, generator=g)
    model = Product(w.clone())
    opts = quiet_options().replicationFactor(4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    pt = poptorchsim.trainingModel(model, opts, opt)
    pt.W.replicaGrouping(CommGroupType.NoGrouping, 0, VariableRetrievalMode.AllReplicas)
    pt(x.reshape(12, 6))
    for r in range(4):
        wr = w[r].clone().requires_grad_()
        ((x[r] @ wr) ** 2).mean().backward()
        torch.testing.assert_close(model.W[r].detach(), w[r] - 0.1 * wr.grad / 4)
    adam_model = Product(w.clone())
    adam = poptorchsim.optim.Adam(adam_model.parameters(), lr=0.1)
    pt2 = poptorchsim.trainingModel(adam_model, quiet_options().replicationFactor(4), adam)
    pt2.W.replicaGrouping(CommGroupType.NoGrouping, 0, VariableRetrievalMode.OnePerGroup)
    pt2(x.reshape(12, 6))
    state = adam.state_dict()["ipu_state"]
    assert all(v.shape[0] == 4 for v in state.values()), {k: v.shape for k, v in state.items()}


def test_inference_replicas_use_their_rows():
    g = torch.Generator().manual_seed(7)
    x, w = torch.randn(4, 2, 6, generator=g), torch.randn(2, 6, 3, generator=g)

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.W = torch.nn.Parameter(w.clone())

        def forward(self, x):
            return x @ self.W
    pt = poptorchsim.inferenceModel(Net(), quiet_options().replicationFactor(4))
    pt.W.replicaGrouping(CommGroupType.Orthogonal, 2, VariableRetrievalMode.OnePerGroup)
    out = pt(x.reshape(8, 6)).reshape(4, 2, 3)
    for r in range(4):                      # orthogonal groups of 2 over 4: r % 2
        torch.testing.assert_close(out[r], x[r] @ w[r % 2])


def test_the_program_is_one_replicas_and_counts_every_replica():
    """The IR holds the shape one replica computes with; the program runs
    all 8 replicas (the estimate's IPUs and the outputs)."""
    x, w = _problem()
    model = Product(w.reshape(40, 4, 14).permute(1, 0, 2).contiguous())
    opts = quiet_options().replicationFactor(8).inputReplicaGrouping(4, CommGroupType.Consecutive)
    pt = poptorchsim.trainingModel(model, opts, torch.optim.SGD(model.parameters(), lr=0.01))
    pt.W.replicaGrouping(CommGroupType.Orthogonal, 2, VariableRetrievalMode.OnePerGroup)
    pt.compile(x.reshape(2, 12, 40))
    program = pt._compiled.program
    assert program.replicas == 8
    w_in = next(t for t in program.graphs["training_step"].inputs if t.role == "param")
    assert tuple(w_in.shape) == (40, 14)
    assert "%W: f32[40,14]  # param" in str(pt.getIR())


def test_wrapper_gives_the_parameter():
    model = Product(torch.ones(2, 3, 4))
    pt = poptorchsim.trainingModel(model, quiet_options().replicationFactor(2),
                                   torch.optim.SGD(model.parameters(), lr=0.1))
    assert pt.W.shape == (2, 3, 4) and pt.W.requires_grad
    assert torch.equal(pt.W, model.W) and torch.equal(pt.W * 2, model.W * 2)


@pytest.mark.parametrize("shape,args,message", [
    ((5, 3, 4), (CommGroupType.Orthogonal, 2), r"make 4 group\(s\), but W has shape \[5, 3, 4\]"),
    ((4, 3, 4), (CommGroupType.Consecutive, 3), "3 replicas a group do not divide the 8"),
    ((), (CommGroupType.NoGrouping, 0), "Scalars cannot be passed as per-replica"),
])
def test_bad_groupings_are_refused_before_anything_changes(shape, args, message):
    model = Product(torch.ones(shape))
    before = model.W.detach().clone()
    pt = poptorchsim.trainingModel(model, quiet_options().replicationFactor(8),
                                   torch.optim.SGD(model.parameters(), lr=0.1))
    pt.W.replicaGrouping(*args, VariableRetrievalMode.OnePerGroup)
    x = torch.ones(8 * 2, 3) if shape else torch.ones(8, 1)
    with pytest.raises(poptorchsim.Error, match=message):
        pt(x)
    assert torch.equal(model.W.detach(), before) and model.W.shape == before.shape
    assert pt._compiled is None


def test_grouping_after_compile_is_refused():
    model = Product(torch.ones(2, 3, 4))
    pt = poptorchsim.trainingModel(model, quiet_options().replicationFactor(2),
                                   torch.optim.SGD(model.parameters(), lr=0.1))
    pt.compile(torch.ones(4, 3))
    with pytest.raises(poptorchsim.Error, match="after the model was compiled"):
        pt.W.replicaGrouping(CommGroupType.NoGrouping, 0, VariableRetrievalMode.OnePerGroup)
    assert pt.per_replica_params == {}
