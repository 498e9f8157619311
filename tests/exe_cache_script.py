"""Trains or exports the standard small model; run by
tests/test_executable_cache.py in a fresh process as
``exe_cache_script.py BUILD MODE PATH`` (and imported by it).

BUILD is the parent's ``cache.build_id()``: other people edit poptorchsim's
sources while the tests run, so the processes agree on one build.
``train OUT.json``: trains for three calls (the cache folder comes from
POPTORCH_CACHE_DIR) and writes ``training_run``'s result.  ``export FILE``:
``compileAndExport``s the same training model to FILE.
"""
import copy
import json
import sys

import torch
from conftest import ClassifierWithLoss, classification_batch, quiet_options, reference_call

import poptorchsim as poptorch
from poptorchsim.passes import front
from poptorchsim.runtime.executables import cache


def _model():
    torch.manual_seed(0)
    model = ClassifierWithLoss()
    optimizer = poptorch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    return model, optimizer


def training_run(options):
    """Three training calls: where the executable came from, the losses and
    weights, and plain PyTorch's."""
    model, optimizer = _model()
    reference = copy.deepcopy(model)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    training = poptorch.trainingModel(model, options, optimizer)
    losses, ref_losses = [], []
    for seed in range(3):
        x, y = classification_batch(4, seed=seed)
        losses.append(float(training(x, y)[1]))
        ref_losses.append(float(reference_call(reference, ref_opt, (x, y))[1].reshape(())))
    return {"loaded_from": training._compiled.loaded_from,
            "losses": losses, "reference_losses": ref_losses,
            "weights": model.fc1.weight.tolist(),
            "reference_weights": reference.fc1.weight.tolist()}


def _train(out):
    traced = []
    capture = front.capture_training

    def counting_capture(*args, **kwargs):
        traced.append(1)
        return capture(*args, **kwargs)

    front.capture_training = counting_capture
    result = training_run(quiet_options())
    with open(out, "w") as f:
        json.dump({**result, "traced": len(traced)}, f)


def _export(filename):
    model, optimizer = _model()
    training = poptorch.trainingModel(model, quiet_options(), optimizer)
    training.compileAndExport(filename, *classification_batch(4))


if __name__ == "__main__":
    cache.build_id = lambda: sys.argv[1]
    {"train": _train, "export": _export}[sys.argv[2]](sys.argv[3])
