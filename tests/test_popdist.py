"""PopDist on torch.distributed (``poptorchsim.popdist``) and the import
aliases of ``python -m poptorchsim.run``: a PopTorch program written as
Graphcore's applications are (``import poptorch``, ``import popdist``,
``popdist.poptorch.Options()``) runs with no edit.

Three launches start processes (a few seconds each); the rest runs in this
process, with the POPDIST_* variables set by hand.
"""
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import poptorchsim
from poptorchsim import popdist
from poptorchsim.distributed import aliases
from poptorchsim.popdist import poptorch as popdist_poptorch
from poptorchsim.run import parse

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ROOT / "tests" / "dist_scripts"
TRAIN, WHICH = SCRIPTS / "popdist_train.py", SCRIPTS / "which_modules.py"
LAUNCH_VARS = ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "RANK", "WORLD_SIZE",
               "MASTER_ADDR", "MASTER_PORT")


def _env(extra_path=None):
    env = {k: v for k, v in os.environ.items()
           if k not in LAUNCH_VARS and not k.startswith("POPDIST_")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + ([str(extra_path)] if extra_path else [])
                                        + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    env["POPTORCHSIM_SMALL_IPU_MODEL"] = "1"
    return env


def _launch(*args, extra_path=None, timeout=120):
    t0 = time.perf_counter()
    result = subprocess.run([sys.executable, "-m", "poptorchsim.run", *map(str, args)],
                            cwd=ROOT, env=_env(extra_path), capture_output=True, text=True,
                            timeout=timeout)
    return result, time.perf_counter() - t0


@pytest.fixture
def no_launch(monkeypatch):
    """This process as a program started by hand: no launcher variables."""
    for var in list(os.environ):
        if var.startswith("POPDIST_") or var in LAUNCH_VARS:
            monkeypatch.delenv(var)
    return monkeypatch


@pytest.fixture
def launched(no_launch):
    """This process as instance 2 of 4 of a launch with 12 replicas."""
    for var, value in (("NUM_INSTANCES", "4"), ("INSTANCE_INDEX", "2"),
                       ("NUM_TOTAL_REPLICAS", "12"), ("NUM_LOCAL_REPLICAS", "3")):
        no_launch.setenv("POPDIST_" + var, value)
    return no_launch


# -- a PopTorch program under the launcher ------------------------------------------------
def test_two_instances_train_as_one_instance_with_all_replicas(tmp_path):
    two, one = tmp_path / "two.pt", tmp_path / "one.pt"
    result, seconds = _launch("--num-instances", 2, "--num-replicas", 4, TRAIN, two)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert seconds < 30
    for i in range(2):
        assert f"instance {i} of 2: 3 steps, 2 local replicas" in result.stdout
    result, _ = _launch("--num-instances", 1, "--num-replicas", 4, "--", TRAIN, one)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "instance 0 of 1: 3 steps, 4 local replicas" in result.stdout
    # instance 0 alone wrote the checkpoint (execute_on_instances({0}, ...))
    assert json.loads((tmp_path / "two.pt.json").read_text()) == {"instances": 2,
                                                                  "replicas": 4}
    got, expected = torch.load(two), torch.load(one)
    torch.manual_seed(0)
    initial = torch.nn.Linear(5, 8).weight      # the script's first layer, as it starts
    assert not torch.allclose(got["fc1.weight"], initial)
    assert set(got) == set(expected)
    for name, value in expected.items():
        torch.testing.assert_close(got[name], value, rtol=1e-6, atol=1e-7,
                                   msg=lambda msg, n=name: f"{n}: {msg}")


def test_a_failing_instance_stops_the_run_and_is_named(tmp_path):
    result, seconds = _launch("--num-instances", 2, "--num-replicas", 4, TRAIN,
                              tmp_path / "w.pt", "--fail-on-instance", 1, timeout=90)
    assert result.returncode == 1
    assert seconds < 30
    lines = [ln for ln in result.stderr.splitlines() if ln.startswith("poptorchsim.run:")]
    assert lines[0] == ("poptorchsim.run: process 1 of 2 failed: ValueError: instance 1 "
                        "fails here on purpose"), result.stderr[-3000:]
    assert lines[1].startswith("poptorchsim.run:   then process 0 of 2 failed: Error: "
                               "Replica process 1 of 2 stopped responding"), lines
    assert not (tmp_path / "w.pt").exists()


def test_imports_resolve_to_poptorchsim_under_the_launcher(tmp_path):
    out = tmp_path / "which.json"
    result, _ = _launch("--ipus-per-replica", 2, WHICH, out)
    assert result.returncode == 0, result.stderr[-3000:]
    found = json.loads(out.read_text())
    assert found["poptorch"] == "poptorchsim" and found["poptorch_is_poptorchsim"]
    assert found["poptorch.optim"] == "poptorchsim.optim"
    assert found["DataLoader"] and found["DataLoaderMode"]
    assert found["popdist"] == "poptorchsim.popdist" and found["popdist_is_ours"]
    assert found["popdist.poptorch"] == "poptorchsim.popdist.poptorch"
    assert found["popdist_env"] is True and found["instances"] == 1
    assert found["ipus_per_replica"] == 2
    assert found["async_sum"] == 28.0       # the DataLoader's worker imported poptorch too
    assert "poptorchsim: a real" not in result.stderr


def test_without_launcher_options_the_script_runs_in_this_process(tmp_path):
    """``python -m poptorchsim.run script.py`` is ``python script.py`` with
    its imports aliased: no launch, so popdist answers as one instance
    outside poprun, and the DataLoader's worker process still imports
    poptorch."""
    out = tmp_path / "which.json"
    result, _ = _launch(WHICH, out)
    assert result.returncode == 0, result.stderr[-3000:]
    found = json.loads(out.read_text())
    assert found["poptorch_is_poptorchsim"] and found["popdist_is_ours"]
    assert found["popdist_env"] is False and found["instances"] == 1
    assert found["async_sum"] == 28.0
    assert "torch.distributed" not in result.stderr and "process 0 of 1" not in result.stderr

    failing = tmp_path / "fails.py"
    failing.write_text("import poptorch\nraise ValueError('the script fails here')\n")
    result, _ = _launch(failing)
    assert result.returncode == 1
    assert result.stderr.rstrip().splitlines()[-1] == "ValueError: the script fails here"


def test_a_real_installed_package_is_not_shadowed(tmp_path):
    fake = tmp_path / "site" / "popdist"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("def getNumInstances():\n    return 7\n\n"
                                      "def isPopdistEnvSet():\n    return 'fake'\n\n"
                                      "def getNumIpusPerReplica():\n    return 5\n")
    (fake / "poptorch.py").write_text("")
    out = tmp_path / "which.json"
    result, _ = _launch(WHICH, out, extra_path=fake.parent)
    assert result.returncode == 0, result.stderr[-3000:]
    found = json.loads(out.read_text())
    assert found["popdist_file"] == str(fake / "__init__.py")
    assert not found["popdist_is_ours"] and found["instances"] == 7
    assert found["popdist.poptorch"] == "popdist.poptorch"
    assert found["poptorch_is_poptorchsim"]          # the others are still aliased
    assert (f"poptorchsim: a real 'popdist' is installed ({fake / '__init__.py'}); "
            "'import popdist' uses it, not 'poptorchsim.popdist'") in result.stderr


# -- popdist's answers ------------------------------------------------------------------
def test_outside_a_launch_one_instance_holds_every_replica(no_launch):
    assert popdist.isPopdistEnvSet() is False
    assert (popdist.getNumInstances(), popdist.getInstanceIndex(),
            popdist.getLocalInstanceIndex(), popdist.getNumLocalReplicas(),
            popdist.getNumTotalReplicas(), popdist.getReplicaIndexOffset(),
            popdist.getNumIpusPerReplica(), popdist.getDeviceId()) == (1, 0, 0, 1, 1, 0, 1, 0)
    assert popdist.checkNumIpusPerReplica(4)
    popdist.init()                      # one instance: nothing to join
    assert popdist.execute_on_instances({0}, lambda a, b=0: a + b, 1, b=2) == 3
    opts = popdist_poptorch.Options(ipus_per_replica=2)
    assert (opts.Distributed.processId, opts.Distributed.numProcesses) == (0, 1)
    assert opts.replication_factor == 1 and opts.ipu_id == 2     # the pair of IPUs 0, 1


def test_a_launched_instance_reads_the_launcher(launched):
    assert popdist.isPopdistEnvSet() and popdist.isUsingPoprun()
    assert (popdist.getNumInstances(), popdist.getInstanceIndex(),
            popdist.getNumLocalReplicas(), popdist.getNumTotalReplicas(),
            popdist.getReplicaIndexOffset()) == (4, 2, 3, 12, 6)
    # 3 replicas of 1 IPU round up to a 4-IPU device: ids 0-3 single, 4-5 pairs, 6 all
    assert popdist.getDeviceId() == 6
    assert popdist.getDeviceId(2) == 14         # 6 IPUs -> the 8-IPU device
    calls = []
    assert popdist.execute_on_instances({0, 1}, calls.append, "x") is None
    assert calls == []
    popdist.execute_on_instances([2], calls.append, "y")
    assert calls == ["y"]
    launched.setenv("POPDIST_NUM_IPUS_PER_REPLICA", "2")
    assert popdist.getNumIpusPerReplica() == 2 and popdist.checkNumIpusPerReplica(2)
    assert not popdist.checkNumIpusPerReplica(1)


def test_popdist_options_are_configured_for_the_instance(launched):
    opts = popdist_poptorch.Options()
    assert isinstance(opts, poptorchsim.Options)
    assert opts.replication_factor == 3 and opts.ipu_id == 6
    assert (opts.Distributed.processId, opts.Distributed.numProcesses) == (2, 4)
    opts.deviceIterations(2).Training.gradientAccumulation(4)  # the rest is the user's
    clone = opts.clone()
    assert type(clone) is popdist_poptorch.Options
    with pytest.raises(RuntimeError, match="Cannot call `replicationFactor`"):
        clone.replicationFactor(1)
    plain = popdist_poptorch.initialize_poptorch_options(poptorchsim.Options())
    assert (plain.replication_factor, plain.Distributed.processId) == (3, 2)
    plain.replicationFactor(1)                  # a plain Options stays the user's


@pytest.mark.parametrize("call, name, fix", [
    (lambda o: o.useIpuId(1), "useIpuId", "popdist.getDeviceId()"),
    (lambda o: o.replicationFactor(1), "replicationFactor",
     "the launcher gives this instance 3 of the 12 replicas (--num-replicas 12 over "
     "--num-instances 4). Change --num-replicas"),
    (lambda o: o.Distributed.disable(), "Distributed.disable", "--num-instances 1"),
    (lambda o: o.Distributed.setEnvVarNames("A", "B"), "Distributed.setEnvVarNames",
     "the launcher sets the instance index and count"),
    (lambda o: o.Distributed.configureProcessId(1), "Distributed.configureProcessId",
     "this is instance 2 of 4"),
])
def test_the_launchers_settings_cannot_be_changed(launched, call, name, fix):
    opts = popdist_poptorch.Options()
    with pytest.raises(popdist_poptorch.PopdistOptionsError) as info:
        call(opts)
    assert isinstance(info.value, poptorchsim.Error) and isinstance(info.value, RuntimeError)
    assert str(info.value).startswith(f"Cannot call `{name}` with popdist.poptorch.Options: ")
    assert fix in str(info.value)
    assert (opts.replication_factor, opts.Distributed.processId) == (3, 2)


def test_blocked_settings_outside_a_launch_say_how_to_launch(no_launch):
    with pytest.raises(RuntimeError, match=r"outside a launch, one instance holding one "
                                           r"replica; start the program with python -m "
                                           r"poptorchsim.run"):
        popdist_poptorch.Options().replicationFactor(4)


# -- every error path -----------------------------------------------------------------------
@pytest.mark.parametrize("var, value, expect", [
    ("NUM_INSTANCES", "two", "POPDIST_NUM_INSTANCES='two' is not a whole number of at "
                             "least 1"),
    ("NUM_INSTANCES", "0", "POPDIST_NUM_INSTANCES='0' is not a whole number of at least 1"),
    ("INSTANCE_INDEX", "-1", "POPDIST_INSTANCE_INDEX='-1' is not a whole number of at least "
                             "0"),
    ("INSTANCE_INDEX", "4", "POPDIST_INSTANCE_INDEX=4, but there are only 4 instances"),
    ("NUM_TOTAL_REPLICAS", "10", "POPDIST_NUM_TOTAL_REPLICAS=10, but 4 instances of 3 "
                                 "replicas each"),
])
def test_inconsistent_launcher_variables_are_named(launched, var, value, expect):
    launched.setenv("POPDIST_" + var, value)
    with pytest.raises(poptorchsim.Error, match="python -m poptorchsim.run") as info:
        popdist.getReplicaIndexOffset()
    assert expect in str(info.value)
    with pytest.raises(poptorchsim.Error):
        popdist_poptorch.Options()


def test_ipus_per_replica_must_agree_with_the_launcher(launched):
    launched.setenv("POPDIST_NUM_IPUS_PER_REPLICA", "1")
    fix = ("the program asks for 2 IPUs per replica, but the launcher gave each replica 1 "
           r"\(POPDIST_NUM_IPUS_PER_REPLICA=1\). Start it with python -m poptorchsim.run "
           "--ipus-per-replica 2")
    with pytest.raises(poptorchsim.Error, match=fix):
        popdist_poptorch.Options(ipus_per_replica=2)
    with pytest.raises(poptorchsim.Error, match=fix):
        popdist.getDeviceId(2)
    for bad in (0, -1, 1.5, True):
        with pytest.raises(poptorchsim.Error, match="a whole number of IPUs per replica"):
            popdist_poptorch.Options(ipus_per_replica=bad)
    with pytest.raises(poptorchsim.Error, match="a whole number of IPUs per replica"):
        popdist.getDeviceId(-1)
    with pytest.raises(poptorchsim.Error, match="expected a poptorch.Options, got dict"):
        popdist_poptorch.initialize_poptorch_options({})


def test_init_outside_the_launcher_names_the_command(launched):
    with pytest.raises(poptorchsim.Error) as info:
        popdist.init()
    text = str(info.value)
    assert "POPDIST_NUM_INSTANCES=4 says this is one of 4 instances" in text
    assert "MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE not set" in text
    assert "python -m poptorchsim.run --num-instances 4 --num-replicas 12 script.py" in text


@pytest.mark.parametrize("instances, fn, expect", [
    ({4}, print, "4 is not an instance: this run has 4 instances, indices 0 to 3"),
    ({-1, 7}, print, "-1, 7 are not instances"),
    ({"0"}, print, "'0' is not an instance"),
    (0, print, "0 is not a set of indices"),
    ({0}, "save", "fn must be callable, not str"),
])
def test_execute_on_instances_checks_its_arguments(launched, instances, fn, expect):
    with pytest.raises(poptorchsim.Error) as info:
        popdist.execute_on_instances(instances, fn)
    assert expect in str(info.value)


# -- the aliases, in this process --------------------------------------------------------
@pytest.fixture
def alias():
    yield aliases.install
    aliases.uninstall()


def test_aliases_map_poptorch_and_its_submodules(alias):
    installed = alias()
    assert installed.aliased["poptorch"] == "poptorchsim"
    import popdist as pd
    import popdist.poptorch as pdp
    import poptorch
    import poptorch.optim
    from poptorch import DataLoader
    from poptorch.enums import OutputMode
    assert poptorch is poptorchsim and poptorch.optim is poptorchsim.optim
    assert poptorch.__spec__.name == "poptorchsim"      # the target's own spec
    assert DataLoader is poptorchsim.DataLoader and OutputMode is poptorchsim.OutputMode
    assert pd is popdist and pdp is popdist_poptorch
    with pytest.raises(ModuleNotFoundError, match="'poptorch' is 'poptorchsim', which has "
                                                  "no module 'poptorchsim.no_such'"):
        import poptorch.no_such
    aliases.uninstall()
    assert "poptorch" not in sys.modules and "poptorch.optim" not in sys.modules
    with pytest.raises(ModuleNotFoundError):
        import poptorch


def test_popart_is_aliased_only_where_poptorchsim_has_it(alias):
    import importlib.util
    installed = alias()
    if importlib.util.find_spec("poptorchsim.popart") is None:
        assert "popart" not in installed.aliased
        assert installed.left["popart"] == ("poptorchsim has no 'poptorchsim.popart': "
                                            "'import popart' is not aliased")
        assert installed.notes() == []          # nothing to tell the user
    else:
        assert installed.aliased["popart"] == "poptorchsim.popart"


def test_real_packages_are_never_shadowed(alias, tmp_path, monkeypatch):
    (tmp_path / "popdist").mkdir()
    (tmp_path / "popdist" / "__init__.py").write_text("REAL = True\n")
    (tmp_path / "poptorch").mkdir()     # a bare folder (namespace package) is no package
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(sys.modules, "popart", type(sys)("popart"))    # already imported
    installed = alias()
    assert set(installed.aliased) == {"poptorch"}
    assert installed.left["popdist"].startswith(
        f"a real 'popdist' is installed ({tmp_path / 'popdist' / '__init__.py'})")
    assert installed.left["popart"].startswith("a real 'popart' is already imported")
    assert len(installed.notes()) == 2
    assert "popdist" not in sys.modules
    try:
        import popdist as real
        assert real.REAL and real is not popdist
    finally:
        sys.modules.pop("popdist", None)


def test_the_launcher_passes_ipus_per_replica():
    args = parse(["--ipus-per-replica", "2", str(TRAIN)])
    assert args.ipus_per_replica == 2
    assert parse([str(TRAIN)]).ipus_per_replica is None
    with pytest.raises(SystemExit):
        parse(["--ipus-per-replica", "0", str(TRAIN)])


def test_the_dataloader_splits_the_dataset_by_instance(launched):
    """popdist.poptorch.Options() gives poptorch.DataLoader this instance's
    part of the dataset: instance 2 of 4, 3 replicas, 2 device iterations."""
    opts = popdist_poptorch.Options().deviceIterations(2)
    data = torch.utils.data.TensorDataset(torch.arange(96))
    loader = poptorchsim.DataLoader(opts, data, batch_size=2)
    assert loader.combinedBatchSize == 12
    assert [int(i) for (b,) in loader for i in b] == list(range(48, 72))


def test_exported_aliases_reach_new_interpreters_and_are_not_real(alias, tmp_path,
                                                                  monkeypatch):
    """``export`` writes poptorch.py into a directory on PYTHONPATH: a fresh
    interpreter started from here imports poptorchsim; a later ``install``
    does not take that module for a real poptorch."""
    monkeypatch.setenv("PYTHONPATH", os.environ.get("PYTHONPATH", str(ROOT)))
    installed = alias()
    installed.export(str(tmp_path / "shims"))
    assert (tmp_path / "shims" / "poptorch.py").exists(), installed.left
    assert os.environ[aliases.ENV] == ("poptorch=poptorchsim,popdist=poptorchsim.popdist,"
                                       "popart=poptorchsim.popart"), installed.left
    child = subprocess.run(
        [sys.executable, "-c", "import poptorch, poptorch.optim, popdist.poptorch, poptorchsim;"
         "print(poptorch is poptorchsim, poptorch.optim.__name__, popdist.poptorch.__name__)"],
        env={**os.environ, "PYTHONPATH": os.environ["PYTHONPATH"] + os.pathsep + str(ROOT)},
        capture_output=True, text=True, timeout=60)
    assert child.stdout.split() == ["True", "poptorchsim.optim", "poptorchsim.popdist.poptorch"], \
        child.stderr[-2000:]
    again = alias()                         # the directory is still on sys.path
    assert "poptorch" in again.aliased
    monkeypatch.syspath_prepend(str(tmp_path / "shims"))
    aliases.uninstall()
    assert aliases.ENV not in os.environ and str(tmp_path / "shims") not in \
        os.environ["PYTHONPATH"].split(os.pathsep)
    monkeypatch.delenv(aliases.ENV, raising=False)
    with pytest.raises(ImportError, match="only in a program run by python -m "
                                          "poptorchsim.run"):
        aliases._become("poptorch")


def test_the_worker_writes_the_aliases_where_they_are_removed_or_reused(monkeypatch,
                                                                       tmp_path):
    from poptorchsim.distributed import _worker
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv(_worker.ALIAS_DIR, str(tmp_path))      # the launcher's, removed
    assert _worker._alias_directory({"poptorch": "poptorchsim"}) == str(tmp_path / "process1")
    monkeypatch.delenv(_worker.ALIAS_DIR)                    # by hand: this user's, reused
    monkeypatch.setattr(_worker.tempfile, "gettempdir", lambda: str(tmp_path))
    mine = tmp_path / f"poptorchsim-aliases-{os.getuid()}"
    assert _worker._alias_directory({"poptorch": 0, "popdist": 1}) == \
        str(mine / "popdist+poptorch")
    assert mine.stat().st_mode & 0o777 == 0o700
    mine.chmod(0o777)                                        # not safely ours: a fresh one
    fresh = _worker._alias_directory({"poptorch": 0})
    assert Path(fresh).parent == tmp_path and Path(fresh).name.startswith("poptorchsim-")
