#!/usr/bin/env python3
"""Model-hub parity sweep: Hugging Face, timm and torchvision models against eager PyTorch.

Every model is built from a config with random weights (nothing is
downloaded): ``transformers.XConfig(...)`` + ``XForY(config)``,
``timm.create_model(name, pretrained=False, ...)`` and torchvision's
constructors, all small (2 layers of width 64, vocabularies of 128, 8 to 12
tokens, 32x32 images) and with dropout and stochastic depth off (a guard
runs every training-mode forward twice and refuses to compare a random
one).  Each model runs in six modes; each (model, mode) is one row:

* ``infer``: ``inferenceModel`` on a copy against ``model.eval()`` in eager
  PyTorch: the largest difference of any output (logits and loss);
* ``sgd``, ``adamw``: three training steps (SGD lr 0.01 momentum 0.9;
  AdamW lr 1e-3 weight decay 0.01) of the whole batch, against the same
  three steps in eager PyTorch: the largest difference of any parameter or
  buffer afterwards;
* ``pipelined``: ``poptorch.BeginBlock`` on the model's layers, 2 to 4
  IPUs (layers that share weights on one IPU, as PopTorch requires: GPT-2's
  tied head goes back to IPU 0 in a third stage, with ``AutoStage.
  AutoIncrement``; GPT-2 and LLaMA leave their embeddings before the first
  block, where PopTorch runs them on IPU 0), ``gradientAccumulation`` 2N-1
  for N stages (PopTorch's rule and stage count), three SGD steps; compared
  with eager PyTorch on the combined batch (each micro-batch's loss divided
  by the accumulation count, one optimizer step per call:
  ``conftest.reference_call``) and with the same options unpipelined (the
  note gives that difference);
* ``replicated``: ``replicationFactor(2)`` with ``gradientAccumulation(2)``,
  three SGD steps, against eager on the combined batch (four micro-batches
  per step); buffers that the forward pass updates (batch-norm running
  statistics) are per replica, so the eager reference keeps one copy per
  replica and ends with replica 0's, which is what the host reads back;
* ``fp16``: ``model.half()``, ``poptorchsim.optim.SGD(lr=0.01,
  loss_scaling=S)`` for three steps, against eager fp16 with the loss
  multiplied by S before ``backward()`` and the gradients divided by S
  before ``step()``; S is the largest of 256, 64, 16, 4, 1 whose eager run
  stays finite (several CNNs' gradients overflow fp16 at 256 in eager
  PyTorch too).

Differences are ``|sim - eager| / max(1, |eager|)`` (absolute up to 1,
relative above: a running variance of 1e4 has an fp32 ulp of 1e-3).
Verdicts: ``match`` when the largest is at most 1e-4 (fp32).  Where it is
not, eager PyTorch is re-run in float64 (as ``tests/test_model_zoo.py``
does for ill-conditioned models) and the row is ``match (fp64 arbiter)``
when the simulator is within 1e-4 of float64, or no further from it than
2x eager fp32 is (eager fp32 itself is then the unstable one; the note
gives both distances).  Batch norm over a few values per channel (micro-
batches of 2-4 at 1x1 spatial size) makes fp32 training of most small CNNs
chaotic, eager fp32 and fp64 ending O(1) apart, so such rows are re-run
with the batch norms in eval mode (running statistics, as when fine-tuning),
which is well conditioned and must match too (``BN frozen`` in the note).
fp16 rows use the fp16 tolerance below and are arbitrated the same way
against eager fp32.  ``refused: <class>: <message head>`` when poptorchsim
raises one of its typed errors (``poptorchsim.Error``); ``MISMATCH`` beyond
tolerance and ``CRASH`` (an untyped exception) are bugs; ``n/a`` when eager
PyTorch itself cannot run the mode.  Programs that do not fit a Mk2 IPU's
tile memory compile with ``debug.allowOutOfMemory`` (noted): the sweep is
about numerics.

fp16 tolerance: ``|sim - eager| <= 2**-10 + 2**-8 |eager|`` per element.
The simulator is bit-exact to PyTorch's CPU fp16 element-wise ops and
matmuls with float partials up to the summation order of reductions split
over tiles, so gradients may differ in their last bit or two; with unit
roundoff u = 2**-11 a weight that rounds differently in one of the three
updates is 1 ulp (2u|w|) away, three steps at most 3 ulps: 2**-8 |w| is 4
ulps at the weight's own magnitude (2 to 4 ulps inside a binade).  The
absolute 2**-10 (one ulp at 1.0) covers weights near zero, whose ulp is
smaller than an update's rounding.

Timing: host seconds per step are the median of the simulator's calls after
compiling (``compile()`` is timed apart), the ratio is simulator / eager
per step (eager: the same step in plain PyTorch, timed in the same run);
< 1 means the simulator is faster.  The full sweep takes about 11 minutes
on one thread of a 2-core machine, ``--quick`` about 45 s.  The exit status
is 1 when a row is MISMATCH, CRASH or TIMEOUT.

    python benchmarks/model_hub.py [--quick] [--models gpt2,bert_*,timm]
                                   [--modes sgd,pipelined] [--markdown PATH]
                                   [--json PATH] [--timeout S] [--threads N]
"""
import argparse
import copy
import fnmatch
import json
import logging
import math
import os
import platform
import signal
import statistics
import sys
import time
import traceback
from dataclasses import asdict, dataclass, field
from typing import Callable, List, Optional, Tuple

import torch
from torch import nn
from tqdm.auto import tqdm

import poptorchsim
from poptorchsim.machine import host_device
from poptorchsim.testing import quiet_options, reference_call, to_layout, zoo

HERE = os.path.dirname(os.path.abspath(__file__))

TOL = 1e-4                    # fp32: largest weight / output difference for "match"
FP64_FACTOR = 2.0             # arbitration: sim no further from fp64 than 2x eager fp32
FP16_ATOL = 2.0 ** -10        # one fp16 ulp at 1.0
FP16_RTOL = 2.0 ** -8         # 4 ulps at the weight's magnitude (2-4 inside a binade)
LOSS_SCALING = 256.0
STEPS = 3
CLASSES = 10
VOCAB = 128
SEQ = 12
MODES = ["infer", "sgd", "adamw", "pipelined", "replicated", "fp16"]
MOVED = 1e-6                  # training rows whose weights moved less are flagged


