"""Calibration from Poplar's own cycle estimators (issue 13 part 3): a
convolution pays ConvPartialnx1's supervisor code and one worker run per
kernel position and channel group on every tile that holds it; an exchange
pays its set-up; every constant has a source; the seed's remote-variables
table keeps its order (docs/cost_model.md)."""
import sys

import pytest
import torch
from conftest import quiet_options
from torch import nn

import poptorchsim
from poptorchsim.estimate import constants as K
from poptorchsim.estimate.cost import _kernel_positions, exchange_cycles, op_cost
from poptorchsim.estimate.targets import MK2


def _conv_op(cin, cout, k, hw=32, batch=4):
    model = nn.Conv2d(cin, cout, k)
    im = poptorchsim.inferenceModel(model, quiet_options())
    im.compile(torch.randn(batch, cin, hw, hw))
    c = im._compiled
    graph = c.program.graphs["inference_forward"]
    op = next(op for op in graph.ops if op.cost_class == "conv")
    return op, c.target


def test_every_constant_has_a_source_and_unit():
    for c in K.REGISTRY.values():
        assert c.source and c.unit, c.name
        assert c.kind in ("hardware", "poplibs", "estimate", "fitted"), c.name
    # the fitted ones are few, and named
    assert {c.name for c in K.REGISTRY.values() if c.kind == "fitted"} == {
        "HOST_COPY_LATENCY_S", "CALL_OVERHEAD_S", "code_bytes_per_tile"}


def test_kernel_positions_follow_convpartialnx1():
    op, _ = _conv_op(5, 12, 5)
    assert _kernel_positions(op) == 25           # 5 input channels: one kernel row at a time
    op, _ = _conv_op(1, 5, 3)
    # 1 channel: kernel rows go 2 at a time (weight heights are 1, 2 or 4): 2 x 3
    assert _kernel_positions(op) == 6
    op, _ = _conv_op(16, 16, 1)
    assert _kernel_positions(op) == 1


def test_small_convolution_pays_a_worker_run_per_kernel_position():
    # 5 -> 12 channels, 5x5: the AMP vertex's fixed costs per kernel
    # position dominate such a small convolution, as on an IPU
    from poptorchsim.estimate.conv_plan import Conv, plan
    small = Conv.forward(1, 1, 5, 12, 28, 28, 5, 5, 1, 0, 0, 4, 4)
    p = plan(small, MK2.tiles, 0.6 * MK2.bytes_per_tile, MK2.sync_cycles)
    assert p.compute > 2 * small.macs / (p.tiles * MK2.amp_macs_fp32)
    wider = plan(Conv.forward(1, 1, 5, 12, 28, 28, 5, 1, 1, 0, 0, 4, 4), MK2.tiles,
                 0.6 * MK2.bytes_per_tile, MK2.sync_cycles)
    assert p.compute > wider.compute


def test_a_1x1_convolution_is_a_flattened_1x1_vertex():
    from poptorchsim.estimate.conv_plan import Conv
    c = Conv.forward(1, 4, 16, 16, 28, 28, 1, 1, 1, 0, 0, 2, 4)
    assert (c.rows, c.cols) == (1, 4 * 28 * 28)
    op, target = _conv_op(16, 16, 1)
    assert "AMP" in op_cost(op, target).plan


def test_an_exchange_pays_its_setup():
    assert exchange_cycles(0, MK2) == 0
    assert exchange_cycles(4, MK2) == pytest.approx(
        K.EXCHANGE_SETUP_CYCLES + 4 / (4 * K.EXCHANGE_EFFICIENCY))


def test_seed_remote_variables_order():
    sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[1]
                           / "benchmarks"))
    import fidelity
    rows = []
    for name, threshold, on_chip, published in fidelity.REMOTE_CASES:
        tm, n = fidelity.remote_variables(threshold, on_chip)
        rows.append({"config": f"seed remote variables: {name}",
                     "estimated": n / tm.cycleEstimate()["seconds"], "published": published})
    assert fidelity.remote_order_matches(rows)
