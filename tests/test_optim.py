"""poptorchsim.optim: LAMB, loss scaling, accumulation types, SGD's combined
variant and velocity scaling, variable and constant attributes, and the
optimizer state through state_dict / load_state_dict (docs/optimizers.md)."""
import copy
import io
import logging
import pickle
import re

import pytest
import torch
from conftest import (
    ClassifierWithLoss,
    LogRecords,
    assert_state_close,
    classification_batch,
    quiet_options,
    reference_call,
)

import poptorchsim

optim = poptorchsim.optim


def options(di=1, ga=1, rf=1):
    o = quiet_options().deviceIterations(di).replicationFactor(rf)
    o.Training.gradientAccumulation(ga)
    return o


def batches(di, ga, rf, calls=3, micro=4):
    return [classification_batch(micro * di * ga * rf, seed=40 + c) for c in range(calls)]


def train_against_eager(make, di=2, ga=2, rf=1, calls=3, model=None):
    """The same optimizer on the simulated IPU and in eager PyTorch (its own step())."""
    model = model if model is not None else ClassifierWithLoss()
    ref = copy.deepcopy(model)
    opt, ref_opt = make(model.parameters()), make(ref.parameters())
    tm = poptorchsim.trainingModel(model, options(di, ga, rf), opt)
    for batch in batches(di, ga, rf, calls):
        tm(*batch)
        reference_call(ref, ref_opt, batch, di, ga, rf)
    return model, ref, tm, opt


# -- LAMB ---------------------------------------------------------------------------------
def lamb_reference(params, grads_per_step, lr, betas, eps, wd, max_weight_norm, bias=True):
    """LAMB written out from the paper's formula in float64: the trust ratio
    phi(||w||) / ||u||, phi(z) = min(z, max_weight_norm), 1 if either is 0."""
    w = [p.detach().double().clone() for p in params]
    m = [torch.zeros_like(x) for x in w]
    v = [torch.zeros_like(x) for x in w]
    b1, b2 = betas
    for t, grads in enumerate(grads_per_step, start=1):
        for i, g in enumerate(grads):
            g = g.double()
            m[i] = b1 * m[i] + (1 - b1) * g
            v[i] = b2 * v[i] + (1 - b2) * g * g
            mc = m[i] / (1 - b1 ** t) if bias else m[i]
            vc = v[i] / (1 - b2 ** t) if bias else v[i]
            u = mc / (vc.sqrt() + eps) + wd * w[i]
            r1 = min(float(torch.linalg.norm(w[i])), max_weight_norm)
            r2 = float(torch.linalg.norm(u))
            trust = r1 / r2 if r1 > 0 and r2 > 0 else 1.0
            w[i] = w[i] - lr * trust * u
    return w


def test_lamb_defaults_follow_poptorch():
    model = ClassifierWithLoss()
    opt = optim.LAMB(model.parameters())
    group = opt.param_groups[0]
    assert (group["lr"], group["betas"], group["eps"], group["weight_decay"]) == \
        (1e-3, (0.9, 0.999), 1e-8, 1e-2)
    assert group["max_weight_norm"] == opt.max_weight_norm == 65500.0   # None: fp16's max
    assert opt.bias_correction and opt.loss_scaling == 1.0
    assert opt.accum_type == opt.first_order_momentum_accum_type == \
        opt.second_order_momentum_accum_type == torch.float32
    assert isinstance(opt, torch.optim.Optimizer) and isinstance(opt, optim.Optimizer)
    assert opt.variable_attrs.isConstant("lr")          # not passed: constant
    assert not optim.LAMB(model.parameters(), lr=0.1).variable_attrs.isConstant("lr")
    with pytest.raises(AssertionError, match="Accumulation types must be either"):
        optim.LAMB(model.parameters(), accum_type=torch.bfloat16)


@pytest.mark.parametrize("bias_correction", [True, False])
def test_lamb_on_the_ipu_equals_its_eager_step_and_the_formula(bias_correction):
    """Several steps with gradient accumulation; a small max_weight_norm so the
    clipping of the trust ratio takes part."""
    kw = dict(lr=0.02, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.05, max_weight_norm=0.9,
              bias_correction=bias_correction)
    model = ClassifierWithLoss()
    start = copy.deepcopy(model)
    assert torch.linalg.norm(model.fc1.weight) > 0.9         # clipped
    assert torch.linalg.norm(model.fc2.bias) < 0.9           # not clipped
    model, ref, _, _ = train_against_eager(lambda p: optim.LAMB(p, **kw), model=model)
    assert not torch.allclose(model.fc1.weight, start.fc1.weight)
    assert_state_close(model, ref)
    # the formula, fed the gradients eager PyTorch computes along the way
    grads_per_step, replay = [], copy.deepcopy(start)
    replay_opt = optim.LAMB(replay.parameters(), **kw)
    for batch in batches(2, 2, 1):
        for i in range(2):
            replay_opt.zero_grad()
            for g in range(2):
                x, y = batch[0][(i * 2 + g) * 4:(i * 2 + g + 1) * 4], \
                    batch[1][(i * 2 + g) * 4:(i * 2 + g + 1) * 4]
                (replay(x, y)[1] / 2).backward()
            grads_per_step.append([p.grad.clone() for p in replay.parameters()])
            replay_opt.step()
    expected = lamb_reference(start.parameters(), grads_per_step, kw["lr"], kw["betas"],
                              kw["eps"], kw["weight_decay"], kw["max_weight_norm"],
                              bias_correction)
    for p, e in zip(model.parameters(), expected):
        torch.testing.assert_close(p.detach().double(), e, rtol=1e-5, atol=1e-6)


