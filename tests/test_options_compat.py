"""PopTorch options found missing by running PopTorch's tests/options_test.py:
loadFromFile, maxRepeatLogs, syncPattern, disableModuleNamescope,
POPTORCH_DEFAULT_OPTIONS enum strings and _Popart calls, the resolved output
mode of a wrapped model, IO tile settings of on-chip locations."""
import copy
import logging

import pytest
import torch
from conftest import LogRecords, quiet_options
from torch import nn

import poptorchsim as poptorch


class _Add(nn.Module):
    def forward(self, x, y):
        return x + y


# -- loadFromFile -----------------------------------------------------------------------
def test_load_from_file_and_override(tmp_path):
    first = tmp_path / "a.conf"
    first.write_text("deviceIterations(2)\n"
                     "setExecutionStrategy(poptorch.ShardedExecution())\n"
                     "  replicationFactor(2)\n \n"
                     "enableSyntheticData(True) # inline comment\n"
                     "# a comment\n"
                     "syncPattern(poptorch.SyncPattern.SinglePipeline)\n")
    second = tmp_path / "b.conf"
    second.write_text("deviceIterations(1)\n")
    opts = poptorch.Options()
    assert opts.loadFromFile(str(first)) is opts
    opts.loadFromFile(str(second))
    assert opts.device_iterations == 1 and opts.replication_factor == 2
    assert opts.synthetic_data is True
    assert opts.sync_pattern == poptorch.SyncPattern.SinglePipeline
    assert not opts.execution_strategy.is_pipelined


def test_load_from_file_syntax_error_names_line_and_file(tmp_path):
    path = tmp_path / "tmp.conf"
    path.write_text("deviceIterations(1)\n# c\n\nreplicationFactor(1)\n"
                    "enableSyntheticData(True)\nlogDir('.')\n"
                    "outputMode(poptorch.OutputMode.All")
    with pytest.raises(poptorch.options.ConfigFileError) as info:
        poptorch.Options().loadFromFile(str(path))
    assert ("SyntaxError at line 5 of tmp.conf: unexpected EOF while parsing\n"
            "> options.outputMode(poptorch.OutputMode.All") in str(info.value)
    assert poptorch.ConfigFileError is poptorch.options.ConfigFileError
    # a setter's own error comes through unchanged
    path.write_text("deviceIterations(0)\n")
    with pytest.raises(ValueError, match="device_iterations must be a positive"):
        poptorch.Options().loadFromFile(str(path))


# -- maxRepeatLogs ------------------------------------------------------------------------
def test_max_repeat_logs_is_kept_and_every_line_prints():
    """PopTorch limits only its dispatcher's type-coercion warnings, which
    poptorchsim does not have: a Python-side warning repeated back to back
    prints every time, whatever maxRepeatLogs says."""
    opts = quiet_options()
    assert opts.max_repeat_logs == 4
    assert opts.clone().maxRepeatLogs(None).max_repeat_logs == (1 << 64) - 1
    poptorch.inferenceModel(_Add(), opts.clone().maxRepeatLogs(1))
    log, records = logging.getLogger("poptorchsim"), LogRecords()
    log.addHandler(records)
    try:
        for _ in range(6):
            log.warning("same line")
    finally:
        log.removeHandler(records)
    assert records.messages == ["same line"] * 6
    with pytest.raises(ValueError, match="maxRepeatLogs expects None or an integer"):
        poptorch.Options().maxRepeatLogs(-1)


