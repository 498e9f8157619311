"""Graphcore's applications, unchanged, as acceptance tests (issue 23, item 6).

    python benchmarks/graphcore_apps.py --examples /path/to/graphcore/examples \
        [--only NAME] [--steps N] [--timeout S] [--deps NAME=DIR[:DIR]] [--deps-all DIR[:DIR]]

Runs each application's own smallest test or command, from a checkout of
https://github.com/graphcore/examples, under ``python -m poptorchsim.run``
(pytest files through ``python -m poptorchsim.run -m pytest``), on
generated or synthetic data, with a timeout each; parses the application's
own success criterion (the assertion its test makes, or the line its
benchmark reads) and prints a table: application, command, result, minutes.
Without the checkout it says so and exits 0.

The applications' Python dependencies are the user's to install (pip
``--target`` directories, passed with ``--deps NAME=DIR`` for one
application or ``--deps-all DIR`` for all; they must not carry their own
torch or numpy).  Modules with no wheel for this Python get a stand-in,
written to a temporary directory put on PYTHONPATH:

* ``horovod`` (0.24.3: an sdist only, built against MPI): a single-process
  ``horovod.torch`` (init, rank 0 of size 1, broadcasts and allreduce as
  identities).  The applications import it at the top and use it only when
  launched with several instances.
* ``dllogger`` (NVIDIA's, installed from git, not on PyPI; FastPitch logs
  through it): ``init``, ``metadata``, ``flush`` do nothing, ``log`` prints.
* ``wandb`` (the pinned 0.12.8 imports ``np.float_``, gone in NumPy 2): the
  applications call it only with ``--wandb``; its ``init`` says so.

The stand-ins come after the ``--deps`` directories on PYTHONPATH, so an
installed package wins.

What cannot run is said in the table's result: a C++ custom op built
against Poplar's headers (the Conformer's RemapCE ``custom_ops.so``), a
pretrained-weights download (the CNN inference uses its own
``--random-weights``), too many data-loader processes for a small machine
(ViT's config asks for 64; ``--dataloader-workers 2``, its own option).
"""
import argparse
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

HOROVOD_TORCH = '''"""Single-process stand-in for horovod.torch (no wheel for this Python)."""
def init(*args, **kwargs): pass
def shutdown(): pass
def is_initialized(): return True
def rank(): return 0
def local_rank(): return 0
def size(): return 1
def local_size(): return 1
def cross_rank(): return 0
def cross_size(): return 1
def mpi_threads_supported(): return True
def allreduce(tensor, average=None, name=None, op=None, **kwargs): return tensor
def allreduce_(tensor, average=None, name=None, op=None, **kwargs): return tensor
def allgather(tensor, name=None): return tensor
def broadcast(tensor, root_rank=0, name=None): return tensor
def broadcast_(tensor, root_rank=0, name=None): return tensor
def broadcast_object(obj, root_rank=0, name=None): return obj
def broadcast_parameters(params, root_rank=0): pass
def broadcast_optimizer_state(optimizer, root_rank=0): pass
def join(device=-1): return 0
def barrier(): pass
class Average: pass
class Sum: pass
class Adasum: pass
'''


DLLOGGER = '''"""Stand-in for NVIDIA's dllogger (installed from git only): prints each log."""
import enum, json
class Verbosity(enum.IntEnum):
    OFF = -1
    DEFAULT = 0
    VERBOSE = 1
class Backend:
    def __init__(self, verbosity=Verbosity.DEFAULT, *args, **kwargs): self.verbosity = verbosity
class StdOutBackend(Backend): pass
class JSONStreamBackend(Backend): pass
def init(backends=()): pass
def metadata(name, meta): pass
def log(step, data, verbosity=Verbosity.DEFAULT):
    print("DLL", step, json.dumps({k: str(v) for k, v in data.items()}), flush=True)
def flush(): pass
'''


WANDB = '''"""Stand-in for wandb: the applications pin wandb 0.12.8, which imports
``np.float_`` (gone in NumPy 2).  They call it only with ``--wandb``, off in
these runs; a run that turns it on is told so."""
__version__ = "0.12.8+poptorchsim-stand-in"
class Settings:
    def __init__(self, *args, **kwargs): pass
def init(*args, **kwargs):
    raise RuntimeError("wandb is a stand-in here (graphcore_apps.py): install a wandb that "
                       "imports under NumPy 2 and pass it with --deps to log to it")
config = {}
run = None
def log(*args, **kwargs): pass
def finish(*args, **kwargs): pass
'''


