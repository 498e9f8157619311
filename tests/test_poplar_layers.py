"""The estimate against Poplar's own IPU Model figures, layer by layer
(``poptorchsim.validation``; benchmarks/poplar_layers.py prints every row).

Guards the summary against regressions: per kind, the median cycle error
and the share of rows within 0.8-1.25 may not fall behind what they are
now, and memory not either.  Values, not time.  The held-out rows
(ResNet-50, VGG-16, AlexNet) are not in the data file.
"""
import json

import pytest

from poptorchsim import validation
from poptorchsim.__main__ import main

# kind -> (cycles: median error at most, share in 0.8-1.25 at least,
#          total memory: median error at most)
BOUNDS = {
    "conv": (0.06, 0.97, 0.30),
    "depthwise": (0.15, 0.75, 0.80),
    "fc": (0.10, 0.65, 0.15),
    "gemm": (0.06, 0.95, 0.25),
    "lstm": (0.08, 0.95, 0.40),
    "gru": (0.10, 0.70, 0.35),
    "pool": (0.12, 0.85, 0.40),
    "reduce": (0.10, 0.75, 0.75),
    # the embedding tool's multiUpdateAdd plans hold more than we model
    "embedding": (0.25, 1.00, 1.30),
    # the bars for cycles: median error at most 10%, at least 85% of
    # rows within 0.8-1.25
    "all": (0.08, 0.85, 0.28),
}


@pytest.fixture(scope="module")
def rows():
    return validation.compare()


def test_the_reference_is_poplars_table_without_the_held_out_rows():
    ref = validation.reference()
    assert ref["source"]["commit"] == "8dcde1ec43c7463babb57c1cc3800d0ae4076078"
    assert ref["source"]["target"] == "IpuModel2"
    names = [r["name"] for r in ref["rows"]]
    assert len(names) == len(set(names)) == 174
    assert not [n for n in names if n.startswith(("resnet50_", "vgg16_", "alexnet_"))]
    assert all(r["cycles"] > 0 and r["total_memory"] > 0 and r["max_tile_memory"] > 0
               for r in ref["rows"])


def test_the_summary_per_kind_holds(rows):
    got = {s.kind: s for s in validation.summarize(rows)}
    assert set(got) == set(BOUNDS)
    failed = []
    for kind, (cycles_error, within, memory_error) in BOUNDS.items():
        s = got[kind]
        if s.cycles_median_error > cycles_error or s.cycles_within < within \
                or s.total_median_error > memory_error:
            failed.append(f"{kind}: cycles median error {s.cycles_median_error:.0%} "
                          f"(at most {cycles_error:.0%}), within {s.cycles_within:.0%} "
                          f"(at least {within:.0%}), memory {s.total_median_error:.0%} "
                          f"(at most {memory_error:.0%})")
    assert not failed, "\n".join(failed)


def test_no_row_is_off_by_more_than_2_5x(rows):
    far = [f"{r.name}: {r.cycle_ratio:.2f}x" for r in rows if validation.error(r.cycle_ratio) > 1.5]
    assert not far, far


def test_every_row_beyond_2x_is_named_with_its_reason(rows):
    """The issue's bar: no row beyond 2x, or each such row named with its
    reason (``validation.OUTLIERS``, printed beside the row)."""
    far = {r.name for r in rows if validation.error(r.cycle_ratio) > 1.0}
    assert far <= set(validation.OUTLIERS), far - set(validation.OUTLIERS)
    named = {r.name: r for r in rows if r.name in validation.OUTLIERS}
    assert all(validation.OUTLIERS[n] in r.note for n, r in named.items())


def test_the_depthwise_backward_is_no_longer_hundreds_of_thousands_of_cycles(rows):
    """The issue's example: a depthwise layer's whole training step is
    12,000-40,000 cycles in Poplar; its backward alone was 640,000 here."""
    depthwise = [r for r in rows if r.kind == "depthwise"]
    assert depthwise and all(r.cycles < 3 * r.poplar_cycles for r in depthwise)


