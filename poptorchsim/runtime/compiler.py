"""The compiler as the runtime calls it: the pass lists of ``passes/compile.py``
run with Python's garbage collector paused (``runtime/collector.py``), and
the young generation collected after a compile that made code."""
from ..passes import compile as passes
from ..passes.compile import estimate_with_branches
from ..passes.compiled import Compiled
from . import collector

__all__ = ["compile_training", "compile_inference", "rebuild_update",
           "estimate_with_branches"]


@collector.paused
def compile_training(model, optimizer, args, kwargs, config, capture=None, traces=None,
                     estimate_only=False) -> Compiled:
    """``passes.compile.compile_training`` (see there)."""
    compiled = passes.compile_training(model, optimizer, args, kwargs, config, capture,
                                       traces, estimate_only)
    if not estimate_only:
        collector.collect_young()
    return compiled


@collector.paused
def compile_inference(model, args, kwargs, config) -> Compiled:
    """``passes.compile.compile_inference`` (see there)."""
    compiled = passes.compile_inference(model, args, kwargs, config)
    collector.collect_young()
    return compiled


@collector.paused
def rebuild_update(compiled, model, optimizer, config) -> Compiled:
    """``passes.compile.rebuild_update`` (see there)."""
    return passes.rebuild_update(compiled, model, optimizer, config)
