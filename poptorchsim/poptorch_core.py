"""``poptorch.poptorch_core``: the names PopTorch's programs and tests import
from its native extension, answered by the simulator.

PopTorch's ``poptorch_core`` is its C++ binding.  Programs reach into it for
a few things: the error classes (``poptorch_core.Error``), the error-handling
example of PopTorch's user guide (``TestErrorType`` and ``_throwTestError``,
which raise each kind of error PopTorch converts from PopART and Poplar), and
whether a compilation is under way (``isCompilingWithDispatcher``).  This
module gives those names the behaviour PopTorch documents; the rest of the
binding (engine handles, dispatcher internals) has no counterpart in a
simulator and is not here: importing one of them fails with an
``AttributeError`` that names it.
"""
import enum
import sys

from .errors import Error, RecoverableError, UnrecoverableError
from .ops import ipuHardwareVersion  # poptorch_core.ipuHardwareVersion
from .runtime.settings.session_options import parse as _parse_options

__all__ = ["Error", "RecoverableError", "UnrecoverableError", "TestErrorType",
           "isCompilingWithDispatcher", "ipuHardwareVersion", "_validateOptions"]


class TestErrorType(enum.Enum):
    """The kinds of error ``_throwTestError`` raises, as PopTorch's binding
    names them (``popart_compiler/CompilerTypes.hpp``)."""
    __test__ = False            # (pytest: not a test class)
    Poptorch = 0
    Popart = 1
    PopartInternal = 2
    Poplibs = 3
    PoplarUnrecoverable = 4
    PoplarUnknown = 5
    PoplarRecoverableFullReset = 6
    PoplarLinkError = 7


# kind -> (error class, PopTorch's error type, message, recovery action)
_TEST_ERRORS = {
    TestErrorType.Poptorch: (Error, "poptorch_cpp_error", "This is a PopTorch error", None),
    TestErrorType.Popart: (Error, "popart_exception", "This is a Popart error", None),
    TestErrorType.PopartInternal: (Error, "popart_internal_exception",
                                   "This is a Popart error", None),
    TestErrorType.Poplibs: (Error, "poplibs_exception", "This is a Poplibs error", None),
    TestErrorType.PoplarUnrecoverable: (UnrecoverableError,
                                        "poplar_unrecoverable_runtime_error",
                                        "This is not recoverable", None),
    TestErrorType.PoplarUnknown: (Error, "poplar_unknown_runtime_error",
                                  "Don't know what happened", None),
    TestErrorType.PoplarRecoverableFullReset: (RecoverableError,
                                               "poplar_recoverable_runtime_error",
                                               "Reboot needed", "FULL_RESET"),
    TestErrorType.PoplarLinkError: (Error, "poplar_link_error",
                                    "Link error. Output: Library -lfoo not found\ncheck path",
                                    None),
}

# the contexts PopTorch's test error is raised in, innermost first, as its
# logging context prints them
_TEST_CONTEXT = ("throwTestError::bottomLevel", "throwTestError::topLevel")


def _throwTestError(error_type):
    """Raises the error PopTorch raises for ``error_type`` (a
    ``TestErrorType``): its class (``Error``, ``RecoverableError`` with a
    recovery action, ``UnrecoverableError``), its ``type``, its ``message``
    and its ``location`` (the contexts it was raised in), with PopTorch's
    long message ("In file:line: 'type': message", the recovery action, the
    location)."""
    if not isinstance(error_type, TestErrorType):
        raise Error(f"Unknown TestErrorType (poptorchsim: {error_type!r} is not a "
                    "poptorch.poptorch_core.TestErrorType; use one of "
                    f"{', '.join(TestErrorType.__members__)})")
    cls, kind, message, action = _TEST_ERRORS[error_type]
    location = "".join(f"  [{k}] {name}\n" for k, name in enumerate(_TEST_CONTEXT))
    long = f"In {__file__}:{sys._getframe().f_lineno}: '{kind}': {message}"
    if cls is RecoverableError:
        error = RecoverableError(long, recovery_action=action, type=kind)
        # PopTorch's long message: the recovery action before the location
        error.args = (f"{error.args[0]}\nError raised in:\n{location}",)
    else:
        error = cls(f"{long}\nError raised in:\n{location}", type=kind)
    error.message, error.location = message, location
    raise error


def isCompilingWithDispatcher():
    """Is a model being traced for compilation now?  (PopTorch: is its
    dispatcher capturing; poptorchsim's trace is the same moment:
    ``poptorch.isRunningOnIpu()``.)"""
    from .ops import isRunningOnIpu
    return isRunningOnIpu()


def _validateOptions(options_dict):
    """PopTorch's backend's parse of ``Options.toDict()``: ``Error`` for an
    unknown option or a value no option takes; each option set logged at
    debug level (``runtime/settings/session_options.py``)."""
    _parse_options(options_dict)