def test_lamb_trains_the_poptorch_test_model():
    """PopTorch's test_lamb_max_weight_norm: LAMB trains with and without a
    max_weight_norm."""
    for max_weight_norm in (100.0, None):
        torch.manual_seed(42)
        model = torch.nn.Linear(10, 10)
        x, label = torch.randn(1, 10), torch.randint(0, 10, [1])

        class WithLoss(torch.nn.Module):
            def __init__(self, base):
                super().__init__()
                self.base = base

            def forward(self, x, t):
                out = self.base(x)
                return out, torch.nn.functional.cross_entropy(out, t)
        tm = poptorchsim.trainingModel(WithLoss(model), quiet_options().deviceIterations(100),
                                       optim.LAMB(model.parameters(), lr=0.01,
                                                  max_weight_norm=max_weight_norm))
        first = tm(x.repeat(100, 1), label.repeat(100))[1]
        for _ in range(9):
            out, loss = tm(x.repeat(100, 1), label.repeat(100))
        assert loss < first and loss < 0.03
        assert torch.argmax(out[-1]) == label


# -- loss scaling ---------------------------------------------------------------------------
@pytest.mark.parametrize("make", [
    lambda p: optim.SGD(p, lr=0.05, momentum=0.9, weight_decay=1e-3, loss_scaling=1024.0),
    lambda p: optim.SGD(p, lr=0.05, momentum=0.9, nesterov=True, loss_scaling=1024.0),
    lambda p: optim.Adam(p, lr=1e-2, weight_decay=1e-3, loss_scaling=1024.0),
    lambda p: optim.AdamW(p, lr=1e-2, loss_scaling=1024.0),
    lambda p: optim.RMSprop(p, lr=1e-2, momentum=0.5, centered=True, loss_scaling=1024.0),
    lambda p: optim.LAMB(p, lr=1e-2, loss_scaling=1024.0),
], ids=["sgd", "sgd_nesterov", "adam", "adamw", "rmsprop", "lamb"])
def test_loss_scaling_in_fp32_equals_pytorch(make):
    """The loss is multiplied by the scale and the gradients divided by it:
    in float32 the weights stay PyTorch's (eager steps know no loss scaling)."""
    model, ref, tm, _ = train_against_eager(make, di=2, ga=2, rf=2)
    assert_state_close(model, ref)
    step = tm.getIR().graphs["training_step"]
    assert [t.name for t in step.inputs if t.role == "hyper"] == ["lossScaling"]


def test_without_loss_scaling_the_step_has_no_scale_input():
    model = ClassifierWithLoss()
    tm = poptorchsim.trainingModel(model, quiet_options(),
                                   optim.SGD(model.parameters(), lr=0.1))
    tm(*classification_batch(4))
    assert not [t for t in tm.getIR().graphs["training_step"].inputs if t.role == "hyper"]


class TinyLossModel(torch.nn.Module):
    """A float16 linear layer whose loss is so small (x 1e-8) that its
    gradients (about 1e-9) are below float16's smallest subnormal (6e-8)."""

    def __init__(self, scale=1e-8):
        super().__init__()
        self.fc = torch.nn.Linear(8, 4)
        self.scale = scale

    def forward(self, x, t):
        out = self.fc(x)
        loss = torch.nn.functional.mse_loss(out, t) * self.scale
        return out, poptorchsim.identity_loss(loss, reduction="none")


FP16_DATA = (torch.randn(8, 8, generator=torch.Generator().manual_seed(1)),
             torch.randn(8, 4, generator=torch.Generator().manual_seed(2)))


def _fp16_step(make):
    """(the float16 model before, after one step with the optimizer ``make`` makes)."""
    torch.manual_seed(0)
    model = TinyLossModel().half()
    before = copy.deepcopy(model)
    tm = poptorchsim.trainingModel(model, quiet_options(), make(model.parameters()))
    tm(FP16_DATA[0].half(), FP16_DATA[1].half())
    return before, model