# ---------------------------------------------------------------------------
# Model table
# ---------------------------------------------------------------------------
@dataclass
class Spec:
    name: str
    family: str                         # "transformers", "timm" or "torchvision"
    build: Callable[[], nn.Module]      # a module: forward(*inputs) -> (output, loss)
    inputs: Callable                    # (n, generator) -> tuple (inputs..., target)
    blocks: List[Tuple[str, int]]       # BeginBlock(module path, ipu) in execution order
    micro: int = 2                      # micro-batch
    seed: int = 0
    note: str = ""

    @property
    def package(self):
        return {"transformers": "transformers", "timm": "timm"}.get(self.family)


class HFWithLoss(nn.Module):
    """A Hugging Face model called with keyword inputs; returns (output, loss).

    ``keys`` names the positional inputs (``labels`` among them, so the model
    computes its own loss); ``output`` is the attribute returned with it."""

    def __init__(self, model, keys, output="logits", identity=False, **fixed):
        super().__init__()
        self.model = model
        self.keys = tuple(keys)
        self.output = output
        self.identity = identity
        self.fixed = fixed

    def forward(self, *args):
        out = self.model(**dict(zip(self.keys, args)), **self.fixed)
        loss = out.loss
        if self.identity:
            # a sum of losses (CLIP: image and text cross-entropy) is one final
            # loss only through identity_loss, in PopTorch as here
            loss = poptorchsim.identity_loss(loss, reduction="none")
        return getattr(out, self.output), loss


def _hf(cls_name, config_name, keys, output="logits", fixed=None, identity=False, **config):
    def build():
        import transformers
        cfg = getattr(transformers, config_name)(**config)
        cfg._attn_implementation = "eager"
        if hasattr(cfg, "use_cache"):
            cfg.use_cache = False
        model = getattr(transformers, cls_name)(cfg)
        return HFWithLoss(model, keys, output, identity, **(fixed or {}))
    return build


def _vision(make):
    def build():
        return zoo.WithLoss(make(), "ce")
    return build


def _timm(name, drop_path=True, **kwargs):
    """timm model with dropout and stochastic depth off (several families
    default to drop_rate 0.2 or drop_path_rate 0.1)."""
    def make():
        import timm
        if drop_path:
            kwargs.setdefault("drop_path_rate", 0.0)
        return timm.create_model(name, pretrained=False, num_classes=CLASSES, drop_rate=0.0,
                                 **kwargs)
    return _vision(make)


def _tv(name, **kwargs):
    def make():
        import torchvision
        return getattr(torchvision.models, name)(num_classes=CLASSES, **kwargs)
    return _vision(make)


# inputs -------------------------------------------------------------------
def lm_inputs(seq=SEQ, low=3):
    """token ids and labels equal to them (causal LMs shift inside)."""
    def make(n, g):
        ids = torch.randint(low, VOCAB, (n, seq), generator=g)
        return ids, ids.clone()
    return make


def mlm_inputs(seq=SEQ):
    """token ids and MLM labels: a third of the positions, -100 elsewhere."""
    def make(n, g):
        ids = torch.randint(3, VOCAB, (n, seq), generator=g)
        labels = torch.randint(3, VOCAB, (n, seq), generator=g)
        keep = torch.rand(n, seq, generator=g) < 0.33
        keep[:, 0] = True
        return ids, torch.where(keep, labels, torch.full_like(labels, -100))
    return make


def cls_inputs(seq=SEQ, low=3):
    def make(n, g):
        return (torch.randint(low, VOCAB, (n, seq), generator=g),
                torch.randint(0, CLASSES, (n,), generator=g))
    return make


def seq2seq_inputs(src=SEQ, tgt=8):
    def make(n, g):
        return (torch.randint(3, VOCAB, (n, src), generator=g),
                torch.randint(3, VOCAB, (n, tgt), generator=g))
    return make


def image_inputs(size=32):
    def make(n, g):
        return (torch.randn(n, 3, size, size, generator=g),
                torch.randint(0, CLASSES, (n,), generator=g))
    return make


def clip_inputs(n, g):
    return (torch.randint(3, VOCAB, (n, 8), generator=g),
            torch.randn(n, 3, 32, 32, generator=g))


def whisper_inputs(n, g):
    return (torch.randn(n, 16, 16, generator=g),
            torch.randint(3, VOCAB, (n, 8), generator=g))


_NO_DROP_BERT = dict(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
_BERT = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
             intermediate_size=128, max_position_embeddings=32, **_NO_DROP_BERT)
_DECODER = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                attention_dropout=0.0)


