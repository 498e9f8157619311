"""Options.Precision.enableFloatingPointExceptions: the first op whose result
is an invalid operation, a division by zero or an overflow raises
poptorch.Error (Poplar's application_runtime_error), naming the op and the
model's line; the device keeps the weights and optimizer state it had before
the call (docs/precision.md).  PopTorch's own tests/exception_test.py cases
are the first five tests."""
import copy

import pytest
import torch
import torch.nn.functional as F
from conftest import quiet_options

import poptorchsim as poptorch
from poptorchsim.errors import FloatingPointException
from poptorchsim.machine import fp_checks

INVALID, DIV0, OVERFLOW = fp_checks.INVALID, fp_checks.DIVIDE_BY_ZERO, fp_checks.OVERFLOW


def fp_options(enabled=True, **kw):
    opts = quiet_options()
    if enabled is not None:
        opts.Precision.enableFloatingPointExceptions(enabled)
    if kw.get("di"):
        opts.deviceIterations(kw["di"])
    return opts


class Fn(torch.nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, *args):
        return self.fn(*args)


# -- PopTorch's exception_test.py: raises only when enabled --------------------------
CASES = {
    "div0": (lambda x, y: x / y, [torch.ones(10, 10), torch.zeros(10, 10)], DIV0),
    "mul0inf": (lambda x, y: x * y,
                [torch.zeros(10, 10), torch.div(torch.ones(10, 10), torch.zeros(10, 10))],
                INVALID),
    "nonreal": (lambda x: torch.sqrt(x), [torch.Tensor([-1, -2])], INVALID),
    "nan": (lambda x, y: x > y,
            [torch.ones(10, 10), torch.div(torch.zeros(10, 10), torch.zeros(10, 10))],
            INVALID),
    "ovf": (lambda x: torch.exp(x), [torch.Tensor([3800, 4203])], OVERFLOW),
}


@pytest.mark.parametrize("setting", ["default", "true", "false"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_poptorch_exception_cases(case, setting):
    fn, args, code = CASES[case]
    enabled = {"default": None, "true": True, "false": False}[setting]
    model = poptorch.inferenceModel(Fn(fn), fp_options(enabled))
    if enabled:
        with pytest.raises(poptorch.Error) as info:
            model(*args)
        assert isinstance(info.value, RuntimeError)      # PopTorch's docstring
        assert info.value.type == "poplar_application_runtime_error"
        assert info.value.error_code == code
        assert str(info.value).startswith("'poplar_application_runtime_error': ")
    else:
        model(*args)                                      # silently non-finite


# -- the triggers: op and line named -------------------------------------------------
class DivideInForward(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x, y):
        h = self.lin(x)
        return h / y                                      # the division


def test_division_by_zero_names_op_and_line():
    model = poptorch.inferenceModel(DivideInForward(), fp_options())
    with pytest.raises(FloatingPointException) as info:
        model(torch.ones(2, 4), torch.zeros(2, 4))
    e = info.value
    assert e.error_code == DIV0 and e.op == "div"
    assert "return h / y" in e.location and __file__ in e.location
    assert "operation 'div' (aten.div.Tensor)" in str(e)
    assert "return h / y" in str(e) and "division by zero" in str(e)
    # the same model keeps running with healthy inputs
    out = model(torch.ones(2, 4), torch.full((2, 4), 2.0))
    assert torch.isfinite(out).all()


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layer1 = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU())
        self.layer2 = torch.nn.Linear(8, 3)

    def forward(self, x, target=None):
        out = self.layer2(self.layer1(x))                 # the model's line
        if target is None:
            return out
        return out, F.cross_entropy(out, target)


def test_nan_input_to_an_inference_model():
    torch.manual_seed(0)
    model = poptorch.inferenceModel(Net(), fp_options())
    x = torch.randn(2, 4)
    x[1, 2] = float("nan")
    with pytest.raises(FloatingPointException) as info:
        model(x)
    e = info.value
    assert e.error_code == INVALID and e.op == "layer1/0/addmm"     # its module's name scope
    assert "out = self.layer2(self.layer1(x))" in e.location
    assert "a NaN operand" in e.message and "forward pass" in e.message


def _training(model, enabled=True, di=None):
    opt = poptorch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    return poptorch.trainingModel(model, fp_options(enabled, di=di), opt), opt


def _device_state(tm, opt, model):
    tm.copyWeightsToHost()
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    ipu = {k: v.clone() for k, v in opt.state_dict()["ipu_state"].items()}
    return weights, ipu


def _assert_same(a, b):
    assert a[0].keys() == b[0].keys() and a[1].keys() == b[1].keys()
    for x, y in zip(a, b):
        for k in x:
            torch.testing.assert_close(x[k], y[k], rtol=0, atol=0)


@pytest.mark.parametrize("di", [1, 3])
def test_nan_input_to_a_training_model_keeps_the_device_state(di):
    """With deviceIterations 3 the NaN is in the last batch: the updates the
    call made before it are undone too."""
    torch.manual_seed(0)
    model = Net()
    reference = copy.deepcopy(model)
    tm, opt = _training(model, di=di)
    x, t = torch.randn(2 * di, 4), torch.randint(0, 3, (2 * di,))
    tm(x, t)                                    # healthy: momentum is not zero
    before = _device_state(tm, opt, model)
    bad = x.clone()
    bad[-1, 0] = float("nan")
    with pytest.raises(FloatingPointException) as info:
        tm(bad, t)
    assert info.value.op == "layer1/0/addmm" and "training step" in info.value.message
    assert "out = self.layer2(self.layer1(x))" in info.value.location
    _assert_same(_device_state(tm, opt, model), before)
    # and training goes on from there exactly as in PyTorch
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    for _ in range(2):
        for k in range(di):
            ref_opt.zero_grad()
            F.cross_entropy(reference(x[2 * k:2 * k + 2]), t[2 * k:2 * k + 2]).backward()
            ref_opt.step()
    tm(x, t)
    tm.copyWeightsToHost()
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p, q)


