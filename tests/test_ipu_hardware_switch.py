"""The switch that reports the simulated IPUs as hardware
(``POPTORCHSIM_IPU_HARDWARE``, ``python -m poptorchsim.run --ipu-hardware``):
PopTorch programs that run only where ``poptorch.ipuHardwareIsAvailable()``
is True run unchanged, and their models follow PopTorch's rules for
hardware; the default stays honest."""
import logging
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from conftest import LogRecords

import poptorchsim as poptorch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(autouse=True)
def _no_switch(monkeypatch):
    monkeypatch.delenv("POPTORCHSIM_IPU_HARDWARE", raising=False)


def test_default_reports_no_hardware():
    assert not poptorch.ipuHardwareIsAvailable()
    assert not poptorch.ipuHardwareIsAvailable(1)


@pytest.mark.parametrize("value,ipus", [("1", 64), ("on", 64), ("TRUE", 64), ("16", 16),
                                        ("2", 2)])
def test_switch_reports_its_ipus(monkeypatch, value, ipus):
    monkeypatch.setenv("POPTORCHSIM_IPU_HARDWARE", value)
    assert poptorch.ipuHardwareIsAvailable()
    assert poptorch.ipuHardwareIsAvailable(ipus)
    assert not poptorch.ipuHardwareIsAvailable(ipus + 1)


@pytest.mark.parametrize("value", ["0", "off", "no", ""])
def test_switch_off_words(monkeypatch, value):
    monkeypatch.setenv("POPTORCHSIM_IPU_HARDWARE", value)
    assert not poptorch.ipuHardwareIsAvailable()


def test_a_bad_setting_is_named(monkeypatch):
    monkeypatch.setenv("POPTORCHSIM_IPU_HARDWARE", "pod16")
    with pytest.raises(poptorch.Error, match="POPTORCHSIM_IPU_HARDWARE='pod16' is not a "
                                             "setting: use 1 .or on."):
        poptorch.ipuHardwareIsAvailable()


class _Three(torch.nn.Module):
    """Three Linear layers, one per IPU."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = (torch.nn.Linear(8, 8) for _ in range(3))

    def forward(self, x):
        with poptorch.Block(ipu_id=0):
            x = self.a(x)
        with poptorch.Block(ipu_id=1):
            x = self.b(x)
        with poptorch.Block(ipu_id=2):
            x = self.c(x)
        return x


def _infer(opts=None, replicas=1):
    opts = (opts or poptorch.Options()).replicationFactor(replicas)
    opts.deviceIterations(3)            # a pipeline of 3 stages takes 3 at least
    model = poptorch.inferenceModel(_Three(), opts)
    return model(torch.randn(3 * replicas, 8))


def test_three_ipus_on_hardware_raise_poptorchs_error(monkeypatch):
    monkeypatch.setenv("POPTORCHSIM_IPU_HARDWARE", "on")
    with pytest.raises(poptorch.Error, match=r"The model specifies the use of 3 IPUs, however "
                                             r"PopTorch must reserve a minimum of 4 .* set "
                                             r"poptorch.Options\(\).autoRoundNumIPUs\(True\)"):
        _infer()


def test_three_ipus_on_hardware_reserve_four_with_auto_round(monkeypatch):
    monkeypatch.setenv("POPTORCHSIM_IPU_HARDWARE", "on")
    records = LogRecords()
    logging.getLogger("poptorchsim").addHandler(records)
    try:
        out = _infer(poptorch.Options().autoRoundNumIPUs(True))
    finally:
        logging.getLogger("poptorchsim").removeHandler(records)
    assert out.shape == (3, 8)
    assert "Reserving 4 IPUs when the model specifices the use of only 3" in records.text


@pytest.mark.parametrize("how", ["no switch", "ipu model", "offline"])
def test_ipu_model_offline_and_no_switch_take_three_ipus(monkeypatch, how):
    opts = poptorch.Options()
    if how != "no switch":
        monkeypatch.setenv("POPTORCHSIM_IPU_HARDWARE", "on")
    if how == "ipu model":
        opts.useIpuModel(True)
    if how == "offline":
        opts.useOfflineIpuTarget(2)
        opts.deviceIterations(3)
        poptorch.inferenceModel(_Three(), opts).compile(torch.randn(3, 8))
        return
    assert _infer(opts).shape == (3, 8)


def test_more_ipus_than_the_system_has_fail_to_acquire(monkeypatch):
    monkeypatch.setenv("POPTORCHSIM_IPU_HARDWARE", "4")
    opts = poptorch.Options().autoRoundNumIPUs(True)
    assert _infer(opts).shape == (3, 8)                    # 3 rounded to 4: fits
    with pytest.raises(poptorch.Error, match=r"Failed to acquire 8 IPU\(s\): the simulated "
                                             r"system reports 4 IPUs"):
        _infer(poptorch.Options().autoRoundNumIPUs(True), replicas=2)


def test_an_executable_compiled_offline_loads_and_runs_on_hardware(monkeypatch, tmp_path):
    """The user guide's precompilation: compiled for an offline target,
    exported, loaded (the offline flags dropped) and run on the hardware;
    the loaded program is still checked against the system's IPUs."""
    monkeypatch.setenv("POPTORCHSIM_IPU_HARDWARE", "64")
    opts = poptorch.Options().deviceIterations(3).autoRoundNumIPUs(True)
    opts.useOfflineIpuTarget(poptorch.ipuHardwareVersion())
    x = torch.randn(3, 8)
    poptorch.inferenceModel(_Three(), opts).compileAndExport(str(tmp_path / "m.poptorch"), x)
    loaded = poptorch.load(str(tmp_path / "m.poptorch"))
    assert loaded(x).shape == (3, 8)
    monkeypatch.setenv("POPTORCHSIM_IPU_HARDWARE", "2")          # 3 IPUs, rounded to 4
    with pytest.raises(poptorch.Error, match=r"Failed to acquire 4 IPU\(s\): the simulated "
                                             r"system reports 2 IPUs"):
        poptorch.load(str(tmp_path / "m.poptorch"))