def test_error_is_symmetric():
    assert validation.error(2.0) == validation.error(0.5) == 1.0
    assert validation.error(1.0) == 0.0
    assert validation.error(0.0) == float("inf")


def test_a_layer_is_rebuilt_from_its_command_line():
    row = {"name": "x", "kind": "conv", "tool": "single_conv_layer",
           "params": "--field {15,20} --kernel-size {5,3} --input-channels 2 "
                     "--output-channels 8 --batch-size 3 --padding-lower 1 --stride 2 --bias 0"}
    from poptorchsim.validation.layers import build
    layer = build(row)
    conv = layer.module.layer.conv
    assert tuple(conv.kernel_size) == (5, 3) and conv.stride == (2, 2)
    assert (conv.in_channels, conv.out_channels) == (2, 8)
    assert tuple(layer.inputs[0].shape) == (3, 2, 15, 20) and layer.training


def test_the_cli_prints_the_summary(capsys):
    assert main(["validate", "--kinds", "reduce,pool"]) == 0
    out = capsys.readouterr().out
    assert "IpuModel2" in out and "reduce" in out and "pool" in out and "all" in out
    assert "cycles: median err" in out


def test_the_cli_refuses_an_unknown_kind(capsys):
    assert main(["validate", "--kinds", "attention"]) == 2
    assert "unknown kind(s) attention" in capsys.readouterr().err


def test_rows_serialise(rows, tmp_path):
    from dataclasses import asdict
    path = tmp_path / "rows.json"
    path.write_text(json.dumps([asdict(r) for r in rows[:3]]))
    assert json.loads(path.read_text())[0]["poplar_cycles"] > 0


def test_a_matrix_product_pays_for_rearranging_operands_it_does_not_take_as_laid_out():
    """Poplar's planner charges copies and exchange to rearrange operands
    (addTransformCycleEstimate): a matrix product expects its operands
    swapped; channels that do not fill the vertex's groups are padded."""
    from poptorchsim.estimate.conv_plan import Conv, _transforms
    mm = Conv.matmul(1, 256, 512, 1024, 2, 4)
    copy, exchange, steps, temp = _transforms(mm, "AMP", 16, 8, 16, 1024, 1024)
    assert steps == 2 and copy > 0 and exchange > 0 and temp > 0
    swapped = mm.swapped()
    assert _transforms(swapped, "AMP", 16, 8, 16, swapped.cout, 1024) == (0, 0, 0, 0)
    # swapped, 5 rows become 5 output channels, padded to 8: the weights and
    # the output are rearranged
    odd = Conv.matmul(1, 5, 512, 1024, 2, 4).swapped()
    assert odd.cout == 5 and _transforms(odd, "AMP", 16, 8, 16, 5, 64)[2] == 2


def test_the_recurrent_rows_are_rebuilt_as_popnns_cells():
    """gru_layer runs popnn's GRU with resetAfter false (PyTorch's nn.GRU is
    the reset-after cell); lstm_layer runs popnn's LSTM without precomputing
    the input products (nn.LSTM precomputes them).  Each row is rebuilt as
    popnn's cell."""
    from poptorchsim.validation.layers import build
    row = next(r for r in validation.reference()["rows"] if r["kind"] == "gru")
    layer = build(row)
    body = layer.module.layer if hasattr(layer.module, "layer") else layer.module
    assert type(body).__name__ == "_GRUResetBefore"
    assert body.gates.out_features == 2 * body.outputs
    assert body.candidate.in_features == body.gates.in_features
    # LSTM: preCalcWeights false, one product of [x, h] per step for all gates
    row = next(r for r in validation.reference()["rows"] if r["kind"] == "lstm")
    body = build(row).module
    body = body.layer if hasattr(body, "layer") else body
    assert type(body).__name__ == "_LSTMCellLoop" and body.gates.out_features == 4 * body.outputs