class HalfScale(torch.nn.Module):
    def forward(self, x):
        y = x * 2                                         # 60000 * 2 > 65504
        return y + 1


def test_fp16_overflow():
    model = poptorch.inferenceModel(HalfScale(), fp_options())
    x = torch.full((4,), 60000.0, dtype=torch.half)
    with pytest.raises(FloatingPointException) as info:
        model(x)
    assert info.value.error_code == OVERFLOW and info.value.op == "mul"
    assert "y = x * 2" in info.value.location
    # in range: no exception
    assert model(torch.full((4,), 30000.0, dtype=torch.half)).eq(60001).all()


class SqrtModel(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x, t):
        out = torch.sqrt(self.lin(x).relu())
        return out, F.mse_loss(out, t)


def test_exception_in_the_backward_pass():
    """sqrt's gradient at 0: 0 / 0.  Backward ops have no line of the model
    (PyTorch's trace records none); the message says backward pass."""
    model = SqrtModel()
    with torch.no_grad():
        model.lin.weight.zero_()
        model.lin.bias.zero_()
    tm, opt = _training(model)
    with pytest.raises(FloatingPointException) as info:
        tm(torch.ones(2, 4), torch.zeros(2, 4))
    assert info.value.error_code == INVALID
    assert "(backward pass)" in info.value.message
    assert torch.all(model.lin.weight == 0)


# -- what does not raise ---------------------------------------------------------------
def test_off_by_default_non_finite_results_silently():
    """The existing behaviour, PopTorch's on hardware without the option."""
    for enabled in (None, False):
        model = poptorch.inferenceModel(DivideInForward(), fp_options(enabled))
        assert torch.isinf(model(torch.ones(2, 4), torch.zeros(2, 4))).any()
        x = torch.ones(2, 4)
        x[0, 0] = float("nan")
        assert torch.isnan(model(x, torch.ones(2, 4))).any()
        tm, _ = _training(Net(), enabled)
        x = torch.randn(2, 4)
        x[0, 0] = float("nan")
        out, loss = tm(x, torch.tensor([0, 1]))
        assert torch.isnan(loss)


def test_off_generates_no_checks_on_generates_out_of_place_checks():
    torch.manual_seed(0)
    off = poptorch.inferenceModel(Net(), fp_options(False))
    on = poptorch.inferenceModel(Net(), fp_options(True))
    x = torch.randn(2, 4)
    off(x), on(x)
    assert "_fp(" not in off._engine.step_fn.source
    assert "_fp(" in on._engine.step_fn.source