_GUARDED = textwrap.dedent("""
    import sys
    import poptorch
    if not poptorch.ipuHardwareIsAvailable():
        print("no hardware")
        sys.exit(0)
    import torch
    model = poptorch.inferenceModel(torch.nn.Linear(4, 2))
    print("ran", tuple(model(torch.ones(3, 4)).shape))
""")


def test_launcher_flag_runs_a_program_guarded_by_the_hardware_check(tmp_path):
    script = tmp_path / "guarded.py"
    script.write_text(_GUARDED)
    env = {k: v for k, v in os.environ.items() if k != "POPTORCHSIM_IPU_HARDWARE"}
    on = subprocess.run([sys.executable, "-m", "poptorchsim.run", "--ipu-hardware", "on",
                         str(script)], cwd=ROOT, env=env, capture_output=True, text=True,
                        timeout=300)
    assert on.returncode == 0 and "ran (3, 2)" in on.stdout, on.stderr[-2000:]


def test_without_the_switch_the_guarded_program_stops(tmp_path, capsys):
    """The same program in this process, as ``python program.py`` runs it."""
    import runpy
    script = tmp_path / "guarded.py"
    script.write_text(_GUARDED.replace("import poptorch\n", "import poptorchsim as poptorch\n"))
    with pytest.raises(SystemExit) as stopped:
        runpy.run_path(str(script), run_name="__main__")
    assert stopped.value.code == 0 and "no hardware" in capsys.readouterr().out


@pytest.mark.parametrize("value,message", [
    ("pod16", "--ipu-hardware 'pod16' is not a setting"),
    ("0", "--ipu-hardware 0 reports no hardware")])
def test_launcher_refuses_a_bad_setting_before_the_program_starts(tmp_path, capsys, value,
                                                                   message):
    from poptorchsim.run import parse
    script = tmp_path / "guarded.py"
    script.write_text(_GUARDED)
    with pytest.raises(SystemExit) as bad:
        parse(["--ipu-hardware", value, str(script)])
    assert bad.value.code == 2 and message in capsys.readouterr().err