def test_a_plan_says_what_it_rearranges():
    """getIR() prints each op's plan: what the plan charges for rearranging
    operands is named there too."""
    from poptorchsim.estimate.conv_plan import Conv, plan
    odd = plan(Conv.matmul(1, 5, 512, 1024, 2, 4), 1472, 0.6 * 638_976, 150)
    assert "rearranged" in odd.describe() and "conv units" in odd.describe()


def test_max_tile_of_a_tool_without_ipu_code_counts_no_code(rows):
    """reduce_op compiled no IPU code: its rows' fullest tile is data alone,
    below the runtime code we charge every tile of a real program."""
    from poptorchsim.estimate.targets import MK2
    reduce_rows = [r for r in rows if r.kind == "reduce"]
    assert reduce_rows and all(r.max_tile < MK2.code_bytes_per_tile for r in reduce_rows)


def test_depthwise_groups_combine_into_the_amp_units_channels():
    """combineConvGroups: a depthwise layer's groups fill the AMP unit's
    channels (block-diagonal weights), and the plan says so."""
    from poptorchsim.estimate.conv_plan import Conv, plan
    dw = Conv.forward(128, 4, 1, 1, 56, 56, 3, 3, 1, 1, 1, 2, 4)
    assert dw.combine_factors() == (4, 8, 16)
    assert Conv.forward(128, 4, 4, 4, 56, 56, 3, 3, 1, 1, 1, 2, 4).combine_factors() == ()
    combined = dw.combined(8)
    assert (combined.groups, combined.cin, combined.cout) == (16, 8, 8)
    assert combined.macs == 8 * dw.macs           # the zeros of the block diagonal
    p = plan(dw.input_grad(4, 56, 56), 1472, 0.6 * 638_976, 150)
    assert "groups combined" in p.describe() and "input, weights, output rearranged" in \
        p.describe()


def test_an_input_gradient_with_one_channel_folds_its_columns_into_channels():
    """outChanFlattenDims: conv_5x200's input gradient has one output channel
    and a kernel wider than its input; its output columns become channels."""
    from poptorchsim.estimate.conv_plan import Conv, plan
    fwd = Conv.forward(1, 1440, 1, 100, 15, 200, 5, 200, 1, 0, 0, 2, 4)
    bwd = fwd.input_grad(1440, 15, 200)
    flat = bwd.out_flattened()
    assert (flat.cout, flat.cols, flat.kw) == (200, 1440, 1) and flat.macs == bwd.macs
    p = plan(bwd, 1472, 0.6 * 638_976, 150)
    assert "output columns as channels" in p.describe()
    # a convolution whose input is wider than its kernel has no such candidate
    assert not Conv.forward(1, 4, 16, 16, 56, 56, 3, 3, 1, 1, 1, 2, 4) \
        .input_grad(4, 56, 56).flat_batch


def test_the_horizontal_mac_is_a_candidate_for_every_convolution():
    """A depthwise layer's weight update reduces over thousands of positions
    to one output channel per group: the horizontal MAC, not an AMP unit
    padding that channel to 8 (ConvVertexType.cpp offers it for any
    convolution)."""
    from poptorchsim.estimate.conv_plan import Conv, plan
    wu = Conv.forward(128, 4, 1, 1, 56, 56, 3, 3, 2, 1, 1, 2, 4).weight_grad()
    assert wu.cin >= 16
    assert plan(wu, 1472, 0.6 * 638_976, 150).vertex == "HMAC"


def test_the_field_is_split_where_it_leaves_a_tile_less_halo():
    """conv_5x200's input gradient, its columns folded into channels, has 15
    rows under a 5-row kernel and 1,440 columns: split by rows, each tile
    would hold five times its input rows."""
    from poptorchsim.estimate.conv_plan import Conv, plan
    bwd = Conv.forward(1, 1440, 1, 100, 15, 200, 5, 200, 1, 0, 0, 2, 4).input_grad(1440, 15, 200)
    p = plan(bwd.out_flattened(), 1472, 0.6 * 638_976, 150)
    assert p.live_bytes < 200_000, p.describe()
