"""The executable cache (Options.enableExecutableCaching, POPTORCH_CACHE_DIR)
and precompilation (compileAndExport, save, loadExecutable, poptorch.load)."""
import copy
import json
import logging
import os
import pickle
import re
import subprocess
import sys
from pathlib import Path

import exe_cache_script
import pytest
import torch
from conftest import ClassifierWithLoss, classification_batch, quiet_options, reference_call

import poptorchsim as poptorch
from poptorchsim.passes import front
from poptorchsim.runtime.executables import cache, export

TESTS = Path(__file__).resolve().parent


@pytest.fixture
def warnings():
    """Messages the poptorchsim logger warns with during the test."""
    seen = []

    class Keep(logging.Handler):
        def emit(self, record):
            if record.levelno >= logging.WARNING:
                seen.append(record.getMessage())

    handler = Keep()
    log = logging.getLogger("poptorchsim")
    log.addHandler(handler)
    yield seen
    log.removeHandler(handler)


def _refuse(*_args, **_kwargs):
    """Stands in for tracing where what runs must come from a file."""
    raise AssertionError("the model was traced")


def _training(model=None, options=None):
    torch.manual_seed(0)
    model = model or ClassifierWithLoss()
    optimizer = poptorch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    return poptorch.trainingModel(model, options or quiet_options(), optimizer)


class _KeyFound(Exception):
    pass


def _key_of(executor, *args):
    """The executable key ``executor`` would compile under, without compiling."""
    def grab(key, _compile_fn):
        raise _KeyFound(key)
    with pytest.raises(_KeyFound) as found:
        executor._compile(*executor._inputs.prepare(args, {}), source=grab)
    return found.value.args[0]


def _run_script(*args, env=None):
    result = subprocess.run([sys.executable, str(TESTS / "exe_cache_script.py"),
                             cache.build_id(), *args],
                            cwd=TESTS, env={**os.environ, **(env or {})},
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]


# -- the cache -----------------------------------------------------------------------------
def test_second_process_loads_the_cached_executable(tmp_path, monkeypatch):
    """This process compiles and stores; a fresh process with
    POPTORCH_CACHE_DIR reads the file, never traces, and trains exactly as
    this one (and as plain PyTorch)."""
    folder = tmp_path / "cache"
    traced = []
    capture = front.capture_training
    monkeypatch.setattr(front, "capture_training",
                        lambda *a, **k: traced.append(1) or capture(*a, **k))
    first = exe_cache_script.training_run(quiet_options().enableExecutableCaching(folder))
    (stored,) = folder.iterdir()
    assert stored.suffix == cache.SUFFIX and traced == [1] and first["loaded_from"] is None
    _run_script("train", str(tmp_path / "second.json"), env={"POPTORCH_CACHE_DIR": str(folder)})
    second = json.loads((tmp_path / "second.json").read_text())
    assert second["traced"] == 0 and second["loaded_from"] == str(stored)
    assert second["losses"] == first["losses"]
    assert second["weights"] == first["weights"]
    torch.testing.assert_close(torch.tensor(second["losses"]),
                               torch.tensor(second["reference_losses"]))
    torch.testing.assert_close(torch.tensor(second["weights"]),
                               torch.tensor(second["reference_weights"]))


def test_enable_executable_caching_serves_a_fresh_model(tmp_path, monkeypatch):
    opts = quiet_options().enableExecutableCaching(tmp_path)
    x, y = classification_batch(4)
    expected = _training(options=opts)(x, y)
    monkeypatch.setattr(front, "capture_training", _refuse)
    again = _training(options=opts)
    out = again(x, y)
    assert again._compiled.loaded_from.startswith(str(tmp_path))
    torch.testing.assert_close(out, expected, rtol=0, atol=0)


def test_caching_off_by_default_and_with_none(tmp_path, monkeypatch):
    monkeypatch.delenv("POPTORCH_CACHE_DIR", raising=False)
    assert cache.cache_directory(poptorch.Options()) is None
    monkeypatch.setenv("POPTORCH_CACHE_DIR", str(tmp_path))
    assert cache.cache_directory(poptorch.Options()) == str(tmp_path)
    assert cache.cache_directory(poptorch.Options().enableExecutableCaching(None)) is None
    with pytest.raises(poptorch.Error, match="folder path"):
        poptorch.Options().enableExecutableCaching(3)