def hf_specs():
    return [
        Spec("gpt2", "transformers",
             _hf("GPT2LMHeadModel", "GPT2Config", ("input_ids", "labels"),
                 vocab_size=VOCAB, n_positions=32, n_embd=64, n_layer=2, n_head=4,
                 resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0),
             lm_inputs(),
             # as Graphcore's examples: the embeddings before the first block
             # (IPU 0), the tied lm_head back on IPU 0 in a third stage
             [("model.transformer.h.1", 1), ("model.transformer.ln_f", 0)],
             note="tied wte / lm_head"),
        Spec("bert_mlm", "transformers",
             _hf("BertForMaskedLM", "BertConfig", ("input_ids", "labels"), **_BERT),
             mlm_inputs(),
             [("model.bert.embeddings", 0), ("model.bert.encoder.layer.1", 1),
              ("model.cls", 0)],
             note="tied word embeddings / decoder"),
        Spec("bert_cls", "transformers",
             _hf("BertForSequenceClassification", "BertConfig", ("input_ids", "labels"),
                 num_labels=CLASSES, **_BERT),
             cls_inputs(),
             [("model.bert.embeddings", 0), ("model.bert.encoder.layer.0", 1),
              ("model.bert.encoder.layer.1", 2), ("model.classifier", 3)]),
        Spec("roberta", "transformers",
             _hf("RobertaForSequenceClassification", "RobertaConfig", ("input_ids", "labels"),
                 num_labels=CLASSES, type_vocab_size=1, pad_token_id=1,
                 **{**_BERT, "max_position_embeddings": SEQ + 2}),
             cls_inputs(),
             [("model.roberta.embeddings", 0), ("model.roberta.encoder.layer.1", 1)]),
        Spec("distilbert", "transformers",
             _hf("DistilBertForSequenceClassification", "DistilBertConfig",
                 ("input_ids", "labels"), vocab_size=VOCAB, dim=64, n_layers=2, n_heads=4,
                 hidden_dim=128, max_position_embeddings=32, dropout=0.0,
                 attention_dropout=0.0, seq_classif_dropout=0.0, num_labels=CLASSES),
             cls_inputs(),
             [("model.distilbert.embeddings", 0), ("model.distilbert.transformer.layer.1", 1)]),
        Spec("t5", "transformers",
             _hf("T5ForConditionalGeneration", "T5Config", ("input_ids", "labels"),
                 vocab_size=VOCAB, d_model=64, d_kv=16, d_ff=128, num_layers=2,
                 num_decoder_layers=2, num_heads=4, dropout_rate=0.0,
                 decoder_start_token_id=0, pad_token_id=0, eos_token_id=1),
             seq2seq_inputs(),
             # the shared embedding (encoder, decoder, tied lm_head) stays on IPU 0
             [("model.encoder", 0), ("model.encoder.block.1", 1), ("model.decoder", 0)],
             note="shared embedding, tied lm_head"),
        Spec("bart", "transformers",
             _hf("BartForConditionalGeneration", "BartConfig", ("input_ids", "labels"),
                 vocab_size=VOCAB, d_model=64, encoder_layers=2, decoder_layers=2,
                 encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=128,
                 decoder_ffn_dim=128, max_position_embeddings=32, dropout=0.0,
                 attention_dropout=0.0, activation_dropout=0.0, pad_token_id=1,
                 bos_token_id=0, eos_token_id=2, decoder_start_token_id=2,
                 forced_eos_token_id=None),
             seq2seq_inputs(),
             [("model.model.encoder", 0), ("model.model.encoder.layers.1", 1),
              ("model.model.decoder", 0)],
             note="shared embedding, tied lm_head"),
        Spec("vit", "transformers",
             _hf("ViTForImageClassification", "ViTConfig", ("pixel_values", "labels"),
                 image_size=32, patch_size=8, hidden_size=64, num_hidden_layers=2,
                 num_attention_heads=4, intermediate_size=128, num_labels=CLASSES,
                 **_NO_DROP_BERT),
             image_inputs(32),
             [("model.vit.embeddings", 0), ("model.vit.layers.1", 1)]),
        Spec("swin", "transformers",
             _hf("SwinForImageClassification", "SwinConfig", ("pixel_values", "labels"),
                 image_size=32, patch_size=2, embed_dim=32, depths=[1, 1], num_heads=[2, 4],
                 window_size=4, mlp_ratio=2.0, drop_path_rate=0.0, num_labels=CLASSES,
                 **_NO_DROP_BERT),
             image_inputs(32),
             [("model.swin.embeddings", 0), ("model.swin.encoder.layers.1", 1)]),
        Spec("clip", "transformers",
             _hf("CLIPModel", "CLIPConfig", ("input_ids", "pixel_values"),
                 output="logits_per_image", fixed={"return_loss": True}, identity=True,
                 text_config=dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                                  num_hidden_layers=2, num_attention_heads=4,
                                  max_position_embeddings=16, attention_dropout=0.0,
                                  eos_token_id=2),
                 vision_config=dict(image_size=32, patch_size=8, hidden_size=64,
                                    intermediate_size=128, num_hidden_layers=2,
                                    num_attention_heads=4, attention_dropout=0.0),
                 projection_dim=32),
             clip_inputs,
             [("model.vision_model", 0), ("model.text_model", 1)],
             note="contrastive loss over the micro-batch, in identity_loss"),
        Spec("whisper", "transformers",
             _hf("WhisperForConditionalGeneration", "WhisperConfig",
                 ("input_features", "labels"),
                 vocab_size=VOCAB, num_mel_bins=16, encoder_layers=2, decoder_layers=2,
                 encoder_attention_heads=4, decoder_attention_heads=4, d_model=64,
                 encoder_ffn_dim=128, decoder_ffn_dim=128, max_source_positions=8,
                 max_target_positions=16, dropout=0.0, attention_dropout=0.0,
                 activation_dropout=0.0, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                 decoder_start_token_id=1, suppress_tokens=None,
                 begin_suppress_tokens=None),
             whisper_inputs,
             [("model.model.encoder", 0), ("model.model.decoder", 1)],
             note="tied decoder embedding / proj_out"),
        Spec("llama", "transformers",
             _hf("LlamaForCausalLM", "LlamaConfig", ("input_ids", "labels"),
                 tie_word_embeddings=False, **_DECODER),
             lm_inputs(),
             # the embedding before the first block: IPU 0
             [("model.model.layers.0", 1), ("model.model.layers.1", 2), ("model.model.norm", 3)],
             note="RoPE, GQA, RMSNorm, SwiGLU"),
        Spec("mistral", "transformers",
             _hf("MistralForCausalLM", "MistralConfig", ("input_ids", "labels"),
                 tie_word_embeddings=True, sliding_window=8, **_DECODER),
             lm_inputs(),
             [("model.model.embed_tokens", 0), ("model.model.layers.1", 1),
              ("model.model.norm", 0)],
             note="sliding window 8, tied head"),
    ]


def timm_specs():
    img = image_inputs(32)
    small_vit = dict(img_size=32, patch_size=8, depth=2)
    return [
        Spec("timm_resnet10t", "timm", _timm("resnet10t"), img,
             [("model.conv1", 0), ("model.layer2", 1), ("model.layer3", 2), ("model.layer4", 3)],
             micro=4),
        Spec("timm_efficientnet_b0", "timm", _timm("efficientnet_b0"), img,
             [("model.conv_stem", 0), ("model.blocks.4", 1)], micro=4),
        Spec("timm_convnext_atto", "timm", _timm("convnext_atto"), img,
             [("model.stem", 0), ("model.stages.1", 1), ("model.stages.2", 2),
              ("model.stages.3", 3)], micro=4),
        Spec("timm_vit_tiny", "timm", _timm("vit_tiny_patch16_224", **small_vit), img,
             [("model.patch_embed", 0), ("model.blocks.1", 1)],
             note="img 32, patch 8, depth 2"),
        Spec("timm_deit_tiny", "timm", _timm("deit_tiny_patch16_224", **small_vit), img,
             [("model.patch_embed", 0), ("model.blocks.1", 1)],
             note="img 32, patch 8, depth 2"),
        Spec("timm_swin_tiny", "timm",
             _timm("swin_tiny_patch4_window7_224", img_size=32, patch_size=2, window_size=4,
                   depths=(1, 1, 1, 1), embed_dim=32, num_heads=(1, 2, 4, 8)),
             img, [("model.patch_embed", 0), ("model.layers.2", 1)],
             note="img 32, patch 2, window 4, depths 1,1,1,1, dim 32"),
        Spec("timm_regnetx_002", "timm", _timm("regnetx_002"), img,
             [("model.stem", 0), ("model.s3", 1)], micro=4),
        Spec("timm_mobilevit_xxs", "timm", _timm("mobilevit_xxs"), image_inputs(64),
             [("model.stem", 0), ("model.stages.3", 1)], micro=4, note="img 64"),
        Spec("timm_mobilenetv3_small_050", "timm", _timm("mobilenetv3_small_050"), img,
             [("model.conv_stem", 0), ("model.blocks.3", 1)], micro=4),
        Spec("timm_ghostnet_050", "timm", _timm("ghostnet_050", drop_path=False), img,
             [("model.conv_stem", 0), ("model.blocks.5", 1)], micro=4),
        Spec("timm_levit_128s", "timm", _timm("levit_128s", img_size=64), image_inputs(64),
             [("model.stem", 0), ("model.stages.1", 1)], micro=4,
             note="img 64, attention-bias tables"),
    ]


