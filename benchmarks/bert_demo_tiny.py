"""Graphcore's BERT ``demo_tiny_128`` configuration (graphcore/examples
``nlp/bert/pytorch/configs_pretraining.yml``) as a host-speed case.

The model is Hugging Face's ``BertForPreTraining`` with that configuration:
hidden 64, 3 layers, 8 heads, sequence 128, vocabulary 30,522, hidden
dropout 0.1 (Hugging Face's default; the config sets attention dropout to
0), layer-norm epsilon 1e-3.  The IPU program is the application's: fp16
weights with half partials and stochastic rounding, micro-batch 1,
gradient accumulation 16, embeddings and the heads on IPU 0 and one layer on
each of IPUs 1-3 (``layers_per_ipu: [0, 1, 1, 1]``), AdamW at lr 1e-3
with loss scaling 16, optimizer state off chip.  The eager reference is the
same model in fp32, the same 16 micro-batches of one sequence each, their
gradients accumulated, then one AdamW step.

``sim_step`` and ``eager_step`` build the two and return a function running
one weight update (and its model), so that a caller can time them
interleaved.
"""
import torch

import poptorchsim as poptorch

SEQ, MASKED, MICRO, ACCUMULATION = 128, 20, 1, 16


def config():
    from transformers import BertConfig
    return BertConfig(vocab_size=30522, hidden_size=64, num_hidden_layers=3,
                      num_attention_heads=8, intermediate_size=256,
                      max_position_embeddings=512, hidden_dropout_prob=0.1,
                      attention_probs_dropout_prob=0.0, layer_norm_eps=1e-3)


class Pretraining(torch.nn.Module):
    """``BertForPreTraining`` returning its loss (MLM + NSP), its MLM head on
    the first ``MASKED`` positions only, as the application's model runs it
    (its data puts the masked tokens first: ``mask_tokens: 20``)."""

    def __init__(self, cfg):
        super().__init__()
        from transformers import BertForPreTraining
        self.bert = BertForPreTraining(cfg)

    def forward(self, input_ids, token_type_ids, attention_mask, labels, next_sentence_label):
        seq, pooled = self.bert.bert(input_ids=input_ids, token_type_ids=token_type_ids,
                                     attention_mask=attention_mask, return_dict=False)[:2]
        scores, nsp = self.bert.cls(seq[:, :MASKED], pooled)
        mlm = torch.nn.functional.cross_entropy(scores.float().reshape(-1, scores.shape[-1]),
                                                labels[:, :MASKED].reshape(-1))
        nsp = torch.nn.functional.cross_entropy(nsp.float(), next_sentence_label)
        return poptorch.identity_loss(mlm + nsp, "none")


def batches(n, seed=0):
    """``n`` sequences: random tokens, the first ``MASKED`` positions
    labelled (the application's layout), a next-sentence label each."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 30522, (n, SEQ), generator=g)
    types = torch.cat([torch.zeros(n, SEQ // 2, dtype=torch.long),
                       torch.ones(n, SEQ // 2, dtype=torch.long)], 1)
    mask = torch.ones(n, SEQ, dtype=torch.long)
    labels = torch.full((n, SEQ), -100, dtype=torch.long)
    labels[:, :MASKED] = torch.randint(0, 30522, (n, MASKED), generator=g)
    nsp = torch.randint(0, 2, (n,), generator=g)
    return ids, types, mask, labels, nsp


def _model(dtype):
    torch.manual_seed(5)                        # the config's random_seed
    model = Pretraining(config())
    return model.to(dtype)


def sim_step(dtype=torch.half, serial=False, pipelined=True):
    """(run, model): ``run()`` is one weight update of the IPU program (16
    micro-batches); ``serial``: the micro-batches one after another."""
    model = _model(dtype)
    if pipelined:
        layers = model.bert.bert.encoder.layer
        for k, layer in enumerate(layers):
            poptorch.BeginBlock(layer, f"layer{k}", ipu_id=k + 1)
        # the heads share the embedding's weights: IPU 0, as the application places them
        poptorch.BeginBlock(model.bert.cls, "heads", ipu_id=0)
    opts = poptorch.Options().showCompilationProgressBar(False).randomSeed(5)
    opts.Training.gradientAccumulation(ACCUMULATION)
    opts._Popart.setEngineOptions({"debug.allowOutOfMemory": "true"})
    if pipelined:
        opts.setExecutionStrategy(poptorch.PipelinedExecution(poptorch.AutoStage.AutoIncrement))
        opts.Training.accumulationAndReplicationReductionType(poptorch.ReductionType.Mean)
    if dtype == torch.half:
        opts.Precision.setPartialsType(torch.half)
        opts.Precision.enableStochasticRounding(True)
    opts.TensorLocations.setOptimizerLocation(poptorch.TensorLocationSettings().useOnChipStorage(False))
    scale = 16.0 if dtype == torch.half else 1.0
    optimizer = poptorch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0,
                                     loss_scaling=scale)
    tm = poptorch.trainingModel(model, opts, optimizer)
    data = batches(ACCUMULATION * MICRO)
    tm.compile(*data)
    if serial:
        tm._engine.batch_fn = None
    return (lambda: tm(*data)), tm


def eager_step(dtype=torch.float):
    """(run, model): one eager weight update of the same model in fp32: the
    16 micro-batches' gradients accumulated, then AdamW."""
    model = _model(dtype)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)
    data = batches(ACCUMULATION * MICRO)

    def run():
        opt.zero_grad()
        for k in range(ACCUMULATION):
            loss = model(*(t[k * MICRO:(k + 1) * MICRO] for t in data)) / ACCUMULATION
            loss.backward()
        opt.step()
    return run, model
