"""Replicas in several processes: ``python -m poptorchsim.run`` with gloo.

Two processes with two replicas each must train the same weights as one
process with four replicas fed the same samples, and a process that dies
must make the run fail quickly with a clear error instead of hanging.
"""
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import poptorchsim

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tests" / "dist_scripts" / "train_small.py"
sys.path.insert(0, str(SCRIPT.parent))
import train_small  # noqa: E402


def _env():
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + ([env["PYTHONPATH"]]
                                                       if env.get("PYTHONPATH") else []))
    env["POPTORCHSIM_SMALL_IPU_MODEL"] = "1"
    for var in ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "POPDIST_NUM_LOCAL_REPLICAS"):
        env.pop(var, None)
    return env


def _launch(*args, timeout=120):
    t0 = time.perf_counter()
    result = subprocess.run([sys.executable, "-m", "poptorchsim.run", *args], cwd=ROOT,
                            env=_env(), capture_output=True, text=True, timeout=timeout)
    return result, time.perf_counter() - t0


def _one_process_reference(processes=2, local=2):
    """One process, ``processes * local`` replicas, fed what the processes were
    fed: process p's combined batch k holds its replicas' micro-batches, and
    replica r of process p is replica p * local + r of the single process."""
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
                                   torch.optim.Adam(model.parameters(), lr=1e-2))
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
    result, seconds = _launch("--num-instances", "2", "--num-replicas", "4", str(SCRIPT),
                              str(out))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "process 0 of 2: 5 steps" in result.stdout
    assert "process 1 of 2: 5 steps" in result.stdout
    got = torch.load(out)
    expected = _one_process_reference()
    torch.manual_seed(0)
    initial = train_small.Small().state_dict()
    assert not torch.allclose(got["net.0.weight"], initial["net.0.weight"])
    for name, value in expected.items():
        torch.testing.assert_close(got[name], value, rtol=1e-5, atol=1e-5,
                                   msg=lambda msg, n=name: f"{n}: {msg}")


def test_a_dead_process_stops_the_run_quickly(tmp_path):
    result, seconds = _launch("--num-instances", "2", "--num-replicas", "2", str(SCRIPT),
                              str(tmp_path / "w.pt"), "die")
    assert result.returncode != 0
    assert seconds < 60
    assert "process 1 of 2 failed first (exit code 3)" in result.stderr, result.stderr[-3000:]


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_survivors_get_a_clear_error_when_a_peer_dies(tmp_path):
    """Without the launcher (which would stop the survivor): process 1 dies
    mid-training and process 0's gradient all-reduce fails at once."""
    port = str(_free_port())
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
    assert time.perf_counter() - t0 < 60
    assert procs[1].returncode == 3
    assert procs[0].returncode != 0
    assert "another replica process stopped responding during the gradient all-reduce" \
        in err0, err0[-3000:]


def test_launcher_checks_its_arguments():
    result, _ = _launch("--num-instances", "2", "--num-replicas", "3", str(SCRIPT), "x")
    assert result.returncode == 2
    assert "must be a positive multiple of --num-instances" in result.stderr


def test_distributed_options_without_a_launcher_name_the_fix(monkeypatch):
    for var in ("MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
    opts = poptorchsim.Options().showCompilationProgressBar(False)
    opts.Distributed.configureProcessId(0, 2)
    model = train_small.Small()
    tm = poptorchsim.trainingModel(model, opts, torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(poptorchsim.Error, match="python -m poptorchsim.run"):
        tm(torch.randn(3, 6), torch.randint(0, 4, (3,)))


# -- poptorchsim.DataLoader: each process its own part ----------------------------------
def _loader(process, processes=2, shuffle=False, seed=None, n=100, batch=2, **kw):
    opts = poptorchsim.Options().deviceIterations(2)
    opts.Distributed.configureProcessId(process, processes)
    if seed is not None:
        opts.randomSeed(seed)
    data = torch.utils.data.TensorDataset(torch.arange(n))
    return poptorchsim.DataLoader(opts, data, batch_size=batch, shuffle=shuffle, **kw)


def _seen(loader):
    return [int(i) for (b,) in loader for i in b]


def test_each_process_reads_its_own_contiguous_slice():
    # combined batch 4; 100 samples -> 12 batches each for 2 processes (96 used)
    first, second = _seen(_loader(0)), _seen(_loader(1))
    assert first == list(range(48)) and second == list(range(48, 96))
    assert len(_loader(0)) == 12


def test_shuffle_is_one_permutation_shared_by_processes_and_redrawn_each_epoch():
    loaders = [_loader(p, shuffle=True, seed=7) for p in range(2)]
    epoch1 = [_seen(ld) for ld in loaders]
    assert not set(epoch1[0]) & set(epoch1[1])
    assert sorted(epoch1[0] + epoch1[1]) != list(range(96))      # shuffled, not a prefix
    again = [_seen(_loader(p, shuffle=True, seed=7)) for p in range(2)]
    assert again == epoch1                                        # deterministic per seed
    epoch2 = [_seen(ld) for ld in loaders]
    assert epoch2 != epoch1 and not set(epoch2[0]) & set(epoch2[1])


def test_distributed_loader_errors():
    with pytest.raises(AssertionError, match="randomSeed"):
        _loader(0, shuffle=True)
    with pytest.raises(ValueError, match="batch_size=None is not supported"):
        _loader(0, batch=None)
    with pytest.raises(ValueError, match="fewer than one combined batch"):
        _loader(0, n=6)
    # opting out keeps the whole dataset in every process
    assert len(_seen(_loader(1, auto_distributed_partitioning=False))) == 100