def _tv_swin_t():
    from torchvision.models.swin_transformer import SwinTransformer
    return SwinTransformer(patch_size=[4, 4], embed_dim=96, depths=[2, 2, 6, 2],
                           num_heads=[3, 6, 12, 24], window_size=[7, 7], dropout=0.0,
                           attention_dropout=0.0, stochastic_depth_prob=0.0,
                           num_classes=CLASSES)


def tv_specs():
    """torchvision classifiers that tests/test_model_zoo.py does not cover
    (it has resnet18/50/101/152, mobilenet_v3_small, efficientnet_b0,
    densenet121, convnext_tiny and a small VisionTransformer).  VGG is left
    out: its 25088x4096 classifier alone is 100M parameters."""
    img = image_inputs(32)
    return [
        Spec("tv_alexnet", "torchvision", _tv("alexnet", dropout=0.0), image_inputs(64),
             [("model.features", 0), ("model.classifier", 1)], micro=4, note="img 64"),
        Spec("tv_squeezenet1_1", "torchvision", _tv("squeezenet1_1", dropout=0.0), img,
             [("model.features", 0), ("model.features.9", 1)], micro=4),
        Spec("tv_shufflenet_v2_x0_5", "torchvision", _tv("shufflenet_v2_x0_5"), img,
             [("model.conv1", 0), ("model.stage3", 1)], micro=4),
        Spec("tv_mnasnet0_5", "torchvision", _tv("mnasnet0_5", dropout=0.0), img,
             [("model.layers", 0), ("model.layers.11", 1)], micro=4),
        Spec("tv_mobilenet_v2", "torchvision", _tv("mobilenet_v2", dropout=0.0), img,
             [("model.features", 0), ("model.features.10", 1)], micro=4),
        Spec("tv_mobilenet_v3_large", "torchvision", _tv("mobilenet_v3_large", dropout=0.0), img,
             [("model.features", 0), ("model.features.10", 1)], micro=4),
        Spec("tv_googlenet", "torchvision",
             _tv("googlenet", aux_logits=False, init_weights=True, dropout=0.0), img,
             [("model.conv1", 0), ("model.inception3b", 1), ("model.inception4c", 2),
              ("model.inception5a", 3)], micro=4),
        Spec("tv_regnet_y_400mf", "torchvision", _tv("regnet_y_400mf"), img,
             [("model.stem", 0), ("model.trunk_output.block3", 1)], micro=4),
        Spec("tv_resnext50_32x4d", "torchvision", _tv("resnext50_32x4d"), img,
             [("model.conv1", 0), ("model.layer3", 1)], micro=4),
        # swin_t's own architecture (swin_t() fixes stochastic_depth_prob=0.2)
        Spec("tv_swin_t", "torchvision", _vision(_tv_swin_t), img,
             [("model.features", 0), ("model.features.4", 1)], note="swin_t, depth off"),
    ]


SPECS = hf_specs() + timm_specs() + tv_specs()
BY_NAME = {s.name: s for s in SPECS}
QUICK = ["gpt2", "bert_cls", "vit", "llama", "timm_resnet10t", "tv_squeezenet1_1"]


# ---------------------------------------------------------------------------
# Helpers
# ---------------------------------------------------------------------------
class RowTimeout(Exception):
    pass


class EagerFailed(Exception):
    """Eager PyTorch itself cannot run the mode (not a simulator bug)."""


class Stochastic(Exception):
    """The model's training-mode forward is random (dropout left on): two
    runs cannot be compared."""


def check_deterministic(model, batch):
    """Two training-mode forward passes of copies give the same outputs."""
    with torch.no_grad():
        a = copy.deepcopy(model)(*batch)
        b = copy.deepcopy(model)(*batch)
    if output_diff(a, b) != 0.0:
        raise Stochastic("two eager training-mode forward passes differ: dropout or "
                         "stochastic depth left on")


def build(spec):
    torch.manual_seed(spec.seed)
    return spec.build()


def make_batches(spec, n_samples, count, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [spec.inputs(n_samples, g) for _ in range(count)]


def cast(batch, dtype):
    return tuple(t.to(dtype) if t.is_floating_point() else t for t in batch)


def leaves(x):
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, (tuple, list)):
        return [t for e in x for t in leaves(e)]
    return []


def _scaled(x, y, scale):
    """max |x - y| / scale(|y|) over elements; equal values (infinities and
    NaNs included) count 0, a NaN or infinity on one side only is inf
    (compared on the CPU: the eager reference may be on a GPU)."""
    x, y = x.double().cpu(), y.double().cpu()
    if not y.numel():
        return 0.0
    same = (x == y) | (torch.isnan(x) & torch.isnan(y))
    d = torch.where(same, torch.zeros_like(x), (x - y).abs() / scale(y.abs()))
    return torch.nan_to_num(d, nan=math.inf).max().item()


def _diff(x, y):
    """max |x - y| / max(1, |y|): absolute for values up to 1, relative above
    (a running variance of 1e4 has an fp32 ulp of 1e-3)."""
    return _scaled(x, y, lambda a: a.clamp(min=1.0))


def output_diff(a, b):
    la, lb = leaves(a), leaves(b)
    if len(la) != len(lb):
        raise AssertionError(f"{len(la)} outputs against eager's {len(lb)}")
    return max((_diff(x, y) for x, y in zip(la, lb)), default=0.0)


def state_diff(a, b):
    """Largest difference (``_diff``) over the floating-point parameters and buffers."""
    sa, sb = a.state_dict(), b.state_dict()
    if sa.keys() != sb.keys():
        raise AssertionError(f"state_dict keys differ: {sorted(set(sa) ^ set(sb))[:4]}")
    return max((_diff(sa[k], sb[k]) for k in sb if sb[k].is_floating_point()), default=0.0)


