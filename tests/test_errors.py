"""Error paths: exception type, message, and no side effect on the weights."""
import copy
import logging
import re

import pytest
import torch
import torch.nn.functional as F
from conftest import (
    ClassifierWithLoss,
    assert_state_close,
    assert_unchanged,
    classification_batch,
    poptorchsim_log,
    quiet_options,
    reference_call,
    snapshot,
)
from torch import nn

import poptorchsim

MISMATCH_SUFFIX = (
    "\nThis error occurred because the inputs passed at runtime don't match the "
    "inputs used to compile the model.\nTo recompile the model for the new inputs "
    "create a new inferenceModel / trainingModel wrapper or call destroy() on the "
    "curent one and try again.")
NO_EXECUTABLE = "Model has not been compiled or has been destroyed."


def sgd(model, lr=0.05):
    return torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)


# ---------------------------------------------------------------------------
# Batch dimension and input validation
# ---------------------------------------------------------------------------
def test_batch_not_divisible_raises_batch_dimension_error():
    model = ClassifierWithLoss()
    before = snapshot(model)
    opts = quiet_options().deviceIterations(3)
    training_model = poptorchsim.trainingModel(model, opts, sgd(model))
    x, y = classification_batch(8)
    with pytest.raises(poptorchsim.BatchDimensionError) as info:
        training_model(x, y)
    err = info.value
    assert isinstance(err, AssertionError)
    assert isinstance(err, poptorchsim.Error)
    msg = str(err)
    assert msg.startswith("Invalid batch dimension")
    assert msg == (
        "Invalid batch dimension: In the input (8, 6), the batch dimension (8) must be a "
        "multiple of Options.deviceIterations(3) * (Options.replicationFactor(1) / "
        "Options.inputReplicaGrouping.input_group_size(1)) * "
        "Options.Training.gradientAccumulation(1) = 3 because it is used to calculate the "
        "batch size which will be executed on the device in any given iteration. For a "
        "full explanation see the batching semantics page of the documentation.")
    assert not training_model.isCompiled()
    assert_unchanged(model, before)


def test_batch_dimension_error_counts_all_factors():
    model = ClassifierWithLoss()
    before = snapshot(model)
    opts = quiet_options().deviceIterations(2).replicationFactor(2)
    opts.Training.gradientAccumulation(3)
    training_model = poptorchsim.trainingModel(model, opts, sgd(model))
    x, y = classification_batch(18)       # 18 % 12 != 0
    with pytest.raises(AssertionError, match=r"^Invalid batch dimension.*= 12 because"):
        training_model(x, y)
    assert_unchanged(model, before)


def test_inference_batch_factor_ignores_nothing_but_accumulation():
    """Inference: F = deviceIterations * replicationFactor."""
    model = ClassifierWithLoss()
    opts = quiet_options().deviceIterations(2).replicationFactor(2)
    inference_model = poptorchsim.inferenceModel(model, opts)
    with pytest.raises(poptorchsim.BatchDimensionError,
                       match=r"Options.Training.gradientAccumulation\(1\) = 4 because"):
        inference_model(torch.randn(6, 6))
    assert inference_model(torch.randn(8, 6)).shape == torch.Size([8, 4])


def test_shape_change_after_compile():
    model = ClassifierWithLoss()
    training_model = poptorchsim.trainingModel(model, quiet_options(), sgd(model))
    x, y = classification_batch(8)
    training_model(x, y)
    before = snapshot(model)
    x2, y2 = classification_batch(16)
    with pytest.raises(poptorchsim.InputMismatchError) as info:
        training_model(x2, y2)
    assert isinstance(info.value, poptorchsim.Error)
    assert str(info.value) == (
        "Shape mismatch for x: expected torch.Size([8, 6]) but got torch.Size([16, 6])."
        + MISMATCH_SUFFIX)
    assert_unchanged(model, before)
    # The original shape still works afterwards.
    training_model(x, y)


def test_shape_change_of_second_input_is_named():
    model = ClassifierWithLoss()
    training_model = poptorchsim.trainingModel(model, quiet_options(), sgd(model))
    x, y = classification_batch(8)
    training_model(x, y)
    before = snapshot(model)
    with pytest.raises(poptorchsim.InputMismatchError,
                       match=re.escape("Shape mismatch for target: expected torch.Size([8]) "
                                       "but got torch.Size([8, 1])")):
        training_model(x, y.reshape(8, 1))
    assert_unchanged(model, before)


