"""``benchmarks/graphcore_apps.py``: the criteria it reads from Graphcore's
applications' output, the stand-ins it writes, and that it skips cleanly
without a checkout.  (Running the applications takes minutes each: the
benchmark itself does that.)"""
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import graphcore_apps as apps  # noqa: E402 - after the sys.path insert above


def test_no_checkout_is_skipped_with_a_message(tmp_path):
    result = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "graphcore_apps.py"),
                             "--examples", str(tmp_path / "absent")],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and "no checkout of graphcore/examples" in result.stdout


def test_criteria_read_as_the_applications_tests_read_them():
    bert = "".join(f"step {i} loss: {5 - i * 0.01:.3f} mlm_acc: {0.5 + i * 0.01:.3f}\n"
                   for i in range(45))
    ok, note = apps.bert_tiny(bert, 0, 360)
    assert ok and "mean mlm_acc (last 10) 0.895" in note
    assert not apps.bert_tiny(bert.replace("mlm_acc: 0.9", "mlm_acc: 0.1"), 0, 360)[0]
    line = ("Step: 2 / 9 - LR: 1.00e-03 - total loss: 10.609 - mlm_loss: 9.909 - nsp_loss: 0.699"
            " - mlm_acc: 0.066 % - nsp_acc: 0.562 %:  throughput: 13.8 samples/sec\n")
    # as the test reads it
    assert apps.bert_tiny(line * 2, 0, 2)[1].startswith("loss 0.70 -> 0.70")
    assert apps.max_throughput("throughput: 9.0 samples/sec (mean) (min: 2.0523179482405527, "
                               "max: 16.147431768165006, std: 5.3)", 0, 10)[0]
    vit = "Epoch: 0.00/1 Step: 1/2 Lr: 0.0 loss: 6.500 accuracy: 0.000 %throughput: 0.16"
    assert apps.vit_pretrain(vit, 0, 2) == (True, "step 1: loss 6.500, accuracy 0.000")
    assert not apps.vit_pretrain(vit, 0, 5)[0]
    assert apps.pytest_passed(3)("3 passed in 4.0s", 0, None)[0]
    assert not apps.pytest_passed(3)("1 failed, 2 passed in 4.0s", 1, None)[0]


def test_step_patterns_count_each_step_once():
    bar = ("Loss:7.06 | Accuracy:0.00%:   1%|   | 1/100 [00:07<12:33]\r"
           "Loss:7.04 | Accuracy:0.00%:   1%|   | 1/100 [00:14<12:33]\r"
           "Lowering: :  40%|████      | 2/5 [00:00]\r"
           "Loss:7.04 | Accuracy:0.00%:   2%|   | 2/100 [00:14<11:49]\n")
    assert apps.steps_seen(apps.TQDM_STEP)(bar, 0, 2) == (True, "2 training steps ran")
    fastpitch = "samples_per_step 8\nlr 0.1 epoch 1 step 1 num_frame 3\nstep:  1\nstep:  2\n"
    assert apps.steps_seen(apps.FASTPITCH_STEP)(fastpitch, 0, 3)[0]
    assert not apps.steps_seen(apps.FASTPITCH_STEP)(fastpitch + "Traceback (most", 0, 3)[0]


def test_stand_ins_import(tmp_path):
    apps.make_stand_ins(tmp_path)
    code = ("import horovod.torch as hvd, dllogger; hvd.init(); "
            "assert hvd.size() == 1 and hvd.rank() == 0 and hvd.allreduce(3) == 3; "
            "dllogger.init(backends=[dllogger.StdOutBackend(dllogger.Verbosity.VERBOSE)]); "
            "dllogger.log(step=1, data={'loss': 2})")
    result = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert 'DLL 1 {"loss": "2"}' in result.stdout
