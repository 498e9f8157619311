"""Numerics of trainingModel / inferenceModel against plain PyTorch.

The simulated IPU must produce the same weights as plain PyTorch trained on
the same data with the same optimizer, where one device iteration is one
optimizer step over the mean gradient of ``ga * rf`` micro-batches.
"""
import copy

import pytest
import torch
from conftest import (
    BatchNormWithLoss,
    ClassifierWithLoss,
    assert_optimizer_state_close,
    assert_state_close,
    classification_batch,
    quiet_options,
    reference_call,
    regression_batch,
)

import poptorchsim

MICRO = 4
CALLS = 3

OPTIMIZERS = {
    "sgd": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, weight_decay=1e-4),
    "adam": lambda p: torch.optim.Adam(p, lr=1e-3),
    "adamw": lambda p: torch.optim.AdamW(p, lr=1e-3, weight_decay=1e-2),
    "rmsprop": lambda p: torch.optim.RMSprop(p, lr=1e-3, alpha=0.9, momentum=0.9,
                                             centered=True),
    "sgd_nesterov": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, nesterov=True),
    "poptorch_sgd": lambda p: poptorchsim.optim.SGD(p, lr=0.05, momentum=0.9,
                                                     weight_decay=1e-4),
    "poptorch_adam": lambda p: poptorchsim.optim.Adam(p, lr=1e-3),
    "sgd_plain": lambda p: torch.optim.SGD(p, lr=0.1),
    "sgd_dampening": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, dampening=0.5),
    "adam_l2": lambda p: torch.optim.Adam(p, lr=1e-3, betas=(0.8, 0.99), weight_decay=0.1),
    "rmsprop_plain": lambda p: torch.optim.RMSprop(p, lr=1e-3),
    "poptorch_loss_scaling": lambda p: poptorchsim.optim.SGD(p, lr=0.05, momentum=0.9,
                                                              loss_scaling=128.0),
}

CONFIGS = {
    "di4": (4, 1, 1),
    "ga3": (1, 3, 1),
    "rf2": (1, 1, 2),
    "di2_ga2_rf2": (2, 2, 2),
}


def make_options(di, ga, rf):
    opts = quiet_options().deviceIterations(di).replicationFactor(rf)
    opts.Training.gradientAccumulation(ga)
    return opts


def batches_for(di, ga, rf, calls=CALLS, micro=MICRO):
    n = micro * di * ga * rf
    return [classification_batch(n, seed=100 + c) for c in range(calls)]


def train_both(opt_name, di, ga, rf, model=None, calls=CALLS):
    """Trains on the simulated IPU and in plain PyTorch; returns both sides."""
    model = model if model is not None else ClassifierWithLoss()
    model.train()
    ref_model = copy.deepcopy(model)
    optimizer = OPTIMIZERS[opt_name](model.parameters())
    ref_optimizer = OPTIMIZERS[opt_name](ref_model.parameters())
    training_model = poptorchsim.trainingModel(model, make_options(di, ga, rf),
                                               optimizer=optimizer)
    results = []
    for batch in batches_for(di, ga, rf, calls):
        sim = training_model(*batch)
        ref = reference_call(ref_model, ref_optimizer, batch, di, ga, rf)
        results.append((sim, ref))
    return model, ref_model, optimizer, ref_optimizer, training_model, results


@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("opt_name", ["sgd", "adam"])
def test_weights_match_pytorch(opt_name, config):
    di, ga, rf = CONFIGS[config]
    model = ClassifierWithLoss()
    initial = model.fc1.weight.detach().clone()
    model, ref_model, *_ = train_both(opt_name, di, ga, rf, model=model)
    # The weights actually moved (the test would be vacuous otherwise).
    assert not torch.allclose(model.fc1.weight, initial)
    assert_state_close(model, ref_model)


@pytest.mark.parametrize("opt_name", ["adamw", "rmsprop", "sgd_nesterov",
                                      "poptorch_sgd", "poptorch_adam", "sgd_plain",
                                      "sgd_dampening", "adam_l2", "rmsprop_plain",
                                      "poptorch_loss_scaling"])
def test_more_optimizers_match_pytorch(opt_name):
    model, ref_model, *_ = train_both(opt_name, 2, 2, 2)
    assert_state_close(model, ref_model)


