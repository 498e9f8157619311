"""Exception types of the PopTorch face.

PopTorch's ``Error`` subclasses ``Exception`` (not ``RuntimeError``); the two
recovery classes subclass ``Error``.  poptorchsim adds a few subclasses that
name the cause precisely.  Where PopTorch raises a builtin exception
(``AssertionError`` for a bad batch dimension, for example) the subclass also
inherits from that builtin, so code written for PopTorch keeps catching it.
"""


class Error(Exception):
    """Base class of every error poptorchsim raises on purpose."""

    def __init__(self, message="", *, location="", type="poptorch_py_error"):
        super().__init__(message)
        self.message = message
        self.location = location
        self.type = type


class RecoverableError(Error):
    """An error after which the device can be used again once reset."""

    def __init__(self, message="", recovery_action="IPU_RESET", **kw):
        super().__init__(f"{message}\nRecovery action required: {recovery_action}", **kw)
        self.recovery_action = recovery_action


class UnrecoverableError(Error):
    """An error after which the (simulated) system must be taken offline."""


class UnsupportedOperationError(Error):
    """The traced program uses ATen operations the IPU graph cannot hold."""


class DataDependentError(Error):
    """Python inside ``forward`` needs a tensor's value while tracing."""


class InputMismatchError(Error):
    """Inputs at run time differ from those the model was compiled for."""


class BatchDimensionError(Error, AssertionError):
    """A batch that does not divide by the combined batch factor.

    PopTorch raises ``AssertionError`` here, so this class is both."""


class ExecutableFileError(Error, AssertionError):
    """A file that ``poptorch.load`` or ``loadExecutable`` cannot read.

    PopTorch raises ``AssertionError`` from ``load`` and ``poptorch.Error``
    from ``loadExecutable``, so this class is both."""


class OutOfMemoryError(Error):
    """The compiled program does not fit in a tile's memory."""


class FloatingPointException(Error, RuntimeError):
    """A floating-point exception on the IPU (``Options.Precision.
    enableFloatingPointExceptions(True)``): an operation divided by zero,
    overflowed or was invalid (a NaN operand or result, inf - inf, 0 * inf,
    the square root of a negative number, a comparison with NaN).

    On hardware Poplar raises ``poplar::application_runtime_error``, a
    ``poplar_error`` that is neither recoverable nor unrecoverable, so
    PopTorch raises a plain ``poptorch.Error`` with ``type``
    ``'poplar_application_runtime_error'``; PopTorch's docstring promises a
    ``RuntimeError``, so the class is both.  ``error_code`` is Poplar's
    ``ErrorCode`` name (``FLOATING_POINT_INVALID_OPERATION``,
    ``FLOATING_POINT_DIVIDE_BY_ZERO``, ``FLOATING_POINT_OVERFLOW``); ``op``
    the IR operation's name and ``location`` the model's line that made it."""

    def __init__(self, message, *, error_code, op, location=""):
        super().__init__(f"'poplar_application_runtime_error': {message}",
                         location=location, type="poplar_application_runtime_error")
        self.message = message
        self.error_code = error_code
        self.op = op


class InputError(Error, TypeError):
    """An input the compiled program cannot take: a tensor on the ``meta``
    device (a shape without values), a Python list of numbers where forward()
    needs a tensor.  Also a ``TypeError``, as Python raises for such input."""


class DtypeError(Error, RuntimeError):
    """A tensor of a type the operation reading it refuses: floating-point
    class labels for ``CrossEntropyLoss``, float indices for an embedding.
    Also a ``RuntimeError``, as PyTorch raises."""


class ModelWrappedError(Error, RuntimeError):
    """The model is wrapped by a ``trainingModel`` already.  PopTorch raises
    ``RuntimeError`` here, so this class is both."""


class NoWeightsError(Error, RuntimeError):
    """The model was built without weights (its parameters or buffers are on
    the ``meta`` device): it compiles for estimates but cannot run, nor
    copy weights to or from the device."""


class LossError(Error):
    """No loss, or more than one independent loss, in a training model."""


def createPoptorchError(msg):
    return Error(f"'poptorch_py_error': {msg}")
