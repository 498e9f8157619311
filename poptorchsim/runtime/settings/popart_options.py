"""PopART session options PopTorch users set with ``Options._Popart.set``,
read and checked as PopTorch's C++ layer checks them when it compiles
(``popart_compiler/source/SessionOptions.cpp``), with its texts.

* ``autoRecomputation``: PopART's ``RecomputationType`` as an int
  (PopTorch has no Python enum for it; ``poptorchsim.popart`` has PopART's):
  0 None, 1 Standard, 2 NormOnly, 3 Pipeline, 4 RecomputeAll.  See
  ``passes/recompute.py``.
* ``syntheticDataMode``: any mode but 0 (Off) is ``enableSyntheticData``.

``MODELLED`` names every option the simulator reads; ``Options._Popart.set``
stores the others too (PopTorch hands them all to PopART) but logs once per
name that the simulation ignores them.
"""
import logging

from ...errors import Error
from ...passes.recompute import MODES as RECOMPUTATION_TYPES

# The PopART options something below reads, and what reads them.
MODELLED = {
    "autoRecomputation": "passes/recompute.py",
    "syntheticDataMode": "runtime/settings/config.py (no host streams)",
    "engineOptions": "runtime/settings/engine_options.py",
    "instrumentWithHardwareCycleCounter": "runtime/executor/observe.py",
    "updatableNamedBuffers": "runtime/executor/observe.py",
    "enableEngineCaching": "runtime/executables/cache.py",
    "cachePath": "runtime/executables/cache.py",
    "rearrangeAnchorsOnHost": "(host-side anchor layout: no cost in the simulation)",
}
MODELLED_PREFIXES = ("automaticLossScalingSettings.",)     # passes/loss_scaling.py
_NOTED = set()          # option names already logged as ignored


def is_modelled(key):
    return key in MODELLED or key.startswith(MODELLED_PREFIXES)


def note_unmodelled(key):
    """Logs, once per option name, that the simulation ignores ``key``."""
    if is_modelled(key) or key in _NOTED:
        return
    _NOTED.add(key)
    logging.getLogger("poptorchsim").warning(
        "Options._Popart.set(%r, ...): PopART option %s is not modelled by poptorchsim; "
        "it is stored (model.options._Popart.options) but changes neither the simulated "
        "program nor its cost. Modelled PopART options: %s.", key, key,
        ", ".join(sorted(MODELLED) + [p + "*" for p in MODELLED_PREFIXES]))


def synthetic_data_mode(options):
    """True when ``syntheticDataMode`` names a synthetic mode (not 0, Off)."""
    value = options._Popart.options.get("syntheticDataMode", 0)
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= 3:
        raise Error(f"Value for SyntheticDataMode out of range (poptorchsim: "
                    f"syntheticDataMode is {value!r}; use 0 (Off), 1 (Zeros), "
                    "2 (RandomNormal) or 3 (RandomUniform))")
    return value != 0

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