def make_stand_ins(directory):
    """Writes the stand-in modules under ``directory``; returns it."""
    hvd = Path(directory) / "horovod"
    hvd.mkdir(parents=True, exist_ok=True)
    (hvd / "__init__.py").write_text('__version__ = "0.24.3+poptorchsim-stand-in"\n')
    (hvd / "torch.py").write_text(HOROVOD_TORCH)
    (Path(directory) / "dllogger.py").write_text(DLLOGGER)
    (Path(directory) / "wandb.py").write_text(WANDB)
    return directory


# --- success criteria: (output, return code, steps) -> (passed, note) ----------------

def pytest_passed(n):
    def check(out, rc, steps):
        m = re.search(r"(\d+) passed", out)
        failed = re.search(r"(\d+) (failed|error)", out)
        ok = rc == 0 and m is not None and int(m.group(1)) == n and not failed
        return ok, (f"{m.group(0) if m else 'no test passed'}"
                    + (f", {failed.group(0)}" if failed else "") + f" (of {n})")
    return check


def max_throughput(out, rc, steps):
    """cnns tests/test_inference.py: ``get_max_thoughput(out) > 0``."""
    if "throughput:" not in out:
        return False, "no throughput line"
    value = float(out[out.find("max:") + 4:].split(",")[0][:-7])
    return rc == 0 and value > 0, f"max throughput {value:.1f} samples/s (simulated IPU)"


def vit_pretrain(out, rc, steps):
    """vit test_vit.py test_pretraining_loss: at ``Step: 4/``, acc < 1 and loss < 15."""
    for line in out.splitlines():
        if f"Step: {steps - 1}/" in line:
            loss = float(re.findall(r"loss:\s+([\d\.]+)", line)[0])
            acc = float(re.findall(r"accuracy:\s+([\d\.]+)", line)[0])
            return (rc == 0 and acc < 1 and loss < 15,
                    f"step {steps - 1}: loss {loss:.3f}, accuracy {acc:.3f}")
    return False, f"no 'Step: {steps - 1}/' line"


def bert_tiny(out, rc, steps):
    """bert tests/bert_tiny_test.py: loss falls, mlm_acc rises, mean mlm_acc of the last
    10 > 0.85."""
    # per line, the last match, as the test's greedy re.match(r".*(loss: ([\d.]+)).*") takes
    losses = [float(m.group(2)) for m in map(re.compile(r".*(loss: ([\d.]+)).*").match,
                                               out.split("\n")) if m]
    accs = [float(m.group(2)) for m in map(re.compile(r".*(mlm_acc: ([\d.]+)).*").match,
                                             out.split("\n")) if m]
    if not losses or not accs:
        return False, "no loss / mlm_acc lines"
    import numpy as np
    falls = losses[-1] < losses[0] and np.diff(losses).mean() < 0
    rises = accs[-1] > accs[0] and np.diff(accs).mean() > 0
    last = float(np.mean(accs[-10:]))
    return rc == 0 and falls and rises and last > 0.85, \
        f"loss {losses[0]:.2f} -> {losses[-1]:.2f}, mean mlm_acc (last 10) {last:.3f}"


def steps_seen(pattern):
    """Programs with no step limit: stopped once ``steps`` steps have run;
    passes when they did, with no error before."""
    def check(out, rc, steps):
        seen = len(set(re.findall(pattern, out)))     # a step's line may be printed twice
        return seen >= steps and "Traceback" not in out, f"{seen} training steps ran"
    return check


# one match per training step in each program's own output
CONFORMER_STEP = r"Epochs: \d+/\d+, step: \d+/"                # src/trainer.py, every step
FASTPITCH_STEP = r"(?m)^step:\s+\d+$|\bstep \d+ num_frame"      # train.py: 4 of 5, the 5th
TQDM_STEP = r"Accuracy:[\d.]+%[^\r\n]*?\|\s*([1-9]\d*)/\d+ \["       # cnns train.py's progress bar


@dataclass
class App:
    name: str
    cwd: str                     # under --examples
    args: list                   # after `python -m poptorchsim.run`
    check: object
    timeout: int = 900
    steps_flag: str = None       # the program's own option for steps, set from --steps
    default_steps: int = None
    stop_after: str = None       # a regex counted in the output: stop at --steps matches
    known: str = ""              # why it cannot run here, when it cannot
    env: dict = field(default_factory=dict)


def pytest_app(name, cwd, target, n, **kw):
    return App(name, cwd, ["-m", "pytest", "-q", "-p", "no:cacheprovider", "-W", "ignore", target],
               pytest_passed(n), **kw)