def test_fp16_gradients_underflow_without_loss_scaling_as_on_the_ipu():
    for kw in ({}, {"loss_scaling": 1.0}):
        before, after = _fp16_step(lambda p, kw=kw: optim.SGD(p, lr=1e6, **kw))
        assert torch.equal(before.fc.weight, after.fc.weight)   # all gradients flushed to 0
    before, after = _fp16_step(lambda p: optim.SGD(p, lr=1e6, loss_scaling=2.0 ** 15))
    moved = (after.fc.weight.float() - before.fc.weight.float()).abs()
    assert (moved > 0).float().mean() > 0.9
    # the step is lr times the true gradient: the scale is divided out again
    fp32 = copy.deepcopy(before).float()
    fp32(FP16_DATA[0].half().float(), FP16_DATA[1].half().float())[1].backward()
    expected = fp32.fc.weight.detach() - 1e6 * fp32.fc.weight.grad
    torch.testing.assert_close(after.fc.weight.float(), expected, rtol=0, atol=1e-3)
    # Adam too, whatever the size of the gradient
    before, after = _fp16_step(lambda p: optim.Adam(p, lr=1e-2, loss_scaling=1.0))
    assert torch.equal(before.fc.weight, after.fc.weight)
    before, after = _fp16_step(lambda p: optim.Adam(p, lr=1e-2, loss_scaling=2.0 ** 15))
    assert (after.fc.weight != before.fc.weight).float().mean() > 0.9


def test_a_loss_scaling_too_large_for_fp16_gives_non_finite_weights():
    """2**16 is beyond float16's largest value (65504): the scaled loss
    gradient overflows, as on an IPU without automatic loss scaling."""
    _, after = _fp16_step(lambda p: optim.SGD(p, lr=1e6, loss_scaling=2.0 ** 16))
    assert not torch.isfinite(after.fc.weight).all()
    # a large gradient overflows at a smaller scale
    torch.manual_seed(0)
    model = TinyLossModel(scale=1.0).half()
    tm = poptorchsim.trainingModel(model, quiet_options(),
                                   optim.SGD(model.parameters(), lr=1e-3, loss_scaling=2.0 ** 15))
    x = torch.full((8, 8), 30.0).half()
    tm(x, torch.full((8, 4), -30.0).half())
    assert not torch.isfinite(model.fc.weight).all()


def test_loss_scaling_variable_changes_without_recompiling():
    """PopTorch's test_optimizer_const: a loss_scaling passed to the
    constructor (even 1.0) is variable."""
    model = ClassifierWithLoss()
    ref = copy.deepcopy(model)
    opt = optim.Adam(model.parameters(), lr=1e-2, loss_scaling=1.0)
    ref_opt = torch.optim.Adam(ref.parameters(), lr=1e-2)
    tm = poptorchsim.trainingModel(model, options(), opt)
    data = batches(1, 1, 1)
    tm(*data[0])
    reference_call(ref, ref_opt, data[0])
    update = tm.getIR().graphs["optimizer_update"]
    opt.loss_scaling = 2.0
    tm.setOptimizer(opt)
    for batch in data[1:]:
        tm(*batch)
        reference_call(ref, ref_opt, batch)
    assert tm.getIR().graphs["optimizer_update"] is update
    assert_state_close(model, ref)


def test_a_new_loss_scaling_reads_sgds_stored_velocity_with_the_new_factor():
    """The separate SGD keeps its velocity multiplied by the loss scaling
    (PopART's velocity scaling); a new loss scaling divides the stored
    velocity by the new factor, as on the IPU (PopTorch: changing the scaling
    during training over- or under-estimates the velocity for a while)."""
    model = ClassifierWithLoss()
    opt = optim.SGD(model.parameters(), lr=0.1, momentum=0.9, loss_scaling=1.0)
    tm = poptorchsim.trainingModel(model, options(), opt)
    batch = classification_batch(4)
    tm(*batch)
    stored = opt.state_dict()["ipu_state"]["Accl___fc1.weight"].clone()
    opt.loss_scaling = 4.0
    tm.setOptimizer(opt)
    probe = copy.deepcopy(model)
    probe(*batch)[1].backward()
    before = model.fc1.weight.detach().clone()
    tm(*batch)
    velocity = 0.9 * stored / 4.0 + probe.fc1.weight.grad       # torch: 0.9 * stored + g
    torch.testing.assert_close(model.fc1.weight, before - 0.1 * velocity)
    torch.testing.assert_close(opt.state_dict()["ipu_state"]["Accl___fc1.weight"],
                               4.0 * velocity)


# -- SGD: velocity scaling and the combined variant ------------------------------------------
def test_separate_sgd_keeps_its_velocity_multiplied_by_the_loss_scaling():
    model = ClassifierWithLoss()
    opt = optim.SGD(model.parameters(), lr=0.1, momentum=0.9, loss_scaling=64.0)
    tm = poptorchsim.trainingModel(model, options(di=2), opt)
    tm(*classification_batch(8))
    device = opt.state_dict()["ipu_state"]["Accl___fc1.weight"]
    torch.testing.assert_close(device, 64.0 * opt.state[model.fc1.weight]["momentum_buffer"])



def test_velocity_scaling_is_for_the_combined_variant():
    model = ClassifierWithLoss()
    records = LogRecords()
    logging.getLogger("poptorchsim").addHandler(records)
    try:
        opt = optim.SGD(model.parameters(), lr=0.1, velocity_scaling=8.0)
    finally:
        logging.getLogger("poptorchsim").removeHandler(records)
    assert any("velocity_scaling value ignored when using the separate variant" in m
               for m in records.messages)
    assert "velocity_scaling" not in opt.param_groups[0]
    opt = optim.SGD(model.parameters(), lr=0.1, velocity_scaling=8.0, use_combined_accum=True)
    assert opt.param_groups[0]["velocity_scaling"] == 8.0       # per group, like lr


