"""Common mistakes of a user porting a model: each gets a typed error that
names the cause and the fix (or PopTorch's behaviour, where PopTorch accepts
the input), and leaves the model as it was."""
import copy
import logging

import pytest
import torch
from conftest import LogRecords, assert_state_close, quiet_options, reference_call
from torch import nn

import poptorchsim


class Classifier(nn.Module):
    def __init__(self, sparse=False):
        super().__init__()
        self.emb = nn.Embedding(10, 4, sparse=sparse)
        self.fc = nn.Linear(4, 3)

    def forward(self, x, y):
        h = self.emb(x).mean(1) if not x.dtype.is_floating_point else x
        out = self.fc(h)
        return out, nn.functional.cross_entropy(out, y)


def _snapshot(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _unchanged(model, before):
    return all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


X, Y = torch.randn(4, 4), torch.tensor([0, 1, 2, 1])


@pytest.mark.parametrize("case,error,match", [
    ("float labels", poptorchsim.DtypeError,
     r"cross_entropy.*needs integer class labels.*\.long\(\).*floating-point inputs: x, y"),
    ("list input", poptorchsim.InputError,
     r"input x is a Python list of numbers.*torch\.tensor"),
    ("meta input", poptorchsim.InputError, r"Input x is a tensor on the meta device"),
])
@pytest.mark.parametrize("training", [True, False])
def test_bad_inputs_get_typed_errors_and_the_model_still_runs(case, error, match, training):
    torch.manual_seed(0)
    model = Classifier()
    before = _snapshot(model)
    if training:
        pm = poptorchsim.trainingModel(model, quiet_options())
    else:
        pm = poptorchsim.inferenceModel(model, quiet_options())
    x, y = {"float labels": (X, Y.float()), "list input": (X.tolist(), Y),
            "meta input": (X.to("meta"), Y)}[case]
    with pytest.raises(error, match=match):
        pm(x, y)
    assert _unchanged(model, before)
    assert not pm.isCompiled()
    out = pm(X, Y)                          # the right inputs work afterwards
    expected = Classifier()
    expected.load_state_dict(before)
    if training:
        assert not _unchanged(model, before)
    else:
        torch.testing.assert_close(out[0], expected(X, Y)[0])


def test_errors_keep_the_builtin_types_pytorch_code_catches():
    assert issubclass(poptorchsim.DtypeError, RuntimeError)
    assert issubclass(poptorchsim.InputError, TypeError)
    assert issubclass(poptorchsim.ModelWrappedError, RuntimeError)


def test_sparse_embedding_is_refused_when_wrapped_for_training():
    model = Classifier(sparse=True)
    with pytest.raises(poptorchsim.UnsupportedOperationError,
                       match=r"Embedding emb has sparse=True.*sparse=False"):
        poptorchsim.trainingModel(model, quiet_options())
    assert not hasattr(model, "_poptorchsim_wrapper") or model._poptorchsim_wrapper() is None
    # inference has no gradient: the flag changes nothing
    ids = torch.randint(0, 10, (4, 2))
    out = poptorchsim.inferenceModel(model, quiet_options())(ids, Y)
    torch.testing.assert_close(out[0], model(ids, Y)[0])
    model.emb.sparse = False                # the fix the message gives
    poptorchsim.trainingModel(model, quiet_options())(ids, Y)


def test_same_model_wrapped_twice_raises_poptorchs_runtime_error():
    model = Classifier()
    first = poptorchsim.trainingModel(model, quiet_options())
    with pytest.raises(RuntimeError, match="already been wrapped") as info:
        poptorchsim.trainingModel(model, quiet_options())
    assert isinstance(info.value, poptorchsim.Error)
    first.destroy()
    poptorchsim.trainingModel(model, quiet_options())


class LossPlusTerm(nn.Module):
    """CrossEntropy plus a hand-written dice term: PopTorch trains the CE alone."""

    def __init__(self, how):
        super().__init__()
        self.fc = nn.Linear(4, 3)
        self.how = how

    def forward(self, x, y):
        out = self.fc(x)
        ce = nn.functional.cross_entropy(out, y)
        dice = 1 - (out.softmax(-1) * nn.functional.one_hot(y, 3)).sum() / out.shape[0]
        if self.how == "sum":
            return out, ce + dice
        if self.how == "scaled":
            return out, 0.5 * ce
        if self.how == "identity":
            return out, poptorchsim.identity_loss(ce + dice, reduction="none")
        return out, ce.detach()


@pytest.mark.parametrize("how,warned", [("sum", "return out, ce \\+ dice"),
                                        ("scaled", "return out, 0.5 \\* ce"),
                                        ("identity", None), ("detached", None)])
def test_loss_term_the_backward_ignores_is_warned_once(how, warned):
    torch.manual_seed(0)
    model = LossPlusTerm(how)
    ref = copy.deepcopy(model)
    records = LogRecords()
    logger = logging.getLogger("poptorchsim")
    logger.addHandler(records)
    try:
        pm = poptorchsim.trainingModel(model, quiet_options(),
                                       torch.optim.SGD(model.parameters(), lr=0.1))
        for _ in range(2):
            pm(X, Y)
    finally:
        logger.removeHandler(records)
    hits = [m for m in records.messages if "backward pass does not use" in m]
    if warned is None:
        assert not hits
    else:
        assert len(hits) == 1
        import re
        assert re.search(warned, hits[0]) and "identity_loss" in hits[0]
        assert "ce = nn.functional.cross_entropy(out, y)" in hits[0]
    # behaviour stays PopTorch's: the CE alone is trained (unless identity_loss)
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)

    class Reference(nn.Module):
        def __init__(self, m):
            super().__init__()
            self.m = m

        def forward(self, x, y):
            out, total = self.m(x, y)
            if how == "identity":
                return out, total
            return out, nn.functional.cross_entropy(out, y)
    wrapped = Reference(ref)
    for _ in range(2):
        reference_call(wrapped, opt, (X, Y))
    assert_state_close(model, ref)


def test_set_optimizer_of_another_type_keeps_the_model():
    torch.manual_seed(0)
    model = Classifier()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    pm = poptorchsim.trainingModel(model, quiet_options(), opt)
    pm(X, Y)
    before = _snapshot(model)
    state = copy.deepcopy(opt.state_dict())
    for other in (torch.optim.SGD(model.parameters(), lr=0.1),
                  torch.optim.Adam(model.parameters(), lr=1e-2),
                  poptorchsim.optim.LAMB(model.parameters(), lr=1e-2)):
        with pytest.raises(poptorchsim.Error, match="Can not replace optimizer of type"):
            pm.setOptimizer(other)
    assert _unchanged(model, before)
    assert pm._optimizer is opt
    torch.testing.assert_close(opt.state_dict()["state"], state["state"])
