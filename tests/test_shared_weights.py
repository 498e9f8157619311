"""Shared parameters and buffers are one device tensor.

A tensor reachable by several module paths (``head.weight = emb.weight``,
as every Hugging Face language model ties its LM head to the input
embedding, or a module called twice) is one input of the compiled program:
the gradients of all its uses sum as in eager autograd, the optimizer
updates it once, memory counts it once, and the tie survives the copy back
to the host.  Uses on two IPUs are refused, as PopTorch requires.
"""
import copy

import pytest
import torch
from conftest import assert_state_close, quiet_options, reference_call
from torch import nn

import poptorchsim

VOCAB, DIM = 16, 8


class TiedLM(nn.Module):
    """Embedding -> Linear -> LM head whose weight is the embedding's."""

    def __init__(self, head_ipu=None, mid_ipu=None):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.mid = nn.Linear(DIM, DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        self.head.weight = self.emb.weight
        if mid_ipu is not None:
            self.mid = poptorchsim.BeginBlock(self.mid, ipu_id=mid_ipu)
        if head_ipu is not None:
            self.head = poptorchsim.BeginBlock(self.head, ipu_id=head_ipu)

    def forward(self, x, y=None):
        out = self.head(torch.tanh(self.mid(self.emb(x))))
        if y is None:
            return out
        return out, nn.functional.cross_entropy(out.reshape(-1, VOCAB), y.reshape(-1))


class TwiceCalled(nn.Module):
    """One Linear applied twice: its weight is used twice per step."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(6, 6)

    def forward(self, x, y):
        out = self.fc(torch.relu(self.fc(x)))
        return out, nn.functional.mse_loss(out, y)


class SharedBuffer(nn.Module):
    """Two modules hold the same buffer; both update it in place."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(6, 6), nn.Linear(6, 6)
        count = torch.zeros(6)
        self.a.register_buffer("seen", count)
        self.b.register_buffer("seen", count)

    def forward(self, x, y):
        h = self.a(x)
        self.a.seen.add_(h.detach().mean(0))
        out = self.b(h) + self.b.seen
        self.b.seen.mul_(0.5)
        return out, nn.functional.mse_loss(out, y)


def _tokens(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randint(0, VOCAB, (n, 3), generator=g),
            torch.randint(0, VOCAB, (n, 3), generator=g))


def _train_both(model, opt_cls, batches, opts=None, di=1, ga=1, rf=1, **opt_kw):
    ref = copy.deepcopy(model)
    ref_opt = opt_cls(ref.parameters(), **opt_kw)
    opt = opt_cls(model.parameters(), **opt_kw)
    pm = poptorchsim.trainingModel(model, opts or quiet_options(), opt)
    for batch in batches:
        pm(*batch)
        reference_call(ref, ref_opt, batch, di, ga, rf)
    pm.copyWeightsToHost()
    return pm, ref


@pytest.mark.parametrize("opt_cls,kw", [(torch.optim.SGD, {"lr": 1.0}),
                                        (torch.optim.SGD, {"lr": 0.5, "momentum": 0.9}),
                                        (torch.optim.AdamW, {"lr": 0.05})])
def test_tied_embedding_and_head_train_as_eager(opt_cls, kw):
    torch.manual_seed(0)
    model = TiedLM()
    pm, ref = _train_both(model, opt_cls, [_tokens(4, s) for s in range(3)], **kw)
    # the update is the sum of both uses' gradients (the embedding's alone differs by ~1)
    assert_state_close(model, ref)
    assert model.head.weight is model.emb.weight          # the tie survives
    pm.detachFromDevice()


def test_tied_weight_is_one_device_tensor():
    torch.manual_seed(0)
    model = TiedLM()
    pm = poptorchsim.trainingModel(model, quiet_options(),
                                   torch.optim.SGD(model.parameters(), lr=0.1))
    pm(*_tokens(4))
    ir = str(pm.getIR())
    assert "_param_constant" not in ir                    # no second copy as a constant
    step = pm._compiled.program.graphs["training_step"]
    params = [t.name for t in step.inputs if t.role == "param"]
    assert params.count("emb.weight") == 1 and "head.weight" not in params
    # always-live memory holds the tied weight once: same as an untied model minus a copy
    untied = TiedLM()
    untied.head.weight = nn.Parameter(untied.emb.weight.detach().clone())
    pu = poptorchsim.trainingModel(untied, quiet_options(),
                                   torch.optim.SGD(untied.parameters(), lr=0.1))
    pu(*_tokens(4))
    tied_bytes = sum(t.nbytes for t in step.inputs if t.role == "param")
    untied_step = pu._compiled.program.graphs["training_step"]
    untied_bytes = sum(t.nbytes for t in untied_step.inputs if t.role == "param")
    assert untied_bytes - tied_bytes == VOCAB * DIM * 4


def test_tied_weights_inference_and_state_dict_round_trip():
    torch.manual_seed(0)
    model = TiedLM()
    x, y = _tokens(4)
    pm = poptorchsim.trainingModel(model, quiet_options(),
                                   torch.optim.SGD(model.parameters(), lr=1.0))
    pm(x, y)
    saved = {k: v.clone() for k, v in pm.state_dict().items()}
    assert set(saved) == {"emb.weight", "mid.weight", "mid.bias", "head.weight"}
    torch.testing.assert_close(saved["emb.weight"], saved["head.weight"])
    inf = poptorchsim.inferenceModel(model, quiet_options())
    torch.testing.assert_close(inf(x), model(x))
    fresh = TiedLM()
    fresh.load_state_dict(saved)
    assert fresh.head.weight is fresh.emb.weight
    torch.testing.assert_close(fresh(x), model(x))
    pm.load_state_dict(saved)
    assert model.head.weight is model.emb.weight


def test_module_called_twice_trains_as_eager():
    torch.manual_seed(0)
    model = TwiceCalled()
    batches = [(torch.randn(4, 6), torch.randn(4, 6)) for _ in range(3)]
    _, ref = _train_both(model, torch.optim.SGD, batches, lr=0.1, momentum=0.9)
    assert_state_close(model, ref)


def test_shared_buffer_is_one_tensor():
    torch.manual_seed(0)
    model = SharedBuffer()
    batches = [(torch.randn(4, 6), torch.randn(4, 6)) for _ in range(3)]
    pm, ref = _train_both(model, torch.optim.SGD, batches, lr=0.1)
    assert_state_close(model, ref)
    assert model.a.seen is model.b.seen
    assert model.a.seen.abs().sum() > 0


def test_tied_weights_pipelined_on_one_ipu_train_as_eager():
    torch.manual_seed(0)
    model = TiedLM(mid_ipu=1, head_ipu=0)      # head back on the embedding's IPU
    opts = quiet_options()
    opts.setExecutionStrategy(poptorchsim.PipelinedExecution(
        poptorchsim.AutoStage.AutoIncrement))
    opts.Training.gradientAccumulation(6)
    pm, ref = _train_both(model, torch.optim.SGD, [_tokens(12, s) for s in range(3)],
                          opts=opts, ga=6, lr=1.0)
    assert pm._compiled.program.n_stages >= 2
    assert_state_close(model, ref)


def test_tied_weights_on_two_ipus_are_refused():
    torch.manual_seed(0)
    model = TiedLM(mid_ipu=1, head_ipu=2)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    opts = quiet_options()
    opts.Training.gradientAccumulation(5)
    pm = poptorchsim.trainingModel(model, opts, torch.optim.SGD(model.parameters(), lr=1.0))
    x, y = _tokens(20)
    with pytest.raises(poptorchsim.Error,
                       match=r"emb\.weight \(also named head\.weight\) is used on IPU \d "
                             r"\(by emb\) and IPU 2 \(by head\).*same IPU"):
        pm(x, y)
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k])


def test_hugging_face_gpt2_tied_head_trains_as_eager():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2,
                                     n_head=2, resid_pdrop=0.0, embd_pdrop=0.0,
                                     attn_pdrop=0.0)
    model = transformers.GPT2LMHeadModel(config)
    assert model.lm_head.weight is model.transformer.wte.weight

    class WithLoss(nn.Module):
        def __init__(self, lm):
            super().__init__()
            self.lm = lm

        def forward(self, ids):
            out = self.lm(input_ids=ids, labels=ids)
            return out.logits, out.loss

    wrapped = WithLoss(model)
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randint(0, 64, (2, 8), generator=g),) for _ in range(3)]
    _, ref = _train_both(wrapped, torch.optim.SGD, batches, lr=0.5)
    assert_state_close(wrapped, ref, rtol=1e-4, atol=1e-5)
    assert model.lm_head.weight is model.transformer.wte.weight