def test_default_optimizer_is_sgd_lr_0_01():
    model = ClassifierWithLoss()
    ref_model = copy.deepcopy(model)
    ref_optimizer = torch.optim.SGD(ref_model.parameters(), lr=0.01)
    training_model = poptorchsim.trainingModel(model, make_options(2, 1, 1))
    for batch in batches_for(2, 1, 1):
        training_model(*batch)
        reference_call(ref_model, ref_optimizer, batch, 2, 1, 1)
    assert_state_close(model, ref_model)


def test_param_groups_with_different_hyperparameters():
    def groups(m):
        return [{"params": m.fc1.parameters(), "lr": 0.1, "weight_decay": 1e-2},
                {"params": m.fc2.parameters(), "lr": 0.01, "momentum": 0.5}]

    model = ClassifierWithLoss()
    ref_model = copy.deepcopy(model)
    optimizer = torch.optim.SGD(groups(model), lr=0.05, momentum=0.9)
    ref_optimizer = torch.optim.SGD(groups(ref_model), lr=0.05, momentum=0.9)
    training_model = poptorchsim.trainingModel(model, make_options(2, 2, 1), optimizer)
    for batch in batches_for(2, 2, 1):
        training_model(*batch)
        reference_call(ref_model, ref_optimizer, batch, 2, 2, 1)
    assert_state_close(model, ref_model)


@pytest.mark.parametrize("how", ["requires_grad", "not_in_optimizer"])
def test_frozen_parameters_stay_frozen(how):
    model = ClassifierWithLoss()
    if how == "requires_grad":
        model.fc1.requires_grad_(False)
    ref_model = copy.deepcopy(model)
    params = model.parameters() if how == "requires_grad" else model.fc2.parameters()
    ref_params = (ref_model.parameters() if how == "requires_grad"
                  else ref_model.fc2.parameters())
    optimizer = torch.optim.SGD(params, lr=0.05, momentum=0.9)
    ref_optimizer = torch.optim.SGD(ref_params, lr=0.05, momentum=0.9)
    initial = copy.deepcopy(model.fc1.state_dict())
    training_model = poptorchsim.trainingModel(model, make_options(2, 1, 1), optimizer)
    for batch in batches_for(2, 1, 1):
        training_model(*batch)
        reference_call(ref_model, ref_optimizer, batch, 2, 1, 1)
    for name, value in initial.items():
        assert torch.equal(model.fc1.state_dict()[name], value)
    assert_state_close(model, ref_model)


def test_poptorch_sgd_max_grad_norm_clips_the_gradient():
    """poptorch.optim's max_grad_norm clips by the global gradient norm (§6)."""
    max_norm = 0.05
    model = ClassifierWithLoss()
    ref_model = copy.deepcopy(model)
    optimizer = poptorchsim.optim.SGD(model.parameters(), lr=0.1, max_grad_norm=max_norm)
    ref_optimizer = torch.optim.SGD(ref_model.parameters(), lr=0.1)
    training_model = poptorchsim.trainingModel(model, make_options(1, 2, 1), optimizer)
    for x, y in batches_for(1, 2, 1):
        training_model(x, y)
        ref_optimizer.zero_grad()
        for xm, ym in zip(x.chunk(2), y.chunk(2)):
            (ref_model(xm, ym)[1] / 2).backward()
        total = torch.nn.utils.clip_grad_norm_(ref_model.parameters(), max_norm)
        assert total > max_norm          # the clipping is exercised
        ref_optimizer.step()
    assert_state_close(model, ref_model)


def test_compile_then_call_matches_pytorch():
    model = ClassifierWithLoss()
    ref_model = copy.deepcopy(model)
    optimizer = OPTIMIZERS["sgd"](model.parameters())
    ref_optimizer = OPTIMIZERS["sgd"](ref_model.parameters())
    training_model = poptorchsim.trainingModel(model, make_options(2, 1, 1), optimizer)
    batches = batches_for(2, 1, 1)
    training_model.compile(*batches[0])
    assert training_model.isCompiled()
    # compile() does not run: the weights have not moved yet.
    assert_state_close(model, ref_model, rtol=0, atol=0)
    for batch in batches:
        training_model(*batch)
        reference_call(ref_model, ref_optimizer, batch, 2, 1, 1)
    assert_state_close(model, ref_model)


