"""Python's cyclic garbage collector, paused while a program compiles.

A compile makes about a million objects for BERT-Large (fake tensors, fx
nodes, IR ops and tensors) and keeps most of them until it returns.  With
the collector running, the growing heap triggers full collections, and each
scans everything (the model, torch, all the compile made so far): BERT-Large
Pod16's compile ran seven of them, about 1.8 s of its 10 s, and they found
almost nothing to free.  ``paused`` turns the collector off for the compile
and back on after it; ``collect_young``, the compile's last step, collects
the young generation once (what the compile made: time linear in it), so
the reference cycles the compile left are freed within it, as they were.
A collector the caller turned off stays off and is not run.
"""
import functools
import gc
import threading

_state = threading.local()


def paused(compile_fn):
    """``compile_fn`` run with the collector off (restored after it)."""
    @functools.wraps(compile_fn)
    def compile_(*args, **kwargs):
        if not gc.isenabled() or getattr(_state, "paused", False):
            return compile_fn(*args, **kwargs)
        gc.disable()
        _state.paused = True
        try:
            return compile_fn(*args, **kwargs)
        finally:
            _state.paused = False
            gc.enable()
    return compile_


def collect_young():
    """Collects the young generation, where this thread paused the collector."""
    if getattr(_state, "paused", False):
        gc.collect(0)
