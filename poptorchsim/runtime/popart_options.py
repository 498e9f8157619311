"""PopART session options PopTorch users set with ``Options._Popart.set``,
read and checked as PopTorch's C++ layer checks them when it compiles
(``popart_compiler/source/SessionOptions.cpp``), with its texts.

* ``autoRecomputation``: PopART's ``RecomputationType`` as an int
  (PopTorch has no Python enum for it): 0 None, 1 Standard, 2 NormOnly,
  3 Pipeline, 4 RecomputeAll.  See ``passes/recompute.py``.
"""
from ..errors import Error
from ..passes.recompute import MODES as RECOMPUTATION_TYPES

_KINDS = ((bool, "bool"), (float, "floating point"), (str, "string"), (int, "uint64"))


def _choices():
    return ", ".join(f"{n} ({name})" for n, name in enumerate(RECOMPUTATION_TYPES))


def recomputation_type(options):
    """``autoRecomputation`` as an int, or None when it was not set."""
    value = options._Popart.options.get("autoRecomputation")
    if value is None:
        return None
    kind = next((name for cls, name in _KINDS if isinstance(value, cls)), "string")
    if kind != "uint64":
        # PopTorch passes a Python bool, float or str to the setter of that
        # type, which has no option of this name
        raise Error(f"Unknown {kind} option autoRecomputation (poptorchsim: PopART's "
                    f"autoRecomputation takes an int, one of {_choices()})")
    if not 0 <= value < len(RECOMPUTATION_TYPES):
        raise Error(f"Value for RecomputationType out of range (poptorchsim: "
                    f"autoRecomputation is {value}; use one of {_choices()})")
    return int(value)
