"""A zoo of real-world models, small enough to train in seconds on a CPU:
torchvision CNNs (their real constructors, on 64x64 images; EfficientNet-B0
on 96x96), a reduced Vision Transformer, a transformer encoder and
encoder-decoder, LSTM and GRU classifiers, embedding bags, a GPT block and
Hugging Face's BERT (it needs ``transformers``), each with its inputs and
loss (``Case``).  Stochastic depth and dropout are off everywhere, so
training is deterministic.

poptorchsim's tests check every model against plain PyTorch
(``tests/test_model_zoo.py``) and its benchmarks time them
(``benchmarks/model_zoo.py``, ``benchmarks/compile_passes.py``); a user
can do the same for a model of theirs with ``poptorchsim.testing``.

    from poptorchsim.testing import zoo
    case = zoo.BY_NAME["resnet18"]
    model = zoo.build(case, case.seed)
    batches = zoo.make_batches(case, model, 2)
"""
import copy
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

TRAIN_RTOL = 1e-4
TRAIN_ATOL = 1e-4
INFER_RTOL = 1e-4
INFER_ATOL = 1e-5
STEPS = 2
IMAGE = 64          # torchvision CNNs: 64x64 RGB images
CLASSES = 10


def optimizer_for(params):
    return torch.optim.SGD(params, lr=0.01, momentum=0.9)


# ---------------------------------------------------------------------------
# Models that torchvision and torch.nn do not provide as a whole
# ---------------------------------------------------------------------------
class EncoderClassifier(nn.Module):
    """nn.TransformerEncoder (3 post-norm layers, GELU) over a projected
    sequence; the mean over time goes through a linear head."""

    def __init__(self, features=8, d_model=32, heads=4, layers=3, classes=CLASSES):
        super().__init__()
        self.proj = nn.Linear(features, d_model)
        layer = nn.TransformerEncoderLayer(d_model, heads, dim_feedforward=64, dropout=0.0,
                                           activation="gelu", batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(d_model, classes)

    def forward(self, x):
        return self.head(self.encoder(self.proj(x)).mean(dim=1))


class Seq2Seq(nn.Module):
    """nn.Transformer (3 encoder and 3 decoder layers) with a causal target
    mask; returns the decoder's output features (an MSE target)."""

    def __init__(self, features=8, d_model=32, heads=4, layers=3):
        super().__init__()
        self.src_proj = nn.Linear(features, d_model)
        self.tgt_proj = nn.Linear(features, d_model)
        self.transformer = nn.Transformer(d_model, heads, num_encoder_layers=layers,
                                          num_decoder_layers=layers, dim_feedforward=64,
                                          dropout=0.0, batch_first=True)
        self.out = nn.Linear(d_model, features)

    def forward(self, src, tgt):
        mask = nn.Transformer.generate_square_subsequent_mask(tgt.shape[1])
        # tgt_is_causal=True: without it nn.Transformer compares the mask with
        # a causal one (torch.equal), which a traced, static program cannot do
        y = self.transformer(self.src_proj(src), self.tgt_proj(tgt), tgt_mask=mask,
                             tgt_is_causal=True)
        return self.out(y)


class LSTMClassifier(nn.Module):
    """A 2-layer bidirectional batch-first LSTM; the last time step's
    features go through a linear head."""

    def __init__(self, features=8, hidden=16, classes=CLASSES):
        super().__init__()
        self.lstm = nn.LSTM(features, hidden, num_layers=2, bidirectional=True,
                            batch_first=True)
        self.head = nn.Linear(2 * hidden, classes)

    def forward(self, x):
        out, _ = self.lstm(x)
        return self.head(out[:, -1])


class GRUClassifier(nn.Module):
    """A 1-layer sequence-first GRU (the batch stays the first dimension of
    the model's input, as PopTorch needs); the final hidden state goes
    through a linear head."""

    def __init__(self, features=8, hidden=16, classes=CLASSES):
        super().__init__()
        self.gru = nn.GRU(features, hidden)
        self.head = nn.Linear(hidden, classes)

    def forward(self, x):
        _, h = self.gru(x.transpose(0, 1))
        return self.head(h[-1])


class BagClassifier(nn.Module):
    """nn.EmbeddingBag over a flat index tensor with offsets, then a linear head."""

    def __init__(self, mode, vocab=50, dim=16, classes=CLASSES):
        super().__init__()
        self.bag = nn.EmbeddingBag(vocab, dim, mode=mode)
        self.head = nn.Linear(dim, classes)

    def forward(self, indices, offsets):
        return self.head(torch.relu(self.bag(indices, offsets)))


class CausalSelfAttention(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, c))


