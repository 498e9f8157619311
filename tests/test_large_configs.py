"""The large published configurations of benchmarks/fidelity.py (issue 13),
built small: the same builders, options and structure (ResNet with the
examples' recomputation checkpoints; BERT pipelined over 4 IPUs with LAMB
and its optimizer state sharded off chip), at sizes that compile in seconds.
And what they needed from poptorchsim: expanded (stride-0) combined batches
trace as dense tensors, and LAMB accepts replicated tensor sharding.
"""
import copy
import importlib.util
import pathlib

import pytest
import torch
import torch.nn as nn
from conftest import ClassifierWithLoss, assert_state_close, classification_batch, quiet_options

import poptorchsim

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def fidelity():
    spec = importlib.util.spec_from_file_location("fidelity", ROOT / "benchmarks" / "fidelity.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# -- expanded inputs -------------------------------------------------------------------
class FlatLabels(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 3)

    def forward(self, x, labels):
        out = self.fc(x)
        return out, nn.functional.cross_entropy(out.view(-1, 3), labels.view(-1))


def test_an_expanded_batch_traces_as_a_dense_one():
    # labels.view(-1) on a stride-0 slice cannot be a view: on the IPU the
    # micro-batch is a dense copy, so it traces and runs like one
    o = quiet_options().replicationFactor(2)
    o.Training.gradientAccumulation(2)
    model = FlatLabels()
    ref = copy.deepcopy(model)
    tm = poptorchsim.trainingModel(model, o, torch.optim.SGD(model.parameters(), lr=0.1))
    x = torch.randn(1, 2, 4).expand(8, 2, 4)
    labels = torch.tensor([[1, 2]]).expand(8, 2)
    tm(x, labels)
    tm2 = poptorchsim.trainingModel(ref, o.clone(),
                                    torch.optim.SGD(ref.parameters(), lr=0.1))
    tm2(x.contiguous(), labels.contiguous())
    assert_state_close(model, ref)


# -- LAMB with sharded optimizer state ------------------------------------------------------
def _lamb_run(rts, calls=2):
    torch.manual_seed(0)
    model = ClassifierWithLoss(in_features=64, hidden=256)
    o = quiet_options().replicationFactor(2)
    o.Training.gradientAccumulation(2)
    if rts:
        o.TensorLocations.setOptimizerLocation(
            poptorchsim.TensorLocationSettings().useReplicatedTensorSharding(True)
            .minElementsForReplicatedTensorSharding(8))
    tm = poptorchsim.trainingModel(model, o, poptorchsim.optim.LAMB(model.parameters(), lr=1e-2))
    for c in range(calls):
        tm(*classification_batch(8, in_features=64, seed=c))
    return tm, model


def test_lamb_with_sharded_state_trains_as_unsharded():
    # PopART all-reduces the shards' partial norms: the trust ratio is the
    # whole weight's, so the weights are those of the unsharded run
    sharded, m_sharded = _lamb_run(True)
    plain, m_plain = _lamb_run(False)
    assert_state_close(m_sharded, m_plain)
    # the program (memory, collectives) is sharded
    assert "fc1.weight" in sharded._compiled.program.sharded_state
    assert (sharded.memoryReport().always_live.sum()
            < plain.memoryReport().always_live.sum())
    assert sharded.cycleEstimate()["collective"] != plain.cycleEstimate()["collective"]


def test_a_new_optimizer_on_a_sharded_model_keeps_its_shards():
    torch.manual_seed(0)
    model = ClassifierWithLoss(in_features=64, hidden=256)
    ref = copy.deepcopy(model)
    o = quiet_options().replicationFactor(2)
    o.TensorLocations.setOptimizerLocation(
        poptorchsim.TensorLocationSettings().useReplicatedTensorSharding(True)
        .minElementsForReplicatedTensorSharding(8))
    tm = poptorchsim.trainingModel(model, o, poptorchsim.optim.Adam(model.parameters(), lr=1e-2))
    ref_tm = poptorchsim.trainingModel(ref, quiet_options().replicationFactor(2),
                                       poptorchsim.optim.Adam(ref.parameters(), lr=1e-2))
    batch = classification_batch(2, in_features=64)
    tm(*batch), ref_tm(*batch)
    tm.setOptimizer(poptorchsim.optim.Adam(model.parameters(), lr=5e-3))
    ref_tm.setOptimizer(poptorchsim.optim.Adam(ref.parameters(), lr=5e-3))
    tm(*batch), ref_tm(*batch)
    assert_state_close(model, ref)
    assert "fc1.weight" in tm._compiled.program.sharded_state


# -- the benchmark's builders, small ---------------------------------------------------------
def test_resnet_builder_places_the_examples_checkpoints(fidelity):
    pytest.importorskip("torchvision")
    tm, n = fidelity.resnet_training(micro=2, arch="resnet18", image=32, replicas=2, ga=2,
                                     checkpoints=["add", "add_1", "layer4/0/conv1", "fc"])
    assert n == 8
    memory = tm.memoryReport()
    assert memory.recomputation == "RecomputeAll"
    assert memory.recomputed_ops
    assert tm.cycleEstimate()["recompute"] > 0
    import torchvision
    gm = fidelity.with_recomputation_checkpoints(torchvision.models.resnet18(), ["add", "fc"])
    after = [n.args[0].name for n in gm.graph.nodes
             if n.target is poptorchsim.recomputationCheckpoint]
    assert after == ["add", "fc"]


def test_bert_builder_pipelines_over_four_ipus(fidelity):
    pytest.importorskip("transformers")
    tiny = dict(hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
                intermediate_size=128)
    tm, n = fidelity.bert_pretraining(tiny, [0, 1, 1, 1], micro=2, ga=10,
                                      amp=[0.15, 0.25, 0.25, 0.25], loss_scaling=16.0,
                                      bias_correction=True, serialization=2, replicas=2,
                                      seq=16, mask_tokens=4, vocab=512)
    assert n == 40
    program = tm._compiled.program
    assert program.n_ipus == 4
    assert program.sharded_state           # LAMB's state sharded over the replicas
    assert len(tm.memoryReport().ipus) == 4
    assert tm.cycleEstimate()["streaming"] > 0      # optimizer state off chip


def test_bert_builder_places_layers_as_mlperfs_bert_does(fidelity):
    """MLPerf v1.1's BERT starts its encoder on IPU 1 and ends it on IPU 0,
    beside the embedding and the heads: ``ipu_of`` gives each layer's IPU."""
    pytest.importorskip("transformers")
    tiny = dict(hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
                intermediate_size=128)
    tm, n = fidelity.bert_pretraining(tiny, None, micro=2, ga=10, amp=[0.23] * 4,
                                      loss_scaling=1.0, bias_correction=False,
                                      serialization=2, replicas=2, seq=16, mask_tokens=4,
                                      vocab=512, ipu="ipu2", ipu_of=[1, 2, 3, 0])
    assert n == 40
    program = tm._compiled.program
    assert program.n_ipus == 4
    ipu_of_layer = {}
    for graph in program.graphs.values():
        for op in graph.ops:
            for i in range(4):
                if f"encoder/{i}/" in op.name:
                    ipu_of_layer.setdefault(i, set()).add(op.ipu)
    assert ipu_of_layer == {0: {1}, 1: {2}, 2: {3}, 3: {0}}, ipu_of_layer


# -- available memory proportion per IPU -------------------------------------------------------
class TwoIPUs(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(512, 512), nn.Linear(512, 512)

    def forward(self, x):
        with poptorchsim.Block(ipu_id=0):
            x = self.a(x)
        with poptorchsim.Block(ipu_id=1):
            return self.b(x)


def _costs_by_ipu(proportions):
    torch.manual_seed(0)
    o = quiet_options()
    o.setExecutionStrategy(poptorchsim.ShardedExecution())
    o.setAvailableMemoryProportion(proportions)
    im = poptorchsim.inferenceModel(TwoIPUs(), o)
    im.compile(torch.randn(256, 512))
    graph = im._compiled.program.graphs["inference_forward"]
    out = {0: [], 1: []}
    for op, cost in zip(graph.ops, im._compiled.costs["inference_forward"]):
        if op.cost_class == "matmul":
            out[op.ipu].append(cost)
    return out


def test_each_ipu_takes_its_own_available_memory_proportion():
    # BERT-Large's [0.15, 0.25, 0.25, 0.25]: IPU 1 must not take IPU 0's value
    same = _costs_by_ipu({"IPU0": 0.6, "IPU1": 0.6})
    low = _costs_by_ipu({"IPU0": 0.6, "IPU1": 0.02})
    assert [c.total for c in same[0]] == [c.total for c in low[0]]
    assert [c.total for c in same[1]] != [c.total for c in low[1]]
