"""``poptorch.profiling.Channel``: PopTorch's named tracepoints.

On hardware a channel writes PopVision trace events through ``libpvti``
(when ``PVTI_OPTIONS`` is set), and is a no-op otherwise.  Here a
tracepoint times its block with the host clock and logs the time at DEBUG
level (``POPTORCH_LOG_LEVEL=DEBUG``); ``instrument`` wraps methods in
tracepoints the same way.

>>> channel = Channel("MyApp")
>>> with channel.tracepoint("TimeThis"):
...     pass
"""
import functools
import logging
import time

logger = logging.getLogger("poptorchsim")


class _Tracepoint:
    def __init__(self, name):
        self.name = name
        self.start = None

    def __enter__(self):
        self.start = time.perf_counter()
        return self

    def __exit__(self, exc_type, exc, traceback):
        logger.debug("tracepoint %s: %.6f s", self.name, time.perf_counter() - self.start)


class Channel:
    """A profiling channel named ``name``; its tracepoints are
    ``<name>.<tracepoint name>``."""

    def __init__(self, name):
        if not isinstance(name, str):
            raise TypeError(f"Channel name must be a str (got {type(name).__name__})")
        self._tracepoint_prefix = name

    def tracepoint(self, name):
        """A context manager that times its block."""
        return _Tracepoint(f"{self._tracepoint_prefix}.{name}")

    def instrument(self, obj, *methods):
        """Wraps each of ``obj``'s ``methods`` (names) in a tracepoint named
        after the method; returns ``obj``."""
        for method in methods:
            original = getattr(obj, method)

            @functools.wraps(original)
            def traced(*args, _original=original, _name=method, **kwargs):
                with self.tracepoint(_name):
                    return _original(*args, **kwargs)
            setattr(obj, method, traced)
        return obj
