"""Replicas in several processes: ``python -m poptorchsim.run`` with gloo.

Two processes with two replicas each must train the same weights as one
process with four replicas fed the same samples, and a process that dies
must make the run fail within seconds with a clear error instead of hanging.
(The DataLoader's part of it is in test_distributed_data.py.)
"""
import os
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import poptorchsim
from poptorchsim.distributed import _worker
from poptorchsim.distributed import launch as launch_module
from poptorchsim.run import parse

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tests" / "dist_scripts" / "train_small.py"
sys.path.insert(0, str(SCRIPT.parent))
import train_small  # noqa: E402 - after the sys.path insert above

LOST = ("Replica process 1 of 2 stopped responding during the gradient all-reduce (gloo: ")


def _env():
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + ([env["PYTHONPATH"]]
                                                       if env.get("PYTHONPATH") else []))
    env["POPTORCHSIM_SMALL_IPU_MODEL"] = "1"
    for var in ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "RANK", "WORLD_SIZE",
                "MASTER_ADDR", "MASTER_PORT") + tuple(v for v in env if v.startswith("POPDIST_")):
        env.pop(var, None)
    return env


def _launch(*args, timeout=120, env=None):
    t0 = time.perf_counter()
    result = subprocess.run([sys.executable, "-m", "poptorchsim.run", *args], cwd=ROOT,
                            env={**_env(), **(env or {})}, capture_output=True, text=True,
                            timeout=timeout)
    return result, time.perf_counter() - t0