def test_dtype_change_after_compile():
    model = ClassifierWithLoss()
    inference_model = poptorchsim.inferenceModel(model, quiet_options())
    x, _ = classification_batch(8)
    inference_model(x)
    with pytest.raises(poptorchsim.InputMismatchError) as info:
        inference_model(x.half())
    assert str(info.value).startswith(
        "Data type mismatch for x: expected torch.float32 but got torch.float16")
    assert str(info.value).endswith(MISMATCH_SUFFIX)


def test_dtype_change_in_training_leaves_weights_unchanged():
    model = ClassifierWithLoss()
    training_model = poptorchsim.trainingModel(model, quiet_options(), sgd(model))
    x, y = classification_batch(8)
    training_model(x, y)
    before = snapshot(model)
    with pytest.raises(poptorchsim.InputMismatchError,
                       match="Data type mismatch for x: expected torch.float32 but got "
                             "torch.float16"):
        training_model(x.half(), y)
    assert_unchanged(model, before)


def test_float64_after_float32_is_accepted():
    """double inputs are converted to float32 on the way in, so they match."""
    model = ClassifierWithLoss()
    inference_model = poptorchsim.inferenceModel(model, quiet_options())
    x, _ = classification_batch(8)
    first = inference_model(x)
    second = inference_model(x.double())
    torch.testing.assert_close(first, second)


def test_number_of_arguments_change():
    model = ClassifierWithLoss()
    inference_model = poptorchsim.inferenceModel(model, quiet_options())
    x, y = classification_batch(8)
    inference_model(x)
    with pytest.raises(poptorchsim.InputMismatchError, match="mismatch"):
        inference_model(x, y)


# ---------------------------------------------------------------------------
# What cannot be compiled
# ---------------------------------------------------------------------------
class FftSvd(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x, y=None):
        h = self.fc(x)
        spectrum = torch.fft.fft(h).real
        singular = torch.linalg.svd(h)[1]
        out = spectrum + singular.sum()
        if y is None:
            return out
        return out, F.mse_loss(out, y)


@pytest.mark.parametrize("training", [False, True])
def test_unsupported_ops_reported_together(training):
    model = FftSvd()
    before = snapshot(model)
    x, y = torch.randn(4, 4), torch.randn(4, 4)
    with pytest.raises(poptorchsim.UnsupportedOperationError) as info:
        if training:
            poptorchsim.trainingModel(model, quiet_options(), sgd(model))(x, y)
        else:
            poptorchsim.inferenceModel(model, quiet_options())(x)
    assert isinstance(info.value, poptorchsim.Error)
    msg = str(info.value)
    assert "aten._fft_r2c" in msg
    assert "aten._linalg_svd" in msg
    # each with its reason and the line of the model that produced it
    assert "complex" in msg and "factorization" in msg
    assert "spectrum = torch.fft.fft(h).real" in msg or 'test_errors.py", line' in msg
    fft_line = FftSvd.forward.__code__.co_firstlineno + 2
    assert f'line {fft_line}, in forward' in msg
    assert_unchanged(model, before)