def fp16_excess(a, b):
    """max over elements of |a-b| / (FP16_ATOL + FP16_RTOL |b|): <= 1 is within tolerance."""
    sa, sb = a.state_dict(), b.state_dict()
    return max((_scaled(sa[k], sb[k], lambda m: FP16_ATOL + FP16_RTOL * m)
                for k in sb if sb[k].is_floating_point()), default=0.0)


def sgd(params):
    return torch.optim.SGD(params, lr=0.01, momentum=0.9)


def adamw(params):
    return torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01)


def options(ga=1, rf=1, blocks=None):
    """Options of a run; programs that do not fit compile anyway (``fits``
    says so in the row's note): the sweep is about numerics."""
    opts = quiet_options().replicationFactor(rf)
    opts._Popart.setEngineOptions({"debug.allowOutOfMemory": "true"})
    opts.Training.gradientAccumulation(ga)
    if blocks and revisits(blocks):
        # stage = IPU (PopTorch's default, AutoStage.SameAsIpu) cannot go back
        # to an IPU: a new stage per block
        opts.setExecutionStrategy(poptorchsim.PipelinedExecution(
            poptorchsim.AutoStage.AutoIncrement))
    return opts


def pipeline_stages(blocks):
    """PopTorch's count: one stage, plus one per change of IPU in the forward
    pass starting from IPU 0 (layers before the first block run on IPU 0)."""
    ipus = [0] + [ipu for _, ipu in blocks]
    return 1 + sum(a != b for a, b in zip(ipus, ipus[1:]))


def revisits(blocks):
    ipus = [ipu for _, ipu in blocks]
    return any(later < earlier for earlier, later in zip(ipus, ipus[1:]))


def annotate(wrapped, blocks):
    for path, ipu in blocks:
        poptorchsim.BeginBlock(wrapped.get_submodule(path), user_id=path, ipu_id=ipu)


def eager_device():
    """Where the eager reference runs: the simulator's host device
    (``poptorchsim.hostDevice()``: ``POPTORCHSIM_DEVICE``, which
    ``benchmarks/gpu_check.py`` sets to cuda), so that on a GPU the sweep
    compares with eager PyTorch on that GPU."""
    return poptorchsim.hostDevice()


def on_eager_device(x):
    """``x`` (tensors in lists and tuples) on ``eager_device()``."""
    return host_device.to(x, eager_device())


def eager_training(model, make_opt, batches, ga=1, rf=1):
    """One optimizer step per batch in plain PyTorch; seconds per step.

    ``rf == 1``: ``conftest.reference_call``.  With replicas, the gradient is
    the same mean over the ``ga * rf`` micro-batches, but buffers that the
    forward pass changes (batch-norm running statistics) are per replica, as
    on IPUs: replica ``r`` updates its own copy with its own micro-batches
    only, and the model ends with replica 0's (what the host reads back)."""
    model.to(eager_device())
    batches = [on_eager_device(b) for b in batches]
    opt = make_opt(model.parameters())
    times = []
    try:
        if rf == 1:
            for b in batches:
                t0 = time.perf_counter()
                reference_call(model, opt, b, 1, ga, rf)
                times.append(time.perf_counter() - t0)
            return times
        buffers = [b for _, b in model.named_buffers()]
        replicas = [[b.detach().clone() for b in buffers] for _ in range(rf)]
        for batch in batches:
            t0 = time.perf_counter()
            split = [to_layout(t, 1, ga, rf) for t in batch]
            opt.zero_grad()
            for g in range(ga):
                for r in range(rf):
                    with torch.no_grad():
                        for b, saved in zip(buffers, replicas[r]):
                            b.copy_(saved)
                    _, loss = model(*[t[0, g, r] for t in split])
                    (loss / (ga * rf)).backward()
                    replicas[r] = [b.detach().clone() for b in buffers]
            opt.step()
            times.append(time.perf_counter() - t0)
        with torch.no_grad():
            for b, saved in zip(buffers, replicas[0]):
                b.copy_(saved)
    except Exception as exc:
        raise EagerFailed(f"{type(exc).__name__}: {_head(exc)}") from exc
    return times


def fits(model):
    """Whether the compiled program fits its IPUs' tile memory."""
    memory = model.memoryReport()
    return bool(memory.total.max() <= memory.capacity)


def sim_training(model, opts, optimizer, batches, row=None):
    """(compile seconds, seconds per step) of a trainingModel over ``batches``."""
    tm = poptorchsim.trainingModel(model, opts, optimizer=optimizer)
    try:
        t0 = time.perf_counter()
        tm.compile(*batches[0])
        compile_s = time.perf_counter() - t0
        if row is not None and not fits(tm):
            row.note = _join(row.note, "does not fit Mk2 tile memory (allowOutOfMemory)")
        times = []
        for b in batches:
            t0 = time.perf_counter()
            tm(*b)
            times.append(time.perf_counter() - t0)
    finally:
        try:
            tm.destroy()
        except Exception:  # noqa: BLE001 - cleanup after a measurement
            pass
    return compile_s, times


def _head(exc, n=110):
    text = str(exc).strip()
    first = text.splitlines()[0] if text else ""
    return first if len(first) <= n else first[:n - 3] + "..."


@dataclass
class Row:
    model: str
    family: str
    mode: str
    diff: Optional[float] = None
    verdict: str = ""
    compile_s: Optional[float] = None
    sim_step_s: Optional[float] = None
    eager_step_s: Optional[float] = None
    ratio: Optional[float] = None
    note: str = ""
    detail: str = field(default="", repr=False)

    def timing(self, compile_s, sim_times, eager_times):
        self.compile_s = compile_s
        self.sim_step_s = statistics.median(sim_times)
        self.eager_step_s = statistics.median(eager_times)
        self.ratio = self.sim_step_s / self.eager_step_s if self.eager_step_s else None


def _arbitrate(row, diff32, ref64_diff):
    """Verdict of a fp32 row: ``ref64_diff()`` -> (sim vs fp64, eager fp32 vs fp64)."""
    row.diff = diff32
    if diff32 <= TOL:
        row.verdict = "match"
        return
    sim64, eager64 = ref64_diff()
    row.note = _join(row.note, f"fp32 eager vs sim {diff32:.1e}; vs fp64: sim {sim64:.1e}, "
                     f"eager fp32 {eager64:.1e}")
    if sim64 <= TOL or sim64 <= FP64_FACTOR * eager64:
        row.verdict = "match (fp64 arbiter)"
    else:
        row.verdict = "MISMATCH"