def _one_process_reference(processes=2, local=2, optimizer="adam"):
    """One process with ``processes * local`` replicas, fed what the processes
    were fed.

    The mapping: the DataLoader of process p holds the contiguous slice
    ``[p * per_process, (p + 1) * per_process)`` and its k-th combined batch
    (C = micro * di * ga * local samples) is laid out by the executor as
    ``[di, ga, local, micro]``: at device iteration i and accumulation step g,
    local replica r of process p takes the micro-batch starting at
    ``p * per_process + k * C + ((i * ga + g) * local + r) * micro``.  So the
    single process's step k is the processes' k-th batches, each reshaped to
    ``[di, ga, local, micro]``, concatenated along the replica axis: its
    replica ``p * local + r`` is replica r of process p, and each weight
    update sums the same 8 micro-batch gradients (2 accumulation steps x 4
    replicas) and divides by the same 8.
    """
    m, di, ga = train_small.MICRO, train_small.DI, train_small.GA
    x, labels = train_small.dataset().tensors
    combined = m * di * ga * local
    per_process = combined * (len(x) // (combined * processes))
    torch.manual_seed(0)
    model = train_small.Small()
    opts = poptorchsim.Options().deviceIterations(di).replicationFactor(processes * local)
    opts.Training.gradientAccumulation(ga)
    opts.showCompilationProgressBar(False)
    tm = poptorchsim.trainingModel(model, opts,
                                   train_small.OPTIMIZERS[optimizer](model.parameters()))
    for k in range(per_process // combined):
        parts = []
        for t in (x, labels):
            per = [t[p * per_process + k * combined:p * per_process + (k + 1) * combined]
                   .reshape(di, ga, local, m, *t.shape[1:]) for p in range(processes)]
            parts.append(torch.cat(per, dim=2).reshape(-1, *t.shape[1:]))
        tm(*parts)
    return model.state_dict()


def test_two_processes_train_like_one_process_with_all_replicas(tmp_path):
    out = tmp_path / "weights.pt"
    result, seconds = _launch("--num-instances", "2", "--num-replicas", "4", "--",
                              str(SCRIPT), str(out))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "process 0 of 2: 5 steps" in result.stdout
    assert "process 1 of 2: 5 steps" in result.stdout
    assert seconds < 60
    got = torch.load(out)
    expected = _one_process_reference()
    torch.manual_seed(0)
    initial = train_small.Small().state_dict()
    assert not torch.allclose(got["net.0.weight"], initial["net.0.weight"])
    for name, value in expected.items():
        torch.testing.assert_close(got[name], value, rtol=1e-5, atol=1e-5,
                                   msg=lambda msg, n=name: f"{n}: {msg}")


@pytest.mark.parametrize("optimizer,atol", [("sgd_combined", 1e-5), ("adam_fp16_accum", 2e-3)])
def test_two_processes_reduce_like_one_with_the_optimizers_accumulators(tmp_path, optimizer,
                                                                        atol):
    """SGD's combined variant adds each process's gradients to its velocity
    after the all-reduce (not the velocity itself twice); a float16
    accumulator's running mean in each process is averaged over processes."""
    out = tmp_path / "weights.pt"
    result, _ = _launch("--num-instances", "2", "--num-replicas", "4", "--",
                        str(SCRIPT), str(out), env={"TRAIN_SMALL_OPTIMIZER": optimizer})
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    got = torch.load(out)
    expected = _one_process_reference(optimizer=optimizer)
    for name, value in expected.items():
        torch.testing.assert_close(got[name], value, rtol=0, atol=atol,
                                   msg=lambda msg, n=name: f"{n}: {msg}")


def test_a_dead_process_stops_the_run_within_seconds(tmp_path):
    # process 1 calls os._exit(3) on its second step, while process 0 waits in
    # the gradient all-reduce
    result, seconds = _launch("--num-instances", "2", "--num-replicas", "2", str(SCRIPT),
                              str(tmp_path / "w.pt"), "die", timeout=90)
    assert result.returncode == 1
    assert seconds < 30
    lines = [ln for ln in result.stderr.splitlines() if ln.startswith("poptorchsim.run:")]
    assert lines[0] == ("poptorchsim.run: process 1 of 2 failed: exit code 3, with no "
                        "Python exception (it exited or was killed)"), result.stderr[-3000:]
    # process 0 raised the Error at once (the launcher's SIGTERM gives it a
    # grace period to be recorded)
    assert len(lines) == 2
    assert lines[1].startswith("poptorchsim.run:   then process 0 of 2 failed: Error: "
                               + LOST), result.stderr[-3000:]
    assert "The other processes stop too" in lines[1]
    assert "poptorchsim.errors.Error: " + LOST in result.stderr


def test_survivors_get_a_clear_error_when_a_peer_dies(tmp_path):
    """Without the launcher (which would stop the survivor), as a program run
    by hand with the launcher's variables: process 1 dies mid-training and
    process 0's gradient all-reduce fails at once."""
    port = str(launch_module.free_port())
    procs = []
    for rank in range(2):
        env = _env()
        env.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "RANK": str(rank),
                    "WORLD_SIZE": "2", "POPDIST_NUM_LOCAL_REPLICAS": "1"})
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "poptorchsim.distributed._worker", str(SCRIPT),
             str(tmp_path / "w.pt"), "die"], cwd=ROOT, env=env, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, text=True))
    t0 = time.perf_counter()
    _, err0 = procs[0].communicate(timeout=90)
    procs[1].communicate(timeout=30)
    assert time.perf_counter() - t0 < 30
    assert procs[1].returncode == 3
    assert procs[0].returncode == 1
    assert "poptorchsim.errors.Error: " + LOST in err0, err0[-3000:]
    assert "so process 0 cannot go on. Look at the output of process 1" in err0


# -- the launcher's pieces, without starting processes ----------------------------------
def test_launcher_checks_its_arguments():
    result, _ = _launch("--num-instances", "2", "--num-replicas", "3", str(SCRIPT), "x")
    assert result.returncode == 2
    assert ("--num-replicas (3) must be a positive multiple of --num-instances (2)"
            in result.stderr)
    assert "Try --num-replicas 4" in result.stderr


@pytest.mark.parametrize("argv,script_args", [
    (["--num-instances", "2", "--num-replicas", "4", "S", "--epochs", "1"], ["--epochs", "1"]),
    (["--num-instances=2", "--num-replicas=4", "--", "S", "--", "x"], ["--", "x"]),
    (["--num-replicas", "4", "--num-instances", "2", "--master-port", "29999", "S"], []),
])
def test_launcher_arguments_before_the_script_are_its_own(argv, script_args):
    args = parse([str(SCRIPT) if a == "S" else a for a in argv])
    assert (args.num_instances, args.num_replicas, args.script, args.args) == \
        (2, 4, str(SCRIPT), script_args)