def test_keyword_inputs_match_pytorch():
    model = ClassifierWithLoss()
    ref_model = copy.deepcopy(model)
    optimizer = OPTIMIZERS["sgd"](model.parameters())
    ref_optimizer = OPTIMIZERS["sgd"](ref_model.parameters())
    training_model = poptorchsim.trainingModel(model, make_options(2, 1, 1), optimizer)
    for x, y in batches_for(2, 1, 1):
        training_model(x, target=y)
        reference_call(ref_model, ref_optimizer, (x, y), 2, 1, 1)
    assert_state_close(model, ref_model)


def test_weights_move_each_call():
    """The user's model holds the new weights after every call, not only at the end."""
    torch.manual_seed(1)
    model = ClassifierWithLoss()
    ref_model = copy.deepcopy(model)
    optimizer = OPTIMIZERS["sgd"](model.parameters())
    ref_optimizer = OPTIMIZERS["sgd"](ref_model.parameters())
    training_model = poptorchsim.trainingModel(model, make_options(2, 1, 1), optimizer)
    for batch in batches_for(2, 1, 1):
        training_model(*batch)
        reference_call(ref_model, ref_optimizer, batch, 2, 1, 1)
        assert_state_close(model, ref_model)


def test_final_loss_and_output_match_pytorch():
    """Default (Final) outputs: the last micro-batch's output and loss."""
    (sim_out, sim_loss), (ref_out, ref_loss) = train_both("sgd", 2, 3, 1)[-1][-1]
    torch.testing.assert_close(sim_out, ref_out[-1, -1, -1], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(sim_loss, ref_loss[-1, -1, -1], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("opt_name", ["sgd", "adam", "rmsprop"])
def test_optimizer_state_after_detach(opt_name):
    model, ref_model, optimizer, ref_optimizer, training_model, _ = \
        train_both(opt_name, 2, 2, 1)
    training_model.detachFromDevice()
    assert not training_model.isAttachedToDevice()
    assert_state_close(model, ref_model)
    assert_optimizer_state_close(optimizer, model, ref_optimizer, ref_model)


@pytest.mark.parametrize("opt_name", ["sgd", "adam"])
def test_training_continues_after_detach(opt_name):
    """Detach, then call again: the state goes back to the device and training goes on."""
    di, ga, rf = 2, 1, 1
    model, ref_model, optimizer, ref_optimizer, training_model, _ = \
        train_both(opt_name, di, ga, rf, calls=2)
    training_model.detachFromDevice()
    for batch in batches_for(di, ga, rf, calls=2):
        training_model(*batch)
        reference_call(ref_model, ref_optimizer, batch, di, ga, rf)
    assert training_model.isAttachedToDevice()
    assert_state_close(model, ref_model)
    training_model.detachFromDevice()
    assert_optimizer_state_close(optimizer, model, ref_optimizer, ref_model)


def test_set_optimizer_changes_lr_between_calls():
    di, ga, rf = 2, 1, 1
    model = ClassifierWithLoss()
    ref_model = copy.deepcopy(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    ref_optimizer = torch.optim.SGD(ref_model.parameters(), lr=0.05, momentum=0.9)
    training_model = poptorchsim.trainingModel(model, make_options(di, ga, rf), optimizer)
    for lr, batch in zip([0.05, 0.01, 0.2], batches_for(di, ga, rf)):
        for group in optimizer.param_groups:
            group["lr"] = lr
        training_model.setOptimizer(optimizer)
        for group in ref_optimizer.param_groups:
            group["lr"] = lr
        training_model(*batch)
        reference_call(ref_model, ref_optimizer, batch, di, ga, rf)
    assert_state_close(model, ref_model)


def test_set_optimizer_with_new_optimizer_object():
    """A new optimizer object brings its own (empty) state and its own lr."""
    di, ga, rf = 2, 1, 1
    model = ClassifierWithLoss()
    ref_model = copy.deepcopy(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    ref_optimizer = torch.optim.SGD(ref_model.parameters(), lr=0.05, momentum=0.9)
    training_model = poptorchsim.trainingModel(model, make_options(di, ga, rf), optimizer)
    batches = batches_for(di, ga, rf)
    training_model(*batches[0])
    reference_call(ref_model, ref_optimizer, batches[0], di, ga, rf)

    new_optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    training_model.setOptimizer(new_optimizer)
    ref_optimizer = torch.optim.SGD(ref_model.parameters(), lr=0.01, momentum=0.9)
    for batch in batches[1:]:
        training_model(*batch)
        reference_call(ref_model, ref_optimizer, batch, di, ga, rf)
    assert_state_close(model, ref_model)


def test_batchnorm_buffers_match_pytorch():
    di = 2
    model = BatchNormWithLoss()
    model.train()
    ref_model = copy.deepcopy(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    ref_optimizer = torch.optim.SGD(ref_model.parameters(), lr=0.05, momentum=0.9)
    training_model = poptorchsim.trainingModel(model, make_options(di, 1, 1), optimizer)
    for c in range(CALLS):
        batch = regression_batch(8 * di, seed=c)
        training_model(*batch)
        reference_call(ref_model, ref_optimizer, batch, di, 1, 1)
    # running_mean / running_var / num_batches_tracked moved as in PyTorch.
    assert int(model.bn.num_batches_tracked) == CALLS * di
    assert not torch.allclose(model.bn.running_mean, torch.zeros_like(model.bn.running_mean))
    assert_state_close(model, ref_model)


def test_batchnorm_buffers_with_gradient_accumulation():
    di, ga = 2, 2
    model = BatchNormWithLoss()
    model.train()
    ref_model = copy.deepcopy(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    ref_optimizer = torch.optim.SGD(ref_model.parameters(), lr=0.05)
    training_model = poptorchsim.trainingModel(model, make_options(di, ga, 1), optimizer)
    for c in range(2):
        batch = regression_batch(8 * di * ga, seed=c)
        training_model(*batch)
        reference_call(ref_model, ref_optimizer, batch, di, ga, 1)
    assert int(model.bn.num_batches_tracked) == 2 * di * ga
    assert_state_close(model, ref_model)


def test_sum_reduction_with_halved_lr_matches_mean():
    """batching_test: with Sum reduction and ga=2, lr/2 gives the Mean result."""
    di, ga = 1, 2
    model = ClassifierWithLoss()
    ref_model = copy.deepcopy(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05 / ga)
    ref_optimizer = torch.optim.SGD(ref_model.parameters(), lr=0.05)
    opts = make_options(di, ga, 1)
    opts.Training.accumulationAndReplicationReductionType(poptorchsim.ReductionType.Sum)
    training_model = poptorchsim.trainingModel(model, opts, optimizer)
    for batch in batches_for(di, ga, 1):
        training_model(*batch)
        reference_call(ref_model, ref_optimizer, batch, di, ga, 1)
    assert_state_close(model, ref_model)


# ---------------------------------------------------------------------------
# Inference
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("di", [1, 3])
def test_inference_matches_eval_model(di):
    model = ClassifierWithLoss()
    x, _ = classification_batch(6 * di)
    inference_model = poptorchsim.inferenceModel(
        model, quiet_options().deviceIterations(di))
    out = inference_model(x)
    with torch.no_grad():
        expected = model.eval()(x)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)


def test_inference_uses_batchnorm_running_statistics():
    model = BatchNormWithLoss()
    with torch.no_grad():
        model.bn.running_mean.uniform_(-1, 1)
        model.bn.running_var.uniform_(0.5, 2)
    model.train()
    x, _ = regression_batch(8)
    out = poptorchsim.inferenceModel(model, quiet_options())(x)
    with torch.no_grad():
        expected = copy.deepcopy(model).eval()(x)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)
    # Inference does not move the running statistics.
    assert int(model.bn.num_batches_tracked) == 0


def test_inference_model_sees_weights_from_training_model():
    model = ClassifierWithLoss()
    x, y = classification_batch(8)
    inference_model = poptorchsim.inferenceModel(model, quiet_options())
    before = inference_model(x)

    training_model = poptorchsim.trainingModel(
        model, quiet_options(), torch.optim.SGD(model.parameters(), lr=0.5))
    training_model(x, y)

    after = inference_model(x)
    with torch.no_grad():
        expected = copy.deepcopy(model).eval()(x)
    assert not torch.allclose(before, after)
    torch.testing.assert_close(after, expected, rtol=1e-5, atol=1e-6)

    # And again after another training call.
    training_model(x, y)
    with torch.no_grad():
        expected = copy.deepcopy(model).eval()(x)
    torch.testing.assert_close(inference_model(x), expected, rtol=1e-5, atol=1e-6)


def test_inference_copy_weights_to_device_after_host_change():
    model = ClassifierWithLoss()
    x, _ = classification_batch(8)
    inference_model = poptorchsim.inferenceModel(model, quiet_options())
    inference_model(x)
    with torch.no_grad():
        model.fc2.bias.add_(1.0)
    inference_model.copyWeightsToDevice()
    with torch.no_grad():
        expected = copy.deepcopy(model).eval()(x)
    torch.testing.assert_close(inference_model(x), expected, rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------------------
# Buffers updated in place by forward() (PopTorch's buffers_test.py)
# ---------------------------------------------------------------------------
class BufferUpdatingModel(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(2, 2, 1)
        self.register_buffer("test_buff", torch.zeros(2))
        self.loss = torch.nn.MSELoss()

    def forward(self, x, target):
        out = self.conv(x)
        with torch.no_grad():
            self.test_buff += self.conv.bias[0]
        return out, self.loss(out, target)


@pytest.mark.parametrize("di,ga", [(1, 1), (3, 1), (2, 3)])
def test_inplace_buffer_update_follows_the_parameters(di, ga):
    model = BufferUpdatingModel()
    ref_model = copy.deepcopy(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_optimizer = torch.optim.SGD(ref_model.parameters(), lr=0.1)
    training_model = poptorchsim.trainingModel(model, make_options(di, ga, 1), optimizer)
    for c in range(3):
        g = torch.Generator().manual_seed(c)
        x = torch.randn(2 * di * ga, 2, 2, 2, generator=g)
        target = torch.randn(x.shape, generator=g)
        training_model(x, target)
        reference_call(ref_model, ref_optimizer, (x, target), di, ga, 1)
    assert not torch.equal(model.test_buff, torch.zeros(2))
    assert_state_close(model, ref_model)


def test_inference_buffer_without_inputs():
    class Counter(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("x", torch.tensor([1.0]))

        def forward(self):
            self.x += 1.0
            return self.x

    model = Counter()
    inference_model = poptorchsim.inferenceModel(model, quiet_options())
    assert [float(inference_model()) for _ in range(4)] == [2.0, 3.0, 4.0, 5.0]
    # Inference buffers reach the host only with copyWeightsToHost.
    assert float(model.x) == 1.0
    inference_model.copyWeightsToHost()
    assert float(model.x) == 5.0


def test_unsynchronised_replicated_buffers():
    class ReplicaBufferModel(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("buffer", torch.zeros(1, 2))

        def forward(self, x):
            self.buffer.copy_(self.buffer + x)
            return poptorchsim.identity_loss(self.buffer, reduction="none")

    opts = quiet_options().replicationFactor(2).broadcastBuffers(False)
    inference_model = poptorchsim.inferenceModel(ReplicaBufferModel(), opts)
    x = torch.tensor([[9], [2]])
    for _ in range(50):
        y = inference_model(x)
    assert y[0][-1] == x[0] * 50
    assert y[1][-1] == x[1] * 50


# ---------------------------------------------------------------------------
# Host <-> device copies (poptorch-api.md §3)
# ---------------------------------------------------------------------------
def test_copy_weights_to_device_keeps_training_state():
    """copyWeightsToDevice mid-training with unchanged host weights changes nothing:
    in particular the momentum on the device is kept."""
    model = ClassifierWithLoss()
    ref_model = copy.deepcopy(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    ref_optimizer = torch.optim.SGD(ref_model.parameters(), lr=0.05, momentum=0.9)
    training_model = poptorchsim.trainingModel(model, make_options(1, 1, 1), optimizer)
    for c, batch in enumerate(batches_for(1, 1, 1)):
        training_model(*batch)
        reference_call(ref_model, ref_optimizer, batch)
        if c == 0:
            training_model.copyWeightsToDevice()
    assert_state_close(model, ref_model)


def test_copy_weights_to_device_uploads_host_changes_in_training():
    model = ClassifierWithLoss()
    ref_model = copy.deepcopy(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    ref_optimizer = torch.optim.SGD(ref_model.parameters(), lr=0.05)
    training_model = poptorchsim.trainingModel(model, make_options(1, 1, 1), optimizer)
    batches = batches_for(1, 1, 1)
    training_model(*batches[0])
    reference_call(ref_model, ref_optimizer, batches[0])
    with torch.no_grad():
        model.fc2.weight.mul_(0.5)
        ref_model.fc2.weight.mul_(0.5)
    training_model.copyWeightsToDevice()
    for batch in batches[1:]:
        training_model(*batch)
        reference_call(ref_model, ref_optimizer, batch)
    assert_state_close(model, ref_model)


def test_load_state_dict_on_inference_model_updates_the_device():
    """PoplarExecutor.load_state_dict loads into the user model, then
    copyWeightsToDevice if attached."""
    model = ClassifierWithLoss()
    inference_model = poptorchsim.inferenceModel(model, quiet_options())
    x, _ = classification_batch(8)
    inference_model(x)
    other = ClassifierWithLoss()
    inference_model.load_state_dict(other.state_dict())
    with torch.no_grad():
        expected = other.eval()(x)
    torch.testing.assert_close(inference_model(x), expected, rtol=1e-5, atol=1e-6)


def test_set_optimizer_of_another_type_is_refused_as_popart_does():
    """SGD -> Adam after compilation: PopART's replacement error; the model
    keeps training with its SGD as eager PyTorch does."""
    di, ga, rf = 2, 1, 1
    model = ClassifierWithLoss()
    ref_model = copy.deepcopy(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    training_model = poptorchsim.trainingModel(model, make_options(di, ga, rf), optimizer)
    ref_optimizer = torch.optim.SGD(ref_model.parameters(), lr=0.05)
    batches = batches_for(di, ga, rf)
    training_model(*batches[0])
    reference_call(ref_model, ref_optimizer, batches[0], di, ga, rf)
    ir = str(training_model.getIR())
    for other, popart in ((torch.optim.Adam(model.parameters(), lr=1e-2), "Adam"),
                          (torch.optim.RMSprop(model.parameters(), lr=1e-2), "Adaptive"),
                          (poptorchsim.optim.SGD(model.parameters(), lr=0.05,
                                                 use_combined_accum=True), "SGD1")):
        with pytest.raises(poptorchsim.Error,
                           match=f"Can not replace optimizer of type S\\w+ with new "
                                 f"optimizer of type {popart}"):
            training_model.setOptimizer(other)
    assert str(training_model.getIR()) == ir
    for batch in batches[1:]:
        training_model(*batch)
        reference_call(ref_model, ref_optimizer, batch, di, ga, rf)
    assert_state_close(model, ref_model)


def test_training_updates_the_users_parameters_in_place():
    """The device weights of a training model live in the user's parameters:
    each call's update lands there without a copy back, and the parameter
    objects (held by the user's optimizer) stay the same."""
    model = ClassifierWithLoss()
    ref_model = copy.deepcopy(model)
    params = list(model.parameters())
    addresses = [p.data_ptr() for p in params]
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    ref_optimizer = torch.optim.SGD(ref_model.parameters(), lr=0.05, momentum=0.9)
    training_model = poptorchsim.trainingModel(model, make_options(1, 1, 1), optimizer)
    for batch in batches_for(1, 1, 1):
        training_model(*batch)
        reference_call(ref_model, ref_optimizer, batch)
    assert [p.data_ptr() for p in model.parameters()] == addresses
    assert all(a is b for a, b in zip(model.parameters(), params))
    assert all(d.data_ptr() == p.data_ptr()
               for d, p in zip(training_model._state.params, params))
    assert_state_close(model, ref_model)


def test_update_casts_each_float64_hyperparameter_once():
    """The optimizer's hyperparameters are float64 scalars (torch.optim's
    Python floats); the update graph casts each to float32 once instead of
    letting every parameter's element-wise op cast it, with the same results
    as eager (the Adam rows of the parity tests above)."""
    model = ClassifierWithLoss()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    training_model = poptorchsim.trainingModel(model, make_options(1, 1, 1), optimizer)
    training_model(*batches_for(1, 1, 1)[0])
    update = training_model._compiled.program.graphs["optimizer_update"]
    mixed = [op for op in update.ops
             if op.outputs and op.outputs[0] is not None and op.outputs[0].shape
             and op.outputs[0].dtype == torch.float32
             and any(getattr(a, "shape", None) == () and getattr(a, "dtype", None)
                     == torch.float64 for a in op.args)]
    casts = [op for op in update.ops if "_to_copy" in str(op.target)]
    sources = [op.args[0].id for op in casts]
    assert not mixed
    assert casts and len(set(sources)) == len(sources)          # each scalar once