@pytest.mark.parametrize("kw", [dict(momentum=0.9, weight_decay=1e-3),
                                dict(momentum=0.9, nesterov=True, weight_decay=1e-3),
                                dict(momentum=0.0)],
                         ids=["momentum", "nesterov", "accumulation_only"])
def test_combined_sgd_equals_pytorch_without_dampening(kw):
    """PopART's SGD1 equations: the micro-batch gradients go straight into the
    velocity (scaled by velocity_scaling / loss_scaling), the momentum and
    weight-decay terms of the next step are added after the weight update."""
    model = ClassifierWithLoss()
    ref = copy.deepcopy(model)
    opt = optim.SGD(model.parameters(), lr=0.05, use_combined_accum=True,
                    velocity_scaling=16.0, loss_scaling=4.0, **kw)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05, **kw)
    tm = poptorchsim.trainingModel(model, options(2, 2, 2), opt)
    for batch in batches(2, 2, 2):
        tm(*batch)
        reference_call(ref, ref_opt, batch, 2, 2, 2)
    assert_state_close(model, ref)


def test_combined_sgd_holds_one_tensor_per_weight():
    """No gradient accumulator and no optimizer state: one velocity tensor of
    the weight's type, where the separate variant keeps an accumulator and a
    velocity."""
    def memory(**kw):
        torch.manual_seed(0)
        model = ClassifierWithLoss(in_features=64, hidden=64)
        tm = poptorchsim.trainingModel(model, options(ga=4),
                                       optim.SGD(model.parameters(), lr=0.1, momentum=0.9, **kw))
        tm.compile(*classification_batch(16, in_features=64))
        report = tm.memoryReport().by_tensor
        return {k.split("/")[0]: int(v.sum()) for k, v in report.items()
                if k.endswith("/fc1.weight")}, tm
    separate, _ = memory()
    combined, tm = memory(use_combined_accum=True,
                          accum_type=torch.float16, velocity_accum_type=torch.float16)
    weight = 64 * 64 * 4
    assert separate["grad"] == separate["momentum_buffer"] == weight
    assert combined == {"velocity": weight, "step": 4}      # accum types ignored
    update = tm.getIR().graphs["optimizer_update"]
    assert not [t for t in update.inputs if t.role == "state" and "step" not in t.name]


def test_combined_sgd_dampens_the_first_step_as_popart():
    """Unlike torch, SGD1 applies (1 - dampening) to the first gradient too."""
    model = ClassifierWithLoss()
    start = copy.deepcopy(model)
    opt = optim.SGD(model.parameters(), lr=0.1, momentum=0.9, dampening=0.5,
                    use_combined_accum=True)
    tm = poptorchsim.trainingModel(model, options(), opt)
    batch = classification_batch(4)
    tm(*batch)
    start(*batch)[1].backward()
    torch.testing.assert_close(model.fc1.weight, start.fc1.weight - 0.1 * 0.5
                               * start.fc1.weight.grad, rtol=1e-5, atol=1e-7)


def _tiny_fp16_sgd(**kw):
    torch.manual_seed(0)
    model = TinyLossModel(scale=1e-7)
    g = torch.Generator().manual_seed(1)
    x, t = torch.randn(8, 8, generator=g).repeat(3, 1), torch.randn(8, 4, generator=g).repeat(3, 1)
    ref = copy.deepcopy(model)
    ref_tm = poptorchsim.trainingModel(ref, options(di=3),
                                       torch.optim.SGD(ref.parameters(), lr=1e5, momentum=0.9))
    ref_tm(x, t)
    if kw.pop("half", False):
        model.half()
        x, t = x.half(), t.half()
    tm = poptorchsim.trainingModel(model, options(di=3),
                                   optim.SGD(model.parameters(), lr=1e5, momentum=0.9, **kw))
    tm(x, t)
    return (model.fc.weight.float() - ref.fc.weight).abs().max().item()


def test_velocity_scaling_keeps_a_float16_velocity_from_underflowing():
    """Gradients of about 1e-8: a float16 velocity holding them as they are
    loses them; scaled (by velocity_scaling in the combined variant, by the
    loss scaling in the separate one) it keeps them."""
    plain = _tiny_fp16_sgd(half=True, use_combined_accum=True, loss_scaling=2.0 ** 14)
    scaled = _tiny_fp16_sgd(half=True, use_combined_accum=True, loss_scaling=2.0 ** 14,
                            velocity_scaling=2.0 ** 14)
    assert scaled < 1e-3 < 5e-3 < plain
    plain = _tiny_fp16_sgd(velocity_accum_type=torch.float16)
    scaled = _tiny_fp16_sgd(velocity_accum_type=torch.float16, loss_scaling=2.0 ** 14)
    assert scaled < 1e-4 < 1e-3 < plain


def test_combined_sgd_refuses_max_grad_norm():
    model = ClassifierWithLoss()
    tm = poptorchsim.trainingModel(model, quiet_options(), optim.SGD(
        model.parameters(), lr=0.1, momentum=0.9, use_combined_accum=True, max_grad_norm=1.0))
    with pytest.raises(poptorchsim.Error, match="use_combined_accum=False"):
        tm(*classification_batch(4))