def test_launcher_rejects_a_missing_script(capsys):
    with pytest.raises(SystemExit):
        parse(["--num-instances", "2", "no_such_script.py"])
    assert "no such script: no_such_script.py" in capsys.readouterr().err


def test_worker_maps_torchrun_variables_to_poprun_and_open_mpi():
    env = {"RANK": "1", "WORLD_SIZE": "2", "POPDIST_NUM_LOCAL_REPLICAS": "3"}
    _worker.set_environment(env)
    assert env["OMPI_COMM_WORLD_RANK"] == "1" and env["OMPI_COMM_WORLD_SIZE"] == "2"
    assert env["POPDIST_INSTANCE_INDEX"] == "1" and env["POPDIST_NUM_INSTANCES"] == "2"
    assert env["POPDIST_NUM_TOTAL_REPLICAS"] == "6"


def test_failure_summary_puts_the_cause_first():
    def failure(exitcode, message=""):
        """What torch's ProcessFailure holds: a recorded exception, or none."""
        if message:
            return SimpleNamespace(exitcode=exitcode, timestamp=100, message=message,
                                   error_file_data={"message": {"message": message}})
        return SimpleNamespace(exitcode=exitcode, timestamp=100,
                               message="To enable traceback see: https://pytorch.org/...",
                               error_file_data={"message": "<NONE>"})
    lines = launch_module.summarize({
        0: failure(1, "Error: Replica process 2 of 4 stopped responding during ..."),
        1: failure(_worker.STOPPED),
        2: failure(1, "ValueError: bad\nmore"),
        3: failure(-9)}, 4)
    assert lines == [
        "poptorchsim.run: process 2 of 4 failed: ValueError: bad",
        "poptorchsim.run:   then process 3 of 4 failed: killed by SIGKILL",
        "poptorchsim.run:   then process 0 of 4 failed: Error: Replica process 2 of 4 "
        "stopped responding during ...",
        "poptorchsim.run:   then process 1 of 4 failed: stopped by the launcher (SIGTERM) "
        "when another process failed"]


# -- Options.Distributed in the runtime --------------------------------------------------
def test_distributed_training_without_a_launcher_names_the_fix(monkeypatch):
    for var in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    opts = poptorchsim.Options().showCompilationProgressBar(False)
    opts.Distributed.configureProcessId(0, 2)
    model = train_small.Small()
    tm = poptorchsim.trainingModel(model, opts, torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(poptorchsim.Error, match="run it with python -m poptorchsim.run "
                                                "--num-instances 2"):
        tm(torch.randn(3, 6), torch.randint(0, 4, (3,)))


def test_launcher_variables_must_agree_with_options(monkeypatch):
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "1")
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    opts = poptorchsim.Options().showCompilationProgressBar(False)
    opts.Distributed.configureProcessId(0, 2)
    model = train_small.Small()
    tm = poptorchsim.trainingModel(model, opts, torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(poptorchsim.Error, match=r"says process 0 of 2, but the launcher "
                                                r"made this process 1 of 2"):
        tm(torch.randn(3, 6), torch.randint(0, 4, (3,)))


def test_an_offline_compile_of_one_process_needs_no_other(monkeypatch):
    """Each process of a distributed run compiles for an offline target on
    its own (PopTorch's offline precompilation): no launcher, no peers; the
    training step is compiled and its estimate made."""
    for var in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    opts = poptorchsim.Options().showCompilationProgressBar(False).useOfflineIpuTarget()
    opts.Distributed.configureProcessId(1, 6)
    model = train_small.Small()
    tm = poptorchsim.trainingModel(model, opts, torch.optim.SGD(model.parameters(), lr=0.1))
    tm.compile(torch.randn(3, 6), torch.randint(0, 4, (3,)))
    assert tm.isCompiled() and tm.cycleEstimate()["total"] > 0


def test_distributed_inference_needs_no_process_group(monkeypatch):
    for var in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    opts = poptorchsim.Options().showCompilationProgressBar(False)
    opts.Distributed.configureProcessId(1, 2)
    model = train_small.Small()
    x, labels = torch.randn(3, 6), torch.randint(0, 4, (3,))
    out, _ = poptorchsim.inferenceModel(model, opts)(x, labels)
    torch.testing.assert_close(out, model.net(x))
