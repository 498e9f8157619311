"""``torch.ops.poptorch``'s errors: arguments checked against the schema,
unbalanced scopes, bad codes, custom operations and PopTorch's plumbing
operators, each with its type and text; the note a stage id other than the
IPU's gets."""
import logging

import pytest
import torch
from conftest import LogRecords, quiet_options
from test_poptorch_op_library import CUBE, Layers, X  # noqa: F401 - CUBE registers the op

import poptorchsim as poptorch

P = torch.ops.poptorch


def _inference(body, *inputs):
    return poptorch.inferenceModel(Layers(body), quiet_options())(*(inputs or (X,)))


# -- errors --------------------------------------------------------------------------------
def test_arguments_are_checked_against_the_schema_when_traced_and_eagerly():
    message = ("poptorch::set_attribute\\(\\) Expected a value of type 'str' for argument "
               "'key' but instead found type 'int'")
    with pytest.raises(RuntimeError, match=message):
        P.set_attribute("__outline", 1, "a")
    with pytest.raises(RuntimeError, match=message):
        _inference(lambda self, x: (P.set_attribute("__outline", 1, "a"), x)[1])
    with pytest.raises(RuntimeError, match="Expected a value of type 'int' for argument 'size'"):
        _inference(lambda self, x: P.dynamic_slice(x, 1, torch.tensor([0]), 2.0, 1))


def test_unbalanced_scopes_raise():
    with pytest.raises(poptorch.Error, match="pop_name_scope\\(\\) was called with no name "
                                             "scope open"):
        _inference(lambda self, x: (P.pop_name_scope(), self.fc1(x))[1])
    with pytest.raises(poptorch.Error, match="Unexpected end_multi_conv.*no begin_multi_conv"):
        _inference(lambda self, x: (P.end_multi_conv(None, None, None, None, None, None),
                                    self.fc1(x))[1])


def test_bad_codes_raise():
    with pytest.raises(poptorch.Error, match="reduction must be sum \\(0\\), mean \\(1\\) or "
                                             "none \\(2\\), got 3"):
        P.identity_loss(X, 3)
    with pytest.raises(poptorch.Error, match="internal_cast: unknown type 'DOUBLE'"):
        _inference(lambda self, x: P.internal_cast(x, "DOUBLE"))
    with pytest.raises(poptorch.Error, match="float_format 7 is not one of"):
        P.ipu_print_tensor(X, "x", 1, 1000, 3, 80, 4, 7, ", ", "(", ")")
    with pytest.raises(poptorch.Error, match="set_matmul_serialization: mode 'rows' is not"):
        P.set_matmul_serialization(X, "rows", 2, False)
    with pytest.raises(poptorch.Error, match="factor \\(3\\) must divide the output_channels "
                                             "dimension \\(8\\)"):
        P.set_matmul_serialization(X, "output_channels", 3, False)
    with pytest.raises(poptorch.Error, match="serializedMatMul: the factor must be at least 1 "
                                             "to serialize on input_channels, got 0"):
        P.set_matmul_serialization(X, "input_channels", 0, False)
    with pytest.raises(poptorch.Error, match="set_overlap_for_input: mode 'x' is not one of"):
        P.set_overlap_for_input(X, "x")
    with pytest.raises(poptorch.Error, match="set_overlap_for_output: mode 'x' is not one of"):
        P.set_overlap_for_output(X, "x")
    with pytest.raises(AssertionError, match="ipu_id must be either None or a non-negative "
                                             "integer \\(got -1\\)"):
        _inference(lambda self, x: (P.begin_ipu_block(0, 0, -1), self.fc1(x))[1])
    with pytest.raises(ValueError, match="Invalid partials types"):
        _inference(lambda self, x: (P.begin_multi_conv(), self.fc1(x),
                                    P.end_multi_conv(None, [5], None, None, None, None))[1])


def test_custom_operation_errors_are_custom_ops():
    with pytest.raises(poptorch.Error) as via_api:
        poptorch.custom_op([X], "Missing", "test.op_library", 1, [X])
    with pytest.raises(poptorch.Error) as via_op:
        P.custom_operation([X], "Missing", "test.op_library", 1, 1, [X], "")
    assert str(via_op.value) == str(via_api.value)
    assert "is not registered" in str(via_op.value)
    with pytest.raises(poptorch.Error, match="num_outputs is 2 but 1 example outputs"):
        P.custom_operation([X], "OpLibraryCube", "test.op_library", 1, 2, [X], "")
    with pytest.raises(poptorch.Error, match="attributes must be a JSON object"):
        P.custom_operation([X], "OpLibraryCube", "test.op_library", 1, 1, [X], "attr_0x1f")


@pytest.mark.parametrize("name, args, use", [
    ("start_for_loop", ([X],), "poptorch.for_loop"),
    ("end_for_loop", ([X], [X], 2), "poptorch.for_loop"),
    ("start_if_block", (X,), "poptorch.cond"),
    ("call_cpu_op", ([X], "id"), "poptorch.CPU"),
    ("optimizer_group", (0, [X]), "poptorch.trainingModel"),
])
def test_plumbing_operators_raise(name, args, use):
    with pytest.raises(poptorch.UnsupportedOperationError,
                       match=f"torch.ops.poptorch.{name} is one half of a construct .* "
                             f"Use {use}"):
        getattr(P, name)(*args)


def test_torch_cluster_operators_are_not_simulated():
    with pytest.raises(poptorch.UnsupportedOperationError,
                       match="torch.ops.poptorch.nearest \\(torch_cluster's nearest\\) is not "
                             "simulated by poptorchsim"):
        P.nearest(X, X, torch.zeros(4, dtype=torch.long), torch.zeros(4, dtype=torch.long))


def test_impl_internal_cast_refuses_other_types_as_poptorch():
    with pytest.raises(ValueError, match="Invalid poptorch.cast target type. Expecting "
                                         "torch.float or torch.half"):
        poptorch._impl.internal_cast(X, torch.int32)


def test_a_stage_other_than_the_ipu_is_noted(monkeypatch):
    from poptorchsim._api import op_handlers
    monkeypatch.setattr(op_handlers, "_NOTED", set())
    records = LogRecords()
    logger = logging.getLogger("poptorchsim")
    logger.addHandler(records)
    try:
        for _ in range(2):
            poptorch.inferenceModel(Layers(lambda self, x: (P.begin_ipu_block(2, 0, 1),
                                                            self.fc1(x))[1]),
                                    quiet_options().deviceIterations(2))(X)
    finally:
        logger.removeHandler(records)
    notes = [m for m in records.messages if "begin_ipu_block(2, 0, 1)" in m]
    assert len(notes) == 1
    assert "does not take stage and phase ids from the call" in notes[0]
