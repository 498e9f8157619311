"""``poptorch._logging``: the names of PopTorch's logging module that
programs and PopTorch's tests call.

``setPopartLogLevel`` checks its level as PopTorch does (a string among
PopTorch's level names, ``ValueError("Level must be one of ...")``
otherwise) and keeps it.  PopART's own log (``popart:ir``,
``popart:devicex``, ...) has no counterpart in the simulator: nothing is
written there at any level, so the level only answers ``popart_log_level``.
``logger`` is poptorchsim's logger, which prints in PopTorch's format."""
import logging

logger = logging.getLogger("poptorchsim")

# PopTorch's level names (python/_logging.py's mapping)
_LEVELS = ("TRACE", "TRACE_ALL", "DEBUG", "DEBUG_IR", "INFO", "WARN", "ERR", "OFF")
popart_log_level = "WARN"


def setPopartLogLevel(level):
    """PopART's log level, by PopTorch's names."""
    global popart_log_level
    if not isinstance(level, str) or level not in _LEVELS:
        raise ValueError("Level must be one of " + ", ".join(_LEVELS))
    popart_log_level = level