def _join(a, b):
    return f"{a}; {b}" if a and b else (a or b)


# ---------------------------------------------------------------------------
# Modes
# ---------------------------------------------------------------------------
def run_infer(spec, row):
    model = build(spec).eval()
    batch, = make_batches(spec, spec.micro, 1)
    eager_times = []
    eager_model, eager_batch = copy.deepcopy(model).to(eager_device()), on_eager_device(batch)
    try:
        with torch.no_grad():
            for _ in range(3):
                t0 = time.perf_counter()
                expected = eager_model(*eager_batch)
                eager_times.append(time.perf_counter() - t0)
    except Exception as exc:
        raise EagerFailed(f"{type(exc).__name__}: {_head(exc)}") from exc
    im = poptorchsim.inferenceModel(copy.deepcopy(model), options())
    t0 = time.perf_counter()
    im.compile(*batch)
    compile_s = time.perf_counter() - t0
    if not fits(im):
        row.note = _join(row.note, "does not fit Mk2 tile memory (allowOutOfMemory)")
    sim_times = []
    for _ in range(3):
        t0 = time.perf_counter()
        got = im(*batch)
        sim_times.append(time.perf_counter() - t0)
    im.destroy()
    row.timing(compile_s, sim_times, eager_times)

    def fp64():
        m64 = copy.deepcopy(model).double()
        with torch.no_grad():
            truth = m64(*cast(batch, torch.float64))
        return output_diff(got, truth), output_diff(expected, truth)
    _arbitrate(row, output_diff(got, expected), fp64)


@dataclass
class Trained:
    initial: nn.Module
    batches: list
    sim: nn.Module
    ref: nn.Module                  # eager fp32
    fp64: Callable                  # () -> eager float64 (computed once)


def _train_both(initial, batches, make_opt, ga, rf, blocks, row=None):
    """The simulator and eager PyTorch trained from copies of ``initial``."""
    ref = copy.deepcopy(initial)
    eager_times = eager_training(ref, make_opt, batches, ga, rf)
    sim = copy.deepcopy(initial)
    if blocks:
        annotate(sim, blocks)
    compile_s, sim_times = sim_training(sim, options(ga, rf, blocks), make_opt(sim.parameters()),
                                        batches, row)
    cache = []

    def fp64():
        if not cache:
            ref64 = copy.deepcopy(initial).double()
            eager_training(ref64, make_opt, [cast(b, torch.float64) for b in batches], ga, rf)
            cache.append(ref64)
        return cache[0]
    return Trained(initial, batches, sim, ref, fp64), (compile_s, sim_times, eager_times)


def _batch_norms(model):
    return [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]


def _run_train(spec, row, make_opt, ga=1, rf=1, blocks=None):
    initial = build(spec).train()
    batches = make_batches(spec, spec.micro * ga * rf, STEPS)
    check_deterministic(initial, batches[0])
    run, timing = _train_both(initial, batches, make_opt, ga, rf, blocks, row)
    row.timing(*timing)
    moved = state_diff(run.sim, initial)
    if moved < MOVED:
        row.note = _join(row.note, f"weights moved only {moved:.1e}")
    _arbitrate(row, state_diff(run.sim, run.ref),
               lambda: (state_diff(run.sim, run.fp64()), state_diff(run.ref, run.fp64())))
    if row.verdict == "match (fp64 arbiter)" and _batch_norms(initial):
        _frozen_bn_check(row, initial, batches, make_opt, ga, rf, blocks)
    return run


def _frozen_bn_check(row, initial, batches, make_opt, ga, rf, blocks):
    """Batch norm over a few values per channel (micro-batches of 2-4 at 1x1
    or 2x2 spatial size) makes fp32 training chaotic: eager fp32 and fp64
    then differ by more than the mode could.  The same mode with the batch
    norms in eval mode (running statistics, as when fine-tuning) is well
    conditioned and must match eager within the tolerance."""
    frozen = copy.deepcopy(initial)
    for m in _batch_norms(frozen):
        m.eval()
    run, _ = _train_both(frozen, batches, make_opt, ga, rf, blocks)
    diff = state_diff(run.sim, run.ref)
    row.note = _join(row.note, f"BN frozen: {diff:.1e}")
    if diff <= TOL:
        return
    sim64, eager64 = state_diff(run.sim, run.fp64()), state_diff(run.ref, run.fp64())
    row.note = _join(row.note, f"BN frozen vs fp64: sim {sim64:.1e}, eager {eager64:.1e}")
    if not (sim64 <= TOL or sim64 <= FP64_FACTOR * eager64):
        row.verdict = "MISMATCH"


def run_sgd(spec, row):
    _run_train(spec, row, sgd)


def run_adamw(spec, row):
    _run_train(spec, row, adamw)


def run_pipelined(spec, row):
    stages = pipeline_stages(spec.blocks)
    ipus = len({0} | {ipu for _, ipu in spec.blocks})
    ga = 2 * stages - 1
    row.note = f"{stages} stages on {ipus} IPUs, GA {ga}"
    run = _run_train(spec, row, sgd, ga=ga, blocks=spec.blocks)
    flat = copy.deepcopy(run.initial)
    sim_training(flat, options(ga), sgd(flat.parameters()), run.batches)
    vs_flat = state_diff(run.sim, flat)
    row.note = _join(row.note, f"vs unpipelined {vs_flat:.1e}")
    if vs_flat <= TOL or not row.verdict.startswith("match"):
        return
    # pipelining changed the rounding: both runs must still pass the arbiter
    flat_eager = state_diff(flat, run.ref)
    if flat_eager <= TOL:
        return
    flat64, eager64 = state_diff(flat, run.fp64()), state_diff(run.ref, run.fp64())
    row.note = _join(row.note, f"unpipelined vs fp64 {flat64:.1e}")
    if not (flat64 <= TOL or flat64 <= FP64_FACTOR * eager64):
        row.verdict = "MISMATCH"


def run_replicated(spec, row):
    row.note = "RF 2, GA 2"
    _run_train(spec, row, sgd, ga=2, rf=2)


def _finite(model):
    return all(torch.isfinite(v).all() for v in model.state_dict().values()
               if v.is_floating_point())


def _same_nonfinite(a, b):
    """Both models have non-finite values in exactly the same places."""
    sa, sb = a.state_dict(), b.state_dict()
    return all(torch.equal(~torch.isfinite(sa[k]), ~torch.isfinite(sb[k]))
               for k in sb if sb[k].is_floating_point())