class Masked(torch.nn.Module):
    def forward(self, scores):
        mask = torch.triu(torch.ones(4, 4, dtype=torch.bool), 1)
        scores = scores.masked_fill(mask, float("-inf"))
        scores = scores + torch.full((4, 4), float("-inf")).triu(1)
        return torch.softmax(scores, -1)


def test_an_infinity_passed_on_is_no_exception():
    """An attention mask of -inf: inf operands give inf results and exp(-inf)
    is 0, IEEE arithmetic that raises nothing on the IPU."""
    model = poptorch.inferenceModel(Masked(), fp_options())
    x = torch.randn(4, 4)
    torch.testing.assert_close(model(x), Masked()(x))


def test_activations_poptorch_runs_with_exceptions_on():
    """PopTorch's activations_test.py runs these on [10, 100, 1000] with the
    option on."""
    x = torch.FloatTensor([[10., 100., 1000.]])
    for op in (torch.nn.ReLU(), torch.nn.Tanh(), torch.nn.Sigmoid(), torch.nn.GELU(),
               torch.nn.Softmax(dim=1), torch.nn.LogSoftmax(dim=1), torch.nn.SiLU(),
               torch.nn.Hardtanh(), torch.nn.LeakyReLU()):
        model = poptorch.inferenceModel(op, fp_options())
        torch.testing.assert_close(model(x), op(x))


# -- a healthy model trains as in PyTorch --------------------------------------------
def test_healthy_model_trains_identically_to_pytorch():
    torch.manual_seed(0)
    model = Net()
    reference = copy.deepcopy(model)
    tm, _ = _training(model)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    for _ in range(4):
        x, t = torch.randn(2, 4), torch.randint(0, 3, (2,))
        _, loss = tm(x, t)
        ref_opt.zero_grad()
        ref_loss = F.cross_entropy(reference(x), t)
        ref_loss.backward()
        ref_opt.step()
        torch.testing.assert_close(loss, ref_loss.detach())
    tm.copyWeightsToHost()
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p, q)


def test_option_is_in_the_executable_cache_key(tmp_path):
    """A program compiled without checks is not reused with them."""
    for enabled in (False, True):
        opts = fp_options(enabled).enableExecutableCaching(str(tmp_path))
        model = poptorch.inferenceModel(DivideInForward(), opts)
        if enabled:
            with pytest.raises(FloatingPointException) as info:
                model(torch.ones(2, 4), torch.zeros(2, 4))
            assert "return h / y" in info.value.location
        else:
            model(torch.ones(2, 4), torch.zeros(2, 4))
    # and the checked program, loaded back from the cache, still checks
    opts = fp_options(True).enableExecutableCaching(str(tmp_path))
    model = poptorch.inferenceModel(DivideInForward(), opts)
    with pytest.raises(FloatingPointException) as info:
        model(torch.ones(2, 4), torch.zeros(2, 4))
    assert "return h / y" in info.value.location


def test_setter_takes_a_bool_only():
    with pytest.raises(AssertionError, match="enableFloatingPointExceptions needs to be set "
                                             "to a bool"):
        poptorch.Options().Precision.enableFloatingPointExceptions(1)
    opts = poptorch.Options()
    opts.from_json('{"Precision.enableFloatingPointExceptions": true}')
    assert opts.Precision.enable_floating_point_exceptions is True


def test_automatic_loss_scaling_unchanged_by_the_checks():
    """PopART's automatic loss scaling reads gradient histograms, no infinite
    gradient: a healthy fp16 model trains the same with the checks on."""
    from test_auto_loss_scaling import _als_options, _data, _model
    results = []
    for enabled in (False, True):
        model = _model()
        opts = _als_options()
        opts.Precision.enableFloatingPointExceptions(enabled)
        opt = poptorch.optim.Adam(model.parameters(), lr=1e-3, loss_scaling=1.0)
        tm = poptorch.trainingModel(model, opts, opt)
        x, y = _data()
        for _ in range(5):
            tm(x, y)
        tm.copyWeightsToHost()
        results.append((opt.state_dict()["ipu_state"]["lossScaleUpdateFactor"].clone(),
                        [p.detach().clone() for p in model.parameters()]))
    assert float(results[0][0]) > 1                     # the scale grew
    torch.testing.assert_close(results[0], results[1], rtol=0, atol=0)