class GPTBlock(nn.Module):
    """A pre-norm GPT decoder block: causal self-attention and a GELU MLP."""

    def __init__(self, dim, heads):
        super().__init__()
        self.ln1 = nn.LayerNorm(dim)
        self.attn = CausalSelfAttention(dim, heads)
        self.ln2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class TinyGPT(nn.Module):
    """Token and position embeddings, 2 GPT blocks, a final LayerNorm and a
    language-model head: logits [batch, time, vocab]."""

    def __init__(self, vocab=40, dim=32, heads=4, layers=2, context=16):
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(context, dim)
        self.blocks = nn.Sequential(*[GPTBlock(dim, heads) for _ in range(layers)])
        self.ln = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, idx):
        positions = torch.arange(idx.shape[1], device=idx.device)
        x = self.tok(idx) + self.pos(positions)
        return self.head(self.ln(self.blocks(x)))


class BertLogits(nn.Module):
    """Hugging Face BertForSequenceClassification from a tiny BertConfig
    (randomly initialised, nothing downloaded); returns the logits."""

    def __init__(self, vocab=100, classes=3):
        super().__init__()
        import transformers
        config = transformers.BertConfig(
            vocab_size=vocab, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
            intermediate_size=64, max_position_embeddings=32, num_labels=classes,
            hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
        self.bert = transformers.BertForSequenceClassification(config)

    def forward(self, input_ids, attention_mask):
        # The padding mask goes in as a prepared 4D additive mask: given the 2D
        # mask, transformers asks ``attention_mask.all()`` to decide whether it
        # may skip the mask, which a traced, static program cannot answer (its
        # tracing check ``is_fake_tensor`` does not see poptorchsim's tracer).
        b, t = attention_mask.shape
        additive = (1.0 - attention_mask.float()) * torch.finfo(torch.float32).min
        mask = additive[:, None, None, :].expand(b, 1, t, t)
        return self.bert(input_ids=input_ids, attention_mask=mask).logits


# ---------------------------------------------------------------------------
# Builders and inputs
# ---------------------------------------------------------------------------
def tv(name, **kwargs):
    def build():
        import torchvision
        return getattr(torchvision.models, name)(num_classes=CLASSES, **kwargs)
    return build


def _densenet_small():
    import torchvision
    return torchvision.models.DenseNet(growth_rate=16, block_config=(2, 2, 2, 2),
                                       num_init_features=32, num_classes=CLASSES)


def _small_vit():
    import torchvision
    return torchvision.models.VisionTransformer(
        image_size=32, patch_size=16, num_layers=2, num_heads=2, hidden_dim=32, mlp_dim=64,
        num_classes=CLASSES)


def images(size=IMAGE):
    def make(batch, g):
        return (torch.randn(batch, 3, size, size, generator=g),)
    make.image_size = size
    return make


def sequence(time=6, features=8):
    def make(batch, g):
        return (torch.randn(batch, time, features, generator=g),)
    return make


def src_tgt(batch, g):
    return torch.randn(batch, 7, 8, generator=g), torch.randn(batch, 5, 8, generator=g)


def bags(batch, g, vocab=50):
    # bags of 1 to 4 indices; every batch of a size has the same total length
    # (the compiled program's input shapes are fixed)
    lengths = torch.arange(batch) % 4 + 1
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)[:-1]])
    indices = torch.randint(0, vocab, (int(lengths.sum()),), generator=g)
    return indices, offsets


def tokens(time=12, vocab=40):
    def make(batch, g):
        return (torch.randint(0, vocab, (batch, time), generator=g),)
    return make


def bert_inputs(batch, g, time=10, vocab=100):
    ids = torch.randint(0, vocab, (batch, time), generator=g)
    mask = torch.ones(batch, time, dtype=torch.long)
    mask[0, time - 3:] = 0        # the first sequence is padded
    return ids, mask