def test_plain_sgd_ignores_the_variant_and_types():
    """Momentum 0 and no gradient accumulation: the plain update, no state."""
    model = ClassifierWithLoss()
    tm = poptorchsim.trainingModel(model, quiet_options(), optim.SGD(
        model.parameters(), lr=0.1, use_combined_accum=True, accum_type=torch.float16))
    tm(*classification_batch(4))
    assert tm._compiled.plan.kind == "sgd"
    assert all(slots == [] for slots in tm._state.opt_state)


# -- accumulation types ---------------------------------------------------------------------
def test_float16_state_is_stored_and_reported_in_float16():
    def run(**kw):
        torch.manual_seed(0)
        model = ClassifierWithLoss()
        tm = poptorchsim.trainingModel(model, options(di=2),
                                       optim.Adam(model.parameters(), lr=1e-2, **kw))
        for batch in batches(2, 1, 1):
            tm(*batch)
        return model, tm
    fp32, tm32 = run()
    fp16, tm16 = run(first_order_momentum_accum_type=torch.float16,
                     second_order_momentum_accum_type=torch.float16)
    first16, _ = run(first_order_momentum_accum_type=torch.float16)
    names = tm16._compiled.capture.trainable_names
    exp_avg, exp_avg_sq = tm16._state.opt_state[names.index("fc1.weight")]
    assert exp_avg.dtype == exp_avg_sq.dtype == torch.float16
    numel = fp16.fc1.weight.numel()
    for tm, size in ((tm32, 4), (tm16, 2)):
        report = tm.memoryReport().by_tensor
        assert int(report["exp_avg/fc1.weight"].sum()) == numel * size
        assert int(report["exp_avg_sq/fc1.weight"].sum()) == numel * size
    # a float16 first moment rounds; a float16 second moment (squared
    # gradients) underflows to 0 for gradients under about 2.4e-4, where the
    # step becomes m / eps: as on an IPU, a larger eps is needed with it
    assert not torch.equal(fp32.fc1.weight, first16.fc1.weight)
    torch.testing.assert_close(fp32.fc1.weight, first16.fc1.weight, rtol=0, atol=1e-3)
    assert not torch.allclose(fp32.fc1.weight, fp16.fc1.weight, rtol=0, atol=1e-2)
    assert "float16" in str(tm16.getIR().graphs["optimizer_update"])


def test_float16_gradient_accumulator_switches_to_a_running_mean():
    model = ClassifierWithLoss()
    opts = options(ga=4)
    opt = optim.SGD(model.parameters(), lr=0.1, momentum=0.9, accum_type=torch.float16,
                    velocity_accum_type=torch.float16)
    tm = poptorchsim.trainingModel(model, opts, opt)
    assert tm.options.Training.meanAccumulationAndReplicationReductionStrategy == \
        poptorchsim.MeanReductionStrategy.Running
    ref = copy.deepcopy(model)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    for batch in batches(1, 4, 1):
        tm(*batch)
        reference_call(ref, ref_opt, batch, 1, 4, 1)
    report = tm.memoryReport().by_tensor
    numel = model.fc1.weight.numel()
    assert int(report["grad/fc1.weight"].sum()) == 2 * numel
    assert int(report["momentum_buffer/fc1.weight"].sum()) == 2 * numel
    assert not torch.equal(model.fc1.weight, ref.fc1.weight)
    torch.testing.assert_close(model.fc1.weight, ref.fc1.weight, rtol=0, atol=1e-3)
    # the combined variant keeps the Post strategy (PopTorch)
    m2 = ClassifierWithLoss()
    tm2 = poptorchsim.trainingModel(m2, options(ga=4), optim.SGD(
        m2.parameters(), lr=0.1, accum_type=torch.float16, use_combined_accum=True))
    assert tm2.options.Training.meanAccumulationAndReplicationReductionStrategy == \
        poptorchsim.MeanReductionStrategy.Post


def test_float16_accumulator_after_compiling_needs_the_running_mean():
    model = ClassifierWithLoss()
    tm = poptorchsim.trainingModel(model, quiet_options(),
                                   optim.SGD(model.parameters(), lr=0.1))
    tm(*classification_batch(4))
    with pytest.raises(ValueError, match=re.escape(
            "Invalid optimizer: the new optimizer would require changing options.Training."
            "meanAccumulationAndReplicationReductionStrategy to "
            "poptorch.MeanReductionStrategy.Running but the executable is already compiled.")):
        tm.setOptimizer(optim.SGD(model.parameters(), lr=0.1, accum_type=torch.float16))