def test_a_boolean_mask_index_is_refused_naming_the_op_and_line():
    """A boolean mask's result has as many rows as the mask has True values,
    which PyTorch's trace leaves symbolic: refused as PopTorch refuses it (it
    raises its tracer's DynamicOutputShapeException), with the op and the
    model's line, the model unchanged."""
    class Masked(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(2, 2)

        def forward(self, x):
            return self.fc(x)[torch.tensor([True, False])]

    model = Masked()
    before = snapshot(model)
    with pytest.raises(poptorchsim.UnsupportedOperationError,
                       match=r"aten.index.Tensor \(used 1x: its output shape depends on "
                             r"tensor values\)\n.*in forward"):
        poptorchsim.inferenceModel(model, quiet_options())(torch.randn(2, 2))
    assert_unchanged(model, before)


class ItemInForward(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x, y=None):
        h = self.fc(x)
        out = h * h.abs().max().item()
        if y is None:
            return out
        return out, F.mse_loss(out, y)


class BranchOnValue(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x, y=None):
        h = self.fc(x)
        if h.sum() > 0:
            out = h * 2
        else:
            out = -h
        if y is None:
            return out
        return out, F.mse_loss(out, y)


@pytest.mark.parametrize("training", [False, True])
@pytest.mark.parametrize("cls", [ItemInForward, BranchOnValue])
def test_data_dependent_python_raises(cls, training):
    model = cls()
    before = snapshot(model)
    x, y = torch.randn(4, 4), torch.randn(4, 4)
    with pytest.raises(poptorchsim.DataDependentError) as info:
        if training:
            poptorchsim.trainingModel(model, quiet_options(), sgd(model))(x, y)
        else:
            poptorchsim.inferenceModel(model, quiet_options())(x)
    assert isinstance(info.value, poptorchsim.Error)
    assert "value" in str(info.value) and "forward()" in str(info.value)
    assert_unchanged(model, before)


# ---------------------------------------------------------------------------
# Losses
# ---------------------------------------------------------------------------
class NoLoss(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x, y):
        out = self.fc(x)
        return out, ((out - y) ** 2).mean()


class TwoLosses(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x, y):
        out = self.fc(x)
        return out, F.mse_loss(out, y) + F.l1_loss(out, y)


class IdentityLoss(nn.Module):
    def __init__(self, reduction="mean"):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.reduction = reduction

    def forward(self, x, y):
        out = self.fc(x)
        # Two torch losses nested inside identity_loss: identity_loss is the loss.
        loss = poptorchsim.identity_loss(F.mse_loss(out, y) + F.smooth_l1_loss(out, y),
                                         reduction=self.reduction)
        return out, loss


class HandMadeIdentityLoss(nn.Module):
    def __init__(self, reduction="mean"):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.reduction = reduction

    def forward(self, x, y):
        out = self.fc(x)
        return out, poptorchsim.identity_loss((out - y) ** 2, reduction=self.reduction)


def test_no_loss_raises_loss_error():
    model = NoLoss()
    before = snapshot(model)
    training_model = poptorchsim.trainingModel(model, quiet_options(), sgd(model))
    with pytest.raises(poptorchsim.LossError, match="Couldn't find a loss") as info:
        training_model(torch.randn(4, 4), torch.randn(4, 4))
    assert isinstance(info.value, poptorchsim.Error)
    assert_unchanged(model, before)


def test_two_independent_losses_raise_loss_error():
    model = TwoLosses()
    before = snapshot(model)
    training_model = poptorchsim.trainingModel(model, quiet_options(), sgd(model))
    with pytest.raises(poptorchsim.LossError) as info:
        training_model(torch.randn(4, 4), torch.randn(4, 4))
    assert str(info.value) == (
        "Multiple independent losses found in graph. Graph must have one final loss. "
        "Wrap final graph loss in poptorch.identity_loss.")
    assert_unchanged(model, before)


class _ChainedLosses(nn.Module):
    """A custom loss with an identity_loss inside (reducing a term) and the
    final identity_loss computed from it."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x, y):
        out = self.fc(x)
        partial = poptorchsim.identity_loss(out - y, reduction="sum")
        return out, partial, poptorchsim.identity_loss(partial * partial * 5, reduction="mean")


def test_a_loss_computed_from_another_identity_loss_is_the_final_one():
    torch.manual_seed(0)
    model = _ChainedLosses()
    x, y = torch.randn(4, 4), torch.randn(4, 4)
    ref = copy.deepcopy(model)
    training_model = poptorchsim.trainingModel(model, quiet_options(), sgd(model))
    _, partial, loss = training_model(x, y)
    out = ref.fc(x)
    torch.testing.assert_close(partial, (out - y).sum())
    torch.testing.assert_close(loss, ((out - y).sum() ** 2 * 5))
    # the step trained on the final loss: plain PyTorch's step on it
    opt = sgd(ref)
    (((ref.fc(x) - y).sum() ** 2) * 5).backward()
    opt.step()
    training_model.copyWeightsToHost()
    torch.testing.assert_close(model.fc.weight, ref.fc.weight)


@pytest.mark.parametrize("cls,reduction", [(IdentityLoss, "mean"),
                                           (HandMadeIdentityLoss, "mean"),
                                           (HandMadeIdentityLoss, "sum")])
def test_identity_loss_is_the_loss(cls, reduction):
    model = cls(reduction)
    ref_model = copy.deepcopy(model)
    opts = quiet_options().deviceIterations(2)
    opts.Training.gradientAccumulation(2)
    training_model = poptorchsim.trainingModel(model, opts, sgd(model))
    ref_optimizer = sgd(ref_model)
    for seed in range(2):
        g = torch.Generator().manual_seed(seed)
        x, y = torch.randn(16, 4, generator=g), torch.randn(16, 4, generator=g)
        _, loss = training_model(x, y)
        _, ref_losses = reference_call(ref_model, ref_optimizer, (x, y), 2, 2, 1)
        torch.testing.assert_close(loss, ref_losses[-1, -1, -1], rtol=1e-5, atol=1e-6)
    assert_state_close(model, ref_model)


class L1WithLoss(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.loss = nn.L1Loss()

    def forward(self, x, y):
        out = self.fc(x)
        return out, self.loss(out, y)


def test_l1_loss_counts_as_a_loss_and_trains():
    """L1Loss is one of the torch losses PopTorch recognises (§7)."""
    model = L1WithLoss()
    ref_model = copy.deepcopy(model)
    training_model = poptorchsim.trainingModel(model, quiet_options(), sgd(model))
    ref_optimizer = sgd(ref_model)
    x, y = torch.randn(4, 4), torch.randn(4, 4)
    for _ in range(2):
        training_model(x, y)
        reference_call(ref_model, ref_optimizer, (x, y))
    assert_state_close(model, ref_model)


def test_identity_loss_rejects_unknown_reduction():
    with pytest.raises(AssertionError, match="Unsupported reduction type!"):
        poptorchsim.identity_loss(torch.ones(2), reduction="max")


# ---------------------------------------------------------------------------
# Wrapping, attaching and the executable's life cycle
# ---------------------------------------------------------------------------
def test_inference_with_gradient_accumulation_raises():
    opts = quiet_options()
    opts.Training.gradientAccumulation(2)
    with pytest.raises(poptorchsim.Error) as info:
        poptorchsim.inferenceModel(ClassifierWithLoss(), opts)
    assert str(info.value).startswith(
        "You must set poptorch.Options().Training.gradientAccumulation to 1 or leave it as "
        "its default value (1) when running a poptorch.inferenceModel().")


def test_wrapping_twice_raises_until_destroyed():
    model = ClassifierWithLoss()
    first = poptorchsim.trainingModel(model, quiet_options(), sgd(model))
    x, y = classification_batch(8)
    first(x, y)
    with pytest.raises(RuntimeError, match=re.escape(
            "Model has already been wrapped in 'poptorch.trainingModel'. Call "
            "model.destroy() on the model to unwrap before wrapping again.")):
        poptorchsim.trainingModel(model, quiet_options(), sgd(model))
    trained = snapshot(model)
    model.destroy()
    assert not first.isCompiled()
    assert_unchanged(model, trained)
    second = poptorchsim.trainingModel(model, quiet_options(), sgd(model))
    second(x, y)
    assert second.isCompiled()


def test_wrapping_twice_raises_even_before_compile():
    model = ClassifierWithLoss()
    first = poptorchsim.trainingModel(model, quiet_options(), sgd(model))
    with pytest.raises(RuntimeError, match="already been wrapped"):
        poptorchsim.trainingModel(model, quiet_options(), sgd(model))
    assert not first.isCompiled()


def test_call_after_destroy_recompiles_or_fails_cleanly():
    model = ClassifierWithLoss()
    training_model = poptorchsim.trainingModel(model, quiet_options(), sgd(model))
    x, y = classification_batch(8)
    training_model(x, y)
    training_model.destroy()
    with pytest.raises(poptorchsim.Error, match=re.escape(NO_EXECUTABLE)):
        training_model.copyWeightsToHost()


def test_detach_twice_raises():
    model = ClassifierWithLoss()
    training_model = poptorchsim.trainingModel(model, quiet_options(), sgd(model))
    x, y = classification_batch(8)
    training_model(x, y)
    training_model.detachFromDevice()
    trained = snapshot(model)
    with pytest.raises(poptorchsim.Error, match="^Device is not attached$"):
        training_model.detachFromDevice()
    assert_unchanged(model, trained)


def test_attach_twice_raises():
    model = ClassifierWithLoss()
    inference_model = poptorchsim.inferenceModel(model, quiet_options())
    inference_model(torch.randn(4, 6))
    with pytest.raises(poptorchsim.Error, match="^Device is already attached$"):
        inference_model.attachToDevice()


@pytest.mark.parametrize("method", ["copyWeightsToHost", "copyWeightsToDevice",
                                    "detachFromDevice", "attachToDevice"])
def test_methods_before_compile_raise(method):
    model = ClassifierWithLoss()
    before = snapshot(model)
    training_model = poptorchsim.trainingModel(model, quiet_options(), sgd(model))
    with pytest.raises(poptorchsim.Error) as info:
        getattr(training_model, method)()
    assert str(info.value) == NO_EXECUTABLE
    assert not training_model.isAttachedToDevice()
    assert_unchanged(model, before)


def test_options_of_wrong_type():
    with pytest.raises(poptorchsim.Error,
                       match=r"Invalid type: 'options' is of type <class 'dict'> "
                             r"\(Expected poptorch.Options\)"):
        poptorchsim.trainingModel(ClassifierWithLoss(), {"device_iterations": 2})


def test_unsupported_optimizer():
    model = ClassifierWithLoss()
    with pytest.raises(AssertionError, match="Unsupported optimizer type"):
        poptorchsim.trainingModel(model, quiet_options(),
                                  torch.optim.Adagrad(model.parameters(), lr=0.1))


def test_amsgrad_rejected():
    model = ClassifierWithLoss()
    with pytest.raises(ValueError, match="Only non-amsgrad Adam/AdamW optimizers are "
                                         "supported."):
        poptorchsim.optim.Adam(model.parameters(), lr=1e-3, amsgrad=True)


def test_offline_device_cannot_run():
    model = ClassifierWithLoss()
    opts = quiet_options().useOfflineIpuTarget()
    inference_model = poptorchsim.inferenceModel(model, opts)
    x = torch.randn(4, 6)
    inference_model.compile(x)
    assert inference_model.isCompiled()
    with pytest.raises(AssertionError, match=re.escape(
            "Trying to run a model on an offline device (ConnectionType.Never): use "
            "model.compile(inputs) instead of model(inputs)")):
        inference_model(x)


# ---------------------------------------------------------------------------
# Memory
# ---------------------------------------------------------------------------
class BigLinear(nn.Module):
    def __init__(self, n):
        super().__init__()
        self.fc = nn.Linear(n, n)
        self.loss = nn.MSELoss()

    def forward(self, x, y):
        out = self.fc(x)
        return out, self.loss(out, y)


def test_model_too_big_for_ipu_memory():
    # 12000 x 12000 fp32 weights (576 MB) + gradients + momentum > 897 MiB of SRAM.
    model = BigLinear(12000)
    corner = model.fc.weight[:4, :4].detach().clone()
    training_model = poptorchsim.trainingModel(
        model, quiet_options(), torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9))
    with pytest.raises(poptorchsim.OutOfMemoryError) as info:
        training_model(torch.randn(2, 12000), torch.randn(2, 12000))
    assert isinstance(info.value, poptorchsim.Error)
    assert re.match(r"Out of memory on tile \d+: \d+ bytes used but tiles only have "
                    r"638976 bytes of memory", str(info.value))
    assert not training_model.isCompiled()
    assert torch.equal(model.fc.weight[:4, :4], corner)


def test_small_model_fits():
    model = BigLinear(64)
    training_model = poptorchsim.trainingModel(
        model, quiet_options(), torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9))
    training_model.compile(torch.randn(2, 64), torch.randn(2, 64))
    assert training_model.isCompiled()
    report = training_model.memoryReport()
    assert int(report.total.max()) <= 638976


# ---------------------------------------------------------------------------
# Options setters
# ---------------------------------------------------------------------------
def test_every_n_without_period():
    with pytest.raises(AssertionError) as info:
        quiet_options().outputMode(poptorchsim.OutputMode.EveryN)
    assert str(info.value) == ("EveryN anchor must have output_return_period set to valid "
                               "positive integer")
    with pytest.raises(AssertionError, match="EveryN anchor must have output_return_period"):
        quiet_options().outputMode(poptorchsim.OutputMode.EveryN, 0)


def test_output_mode_must_be_enum():
    with pytest.raises(AssertionError):
        quiet_options().outputMode("All")


def test_other_modes_ignore_period():
    opts = quiet_options().outputMode(poptorchsim.OutputMode.All, 5)
    assert opts.output_mode == poptorchsim.OutputMode.All
    assert opts.output_return_period == 1


def test_device_iterations_wrong_type():
    # PopTorch's OptionsDict.set: "Unexpected type %s for option %s. Expected %s"
    # with the option's key (device_iterations), as in poptorch-api.md §2.
    with pytest.raises(AssertionError) as info:
        quiet_options().deviceIterations(2.0)
    assert str(info.value) == ("Unexpected type <class 'float'> for option "
                               "device_iterations. Expected <class 'int'>")


def test_set_unknown_option():
    with pytest.raises(AssertionError, match="Invalid option not_an_option, valid options "
                                             "are"):
        quiet_options().set(not_an_option=3)


def test_reading_unset_option():
    with pytest.raises(AttributeError, match=re.escape("Invalid attribute random_seed.")):
        quiet_options().random_seed  # noqa: B018 - the attribute's access raises


def test_reduction_type_no_reduction():
    with pytest.raises(ValueError):
        quiet_options().Training.accumulationAndReplicationReductionType(
            poptorchsim.ReductionType.NoReduction)


def test_jit_trace_model_true():
    with pytest.raises(ValueError, match=re.escape(
            "options.Jit.traceModel(True) is no longer supported")):
        quiet_options().Jit.traceModel(True)


def test_available_memory_proportion_keys():
    with pytest.raises(AssertionError):
        quiet_options().setAvailableMemoryProportion({"GPU0": 0.5})


def test_partials_type():
    with pytest.raises(ValueError):
        quiet_options().Precision.setPartialsType(torch.int32)


def test_setters_chain_and_return_self():
    opts = quiet_options()
    assert opts.deviceIterations(2).replicationFactor(2) is opts
    assert opts.Training.gradientAccumulation(3) is opts.Training
    assert (opts.device_iterations, opts.replication_factor,
            opts.Training.gradient_accumulation) == (2, 2, 3)


# ---------------------------------------------------------------------------
# Argument parsing (poptorch-api.md §3, step 2)
# ---------------------------------------------------------------------------
class TwoInputs(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(6, 4)

    def forward(self, x, y):
        return self.fc(x) + y


def test_missing_mandatory_parameter():
    inference_model = poptorchsim.inferenceModel(TwoInputs(), quiet_options())
    with pytest.raises(poptorchsim.Error, match=r"Mandatory parameter y missing: "
                       r"TwoInputs.forward\(x, y\) needs it; pass it positionally or as y="):
        inference_model(torch.randn(4, 6))


def test_too_many_arguments():
    inference_model = poptorchsim.inferenceModel(TwoInputs(), quiet_options())
    with pytest.raises(AssertionError, match=re.escape(
            "Too many arguments provided: expected ['x', 'y'] (2) but got 3")):
        inference_model(torch.randn(4, 6), torch.randn(4, 4), torch.randn(4, 4))


def test_non_tensor_argument_value_change():
    class Scaled(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(6, 4)

        def forward(self, x, k=2):
            return self.fc(x) * k

    inference_model = poptorchsim.inferenceModel(Scaled(), quiet_options())
    inference_model(torch.randn(4, 6))
    with pytest.raises(poptorchsim.InputMismatchError) as info:
        inference_model(torch.randn(4, 6), 3)
    assert str(info.value) == "Value mismatch for k: expected 2 but got 3." + MISMATCH_SUFFIX


def test_zero_sized_input():
    inference_model = poptorchsim.inferenceModel(nn.Linear(6, 4), quiet_options())
    with pytest.raises(poptorchsim.Error, match=re.escape(
            "Zero-sized tensors are unsupported (Got shape [0, 6])")):
        inference_model(torch.randn(0, 6))


# ---------------------------------------------------------------------------
# Output mode EveryN: PopART's DataFlow::isValidAnchorReturnPeriod
# ---------------------------------------------------------------------------
def test_every_n_period_larger_than_device_iterations():
    opts = quiet_options().deviceIterations(4).outputMode(poptorchsim.OutputMode.EveryN, 8)
    inference_model = poptorchsim.inferenceModel(nn.Linear(6, 4), opts)
    with pytest.raises(poptorchsim.Error,
                       match="Return period must be <= to the number of batches per step"):
        inference_model(torch.randn(8, 6))


def test_every_n_period_not_a_factor_of_device_iterations():
    opts = quiet_options().deviceIterations(4).outputMode(poptorchsim.OutputMode.EveryN, 3)
    inference_model = poptorchsim.inferenceModel(nn.Linear(6, 4), opts)
    with pytest.raises(poptorchsim.Error,
                       match="Return period must be a factor of the number of batches "
                             "per step"):
        inference_model(torch.randn(8, 6))


# ---------------------------------------------------------------------------
# Buffers changed by forward() (poptorch-api.md §7; PopTorch's buffers_test.py)
# ---------------------------------------------------------------------------
def test_buffer_removed_in_forward():
    class RemovesBuffer(nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("y", torch.tensor([2.0]))

        def forward(self, x):
            x = x + 1
            if "y" in self._buffers:
                del self._buffers["y"]
            return x

    inference_model = poptorchsim.inferenceModel(RemovesBuffer(), quiet_options())
    with pytest.raises(poptorchsim.Error, match=re.escape(
            "Buffer y is removed from the model when calling the forward method.")):
        inference_model(torch.tensor([5.0]))


def test_buffer_reassigned_in_forward():
    class ReassignsBuffer(nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("y", torch.tensor([2.0]))

        def forward(self, x):
            x = x + 1
            self.y = x
            return x

    inference_model = poptorchsim.inferenceModel(ReassignsBuffer(), quiet_options())
    with pytest.raises(poptorchsim.Error, match=re.escape(
            "Buffer y is reassigned within the model when calling the forward method. "
            "This is not supported. Consider using self.y.copy_(src) to copy data from a "
            "source tensor, where src is the name of the source tensor.")):
        inference_model(torch.tensor([5.0]))


class BufferUpdatingModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(2, 2, 1)
        self.register_buffer("test_buff", torch.zeros(2))
        self.loss = nn.MSELoss()

    def forward(self, x, target):
        out = self.conv(x)
        with torch.no_grad():
            self.test_buff += self.conv.bias[0]
        return out, self.loss(out, target)


def test_inplace_buffer_update_with_replicas_needs_broadcast_off():
    model = BufferUpdatingModel()
    before = snapshot(model)
    opts = quiet_options().replicationFactor(2)
    training_model = poptorchsim.trainingModel(
        model, opts, torch.optim.SGD(model.parameters(), lr=0.1))
    x = torch.ones(4, 2, 2, 2)
    with pytest.raises(poptorchsim.Error, match=re.escape(
            "PopTorch does not support broadcasting buffers. If your model is able to "
            "tolerate buffers becoming out of sync between replicas, you can disable "
            "buffer broadcasting using poptorch.Options.broadcastBuffers(False).")):
        training_model(x, torch.zeros_like(x))
    assert_unchanged(model, before)


def test_compilation_time_errors():
    x = torch.randn(4, 6)
    inference_model = poptorchsim.inferenceModel(nn.Linear(6, 4), quiet_options())
    with pytest.raises(poptorchsim.Error, match=re.escape(
            "Please compile the model before obtaining compilation time.")):
        inference_model.compilationTime()
    inference_model(x)
    # The time comes from the progress bar, which quiet_options() turned off.
    with pytest.raises(poptorchsim.Error, match=re.escape(
            "Please set showCompilationProgressBar option to obtain compilation time.")):
        inference_model.compilationTime()


def test_compilation_time_with_progress_bar():
    import datetime
    opts = poptorchsim.Options().showCompilationProgressBar(True)
    inference_model = poptorchsim.inferenceModel(nn.Linear(6, 4), opts)
    inference_model(torch.randn(4, 6))
    assert isinstance(inference_model.compilationTime(), datetime.timedelta)


# ---------------------------------------------------------------------------
# Semantics PopTorch users rely on, and errors that say how to fix them
# ---------------------------------------------------------------------------
def test_destroy_keeps_weights_the_user_changed_after_training():
    model = ClassifierWithLoss()
    opt = sgd(model)
    tm = poptorchsim.trainingModel(model, quiet_options(), opt)
    tm(*classification_batch(8))
    model.fc1.weight = nn.Parameter(torch.full_like(model.fc1.weight, 7.0))
    with torch.no_grad():
        model.fc2.bias.fill_(-3.0)
    tm.destroy()
    assert torch.all(model.fc1.weight == 7.0) and torch.all(model.fc2.bias == -3.0)
    # the optimizer state still comes back (momentum after one step)
    assert opt.state[model.fc2.weight]["momentum_buffer"].abs().sum() > 0


def test_a_wrapped_model_can_be_saved_and_loads_unwrapped(tmp_path):
    model = ClassifierWithLoss()
    tm = poptorchsim.trainingModel(model, quiet_options(), sgd(model))
    tm(*classification_batch(8))
    path = tmp_path / "model.pt"
    torch.save(model, path)
    loaded = torch.load(path, weights_only=False)
    assert_state_close(loaded, model, rtol=0, atol=0)
    with pytest.raises(poptorchsim.Error, match="model was never wrapped"):
        loaded.destroy()
    again = poptorchsim.trainingModel(loaded, quiet_options(), sgd(loaded))   # not wrapped
    again(*classification_batch(8))
    copy.deepcopy(model)                      # the wrapped original still copies


def test_an_optimizer_over_other_parameters_is_refused():
    model, other = ClassifierWithLoss(), ClassifierWithLoss()
    before = snapshot(model)
    opts = quiet_options()
    with pytest.raises(poptorchsim.Error, match=r"parameter group 0 holds 4 tensor\(s\) that "
                       r"are not parameters of the model.*model.parameters\(\)"):
        poptorchsim.trainingModel(model, opts, sgd(other))
    assert_unchanged(model, before)
    opts.deviceIterations(1)                  # the options were not frozen
    poptorchsim.trainingModel(model, opts, sgd(model))(*classification_batch(8))


def test_inputs_that_require_grad_are_detached_with_poptorchs_warning():
    """PopTorch 3 detaches an input that requires grad and warns: the model
    trains as with the detached input, and no gradient reaches the caller's
    tensor, on the compiling call and after it."""
    model, reference = ClassifierWithLoss(), ClassifierWithLoss()
    reference.load_state_dict(model.state_dict())
    tm = poptorchsim.trainingModel(model, quiet_options(), sgd(model))
    ref = poptorchsim.trainingModel(reference, quiet_options(), sgd(reference))
    x, y = classification_batch(8)
    with poptorchsim_log(logging.WARNING) as records:
        _, loss = tm(x.clone().requires_grad_(), y)
    assert "Input tensor has requires_grad=True set. This tensor will be detached because " \
           "backward pass via inputs is not supported." in records.messages
    torch.testing.assert_close(loss, ref(x, y)[1], rtol=0, atol=0)
    again = x.clone().requires_grad_()
    torch.testing.assert_close(tm(again, y)[1], ref(x, y)[1], rtol=0, atol=0)
    assert again.grad is None
    for a, b in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_option_errors_say_how_to_fix_them():
    opts = quiet_options()
    poptorchsim.inferenceModel(nn.Linear(2, 2), opts)
    with pytest.raises(AttributeError, match=r"Can't modify frozen Options: .*options.clone\(\)"):
        opts.deviceIterations(2)
    with pytest.raises(AttributeError, match=r"Invalid attribute deviceIteration\. Did you mean "
                       r"deviceIterations\?"):
        poptorchsim.Options().deviceIteration(2)
    with pytest.raises(AttributeError, match=r"gradientAcumulation\. Did you mean "
                       r"gradientAccumulation\?"):
        poptorchsim.Options().Training.gradientAcumulation(2)
    with pytest.raises(AttributeError, match=r"Invalid attribute zzz\.$"):
        poptorchsim.Options().zzz()


def test_a_destroyed_wrapper_compiles_again_for_other_inputs():
    """After destroy(), the mismatch error's fix: the same wrapper called
    with inputs of another structure (a list) compiles for them, and a
    change forward() makes to an input in place reaches the caller's list."""
    class AddInPlace(nn.Module):
        def forward(self, x):
            if isinstance(x, list):
                x[0] += 4
            else:
                x += 1

    model = poptorchsim.inferenceModel(AddInPlace(), quiet_options())
    t = torch.ones(1)
    model(t)
    assert t.item() == 2.0
    with pytest.raises(poptorchsim.InputMismatchError):
        model([torch.ones(1)])
    model.destroy()
    listed = [torch.ones(1)]
    assert model(listed) is None
    assert listed[0].item() == 5.0