def _finite_part(model):
    """A copy whose non-finite values are 0 (to compare the finite rest)."""
    out = copy.deepcopy(model)
    with torch.no_grad():
        for v in out.state_dict().values():
            if v.is_floating_point():
                v.copy_(torch.where(torch.isfinite(v), v, torch.zeros_like(v)))
    return out


def eager_fp16(model, data, scale):
    """SGD(lr 0.01) steps with the loss multiplied by ``scale`` before
    ``backward()`` and the gradients divided by it before ``step()``."""
    model.to(eager_device())
    data = [on_eager_device(b) for b in data]
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    times = []
    try:
        for b in data:
            t0 = time.perf_counter()
            opt.zero_grad()
            _, loss = model(*b)
            (loss * scale).backward()
            for p in model.parameters():
                if p.grad is not None:
                    p.grad.div_(scale)
            opt.step()
            times.append(time.perf_counter() - t0)
    except Exception as exc:
        raise EagerFailed(f"{type(exc).__name__}: {_head(exc)}") from exc
    return times


def _fp16_both(initial, batches, row=None):
    """(sim, eager, loss scale, (compile s, sim step s, eager step s)) of
    fp16 training from copies of ``initial``, at the largest static loss
    scale of 256, 64, 16, 4, 1 whose eager fp16 run stays finite (some CNNs'
    gradients overflow fp16 at 256 in eager PyTorch too)."""
    half_batches = [cast(b, torch.float16) for b in batches]
    for scale in (LOSS_SCALING, 64.0, 16.0, 4.0, 1.0):
        ref = copy.deepcopy(initial).half()
        eager_times = eager_fp16(ref, half_batches, scale)
        if _finite(ref):
            break
    else:
        raise EagerFailed("eager fp16 training overflows to inf/NaN at every loss scale "
                          "from 256 to 1")
    sim = copy.deepcopy(initial).half()
    opt = poptorchsim.optim.SGD(sim.parameters(), lr=0.01, loss_scaling=scale)
    compile_s, sim_times = sim_training(sim, options(), opt, half_batches, row)
    return sim, ref, scale, (compile_s, sim_times, eager_times)


def _fp16_verdict(row, initial, batches, sim, ref, scale, prefix=""):
    """"match", "match (fp32 arbiter)" or "MISMATCH" of one fp16 run."""
    if not _finite(sim):
        row.note = _join(row.note, f"{prefix}non-finite sim weights (eager finite)")
        return "MISMATCH"
    excess = fp16_excess(sim, ref)
    row.note = _join(row.note, f"{prefix}{excess:.2f}x fp16 tolerance")
    if excess <= 1.0:
        return "match"
    ref32 = copy.deepcopy(initial)
    eager_fp16(ref32, batches, scale)
    sim32, eager32 = state_diff(sim, ref32), state_diff(ref, ref32)
    row.note = _join(row.note, f"{prefix}vs fp32: sim {sim32:.1e}, eager fp16 {eager32:.1e}")
    return "match (fp32 arbiter)" if sim32 <= FP64_FACTOR * eager32 else "MISMATCH"


def run_fp16(spec, row):
    initial = build(spec).train()
    batches = make_batches(spec, spec.micro, STEPS)
    check_deterministic(initial, batches[0])
    try:
        sim, ref, scale, timing = _fp16_both(initial, batches, row)
    except EagerFailed:
        if not _batch_norms(initial):
            raise
        # eager's own fp16 training diverges: compare with the batch norms frozen
        row.note = _join(row.note, "eager fp16 overflows at every loss scale with "
                         "training-mode BN: BN frozen")
        initial = copy.deepcopy(initial)
        for m in _batch_norms(initial):
            m.eval()
        sim, ref, scale, timing = _fp16_both(initial, batches, row)
    row.timing(*timing)
    row.note = _join(row.note, f"loss scale {scale:g}")
    if state_diff(sim, copy.deepcopy(initial).half()) == 0.0:
        row.note = _join(row.note, "fp16 weights did not move")
    row.diff = state_diff(sim, ref)
    row.verdict = _fp16_verdict(row, initial, batches, sim, ref, scale)
    if row.verdict == "match (fp32 arbiter)" and any(m.training for m in _batch_norms(initial)):
        # as _frozen_bn_check: the same with the batch norms in eval mode
        frozen = copy.deepcopy(initial)
        for m in _batch_norms(frozen):
            m.eval()
        sim, ref, scale, _ = _fp16_both(frozen, batches)
        verdict = _fp16_verdict(row, frozen, batches, sim, ref, scale,
                                prefix=f"BN frozen (loss scale {scale:g}): ")
        if verdict == "MISMATCH":
            row.verdict = "MISMATCH"


RUNNERS = {"infer": run_infer, "sgd": run_sgd, "adamw": run_adamw,
           "pipelined": run_pipelined, "replicated": run_replicated, "fp16": run_fp16}


def _alarm(signum, frame):
    raise RowTimeout()


def run_row(spec, mode, timeout=None):
    """One (model, mode): a Row with its verdict; never raises (but KeyboardInterrupt)."""
    row = Row(spec.name, spec.family, mode)
    use_alarm = timeout and hasattr(signal, "SIGALRM")
    if use_alarm:
        old = signal.signal(signal.SIGALRM, _alarm)
        signal.alarm(int(timeout))
    try:
        RUNNERS[mode](spec, row)
    except RowTimeout:
        row.verdict = f"TIMEOUT (> {timeout:g} s)"
    except Stochastic as exc:
        row.verdict = "n/a"
        row.note = _join(row.note, str(exc))
    except EagerFailed as exc:
        row.verdict = "n/a"
        row.note = _join(row.note, f"eager PyTorch fails: {exc}")
    except poptorchsim.Error as exc:
        row.verdict = f"refused: {type(exc).__name__}: {_head(exc)}"
        row.detail = traceback.format_exc()
    except Exception as exc:  # noqa: BLE001 - any crash is a row of the table
        row.verdict = f"CRASH: {type(exc).__name__}: {_head(exc)}"
        row.detail = traceback.format_exc()
    finally:
        if use_alarm:
            signal.alarm(0)
            signal.signal(signal.SIGALRM, old)
    return row


# ---------------------------------------------------------------------------
# Output
# ---------------------------------------------------------------------------
def _fmt(x, spec):
    return "" if x is None else format(x, spec)


def _cell(text):
    return text.replace("|", "\\|").replace("\n", " ")