APPS = [
    pytest_app("gpt2-cpu-ipu", "nlp/gpt2/pytorch/tests", "cpu_ipu_test.py", 1),
    pytest_app("gpt2-loss-serialize", "nlp/gpt2/pytorch/tests", "loss_seralize_test.py", 1),
    pytest_app("clip-cpu-ipu", "multimodal/CLIP/pytorch/tests", "cpu_ipu_test.py", 1, timeout=1500),
    pytest_app("conformer-forward-grad", "speech/conformer/pytorch",
               "tests/test_forward_grad.py", 3),
    App("conformer-train", "speech/conformer/pytorch",
        ["main.py", "train", "--train_dataset.use_generated_data", "true",
         "--trainer.num_epochs", "1", "--ipu_options.gradient_accumulation", "1",
         "--train_iterator.batch_size", "1", "--train_iterator.num_workers", "1"],
        steps_seen(CONFORMER_STEP), default_steps=2, stop_after=CONFORMER_STEP,
        known="its encoder and decoder layers call the RemapCE custom op, loaded from "
              "./custom_ops.so, a C++ PopART op built against Poplar's headers"),
    pytest_app("fastpitch-layers", "speech/fastpitch/pytorch", "tests/test_layers.py", 3),
    App("fastpitch-train", "speech/fastpitch/pytorch",
        ["train.py", "--checkpoint-dir", "{tmp}", "--epochs", "1", "--learning-rate", "0.1",
         "--batch-size", "2", "--dur-predictor-loss-scale", "0.1", "--pitch-predictor-loss-scale",
         "0.1", "--gradient-accumulation", "4", "--replication-factor", "1",
         "--num-dataloader-workers", "2", "--generated-data"],
        steps_seen(FASTPITCH_STEP), default_steps=3, stop_after=FASTPITCH_STEP, timeout=1200),
    App("cnns-train-resnet18", "vision/cnns/pytorch",
        ["train/train.py", "--data", "synthetic", "--model", "resnet18", "--epoch", "1",
         "--precision", "16.16", "--validation-mode", "none", "--optimizer", "sgd_combined",
         "--lr", "0.001",
         "--gradient-accumulation", "64", "--micro-batch-size", "1", "--dataloader-worker", "4",
         "--seed", "0"],
        steps_seen(TQDM_STEP), default_steps=2, stop_after=TQDM_STEP,
        timeout=1500),
    App("cnns-inference-pipelined", "vision/cnns/pytorch",
        ["inference/run_benchmark.py", "--data", "synthetic", "--micro-batch-size", "2", "--model",
         "resnet18", "--pipeline-splits", "layer3/0", "--device-iterations", "4", "--precision",
         "16.16", "--iterations", "10", "--dataloader-worker", "4", "--random-weights"],
        max_throughput, steps_flag="--iterations", default_steps=10),
    App("vit-pretrain", "vision/vit/pytorch",
        ["pretrain.py", "--micro-batch-size", "8", "--config", "b16_in1k_pretrain",
         "--gradient-accumulation", "8", "--training-steps", "5", "--epochs", "0",
         "--replication-factor", "2", "--iterations", "2", "--dataset", "generated",
         "--dataloader-workers", "2"],
        vit_pretrain, steps_flag="--training-steps", default_steps=5, timeout=3600),
    # the same program and config at 8 images a step (the test's takes 128: about 13
    # minutes a step on 2 cores), so that it runs in minutes
    App("vit-pretrain-small", "vision/vit/pytorch",
        ["pretrain.py", "--micro-batch-size", "1", "--config", "b16_in1k_pretrain",
         "--gradient-accumulation", "8", "--training-steps", "2", "--epochs", "0",
         "--replication-factor", "1", "--iterations", "2", "--dataset", "generated",
         "--dataloader-workers", "2", "--rebatched-worker-size", "8"],
        vit_pretrain, steps_flag="--training-steps", default_steps=2, timeout=1200),
    App("bert-tiny", "nlp/bert/pytorch",
        ["run_pretraining.py", "--config", "demo_tiny_128", "--training-steps", "360",
         "--custom-ops", "false", "--disable-progress-bar", "true"],
        bert_tiny, steps_flag="--training-steps", default_steps=360, timeout=3600),
]


def command(app, steps, tmp):
    args = [a.replace("{tmp}", tmp) for a in app.args]
    if steps is not None and app.steps_flag:
        args[args.index(app.steps_flag) + 1] = str(steps)
    return [sys.executable, "-m", "poptorchsim.run", *args]