@pytest.mark.parametrize("damage", ["garbage", "truncated", "other build"])
def test_a_bad_cache_file_is_logged_and_recompiled(tmp_path, monkeypatch, warnings, damage):
    opts = quiet_options().enableExecutableCaching(tmp_path)
    x, y = classification_batch(4)
    expected = _training(options=opts)(x, y)
    (path,) = tmp_path.iterdir()
    good = path.read_bytes()
    if damage == "garbage":
        path.write_bytes(b"not an executable")
    elif damage == "truncated":
        path.write_bytes(good[:len(good) // 2])
    else:
        compiled, key = cache.unpack(good), _key_of(_training(), x, y)
        with monkeypatch.context() as m:
            m.setattr(cache, "full_version", lambda: "0.0.1+elsewhere")
            path.write_bytes(cache.pack(compiled, key))
    model = _training(options=opts)
    out = model(x, y)
    assert model._compiled.loaded_from is None      # compiled again
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    assert any(str(path) in w and "Compiling the model again" in w for w in warnings)
    if damage == "other build":
        assert any("0.0.1+elsewhere" in w for w in warnings)
    assert _training(options=opts)(x, y)[1] == expected[1]        # the file was replaced
    assert path.read_bytes() != b"not an executable"


# -- what the key covers ------------------------------------------------------------------
class Scaled(ClassifierWithLoss):
    def forward(self, x, target=None):
        out = self.fc2(self.act(self.fc1(x))) * 2
        return out, self.loss(out, target)


def _helper(x):
    return x + 1


class UsesHelper(ClassifierWithLoss):
    def forward(self, x, target=None):
        out = _helper(self.fc2(self.act(self.fc1(x))))
        return out, self.loss(out, target)


class WithConstant(ClassifierWithLoss):
    """Holds a plain tensor (not a buffer): tracing bakes its value in."""

    def __init__(self, value):
        super().__init__()
        self.offset = torch.full((4,), value)
        self.weights = [self.fc1.weight]          # as nn.LSTM keeps its _flat_weights

    def forward(self, x, target=None):
        out = self.fc2(self.act(self.fc1(x))) + self.offset
        return out, self.loss(out, target)


def _key(model=None, options=None, optimizer=None, batch=4, inference=False):
    """The key of a training (or inference) model; ``optimizer(params)``."""
    torch.manual_seed(0)
    model = model or ClassifierWithLoss()
    x, y = classification_batch(batch)
    if inference:
        return _key_of(poptorch.inferenceModel(model, options or quiet_options()), x)
    make = optimizer or (lambda params: poptorch.optim.SGD(params, lr=0.1))
    return _key_of(poptorch.trainingModel(model, options or quiet_options(),
                                          make(model.parameters())), x, y)


def test_the_key_changes_with_model_inputs_options_and_optimizer(monkeypatch):
    base = _key()
    assert _key() == base                                   # deterministic
    assert _key(optimizer=lambda p: poptorch.optim.SGD(p, lr=0.5)) == base    # lr: a scalar
    different = {
        "layer size": _key(ClassifierWithLoss(hidden=9)),
        "forward code": _key(Scaled()),
        "input shape": _key(batch=8),
        "device iterations": _key(options=quiet_options().deviceIterations(2), batch=8),
        "IPU model": _key(options=quiet_options().useIpuModelVersion("ipu21")),
        "memory proportion": _key(
            options=quiet_options().setAvailableMemoryProportion({"IPU0": 0.3})),
        "optimizer kind": _key(optimizer=poptorch.optim.Adam),
        "momentum on": _key(optimizer=lambda p: poptorch.optim.SGD(p, lr=0.1, momentum=0.9)),
        "eval mode": _key(ClassifierWithLoss().eval()),
        "inference": _key(inference=True),
    }
    assert len({k.digest for k in different.values()} | {base.digest}) == len(different) + 1
    assert different["input shape"].differences(base) == ["inputs"]
    assert different["optimizer kind"].differences(base) == ["optimizer"]
    assert different["forward code"].differences(base) == ["model code and attributes"]
    # weights are uploaded, not compiled in; a tensor constant is compiled in
    changed = ClassifierWithLoss()
    with torch.no_grad():
        changed.fc1.weight.add_(1.0)
    assert _key(changed) == base
    with_constant = _key(WithConstant(1.0))
    with torch.no_grad():
        held = WithConstant(1.0)
        held.fc1.weight.add_(1.0)
    assert _key(held) == with_constant
    assert _key(WithConstant(2.0)) != with_constant
    # a helper function the model calls is part of its code
    helper_key = _key(UsesHelper())
    monkeypatch.setattr(sys.modules[__name__], "_helper", lambda x: x - 1)
    assert _key(UsesHelper()) != helper_key
    # inference traces in eval mode whatever the module's mode
    assert _key(ClassifierWithLoss().eval(), inference=True) == different["inference"]


# -- compileAndExport, save, load, loadExecutable ---------------------------------------
def _normal_losses(steps):
    """Losses of the standard training model compiled normally, and plain
    PyTorch's, over ``steps`` calls."""
    torch.manual_seed(0)
    model = ClassifierWithLoss()
    reference = copy.deepcopy(model)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    normal = _training(model)
    losses = [normal(*classification_batch(4, seed=s))[1] for s in steps]
    ref = [reference_call(reference, ref_opt, classification_batch(4, seed=s))[1].reshape(())
           for s in steps]
    return losses, ref, model


def test_export_in_another_process_then_load_trains_as_a_fresh_compile(tmp_path,
                                                                       monkeypatch):
    path = tmp_path / "training.poptorch"
    _run_script("export", str(path))
    expected, reference, normal_model = _normal_losses(range(3))
    monkeypatch.setattr(front, "capture_training", _refuse)
    loaded = poptorch.load(str(path))
    assert loaded.isCompiled() and isinstance(loaded.model, ClassifierWithLoss)
    losses = [loaded(*classification_batch(4, seed=s))[1] for s in range(3)]
    assert losses == expected
    torch.testing.assert_close(losses, reference)
    torch.testing.assert_close(loaded.model.state_dict(), normal_model.state_dict(),
                               rtol=0, atol=0)


def test_save_after_training_then_load_continues_training(tmp_path, monkeypatch):
    """Trained weights, the optimizer's momentum and the RNG state travel in
    the file; a missing folder is made."""
    original = _training()
    for s in range(2):
        original(*classification_batch(4, seed=s))
    path = tmp_path / "sub" / "model.poptorch"
    rng = torch.get_rng_state()
    original.save(str(path))
    torch.rand(3)
    monkeypatch.setattr(front, "capture_training", _refuse)
    loaded = poptorch.load(str(path))
    assert torch.equal(torch.get_rng_state(), rng)
    for s in range(2, 5):
        batch = classification_batch(4, seed=s)
        torch.testing.assert_close(loaded(*batch), original(*batch), rtol=0, atol=0)


def test_inference_export_then_load_with_a_fresh_model(tmp_path, monkeypatch):
    torch.manual_seed(0)
    model = ClassifierWithLoss().eval()
    x, _ = classification_batch(4)
    wrapped = poptorch.inferenceModel(model, quiet_options().deviceIterations(2))
    wrapped.compileAndExport(str(tmp_path), x)           # a folder: model.poptorch inside
    path = tmp_path / "model.poptorch"
    monkeypatch.setattr(front, "capture_inference", _refuse)

    def edit(opts):
        opts.useIpuId(1)
    loaded = poptorch.load(str(path), edit_opts_fn=edit)
    assert loaded.options.ipu_id == 1 and loaded.options.device_iterations == 2
    assert loaded.model is not model
    with torch.no_grad():
        torch.testing.assert_close(loaded(x), model(x))


def test_export_model_false_needs_load_executable(tmp_path, monkeypatch):
    path = str(tmp_path / "exe.poptorch")
    x, y = classification_batch(4)
    _training().compileAndExport(path, x, y, export_model=False)
    with pytest.raises(AssertionError, match=r"created with 'export_model=False'.*"
                                             r"loadExecutable\(\"" + re.escape(path)):
        poptorch.load(path)
    expected, _, _ = _normal_losses([0, 1])
    monkeypatch.setattr(front, "capture_training", _refuse)
    fresh = _training()
    fresh.loadExecutable(path)
    assert [fresh(*classification_batch(4, seed=s))[1] for s in (0, 1)] == expected
    with pytest.raises(poptorch.Error, match="already compiled"):
        fresh.loadExecutable(path)


def test_load_executable_into_a_different_model_is_an_error(tmp_path):
    path = str(tmp_path / "exe.poptorch")
    _training().compileAndExport(path, *classification_batch(4))
    opts = quiet_options()
    opts.Training.gradientAccumulation(2)
    other = _training(options=opts)
    with pytest.raises(poptorch.Error, match="compiled for different inputs, options"):
        other.loadExecutable(path)
    assert not other.isCompiled()
    wider = _training(ClassifierWithLoss(hidden=9))
    with pytest.raises(poptorch.Error, match="compiled for different model code and "
                                             r"attributes, parameters and buffers\. "):
        wider.loadExecutable(path)


def test_files_from_another_version_or_not_ours(tmp_path):
    path = tmp_path / "exe.poptorch"
    _training().compileAndExport(str(path), *classification_batch(4))
    data = export.read(str(path))
    data["version"] = "0.0.1"
    path.write_bytes(export.HEADER + pickle.dumps(data))
    message = "File was created with version: 0.0.1 and this is version " + poptorch.__version__
    with pytest.raises(poptorch.Error, match=message):
        poptorch.load(str(path))
    with pytest.raises(AssertionError, match=message):      # PopTorch's load raises this
        poptorch.load(str(path))
    with pytest.raises(poptorch.Error, match=message):
        _training().loadExecutable(str(path))
    path.write_bytes(b"something else")
    with pytest.raises(poptorch.Error, match="not a file written by poptorchsim"):
        poptorch.load(str(path))


def test_a_file_from_another_build_is_compiled_again(tmp_path, warnings, monkeypatch):
    path = str(tmp_path / "exe.poptorch")
    with monkeypatch.context() as m:
        m.setattr(cache, "full_version", lambda: "0.1.0+another")
        _training().compileAndExport(path, *classification_batch(4))
    expected, _, _ = _normal_losses([0])
    loaded = poptorch.load(path)
    assert [loaded(*classification_batch(4))[1]] == expected
    assert any("0.1.0+another" in w and "compiling the model again" in w for w in warnings)


def test_save_needs_a_compiled_model(tmp_path):
    with pytest.raises(poptorch.Error, match="Model has not been compiled"):
        _training().save(str(tmp_path / "x.poptorch"))
    assert not (tmp_path / "x.poptorch").exists()


def test_an_unwritable_cache_folder_is_logged_not_fatal(tmp_path, warnings):
    blocker = tmp_path / "file"
    blocker.write_text("a file where the cache folder should be")
    x, y = classification_batch(4)
    out = _training(options=quiet_options().enableExecutableCaching(blocker / "cache"))(x, y)
    assert torch.isfinite(out[1])
    assert any("Could not write the executable cache file" in w for w in warnings)


def test_a_program_calling_host_functions_is_not_cached(tmp_path):
    """poptorch.CPU functions live in the process that traced the model: such
    a program is compiled every time, never stored."""
    class OnHost(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(4, 4)
            self.cpu = poptorch.CPU(lambda x: x * 2, "Double")

        def forward(self, x):
            return self.cpu(self.fc(x))

    opts = quiet_options().enableExecutableCaching(tmp_path)
    torch.manual_seed(0)
    model = OnHost()
    x = torch.randn(2, 4)
    first = poptorch.inferenceModel(model, opts)
    out = first(x)
    assert not any(tmp_path.iterdir())
    again = poptorch.inferenceModel(model, opts)
    torch.testing.assert_close(again(x), out)
    assert again._compiled.loaded_from is None
    with torch.no_grad():
        torch.testing.assert_close(out, model.fc(x) * 2)
