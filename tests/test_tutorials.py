"""The tutorials run end to end (their --small variants, as CI runs them)."""
import json
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _run_tutorial(script, *args, timeout=300):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(ROOT)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    return subprocess.run([sys.executable, str(ROOT / script), *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)


def test_basics_tutorial_runs_and_reports_accuracy():
    result = _run_tutorial("tutorials/basics/basics.py", "--small")
    assert result.returncode == 0, (
        f"basics.py --small exited with {result.returncode}\n"
        f"--- stdout ---\n{result.stdout[-4000:]}\n--- stderr ---\n{result.stderr[-4000:]}")
    lines = [line for line in result.stdout.splitlines() if line.strip()]
    assert lines, "basics.py printed nothing"
    match = re.search(r"accuracy: (\d+(?:\.\d+)?)%", lines[-1])
    assert match, f"the last line does not report an accuracy: {lines[-1]!r}"
    # two well-separated blobs: anything below 90% means training went wrong
    assert 90.0 <= float(match.group(1)) <= 100.0, lines[-1]


def test_memory_profiling_tutorial(tmp_path):
    result = _run_tutorial("tutorials/memory_profiling/memory_profiling.py", "--small",
                           "--out", str(tmp_path))
    assert result.returncode == 0, (
        f"memory_profiling.py --small exited with {result.returncode}\n"
        f"--- stdout ---\n{result.stdout[-4000:]}\n--- stderr ---\n{result.stderr[-4000:]}")
    assert "Out of memory on tile" in result.stdout, result.stdout[-4000:]
    # the model that does not fit, profiled anyway, and the fixed one that trained
    for model in ("too_big", "fixed"):
        for name in ("profile.json", "memory.png", "cycles_by_op.png", "liveness.png",
                     "index.html"):
            path = tmp_path / model / name
            assert path.is_file() and path.stat().st_size > 0, f"missing report file {path}"
    lines = [line for line in result.stdout.splitlines() if line.strip()]
    assert re.match(r"Done in \d+(?:\.\d+)? s\.", lines[-1]), lines[-1]


def test_pipelining_tutorial(tmp_path):
    result = _run_tutorial("tutorials/pipelining/pipelining.py", "--small",
                           "--out", str(tmp_path))
    assert result.returncode == 0, (
        f"pipelining.py --small exited with {result.returncode}\n"
        f"--- stdout ---\n{result.stdout[-4000:]}\n--- stderr ---\n{result.stderr[-4000:]}")
    # PopTorch's training rule for pipelines, caught and printed
    assert "gradientAccumulation must be greater than or equal to" in result.stdout, (
        result.stdout[-4000:])
    # the pipelined model's schedule, as a picture and as a Chrome trace
    for name in ("timeline.png", "timeline.json"):
        path = tmp_path / "pipelined" / name
        assert path.is_file() and path.stat().st_size > 0, f"missing report file {path}"
    trace = json.loads((tmp_path / "pipelined" / "timeline.json").read_text())
    names = {e["name"] for e in trace["traceEvents"] if e.get("ph") == "X"}
    assert "F0 mb0" in names and "B3 mb6" in names, sorted(names)[:10]
    lines = [line for line in result.stdout.splitlines() if line.strip()]
    assert re.match(r"Done in \d+(?:\.\d+)? s\.", lines[-1]), lines[-1]


def test_replication_tutorial(tmp_path):
    result = _run_tutorial("tutorials/replication/replication.py", "--small",
                           "--out", str(tmp_path))
    assert result.returncode == 0, (
        f"replication.py --small exited with {result.returncode}\n"
        f"--- stdout ---\n{result.stdout[-4000:]}\n--- stderr ---\n{result.stderr[-4000:]}")
    out = result.stdout
    # 4 replicas learn what plain PyTorch learns; sharding changes no weight
    assert "4 replicas x 1 IPU = 4 IPUs" in out, out[-4000:]
    diff = re.search(r"micro-batches per step: max weight difference (\S+)", out)
    assert diff and float(diff.group(1)) < 1e-5, out[-4000:]
    assert "max weight difference from section 1 0.0e+00" in out, out[-4000:]
    # the IR of the sharded update, the seed's table and the model that only fits sharded
    assert "reduce-scatter" in out and "all-gather" in out, out[-4000:]
    assert "Same ranking as published: yes" in out, out[-4000:]
    assert "poptorch.OutOfMemoryError" in out and "Out of memory on tile" in out, out[-4000:]
    assert "in Streaming Memory, sharded  fits" in out, out[-4000:]
    for name in ("remote_variables.png", "replicated/memory.png", "sharded/memory.png"):
        path = tmp_path / name
        assert path.is_file() and path.stat().st_size > 0, f"missing report file {path}"
    # two processes with the launcher, unless this poptorchsim has none
    if (ROOT / "poptorchsim" / "run.py").is_file():
        assert "(within 1e-5)" in out, out[-4000:]
        assert (tmp_path / "two_processes.pt").is_file()
    else:
        assert "skipped: poptorchsim.run" in out, out[-4000:]
    lines = [line for line in out.splitlines() if line.strip()]
    assert re.match(r"Done in \d+(?:\.\d+)? s\.", lines[-1]), lines[-1]


def test_precompilation_tutorial():
    result = _run_tutorial("tutorials/precompilation/precompilation.py", "--small")
    assert result.returncode == 0, (
        f"precompilation.py --small exited with {result.returncode}\n"
        f"--- stdout ---\n{result.stdout[-4000:]}\n--- stderr ---\n{result.stderr[-4000:]}")
    assert "second process: loaded=True" in result.stdout, result.stdout[-4000:]
    assert "poptorch.load raised AssertionError" in result.stdout, result.stdout[-4000:]
    lines = [line for line in result.stdout.splitlines() if line.strip()]
    assert re.match(r"Done in \d+(?:\.\d+)? s\.", lines[-1]), lines[-1]