# -- syncPattern ---------------------------------------------------------------------------
class _TwoIpus(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(256, 256), nn.Linear(256, 256)

    def forward(self, x):
        with poptorch.Block(ipu_id=0):
            x = self.a(x).relu()
        with poptorch.Block(ipu_id=1):
            x = self.b(x)
        return x


def _host_cycles(model_cls, pattern, rf=1):
    torch.manual_seed(0)
    opts = quiet_options().deviceIterations(4).replicationFactor(rf).syncPattern(pattern)
    pm = poptorch.inferenceModel(model_cls(), opts)
    pm.compile(torch.randn(4 * rf * 32, 256))
    return pm.cycleEstimate()["host"]


def test_sync_pattern_overlaps_host_io():
    full = _host_cycles(_TwoIpus, poptorch.SyncPattern.Full)
    single = _host_cycles(_TwoIpus, poptorch.SyncPattern.SinglePipeline)
    assert single < full            # the IO IPUs stream in their idle time
    # one IPU per replica: nothing to desynchronise
    assert _host_cycles(lambda: nn.Linear(256, 256), poptorch.SyncPattern.SinglePipeline) == \
        _host_cycles(lambda: nn.Linear(256, 256), poptorch.SyncPattern.Full)
    rf_full = _host_cycles(lambda: nn.Linear(256, 256), poptorch.SyncPattern.Full, rf=4)
    ladder = _host_cycles(lambda: nn.Linear(256, 256), poptorch.SyncPattern.ReplicaAndLadder,
                          rf=4)
    assert ladder < rf_full         # a replica's IO overlaps the others' compute


def test_sync_pattern_option_and_copy():
    opts = poptorch.Options()
    assert opts.sync_pattern == poptorch.SyncPattern.Full
    opts.syncPattern(poptorch.SyncPattern.ReplicaAndLadder)
    assert copy.deepcopy(opts).sync_pattern == poptorch.SyncPattern.ReplicaAndLadder
    opts.outputMode(poptorch.OutputMode.All)        # toDict needs one, as PopTorch's
    assert opts.toDict()["sync_pattern"] == poptorch.SyncPattern.ReplicaAndLadder
    with pytest.raises(AssertionError, match="poptorch.SyncPattern"):
        opts.syncPattern(1)


# -- module name scopes ------------------------------------------------------------------
class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.layer1 = nn.Sequential(nn.Conv2d(1, 4, 5), nn.MaxPool2d(2), nn.ReLU())
        self.layer2 = nn.Sequential(nn.Linear(40, 10), nn.ReLU())
        self.softmax = nn.LogSoftmax(1)

    def forward(self, x):
        x = self.layer1(x).view(5, 40)
        return self.softmax(self.layer2(x))


@pytest.mark.parametrize("enabled", [True, False])
def test_module_name_scopes(enabled):
    opts = quiet_options()
    if not enabled:
        opts.disableModuleNamescope()
    model = _Net()
    pm = poptorch.inferenceModel(model, opts)
    x = torch.randn(2, 1, 15, 15)
    torch.testing.assert_close(pm(x), model(x))
    names = pm.getTensorNames()
    scoped = ["layer1/0/convolution", "layer1/2/relu", "layer2/0/addmm",
              "softmax/_log_softmax"]
    plain = ["convolution", "relu", "addmm", "_log_softmax"]
    assert set(scoped if enabled else plain) <= set(names)
    assert not set(plain if enabled else scoped) & set(names)
    assert "view" in names          # traced outside any submodule
    assert not model.layer1._forward_pre_hooks      # hooks gone after compiling


def test_module_name_scopes_in_training_anchor():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc, self.act = nn.Linear(4, 4), nn.ReLU()

        def forward(self, x):
            with poptorch.NameScope("enc"):
                h = self.act(self.fc(x))
            return h, poptorch.identity_loss(h.sum(), "none")

    opts = quiet_options()
    opts.anchorTensor("h", "enc/act/relu")
    model = M()
    pm = poptorch.trainingModel(model, opts, torch.optim.SGD(model.parameters(), lr=0.0))
    x = torch.randn(2, 4)
    pm(x)
    assert "enc/fc/addmm" in pm.getTensorNames()
    torch.testing.assert_close(pm.getAnchoredTensor("h"), model.act(model.fc(x)))
    assert not model.fc._forward_hooks


# -- POPTORCH_DEFAULT_OPTIONS ------------------------------------------------------------
def test_default_options_enum_strings_and_popart(monkeypatch):
    monkeypatch.setenv("POPTORCH_DEFAULT_OPTIONS",
                       '{"connectionType": "ConnectionType.OnDemand",'
                       ' "syncPattern": "SyncPattern.SinglePipeline",'
                       ' "_Popart.set": ["saveInitializersToFile", "my_file.onnx"],'
                       ' "logDir": "a.b"}')
    opts = poptorch.Options()
    assert opts.connection_type == poptorch.ConnectionType.OnDemand
    assert opts.sync_pattern == poptorch.SyncPattern.SinglePipeline
    assert opts._Popart.options["saveInitializersToFile"] == "my_file.onnx"
    assert opts.log_dir == "a.b"        # not an enum: kept as the string
    assert "saveInitializersToFile='my_file.onnx'" in repr(opts)


# -- output mode, tensor locations ------------------------------------------------------
def test_wrapped_model_options_carry_the_resolved_output_mode():
    opts = quiet_options()
    model = nn.Linear(2, 2)
    training = poptorch.trainingModel(nn.Sequential(model), opts)
    inference = poptorch.inferenceModel(nn.Sequential(model), opts)
    assert opts.defaultOutputMode()
    assert training.options.output_mode == poptorch.OutputMode.Final
    assert inference.options.output_mode == poptorch.OutputMode.All


def test_io_tile_settings_of_on_chip_locations_need_no_io_tiles():
    opts = quiet_options()
    opts.TensorLocations.setWeightLocation(
        poptorch.TensorLocationSettings().useIOTilesToStore(True)
        .useReplicatedTensorSharding(False))
    pm = poptorch.inferenceModel(_Add(), opts)
    x = torch.ones(2)
    torch.testing.assert_close(pm(x, x), 2 * x)