@dataclass
class Case:
    name: str
    build: Callable[[], nn.Module]
    inputs: Callable            # (batch, generator) -> tuple of model inputs
    loss: str                   # "ce": classes on the last dim; "mse": regression
    batch: int = 2
    # "fp32": eager PyTorch as the model is; "fp64": eager on model.double(),
    # for models whose fp32 training is too ill-conditioned to agree to 1e-4
    reference: str = "fp32"
    seed: int = 0               # torch.manual_seed before building the model
    slow: bool = False          # longer than a few seconds: left out of quick runs
    needs: tuple = ()           # packages it needs besides torch and torchvision


ZOO = [
    # seed 3: with some initialisations a max-pool window holds two values
    # so close that fp32 rounding decides which one the gradient flows to, and
    # two fp32 runs (or fp32 and fp64) then differ by up to ~30x the tolerance
    # after two steps; with seed 3 eager fp32, fp64 and the simulator agree to
    # ~0.02x the tolerance
    Case("resnet18", tv("resnet18"), images(), "ce", seed=3),
    Case("mobilenet_v3_small", tv("mobilenet_v3_small", dropout=0.0), images(), "ce"),
    # fp64 reference: two fp32 runs that sum in different orders differ by
    # several times the tolerance (ReLU/SiLU inputs near 0 and batch norms
    # over few values amplify rounding); fp32 eager vs fp64 is ~0.2x of it here
    Case("efficientnet_b0", tv("efficientnet_b0", dropout=0.0, stochastic_depth_prob=0.0),
         images(96), "ce", batch=4, reference="fp64"),
    # the real densenet121 compiles in ~15 s: slow (seed 3 as for resnet18);
    # a DenseNet with 2 layers in each of its 4 blocks covers the same layers
    # in the default run
    Case("densenet121", tv("densenet121"), images(), "ce", seed=3, slow=True),
    Case("densenet_small", _densenet_small, images(), "ce", batch=4),
    Case("convnext_tiny", tv("convnext_tiny", stochastic_depth_prob=0.0), images(), "ce"),
    Case("vit_small", _small_vit, images(32), "ce"),
    Case("transformer_encoder", EncoderClassifier, sequence(), "ce"),
    Case("transformer", Seq2Seq, src_tgt, "mse"),
    Case("lstm_bidirectional", LSTMClassifier, sequence(), "ce"),
    Case("gru", GRUClassifier, sequence(), "ce"),
    Case("embedding_bag_mean", lambda: BagClassifier("mean"), bags, "ce", batch=4),
    Case("embedding_bag_sum", lambda: BagClassifier("sum"), bags, "ce", batch=4),
    Case("gpt_block", TinyGPT, tokens(), "ce"),
    Case("bert", BertLogits, bert_inputs, "ce", needs=("transformers",)),
]
BY_NAME = {c.name: c for c in ZOO}


# ---------------------------------------------------------------------------
# Training wrapper and data
# ---------------------------------------------------------------------------
class WithLoss(nn.Module):
    """``model`` and a loss: ``forward(*inputs, target)`` returns (output, loss)."""

    def __init__(self, model, loss):
        super().__init__()
        self.model = model
        self.kind = loss

    def forward(self, *args):
        *inputs, target = args
        out = self.model(*inputs)
        if self.kind == "ce":
            loss = F.cross_entropy(out.reshape(-1, out.shape[-1]), target.reshape(-1))
        else:
            loss = F.mse_loss(out, target)
        return out, loss


def make_target(case, output, g):
    if case.loss == "ce":
        return torch.randint(0, output.shape[-1], output.shape[:-1], generator=g)
    return torch.randn(output.shape, generator=g)


def make_batches(case, model, n, seed=0):
    """``n`` batches (inputs..., target) for ``model`` (an nn.Module of ``case``)."""
    g = torch.Generator().manual_seed(seed)
    batches = []
    for _ in range(n):
        inputs = case.inputs(case.batch, g)
        with torch.no_grad():
            out = copy.deepcopy(model).eval()(*inputs)
        batches.append((*inputs, make_target(case, out, g)))
    return batches


def build(case, seed=0):
    torch.manual_seed(seed)
    return case.build()


def eager_train(wrapped, batches):
    """The reference: plain PyTorch, one SGD step per batch."""
    opt = optimizer_for(wrapped.parameters())
    for batch in batches:
        opt.zero_grad()
        _, loss = wrapped(*batch)
        loss.backward()
        opt.step()


def as_float64(batch):
    return tuple(t.double() if t.is_floating_point() else t for t in batch)
