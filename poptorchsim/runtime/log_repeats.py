"""``Options.maxRepeatLogs``: often-repeated log lines are suppressed.

PopTorch's logger (spdlog's duplicate filter) prints a line repeated back to
back at most ``max_repeat_logs`` times (4 by default) and drops the rest
until a different line comes.  ``RepeatFilter`` does the same on
poptorchsim's logger (``logging.getLogger("poptorchsim")``): a record equal
to the previous one (logger, level, message) is dropped once it has passed
``max_repeats`` times in a row, and the first different record says how many
were skipped.  Wrapping a model applies its ``Options.max_repeat_logs``
(``apply(options)``); ``maxRepeatLogs(None)`` shows every line.
"""
import logging

DEFAULT_MAX_REPEATS = 4
UNLIMITED = (1 << 64) - 1       # PopTorch's value for maxRepeatLogs(None)


class RepeatFilter(logging.Filter):
    def __init__(self, max_repeats=DEFAULT_MAX_REPEATS):
        super().__init__()
        self.max_repeats = max_repeats
        self._last = None
        self._count = 0
        self.skipped = 0            # dropped since the last line that passed

    def filter(self, record):
        key = (record.name, record.levelno, record.getMessage())
        if key == self._last:
            self._count += 1
            if self._count > self.max_repeats:
                self.skipped += 1
                return False
            return True
        self._last, self._count = key, 1
        if self.skipped:
            record.msg = (f"(skipped {self.skipped} repeats of the previous line: "
                          f"Options.maxRepeatLogs) {record.getMessage()}")
            record.args = ()
            self.skipped = 0
        return True


def _installed():
    log = logging.getLogger("poptorchsim")
    for f in log.filters:
        if isinstance(f, RepeatFilter):
            return f
    f = RepeatFilter()
    log.addFilter(f)
    return f


FILTER = _installed()


def set_max_repeats(max_repeats):
    """Lines repeated back to back pass this many times (None: all of them)."""
    FILTER.max_repeats = UNLIMITED if max_repeats is None else int(max_repeats)


def apply(options):
    set_max_repeats(getattr(options, "max_repeat_logs", DEFAULT_MAX_REPEATS))
