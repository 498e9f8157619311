"""``Options.toDict()`` as PopTorch's backend takes it, the backend's parse
(``poptorch_core._validateOptions``: its errors and its debug lines), and
the same lines when a model compiles at debug level."""

import pytest
import torch
from conftest import poptorchsim_log

import poptorchsim
from poptorchsim import poptorch_core


def _debug_lines(fn):
    with poptorchsim_log() as records:
        fn()
    return records.messages


def test_to_dict_is_one_flat_dictionary_as_poptorchs():
    opts = poptorchsim.Options().replicationFactor(2).deviceIterations(3)
    opts.setExecutionStrategy(poptorchsim.ShardedExecution()).enableSyntheticData(True)
    opts.Training.gradientAccumulation(4)
    opts.Precision.setPartialsType(torch.half)
    with pytest.raises(AssertionError, match="An output mode must be picked"):
        opts.toDict()
    d = opts.outputMode(poptorchsim.OutputMode.All).toDict()
    assert (d["execution_mode"], d["replication_factor"], d["device_iterations"]) == (1, 2, 3)
    assert (d["gradient_accumulation"], d["syntheticDataMode"]) == (4, 2)
    assert d["partialsTypeMatMuls"] == "half" and d["convolutionOptions"] == {
        "partialsType": "half"}
    assert "synthetic_data" not in d and "relax_optimizer_checks" not in d
    assert callable(d["compilation_progress_bar_fn"])
    poptorch_core._validateOptions(d)


@pytest.mark.parametrize("key,value,message", [
    ("asdfasdf", True, "Unknown bool option asdfasdf"),
    ("dotChecks", torch.empty(1), "Unknown value type Tensor for option dotChecks"),
    ("engineOptions", "x", "Unknown string option engineOptions"),
])
def test_the_parse_refuses_what_poptorchs_backend_refuses(key, value, message):
    opts = poptorchsim.Options().outputMode(poptorchsim.OutputMode.All)
    opts._Popart.options[key] = value
    with pytest.raises(poptorchsim.Error, match=message):
        poptorch_core._validateOptions(opts.toDict())


def test_the_parse_logs_each_option_as_poptorch_does():
    opts = poptorchsim.Options().outputMode(poptorchsim.OutputMode.All)
    opts._Popart.options["engineOptions"] = {"debug.allowOutOfMemory": "true"}
    opts._Popart.options["dotChecks"] = ["FINAL"]
    lines = _debug_lines(lambda: poptorch_core._validateOptions(opts.toDict()))
    assert "poptorch.Options set replication_factor to value 1" in lines
    assert "poptorch.Options set broadcast_buffers to value true" in lines
    assert "poptorch.Options set engineOptions[debug.allowOutOfMemory] to true" in lines
    assert "poptorch.Options added FINAL to dotChecks" in lines


def test_a_compile_at_debug_level_logs_its_options():
    opts = poptorchsim.Options().deviceIterations(2).showCompilationProgressBar(False)
    model = poptorchsim.inferenceModel(torch.nn.Linear(3, 2), opts)
    lines = _debug_lines(lambda: model.compile(torch.randn(4, 3)))
    assert "poptorch.Options set device_iterations to value 2" in lines
    assert "poptorch.Options set output_mode to value 2" in lines      # Default: All


def test_an_unknown_popart_option_fails_the_compile_as_in_poptorch():
    opts = poptorchsim.Options().showCompilationProgressBar(False)
    opts._Popart.options["enableSomethingNew"] = True
    model = poptorchsim.inferenceModel(torch.nn.Linear(3, 2), opts)
    with pytest.raises(poptorchsim.Error, match="Unknown bool option enableSomethingNew"):
        model(torch.randn(2, 3))
    assert not model.isCompiled()
