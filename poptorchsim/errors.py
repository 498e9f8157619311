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


class LossError(Error):
    """No loss, or more than one independent loss, in a training model."""


def createPoptorchError(msg):
    return Error(f"'poptorch_py_error': {msg}")
