"""``torch.ops.poptorch`` as a library: PopTorch's operators with its
schemas, registered when poptorchsim is imported (skipped with a note where
another library owns the namespace), usable eagerly and under ``make_fx``
with fake tensors."""
import logging

import pytest
import torch
from conftest import LogRecords
from torch.fx.experimental.proxy_tensor import make_fx

import poptorchsim as poptorch
from poptorchsim._api import op_library

P = torch.ops.poptorch


# -- the library ------------------------------------------------------------------------
POPTORCH_OPS = [   # every operator of PopTorch's TORCH_LIBRARY(poptorch, m) block
    "begin_ipu_block", "end_ipu_block", "start_for_loop", "start_if_block",
    "start_else_block", "optimizer_group", "begin_multi_conv", "end_multi_conv",
    "push_name_scope", "pop_name_scope", "set_attribute", "clear_attribute",
    "ipu_print_tensor", "nop", "end_for_loop", "end_if_block", "set_matmul_serialization",
    "set_overlap_for_input", "set_overlap_for_output", "recomputation_checkpoint",
    "set_available_memory", "custom_operation", "ctc_beam_search_decoder", "dynamic_slice",
    "dynamic_update", "identity_loss", "internal_cast", "end_cpu_op", "call_cpu_op", "fps",
    "nearest", "nearest_batch_list"]


def test_every_poptorch_operator_is_defined_with_poptorchs_schema():
    assert sorted(op_library.SCHEMAS) == sorted(POPTORCH_OPS)
    for name in POPTORCH_OPS:
        schema = str(getattr(P, name).default._schema)
        assert schema == f"poptorch::{name}{op_library.SCHEMAS[name]}"
    assert str(P.begin_ipu_block.default._schema) == \
        "poptorch::begin_ipu_block(int stage_id, int phase_id, int ipu_id) -> ()"
    assert str(P.internal_cast.default._schema) == \
        "poptorch::internal_cast(Tensor self, str dtype) -> Tensor"


def test_a_namespace_taken_by_another_library_is_skipped_with_a_note():
    taken = torch.library.Library("poptorchsim_test_taken", "DEF")    # noqa: F841 - kept alive
    records = LogRecords()
    logger = logging.getLogger("poptorchsim")
    logger.addHandler(records)
    try:
        assert op_library.register("poptorchsim_test_taken") is None
    finally:
        logger.removeHandler(records)
    assert len(records.messages) == 1
    assert "torch.ops.poptorchsim_test_taken is already defined by another library" \
        in records.messages[0]
    assert not hasattr(torch.ops.poptorchsim_test_taken, "nop")


def test_importing_after_a_real_poptorch_library_does_not_crash():
    """A process where PopTorch defined ``torch.ops.poptorch`` first."""
    import subprocess
    import sys
    code = ("import torch\n"
            "lib = torch.library.Library('poptorch', 'DEF')\n"
            "lib.define('nop(Tensor self) -> Tensor')\n"
            "import poptorchsim\n"
            "assert not hasattr(torch.ops.poptorch, 'push_name_scope')\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    assert "torch.ops.poptorch is already defined by another library (PopTorch itself?)" \
        in done.stderr


def test_eager_calls_do_what_the_api_does():
    x = torch.randn(4, 8, requires_grad=True)
    y = P.nop(x)
    assert torch.equal(y, x) and y is not x and y.grad_fn is not None
    assert P.identity_loss(x, 0).item() == pytest.approx(x.sum().item())
    assert P.identity_loss(x, 1).item() == pytest.approx(x.mean().item())
    assert torch.equal(P.identity_loss(x, 2), x)
    assert P.recomputation_checkpoint(x) is x and P.set_available_memory(x, 0.3) is x
    assert P.internal_cast(x, "FLOAT16").dtype == torch.float16
    P.push_name_scope("outside"), P.pop_name_scope(), P.pop_name_scope()   # nothing traced
    P.begin_ipu_block(1, 0, 1), P.end_ipu_block()
    P.set_attribute("__outline", "layer", "a"), P.clear_attribute("__outline", "layer")
    start = torch.tensor([2])
    torch.testing.assert_close(P.dynamic_slice(x, 1, start, 2, 1),
                               poptorch.dynamic_slice(x, 1, start, 2, 1))
    P.identity_loss(x, 1).backward()
    torch.testing.assert_close(x.grad, torch.full_like(x, 1 / 32))
    x.grad = None
    (P.nop(x) * 2).sum().backward()                  # gradients flow through the ops
    torch.testing.assert_close(x.grad, torch.full_like(x, 2.0))


def test_make_fx_with_fake_tensors_traces_through_the_operators():
    def f(x):
        P.push_name_scope("s")
        y = P.internal_cast(P.nop(x), "FLOAT16")
        P.pop_name_scope()
        return P.identity_loss(P.recomputation_checkpoint(y), 0)

    gm = make_fx(f, tracing_mode="fake")(torch.randn(3, 4))
    targets = [str(n.target) for n in gm.graph.nodes if n.op == "call_function"]
    assert targets == ["poptorchsim.nop.default", "aten._to_copy.default",
                       "aten.sum.default"]
    torch.testing.assert_close(gm(torch.ones(3, 4)), torch.tensor(12.0, dtype=torch.half))