def markdown(rows):
    lines = ["| model | family | mode | max diff | verdict | compile s | host s/step | "
             "eager s/step | sim/eager | note |",
             "|---|---|---|---:|---|---:|---:|---:|---:|---|"]
    for r in rows:
        lines.append(f"| {r.model} | {r.family} | {r.mode} | {_fmt(r.diff, '.1e')} | "
                     f"{_cell(r.verdict)} | {_fmt(r.compile_s, '.2f')} | "
                     f"{_fmt(r.sim_step_s, '.4f')} | {_fmt(r.eager_step_s, '.4f')} | "
                     f"{_fmt(r.ratio, '.2f')} | {_cell(r.note)} |")
    return "\n".join(lines)


def _short(row):
    """One cell of the per-model table: the difference and how it was judged."""
    v = row.verdict
    if v.startswith("match"):
        mark = {"match": "", "match (fp64 arbiter)": " (f64)",
                "match (fp32 arbiter)": " (f32)"}.get(v, "")
        return f"{'0' if row.diff == 0 else _fmt(row.diff, '.0e')}{mark}"
    if v.startswith("refused"):
        return "refused: " + v.split(":")[1].strip()
    return f"**{v.split(':')[0]}**"


def compact(rows, ratios):
    """One line per model: each mode's largest difference from eager PyTorch
    (``(f64)``/``(f32)``: judged against a float64/float32 re-run, as eager
    itself is unstable there), and the host time per step against eager."""
    modes = list(dict.fromkeys(r.mode for r in rows))
    by_model = {}
    for r in rows:
        by_model.setdefault((r.model, r.family), {})[r.mode] = r
    lines = ["| model | " + " | ".join(modes) + " | sim/eager per step |",
             "|---|" + "---:|" * len(modes) + "---:|"]
    for (model, _family), cells in by_model.items():
        ratio = ratios.get(model)
        lines.append(f"| {model} | " + " | ".join(_cell(_short(cells[m])) if m in cells else ""
                                                   for m in modes)
                     + f" | {_fmt(ratio, '.2f')} |")
    return "\n".join(lines)


def per_model_ratio(rows):
    """Per model: the geometric mean of sim/eager per-step ratios over its modes."""
    out = {}
    for r in rows:
        if r.ratio:
            out.setdefault(r.model, []).append(r.ratio)
    return {m: math.exp(statistics.fmean(math.log(x) for x in v)) for m, v in out.items()}


def summary(rows):
    counts = {}
    for r in rows:
        key = r.verdict.split(":")[0].split(" (")[0]
        counts[key] = counts.get(key, 0) + 1
    return ", ".join(f"{v} {k}" for k, v in sorted(counts.items()))


def select(patterns):
    if not patterns:
        return list(SPECS)
    chosen = []
    for pat in patterns:
        hits = [s for s in SPECS if fnmatch.fnmatch(s.name, pat) or s.family == pat]
        if not hits:
            raise KeyError(pat)
        chosen += [s for s in hits if s not in chosen]
    return chosen


def available(spec):
    if spec.package is None:
        return True
    try:
        __import__(spec.package)
        return True
    except ImportError:
        return False


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help=f"only {', '.join(QUICK)}")
    parser.add_argument("--models", help="comma-separated names, globs (bert_*) or families "
                        "(transformers, timm, torchvision); known: " + ", ".join(BY_NAME))
    parser.add_argument("--modes", help=f"comma-separated modes (default all: {','.join(MODES)})")
    parser.add_argument("--markdown", metavar="PATH", help="also write the table here")
    parser.add_argument("--json", metavar="PATH", help="also write the rows as JSON")
    parser.add_argument("--timeout", type=float, default=600.0,
                        help="seconds per row before it is TIMEOUT (default 600)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    args = parser.parse_args(argv)
    try:
        specs = select([p.strip() for p in args.models.split(",") if p.strip()]
                       if args.models else (QUICK if args.quick else None))
    except KeyError as exc:
        parser.error(f"no model matches {exc}; known: {', '.join(BY_NAME)}")
    modes = [m.strip() for m in args.modes.split(",")] if args.modes else MODES
    bad = [m for m in modes if m not in RUNNERS]
    if bad:
        parser.error(f"unknown mode(s) {', '.join(bad)}; known: {', '.join(MODES)}")
    missing = sorted({s.package for s in specs if not available(s)})
    if missing:
        print(f"skipping models of {', '.join(missing)} (not installed)")
        specs = [s for s in specs if available(s)]

    torch.set_num_threads(args.threads)
    logging.getLogger("poptorchsim").setLevel(logging.ERROR)
    for noisy in ("transformers", "timm"):
        logging.getLogger(noisy).setLevel(logging.ERROR)
    print(f"machine: {platform.machine()}, torch {torch.__version__} with "
          f"{torch.get_num_threads()} thread(s), poptorchsim {poptorchsim.__version__}; "
          f"{len(specs)} models x {len(modes)} modes")
    t_start = time.perf_counter()
    rows = []
    bar = tqdm(total=len(specs) * len(modes), desc="model hub", leave=False)
    for spec in specs:
        for mode in modes:
            bar.set_postfix_str(f"{spec.name} {mode}")
            row = run_row(spec, mode, args.timeout)
            rows.append(row)
            if not row.verdict.startswith(("match", "n/a")):
                tqdm.write(f"{spec.name} {mode}: {row.verdict}")
            bar.update()
    bar.close()
    wall = time.perf_counter() - t_start

    table = markdown(rows)
    ratios = per_model_ratio(rows)
    text = (f"{compact(rows, ratios)}\n\nverdicts: {summary(rows)}; wall time {wall:.0f} s "
            f"({torch.get_num_threads()} torch thread(s)); sim/eager: geometric mean over "
            f"the modes of host seconds per step\n\n{table}\n")
    print(text)
    for path in (args.markdown, args.json):
        if path:
            os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(text)
        print(f"wrote {args.markdown}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": [asdict(r) for r in rows], "per_model_ratio": ratios,
                       "wall_s": wall, "threads": torch.get_num_threads(),
                       "tolerance": {"fp32": TOL, "fp16_atol": FP16_ATOL,
                                     "fp16_rtol": FP16_RTOL, "fp64_factor": FP64_FACTOR}},
                      f, indent=2)
        print(f"wrote {args.json}")
    bad_rows = [r for r in rows if r.verdict.startswith(("MISMATCH", "CRASH", "TIMEOUT"))]
    return 1 if bad_rows else 0


if __name__ == "__main__":
    sys.exit(main())