def test_rmsprop_tf_variant_and_float16_mean_square():
    torch.manual_seed(0)
    model = ClassifierWithLoss()
    start = copy.deepcopy(model)
    opt = optim.RMSprop(model.parameters(), lr=1e-2, alpha=0.9, eps=1e-3, momentum=0.5,
                        use_tf_variant=True)
    tm = poptorchsim.trainingModel(model, options(di=2), opt)
    data = classification_batch(8)
    tm(*data)
    # TensorFlow's RMSprop: mean square from 1, eps inside the sqrt, lr in the momentum
    w = [p.detach().clone() for p in start.parameters()]
    ms = [torch.ones_like(p) for p in w]
    mom = [torch.zeros_like(p) for p in w]
    for i in range(2):
        m = copy.deepcopy(start)
        for p, v in zip(m.parameters(), w):
            p.data = v.clone()
        m(data[0][i * 4:(i + 1) * 4], data[1][i * 4:(i + 1) * 4])[1].backward()
        for k, p in enumerate(m.parameters()):
            ms[k] = 0.9 * ms[k] + 0.1 * p.grad ** 2
            mom[k] = 0.5 * mom[k] + 1e-2 * p.grad / torch.sqrt(ms[k] + 1e-3)
            w[k] = w[k] - mom[k]
    for p, e in zip(model.parameters(), w):
        torch.testing.assert_close(p.detach(), e, rtol=1e-5, atol=1e-6)


def test_adamw_without_bias_correction():
    torch.manual_seed(0)
    model = ClassifierWithLoss()
    start = copy.deepcopy(model)
    tm = poptorchsim.trainingModel(model, options(), optim.AdamW(
        model.parameters(), lr=1e-2, weight_decay=0.1, bias_correction=False))
    batch = classification_batch(4)
    tm(*batch)
    start(*batch)[1].backward()
    for p, q in zip(model.parameters(), start.parameters()):
        g = q.grad
        m, v = 0.1 * g, 0.001 * g * g
        expected = q.detach() * (1 - 1e-2 * 0.1) - 1e-2 * m / (v.sqrt() + 1e-8)
        torch.testing.assert_close(p.detach(), expected, rtol=1e-5, atol=1e-6)


# -- variable and constant attributes -------------------------------------------------------
def test_variable_attributes_as_poptorch():
    model = ClassifierWithLoss()
    # PopTorch's docs: lr, momentum and loss_scaling will be marked as variable
    opt = optim.SGD(model.parameters(), lr=0.01, momentum=0.0, use_combined_accum=False)
    va = opt.variable_attrs
    assert isinstance(va, optim.VariableAttributes)
    assert not va.isConstant("lr") and not va.isConstant("momentum")
    assert va.isConstant("loss_scaling") and va.isConstant("weight_decay")
    va.markAsVariable("loss_scaling")
    va.markAsConstant("momentum")
    assert not va.isConstant("loss_scaling") and va.isConstant("momentum")
    with pytest.raises(AssertionError, match=re.escape("Unknown attribute foo, allowed values: ")):
        va.markAsConstant("foo")
    with pytest.raises(AssertionError, match="Unknown attribute velocity_scaling"):
        va.markAsVariable("velocity_scaling")       # only the combined variant has it
    combined = optim.SGD(model.parameters(), lr=0.01, use_combined_accum=True)
    combined.variable_attrs.markAsVariable("velocity_scaling")


def test_changing_a_variable_attribute_keeps_the_compiled_program():
    model = ClassifierWithLoss()
    ref = copy.deepcopy(model)
    opt = optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-3)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-3)
    tm = poptorchsim.trainingModel(model, options(di=2), opt)
    data = batches(2, 1, 1)
    tm(*data[0])
    reference_call(ref, ref_opt, data[0], 2)
    compiled, program = tm._compiled, tm.getIR()
    update, update_fn = program.graphs["optimizer_update"], tm._engine.update_fn
    for group in opt.param_groups + ref_opt.param_groups:
        group.update(lr=0.01, momentum=0.5, weight_decay=1e-2)
    tm.setOptimizer(opt)
    for batch in data[1:]:
        tm(*batch)
        reference_call(ref, ref_opt, batch, 2)
    assert tm._compiled is compiled and tm.getIR() is program
    assert program.graphs["optimizer_update"] is update and tm._engine.update_fn is update_fn
    assert_state_close(model, ref)


def test_changing_a_constant_attribute_is_refused_as_popart_refuses_it():
    model = ClassifierWithLoss()
    opt = optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    tm = poptorchsim.trainingModel(model, quiet_options(), opt)
    batch = classification_batch(4)
    tm(*batch)
    opt.param_groups[0]["weight_decay"] = 1e-2          # not passed: constant 0
    with pytest.raises(poptorchsim.Error, match=re.escape(
            "Problem with weight decays. OptimizerValue for tensor fc1.weight is not a valid "
            "replacement.Values are constant but do not match.")) as info:
        tm.setOptimizer(opt)
    assert "markAsVariable('weight_decay')" in str(info.value)
    opt.param_groups[0]["weight_decay"] = 0.0
    opt.variable_attrs.markAsConstant("lr")             # after compiling
    with pytest.raises(poptorchsim.Error, match="Can not replace a constant value with a non "
                                                "constant value"):
        tm.setOptimizer(opt)
    opt.variable_attrs.markAsVariable("lr")
    tm.setOptimizer(opt)
    tm(*batch)
    # torch.optim: attributes at their defaults are constant (lr never)
    model = ClassifierWithLoss()
    tm = poptorchsim.trainingModel(model, quiet_options(),
                                   torch.optim.SGD(model.parameters(), lr=0.05))
    tm(*batch)
    with pytest.raises(poptorchsim.Error, match="Problem with momentums"):
        tm.setOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9))
    tm.setOptimizer(torch.optim.SGD(model.parameters(), lr=0.5))
    tm(*batch)


