"""Shared models and helpers for the poptorchsim test suite.

The reference for every numerics test is plain PyTorch on a deep copy of the
model, fed the same combined batch in PopTorch's layout
``[deviceIterations, gradientAccumulation, replicationFactor, micro_batch, ...]``:
each device iteration is one optimizer step whose gradient is the mean over
the ``ga * rf`` micro-batches' gradients.
"""
import contextlib
import copy
import logging
import os

# the IR verifier runs after every compiler pass in the test suite (and in
# the programs tests start)
os.environ.setdefault("POPTORCHSIM_VERIFY_PASSES", "1")
# under pytest-xdist each worker computes with one thread (and so do the
# programs tests start): two workers of two threads each on two cores stall
# one another, several times slower than one thread each
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest
import torch
from torch import nn

if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

# the helpers users have too (poptorchsim.testing), under the names the tests import
from poptorchsim.testing import (  # noqa: E402,F401 - re-exported for the tests
    ATOL,
    RTOL,
    assert_state_close,
    quiet_options,
    reference_call,
    reference_train,
    to_layout,
)


class LogRecords(logging.Handler):
    """Keeps what a logger emits while attached: messages and level names."""

    def __init__(self):
        super().__init__()
        self.messages, self.levels = [], []

    def emit(self, record):
        self.messages.append(record.getMessage())
        self.levels.append(record.levelname)

    @property
    def text(self):
        return "".join(self.messages)


@contextlib.contextmanager
def poptorchsim_log(level=logging.DEBUG):
    """A ``LogRecords`` of what the ``poptorchsim`` logger emits at ``level``
    while the block runs (its handlers and level restored after)."""
    records, log = LogRecords(), logging.getLogger("poptorchsim")
    saved = log.level
    log.addHandler(records)
    log.setLevel(level)
    try:
        yield records
    finally:
        log.removeHandler(records)
        log.setLevel(saved)


# ---------------------------------------------------------------------------
# Models
# ---------------------------------------------------------------------------
class ClassifierWithLoss(nn.Module):
    """Two linear layers and a CrossEntropyLoss; returns (output, loss).

    Without a target it returns the logits alone (for inference)."""

    def __init__(self, in_features=6, hidden=8, classes=4):
        super().__init__()
        self.fc1 = nn.Linear(in_features, hidden)
        self.act = nn.ReLU()
        self.fc2 = nn.Linear(hidden, classes)
        self.loss = nn.CrossEntropyLoss()

    def forward(self, x, target=None):
        out = self.fc2(self.act(self.fc1(x)))
        if target is None:
            return out
        return out, self.loss(out, target)


class RegressorWithLoss(nn.Module):
    """A single Linear layer and an MSELoss; returns (output, loss)."""

    def __init__(self, in_features=10, out_features=10):
        super().__init__()
        self.fc = nn.Linear(in_features, out_features)
        self.loss = nn.MSELoss()

    def forward(self, x, target=None):
        out = self.fc(x)
        if target is None:
            return out
        return out, self.loss(out, target)


class BatchNormWithLoss(nn.Module):
    """Linear -> BatchNorm1d -> ReLU -> Linear with an MSELoss."""

    def __init__(self, in_features=6, hidden=8, out_features=3):
        super().__init__()
        self.fc1 = nn.Linear(in_features, hidden)
        self.bn = nn.BatchNorm1d(hidden)
        self.fc2 = nn.Linear(hidden, out_features)
        self.loss = nn.MSELoss()

    def forward(self, x, target=None):
        out = self.fc2(torch.relu(self.bn(self.fc1(x))))
        if target is None:
            return out
        return out, self.loss(out, target)


# ---------------------------------------------------------------------------
# Data
# ---------------------------------------------------------------------------
def classification_batch(n, in_features=6, classes=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, in_features, generator=g)
    y = torch.randint(0, classes, (n,), generator=g)
    return x, y


def regression_batch(n, in_features=6, out_features=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, in_features, generator=g)
    y = torch.randn(n, out_features, generator=g)
    return x, y


# ---------------------------------------------------------------------------
# Comparisons
# ---------------------------------------------------------------------------
def snapshot(model):
    """A detached copy of the model's state_dict."""
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def assert_unchanged(model, before):
    after = model.state_dict()
    assert after.keys() == before.keys()
    for name, value in before.items():
        assert torch.equal(after[name], value), f"{name} changed"


def assert_optimizer_state_close(actual_opt, actual_model, expected_opt, expected_model,
                                 rtol=RTOL, atol=ATOL):
    """Every state entry of the reference optimizer matches, parameter by parameter."""
    actual_params = dict(actual_model.named_parameters())
    expected_params = dict(expected_model.named_parameters())
    for name, p_ref in expected_params.items():
        ref_state = expected_opt.state[p_ref]
        got_state = actual_opt.state[actual_params[name]]
        assert ref_state, f"reference has no state for {name}"
        for key, value in ref_state.items():
            assert key in got_state, f"{name}: optimizer state lacks {key!r}"
            got = got_state[key]
            if isinstance(value, torch.Tensor):
                got = torch.as_tensor(got, dtype=value.dtype)
                torch.testing.assert_close(got, value, rtol=rtol, atol=atol,
                                           msg=lambda m, n=name, k=key: f"{n}/{k}: {m}")
            else:
                assert float(got) == pytest.approx(float(value)), f"{name}/{key}"


@pytest.fixture
def options():
    return quiet_options()


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield


def clone_model(model):
    return copy.deepcopy(model)