def run(app, cwd, cmd, env, steps, timeout):
    """(output, return code): the program's stdout and stderr together,
    stopped (its whole process group) at the timeout or once
    ``app.stop_after`` has matched ``steps`` times."""
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, start_new_session=True)
    out, deadline, stopped = [], time.monotonic() + timeout, None
    os.set_blocking(proc.stdout.fileno(), False)
    while True:
        chunk = proc.stdout.read()
        if chunk:
            out.append(chunk.decode("utf-8", "replace"))
        done = proc.poll() is not None
        if done and not chunk:
            break
        text = "".join(out)
        if app.stop_after and steps and len(set(re.findall(app.stop_after, text))) >= steps:
            stopped = f"stopped after {steps} steps"
        elif time.monotonic() > deadline:
            stopped = f"timed out after {timeout} s"
        if stopped and not done:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            break
        time.sleep(0.5)
    text = "".join(out)
    rc = proc.returncode
    if stopped and stopped.startswith("stopped"):
        rc = 0
    if stopped:
        text += f"\n[graphcore_apps] {stopped}\n"
    return text, rc, stopped


def last_error(out):
    lines = [line for line in out.splitlines()
             if re.match(r"^(\w+\.)*\w*(Error|Exception)\b", line)]
    return lines[-1][:160] if lines else ""


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--examples", required=True, help="a checkout of graphcore/examples")
    p.add_argument("--only", action="append", choices=[a.name for a in APPS],
                   help="run this application only (may be repeated)")
    p.add_argument("--steps", type=int, default=None,
                   help="steps (iterations) for the applications that take them")
    p.add_argument("--timeout", type=int, default=None, help="seconds per application")
    p.add_argument("--deps", action="append", default=[], metavar="NAME=DIR[:DIR]",
                   help="PYTHONPATH entries for one application (NAME, or its prefix: gpt2)")
    p.add_argument("--deps-all", default="", metavar="DIR[:DIR]",
                   help="PYTHONPATH entries for every application")
    p.add_argument("--log-dir", default=None, help="write each application's output here")
    args = p.parse_args(argv)

    examples = Path(args.examples)
    if not examples.is_dir():
        print(f"graphcore_apps: no checkout of graphcore/examples at {examples}: skipped "
              f"(git clone https://github.com/graphcore/examples)")
        return 0
    deps = {}
    for item in args.deps:
        name, _, path = item.partition("=")
        deps[name] = path
    apps = [a for a in APPS if not args.only or a.name in args.only]
    rows = []
    with tempfile.TemporaryDirectory(prefix="graphcore-apps-") as tmp:
        shims = make_stand_ins(os.path.join(tmp, "stand-ins"))
        for app in apps:
            cwd = examples / app.cwd
            steps = args.steps if args.steps is not None else app.default_steps
            cmd = command(app, steps if app.steps_flag else None, tmp)
            shown = "python -m poptorchsim.run " + " ".join(cmd[3:])
            if not cwd.is_dir():
                rows.append((app.name, shown, f"SKIPPED: {app.cwd} not in the checkout", 0.0))
                continue
            own = [v for k, v in deps.items() if app.name.startswith(k)]
            path = [*own, args.deps_all, shims, str(ROOT), os.environ.get("PYTHONPATH", "")]
            env = dict(os.environ, PYTHONPATH=os.pathsep.join(x for x in path if x),
                       WANDB_MODE="disabled", **app.env)
            print(f"== {app.name}: (cd {app.cwd} && {shown})", flush=True)
            t0 = time.monotonic()
            out, rc, stopped = run(app, cwd, cmd, env, steps, args.timeout or app.timeout)
            minutes = (time.monotonic() - t0) / 60
            if args.log_dir:
                Path(args.log_dir).mkdir(parents=True, exist_ok=True)
                (Path(args.log_dir) / f"{app.name}.log").write_text(out)
            try:
                ok, note = app.check(out, rc, steps)
            except Exception as e:  # noqa: BLE001 - an unparsable output is a failure, said so
                ok, note = False, f"could not parse the output ({e})"
            if not ok:
                error = last_error(out)
                note += f"; {error}" if error else ""
                note += f"; {stopped}" if stopped and stopped.startswith("timed") else ""
                if app.known:
                    note += f"; cannot run here: {app.known}"
            rows.append((app.name, shown, ("PASS: " if ok else "FAIL: ") + note, minutes))
            print(f"   {rows[-1][2]} ({minutes:.1f} min)", flush=True)
    print("\n| application | command | result | minutes |\n| --- | --- | --- | --- |")
    for name, shown, result, minutes in rows:
        print(f"| {name} | `{shown}` | {result} | {minutes:.1f} |")
    return 0 if all(r[2].startswith(("PASS", "SKIPPED")) for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
