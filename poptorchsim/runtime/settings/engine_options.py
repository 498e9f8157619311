"""Poplar engine options, as PopTorch users pass them.

They come from ``POPLAR_ENGINE_OPTIONS`` (a JSON object in the environment),
then ``Options._Popart.setEngineOptions({...})``, then
``Options.enableProfiling(dir)``; later sources win.  Values are strings, as
Poplar takes them ("true", "false").
"""
import json
import os

from ...errors import Error


def _truthy(value):
    return str(value).lower() in ("true", "1", "yes", "on")


def engine_options(options):
    merged = {}
    raw = os.environ.get("POPLAR_ENGINE_OPTIONS")
    if raw:
        try:
            merged.update(json.loads(raw))
        except json.JSONDecodeError as exc:
            raise Error(f"POPLAR_ENGINE_OPTIONS is not valid JSON ({exc}): {raw!r}. "
                        'Use for example \'{"autoReport.all":"true"}\'.') from None
    merged.update(options._Popart.options.get("engineOptions", {}))
    return merged


def profiling_directory(options):
    """Where reports go, or None when profiling is off."""
    opts = engine_options(options)
    if not (_truthy(opts.get("autoReport.all", False))
            or any(k.startswith("autoReport.output") and _truthy(v) for k, v in opts.items())):
        return None
    return opts.get("autoReport.directory", ".")


def allow_out_of_memory(options):
    """Poplar's ``debug.allowOutOfMemory``; on by default while profiling."""
    opts = engine_options(options)
    if "debug.allowOutOfMemory" in opts:
        return _truthy(opts["debug.allowOutOfMemory"])
    return profiling_directory(options) is not None