def test_marked_as_variable_before_compiling_can_change():
    """PopTorch's test_optimizer_mark_as_variable; a momentum made variable
    compiles the velocity in (PopART's rule), so it can start later."""
    def run(momentum):
        torch.manual_seed(0)
        model = ClassifierWithLoss()
        opt = optim.SGD(model.parameters(), lr=0.05)
        opt.variable_attrs.markAsVariable("momentum")
        opt.variable_attrs.markAsVariable("loss_scaling")
        tm = poptorchsim.trainingModel(model, options(), opt)
        data = batches(1, 1, 1)
        tm(*data[0])
        update = tm.getIR().graphs["optimizer_update"]
        opt.param_groups[0]["momentum"] = momentum
        opt.loss_scaling = 16.0
        tm.setOptimizer(opt)
        for batch in data[1:]:
            tm(*batch)
        assert tm.getIR().graphs["optimizer_update"] is update
        return model
    assert not torch.allclose(run(0.9).fc1.weight, run(0.0).fc1.weight)


def test_automatic_loss_scaling_makes_the_loss_scaling_variable():
    model = ClassifierWithLoss().half()      # automatic loss scaling watches fp16 gradients
    opts = quiet_options()
    opts.Training.setAutomaticLossScaling(True)
    opt = optim.SGD(model.parameters(), lr=0.05)
    tm = poptorchsim.trainingModel(model, opts, opt)
    x, target = classification_batch(4)
    tm(x.half(), target)
    assert not opt.variable_attrs.isConstant("loss_scaling")
    opt.loss_scaling = 128.0
    tm.setOptimizer(opt)


# -- optimizer state ------------------------------------------------------------------------
STATEFUL = {
    "adam_fp16": lambda p: optim.Adam(p, lr=1e-2, first_order_momentum_accum_type=torch.float16),
    "sgd_scaled": lambda p: optim.SGD(p, lr=0.1, momentum=0.9, dampening=0.1, loss_scaling=64.0),
    "sgd_combined": lambda p: optim.SGD(p, lr=0.1, momentum=0.9, weight_decay=1e-3,
                                        use_combined_accum=True, velocity_scaling=8.0),
    "lamb": lambda p: optim.LAMB(p, lr=1e-2),
    "rmsprop_tf": lambda p: optim.RMSprop(p, lr=1e-2, momentum=0.5, use_tf_variant=True),
}


@pytest.mark.parametrize("name", list(STATEFUL))
def test_optimizer_state_round_trips_through_state_dict(name):
    make = STATEFUL[name]
    model = ClassifierWithLoss()
    other = copy.deepcopy(model)
    opt = make(model.parameters())
    assert opt.state_dict()["ipu_state"] is None          # nothing on a device yet
    tm = poptorchsim.trainingModel(model, options(di=2), opt)
    data = batches(2, 1, 1, calls=4)
    for batch in data[:2]:
        tm(*batch)
    saved = opt.state_dict()
    assert set(saved) >= {"ipu_state", "ipu_param", "state", "param_groups"}
    assert all(isinstance(v, torch.Tensor) for v in saved["ipu_state"].values())
    assert "lossScaling_FLOAT" in saved["ipu_param"]
    buffer = io.BytesIO()
    torch.save(saved, buffer)
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=False)
    saved["state"] = {}             # the device state alone carries it
    other.load_state_dict(model.state_dict())
    other_opt = make(other.parameters())
    other_opt.load_state_dict(saved)
    other_tm = poptorchsim.trainingModel(other, options(di=2), other_opt)
    for batch in data[2:]:
        tm(*batch)
        other_tm(*batch)
    for p, q in zip(model.parameters(), other.parameters()):
        assert torch.equal(p, q)
    # a state loaded into the optimizer of a compiled model goes to the device
    # before its next run: rewinding weights and state replays the same steps
    weights, state = copy.deepcopy(model.state_dict()), opt.state_dict()
    for batch in data[:2]:
        tm(*batch)
    first = [p.detach().clone() for p in model.parameters()]
    tm.load_state_dict(weights)
    opt.load_state_dict(state)
    for batch in data[:2]:
        tm(*batch)
    for p, q in zip(model.parameters(), first):
        assert torch.equal(p, q)


def test_load_state_dict_errors_as_poptorch():
    model = ClassifierWithLoss()
    opt = optim.Adam(model.parameters(), lr=1e-3)
    with pytest.raises(RuntimeError, match="Only IPU optimizer states can be loaded onto the "
                                           "IPU."):
        opt.load_state_dict(torch.optim.Adam(model.parameters(), lr=1e-3).state_dict())
    with pytest.raises(RuntimeError, match="Cannot load optimizer state dictionary because "
                                           "it is empty."):
        optim.Optimizer.set_state_dict(opt, {})


