"""A zoo of real-world models: inference and two training steps against PyTorch.

Every model of the table ``ZOO`` is checked twice:

* inference: ``inferenceModel`` on a copy gives what ``model.eval()(x)``
  gives in plain PyTorch;
* training: the model wrapped with a loss (``WithLoss``) trains two SGD
  steps (lr 0.01, momentum 0.9) on the simulated IPU, and a deep copy the
  same two steps in plain PyTorch; every parameter and buffer then matches.
  Models are called with the whole batch (deviceIterations,
  gradientAccumulation and replicationFactor all 1), so batch-norm models see
  the batch of 2 or more they need in training mode.

Sizes are small so that each test takes a few seconds on two CPU cores:
torchvision CNNs run on 64x64 images (their real constructors, 10 classes;
EfficientNet-B0 on 96x96, see its entry), the Vision Transformer is a
reduced ``VisionTransformer(image_size=32, patch_size=16, num_layers=2,
num_heads=2, hidden_dim=32, mlp_dim=64, num_classes=10)`` instead of the full
``vit_b_16``, and the sequence models are a few layers of width 32.  Stochastic depth and dropout
are off everywhere, so training is deterministic.  The full densenet121 is
marked slow (excluded by default); a smaller DenseNet stands in for it.
Transformers' BERT is skipped when ``transformers`` is not installed.

The table itself is ``poptorchsim.testing.zoo`` (``benchmarks/model_zoo.py``
times the same table).
"""
import copy
import importlib.util

import pytest
import torch
from conftest import assert_state_close, quiet_options

import poptorchsim
from poptorchsim.testing.zoo import (
    INFER_ATOL,
    INFER_RTOL,
    STEPS,
    TRAIN_ATOL,
    TRAIN_RTOL,
    ZOO,
    WithLoss,
    as_float64,
    build,
    eager_train,
    make_batches,
    optimizer_for,
)


@pytest.fixture(autouse=True, scope="module")
def _one_torch_thread():
    """One intra-op thread (restored afterwards) for eager and simulator alike:
    at these sizes a second thread gains little, and when another process
    shares the two cores OpenMP's waiting threads make every op ~20x slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def params(cases=ZOO):
    """The cases as pytest parameters: the slow ones marked, those needing a
    package that is not installed skipped."""
    out = []
    for c in cases:
        marks = [pytest.mark.slow] if c.slow else []
        missing = [p for p in c.needs if importlib.util.find_spec(p) is None]
        if missing:
            marks.append(pytest.mark.skip(reason=f"{', '.join(missing)} not installed"))
        out.append(pytest.param(c, id=c.name, marks=marks))
    return out


# ---------------------------------------------------------------------------
# Tests
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("case", params())
def test_inference_matches_eager(case):
    model = build(case, case.seed).eval()
    (*inputs, _), = make_batches(case, model, 1)
    with torch.no_grad():
        expected = model(*inputs)
    got = poptorchsim.inferenceModel(copy.deepcopy(model), quiet_options())(*inputs)
    torch.testing.assert_close(got, expected, rtol=INFER_RTOL, atol=INFER_ATOL)


@pytest.mark.parametrize("case", params())
def test_two_training_steps_match_eager(case):
    model = build(case, case.seed).train()
    batches = make_batches(case, model, STEPS, seed=1)
    sim = WithLoss(model, case.loss)
    ref = copy.deepcopy(sim)
    initial = copy.deepcopy(sim)
    training = poptorchsim.trainingModel(sim, quiet_options(),
                                         optimizer=optimizer_for(sim.parameters()))
    for batch in batches:
        training(*batch)
    if case.reference == "fp64":
        eager_train(ref.double(), [as_float64(b) for b in batches])
        ref.float()
    else:
        eager_train(ref, batches)
    # the weights moved (the comparison would be vacuous otherwise)
    moved = max((a - b).abs().max().item() for a, b in
                zip(sim.parameters(), initial.parameters()))
    assert moved > 1e-5
    assert_state_close(sim, ref, rtol=TRAIN_RTOL, atol=TRAIN_ATOL)
