"""``python -m poptorchsim.run -m pytest tests/x.py``: a module (pytest,
as Graphcore's applications run their tests) run in this process with
``import poptorch`` answered by poptorchsim, as ``python -m pytest`` would
run it: the current directory first on ``sys.path``, the module's exit
status the launcher's."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

from poptorchsim.run import parse

ROOT = Path(__file__).resolve().parents[1]

APP_TEST = '''import poptorch
import popdist
import helper_here


def test_aliased():
    assert poptorch.__name__ == "poptorchsim" and not popdist.isPopdistEnvSet()
    assert helper_here.VALUE == 3


def test_fails_when_asked():
    import os
    assert os.environ.get("FAIL_ONE") != "1"
'''


def _run(cwd, *args, fail=False):
    env = {k: v for k, v in os.environ.items() if not k.startswith("POPDIST_")}
    env["PYTHONPATH"] = os.pathsep.join(
        [str(ROOT)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    env["FAIL_ONE"] = "1" if fail else "0"
    return subprocess.run([sys.executable, "-m", "poptorchsim.run", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=120)


def test_a_module_runs_in_this_process_with_the_aliases(tmp_path):
    (tmp_path / "test_app.py").write_text(APP_TEST)
    (tmp_path / "helper_here.py").write_text("VALUE = 3\n")    # found from the current directory
    result = _run(tmp_path, "-m", "pytest", "-q", "-p", "no:cacheprovider", "test_app.py")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "2 passed" in result.stdout

    result = _run(tmp_path, "-m", "pytest", "-q", "-p", "no:cacheprovider", "test_app.py",
                  fail=True)
    assert result.returncode == 1, result.stdout[-3000:] + result.stderr[-3000:]
    assert "1 failed, 1 passed" in result.stdout


def test_parse_a_module():
    args = parse(["-m", "pytest", "-x", "tests/a.py"])
    assert args.module and args.here and args.script == "pytest"
    assert args.args == ["-x", "tests/a.py"]
    with pytest.raises(SystemExit):
        parse(["--num-instances", "2", "-m", "pytest"])


SAMPLER_PROGRAM = '''import torch
import poptorch


class Batches(torch.utils.data.Sampler):
    """Written for torch 2.0, as PopTorch's tests write their samplers."""

    def __init__(self, n):
        super().__init__(None)
        self.n = n

    def __iter__(self):
        return iter([[i, i + 1] for i in range(0, self.n, 2)])

    def __len__(self):
        return self.n // 2


data = torch.utils.data.TensorDataset(torch.arange(8.0))
loader = poptorch.DataLoader(poptorch.Options(), data, batch_sampler=Batches(8))
print("batches", [b[0].tolist() for b in loader])
'''


def test_samplers_written_for_torch_2_0_run_unchanged(tmp_path):
    """torch 2.0's ``Sampler.__init__(data_source)``, which later PyTorch
    dropped, is there for programs the launcher runs (torch_compat.py)."""
    (tmp_path / "program.py").write_text(SAMPLER_PROGRAM)
    result = _run(tmp_path, "program.py")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "batches [[0.0, 1.0], [2.0, 3.0], [4.0, 5.0], [6.0, 7.0]]" in result.stdout
