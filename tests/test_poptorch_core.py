"""``poptorch.poptorch_core``: the native-extension names PopTorch's programs
import (its user guide's error-handling example, its tests' error checks)."""
import pytest
import torch

import poptorchsim as poptorch
from poptorchsim import poptorch_core as core


@pytest.mark.parametrize("kind", list(core.TestErrorType))
def test_each_test_error_has_popTorchs_class_type_and_location(kind):
    with pytest.raises(poptorch.Error) as caught:
        core._throwTestError(kind)
    e = caught.value
    assert e.location.count("throwTestError::bottomLevel") == 1
    assert e.location.index("bottomLevel") < e.location.index("topLevel")   # innermost first
    assert "throwTestError" not in e.message and e.message in str(e)
    assert f"'{e.type}': {e.message}" in str(e)                             # the long message
    assert isinstance(e, poptorch.RecoverableError) == (kind.name == "PoplarRecoverableFullReset")
    assert isinstance(e, poptorch.UnrecoverableError) == (kind.name == "PoplarUnrecoverable")
    if isinstance(e, poptorch.RecoverableError):
        assert e.recovery_action == "FULL_RESET" and e.type == "poplar_recoverable_runtime_error"
        assert "Recovery action required: FULL_RESET" in str(e)
    if kind.name == "PoplarLinkError":
        assert e.type == "poplar_link_error" and "-lfoo not found" in e.message


def test_a_user_guide_style_handler_picks_the_recovery():
    """The user guide's handler: a recoverable error's action, an
    unrecoverable one, or any other error's type and location."""
    seen = []
    for kind in core.TestErrorType:
        try:
            core._throwTestError(kind)
        except poptorch.RecoverableError as e:
            seen.append(e.recovery_action)
        except poptorch.UnrecoverableError:
            seen.append("offline")
        except poptorch.Error as e:
            seen.append(e.type)
    assert seen == ["poptorch_cpp_error", "popart_exception", "popart_internal_exception",
                    "poplibs_exception", "offline", "poplar_unknown_runtime_error",
                    "FULL_RESET", "poplar_link_error"]


def test_a_bad_test_error_type_is_a_typed_error():
    with pytest.raises(poptorch.Error, match="Unknown TestErrorType.*Poptorch, Popart"):
        core._throwTestError(3)


def test_is_compiling_only_while_the_model_is_traced():
    seen = []

    class Model(torch.nn.Module):
        def forward(self, x):
            seen.append(core.isCompilingWithDispatcher())
            return x * 2

    model = poptorch.inferenceModel(Model())
    model(torch.ones(2))
    assert seen and all(seen) and not core.isCompilingWithDispatcher()
    assert core.Error is poptorch.Error
