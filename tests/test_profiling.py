"""Profiling: reports written on compile (JSON, PNG plots, HTML), their text
summary, the ``python -m poptorchsim report`` command, and out-of-memory
models reported instead of raised while profiling."""
import json
import os
import pathlib
import subprocess
import sys

import pytest
import torch
from conftest import ClassifierWithLoss, classification_batch, quiet_options
from torch import nn

import poptorchsim
from poptorchsim.profiling import load_reports, summary, write_report

ROOT = pathlib.Path(__file__).resolve().parents[1]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
FILES = ("profile.json", "memory.png", "cycles_by_op.png", "liveness.png", "timeline.png",
         "timeline.json", "index.html")


def _train_compiled(options, model=None, batch=8):
    model = model or ClassifierWithLoss()
    training = poptorchsim.trainingModel(
        model, options, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    training.compile(*classification_batch(batch))
    return training


@pytest.fixture(scope="module")
def profile_root(tmp_path_factory):
    """A profile root holding one compiled model's report (written on compile)."""
    root = tmp_path_factory.mktemp("profile")
    _train_compiled(quiet_options().enableProfiling(str(root)))
    return root


def _env():
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + (
        [env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    return env


def test_enable_profiling_writes_every_file(profile_root):
    model_dir = profile_root / "training"
    for name in FILES:
        assert (model_dir / name).is_file(), name
    for name in ("memory.png", "cycles_by_op.png", "liveness.png"):
        data = (model_dir / name).read_bytes()
        assert data[:8] == PNG_MAGIC, name
        assert len(data) > 10_000, f"{name} is only {len(data)} bytes"
    html = (model_dir / "index.html").read_text()
    for name in ("memory.png", "cycles_by_op.png", "liveness.png", "profile.json"):
        assert name in html
    assert "Mk2" in html and "samples/s" in html and "fits" in html


def test_report_json_is_consistent(profile_root):
    report = json.loads((profile_root / "training" / "profile.json").read_text())
    assert report["model"] == "training" and report["kind"] == "training"
    mem, tiles = report["memory"], report["target"]["tiles"]
    assert tiles == 1472
    always, notalways, total = mem["always_live"], mem["not_always_live"], mem["total"]
    assert len(always) == len(notalways) == len(total) == tiles
    assert all(t == a + n for t, a, n in zip(total, always, notalways))
    assert all(a > 0 for a in always)          # code lives on every tile
    assert mem["peak_bytes"] == max(total) == total[mem["peak_tile"]]
    assert 0 < mem["peak_bytes"] <= mem["capacity"]
    assert mem["fits"] and mem["tiles_over"] == 0
    assert mem["always_live_bytes"] == sum(always)
    per_call = report["cycles"]["per_call"]
    assert per_call["total"] == pytest.approx(
        sum(per_call[k] for k in ("compute", "exchange", "sync", "host")))
    assert report["cycles"]["samples_per_second"] > 0
    ops = report["ops"]
    assert ops and ops == sorted(ops, key=lambda o: -o["cycles_per_call"])
    assert set(report["liveness"]) >= {"training_step"}


def test_load_reports_and_summary(profile_root):
    assert load_reports(str(profile_root / "training")) == load_reports(str(profile_root))
    (report,) = load_reports(str(profile_root))
    text = summary(report)
    peak = report["memory"]["peak_tile"]
    assert f"peak tile {peak}" in text and f"tile {peak:>5}" in text
    assert "Mk2" in text and "fits" in text and "samples/s" in text
    assert report["ops"][0]["name"] in text


def test_profiling_from_poplar_engine_options(tmp_path, monkeypatch):
    monkeypatch.setenv("POPLAR_ENGINE_OPTIONS", json.dumps(
        {"autoReport.all": "true", "autoReport.directory": str(tmp_path)}))
    _train_compiled(quiet_options())
    for name in FILES:
        assert (tmp_path / "training" / name).is_file(), name


def test_report_without_matplotlib_still_writes_json_and_html(profile_root, tmp_path,
                                                              monkeypatch):
    (report,) = load_reports(str(profile_root))
    monkeypatch.setitem(sys.modules, "matplotlib", None)     # import raises ImportError
    written = write_report(report, str(tmp_path / "out"))
    # the Chrome trace of the schedule is JSON: it needs no matplotlib
    assert set(written) == {"json", "html", "trace"}
    assert sorted(os.listdir(tmp_path / "out")) == ["index.html", "profile.json",
                                                    "timeline.json"]
    html = (tmp_path / "out" / "index.html").read_text()
    assert "matplotlib is not installed" in html and ".png" not in html


def _cli(command, root):
    result = subprocess.run([sys.executable, "-m", "poptorchsim", command, str(root)],
                            capture_output=True, text=True, env=_env(), timeout=120)
    assert result.returncode == 0, result.stderr
    return result


def test_cli_prints_the_summary(profile_root):
    result = _cli("report", profile_root)
    (report,) = load_reports(str(profile_root))
    assert summary(report) in result.stdout


def test_cli_lists_operations_with_class_and_cycles(profile_root):
    result = _cli("ops", profile_root)
    (report,) = load_reports(str(profile_root))
    kinds = {op["op"] for op in report["ops"]}
    lines = [line for line in result.stdout.splitlines() if line.startswith("aten.")]
    assert {line.split()[0] for line in lines} == kinds
    mm = next(line for line in lines if line.startswith("aten.addmm"))
    assert mm.split()[1] == "matmul"
    shares = [float(line.split()[-1].rstrip("%")) for line in lines]
    assert 0 < sum(shares) <= 100.5


def test_cli_without_reports_fails_clearly(tmp_path):
    # -X importtime also shows that the command never imports matplotlib
    result = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "poptorchsim", "report", str(tmp_path)],
        capture_output=True, text=True, env=_env(), timeout=120)
    assert result.returncode != 0
    assert "no profile.json found" in result.stderr
    assert "matplotlib" not in result.stderr


class Wide(nn.Module):
    def __init__(self, n=512):
        super().__init__()
        self.fc = nn.Linear(n, n)
        self.loss = nn.MSELoss()

    def forward(self, x, y):
        out = self.fc(x)
        return out, self.loss(out, y)


def _wide_on_small_ipu(options, monkeypatch):
    monkeypatch.setenv("POPTORCHSIM_SMALL_IPU_MODEL", "1")     # 4 tiles x 624 KiB
    model = Wide()
    training = poptorchsim.trainingModel(
        model, options, optimizer=torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    training.compile(torch.randn(4, 512), torch.randn(4, 512))
    return training


def test_model_that_does_not_fit_is_reported_while_profiling(tmp_path, monkeypatch):
    _wide_on_small_ipu(quiet_options().enableProfiling(str(tmp_path)), monkeypatch)
    (report,) = load_reports(str(tmp_path))
    mem = report["memory"]
    assert report["target"]["tiles"] == 4
    assert not mem["fits"] and mem["tiles_over"] > 0
    assert mem["peak_bytes"] > mem["capacity"]
    assert "DOES NOT FIT" in summary(report)
    for name in FILES:
        assert (tmp_path / "training" / name).is_file(), name
    assert "would not load on a real IPU" in (tmp_path / "training" / "index.html").read_text()


def test_model_that_does_not_fit_raises_without_profiling(monkeypatch):
    monkeypatch.delenv("POPLAR_ENGINE_OPTIONS", raising=False)
    with pytest.raises(poptorchsim.OutOfMemoryError, match="Out of memory on tile"):
        _wide_on_small_ipu(quiet_options(), monkeypatch)