def test_optimizers_pickle_and_copy_with_their_poptorch_attributes():
    model = ClassifierWithLoss()
    opt = optim.SGD(model.parameters(), lr=0.1, loss_scaling=4.0, use_combined_accum=True,
                    velocity_scaling=3.0, velocity_accum_type=torch.float16)
    for copied in (copy.copy(opt), pickle.loads(pickle.dumps(opt))):
        assert copied.loss_scaling == 4.0 and copied.use_combined_accum
        assert copied.velocity_accum_type == torch.float16
        assert copied.param_groups[0]["velocity_scaling"] == 3.0
        assert not copied.variable_attrs.isConstant("loss_scaling")
    lamb = pickle.loads(pickle.dumps(optim.LAMB(model.parameters(), bias_correction=False)))
    assert not lamb.bias_correction and lamb.max_weight_norm == 65500.0


def test_lamb_accepts_sharded_optimizer_state():
    # PopART all-reduces the shards' partial norms (numerics: tests/test_large_configs.py)
    model = ClassifierWithLoss(in_features=64, hidden=256)
    o = options(rf=2)
    o.TensorLocations.setOptimizerLocation(
        poptorchsim.TensorLocationSettings().useReplicatedTensorSharding(True)
        .minElementsForReplicatedTensorSharding(8))
    tm = poptorchsim.trainingModel(model, o, optim.LAMB(model.parameters(), lr=1e-3))
    tm(*classification_batch(8, in_features=64))
    assert "fc1.weight" in tm._compiled.program.sharded_state


def test_state_dict_after_load_state_dict_still_reads_the_device():
    model = ClassifierWithLoss()
    opt = optim.Adam(model.parameters(), lr=1e-2)
    tm = poptorchsim.trainingModel(model, options(), opt)
    batch = classification_batch(4)
    tm(*batch)
    opt.load_state_dict(opt.state_dict())
    tm(*batch)
    steps = {k: float(v) for k, v in opt.state_dict()["ipu_state"].items() if "Step" in k}
    assert set(steps.values()) == {2.0}


@pytest.mark.parametrize("relax", [False, True])
def test_unexpected_optimizer_attributes_are_reported_once(relax):
    """PopTorch's attribute tracker: what an optimizer gains after wrapping is
    ignored by the compiled update, and said once (at debug level with
    relaxOptimizerAttributesChecks)."""
    model = ClassifierWithLoss()
    opt = optim.SGD(model.parameters(), lr=0.1)
    tm = poptorchsim.trainingModel(model, quiet_options().relaxOptimizerAttributesChecks(relax),
                                   opt)
    tm(*classification_batch(4))
    records = LogRecords()
    records.setLevel(logging.DEBUG)
    log = logging.getLogger("poptorchsim")
    level = log.level
    log.addHandler(records)
    log.setLevel(logging.DEBUG)
    try:
        opt.my_attribute = 1
        opt.param_groups[0]["my_group_attribute"] = 2
        tm.setOptimizer(opt)
        tm.setOptimizer(opt)
    finally:
        log.removeHandler(records)
        log.setLevel(level)
    expected = ["Ignoring unexpected optimizer attribute in SGD2 optimizer: ['my_attribute']",
                "Ignoring unexpected group 0 attribute in SGD2 optimizer: "
                "['my_group_attribute']"]
    assert [m for m in records.messages if m.startswith("Ignoring")] == expected
    levels = [lv for lv, m in zip(records.levels, records.messages) if m.startswith("Ignoring")]
    assert levels == ["DEBUG" if relax else "WARNING"] * 2


@pytest.mark.parametrize("make", [
    lambda p: torch.optim.SGD(p, lr=0.1, weight_decay=0.01),
    lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, dampening=0.3, weight_decay=0.01),
    lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.01),
    lambda p: torch.optim.Adam(p, lr=1e-3, weight_decay=0.01),
    lambda p: torch.optim.AdamW(p, lr=1e-3, weight_decay=0.01),
    lambda p: torch.optim.RMSprop(p, lr=1e-3, weight_decay=0.01),
    lambda p: torch.optim.RMSprop(p, lr=1e-3, centered=True, momentum=0.5, weight_decay=0.01),
], ids=["sgd", "sgd-dampening", "sgd-nesterov", "adam", "adamw", "rmsprop",
        "rmsprop-centered"])
def test_one_update_per_call_is_bit_for_bit_torch_optim(make):
    """Each update rounds as torch.optim's in-place arithmetic does (fused
    multiply-adds in add(alpha=), addcmul and lerp; addcdiv's order): an ulp
    a step apart would grow in an unstable model."""
    torch.manual_seed(0)
    model = ClassifierWithLoss(in_features=64, hidden=32, classes=10)
    ref = copy.deepcopy(model)
    pm = poptorchsim.trainingModel(model, options(), make(model.parameters()))
    ref_opt = make(ref.parameters())
    for call in range(4):
        x, y = classification_batch(4, in_features=64, classes=10, seed=call)
        pm(x, y)
        reference_call(ref, ref_opt, (x, y))
    assert_state_close(model, ref, rtol=0, atol=0)
