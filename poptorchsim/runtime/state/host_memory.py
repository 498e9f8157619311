"""The host process's memory policy while programs run.

Every step of a simulated program allocates and frees the same tensors.
glibc's malloc serves large blocks with fresh ``mmap`` pages and gives freed
memory back to the kernel, so each step page-faults its activations and
gradients in again: 33,000 minor faults per ResNet-50 training step at
batch 2 (eager PyTorch in the same process: 10,000), about a quarter of the
step's host time.  PyTorch's own CPU performance guide recommends a caching
allocator (jemalloc, tcmalloc) for this reason.  The first program run
raises glibc's mmap and trim thresholds once, so freed memory stays in the
process's heap for the next step (resident memory stays at the peak that
each step reaches anyway).  Eager PyTorch in the same process benefits too.

An executor's ``destroy()`` hands what it freed back to the kernel
(``give_back_freed_memory``: ``malloc_trim``), since the heap would
otherwise keep up to the trim threshold (1 GB) of it.

``POPTORCHSIM_HOST_MALLOC=system`` leaves malloc as it is.  Other C
libraries (macOS, Windows, musl) are left as they are.
"""
import ctypes
import ctypes.util
import logging
import os
import platform

logger = logging.getLogger("poptorchsim")

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_MMAP_THRESHOLDS = (1 << 30, 32 << 20)      # the largest glibc accepts
_TRIM_THRESHOLD = 1 << 30

_state = {"applied": None}


def keep_freed_memory():
    """Applies the policy once per process; True when malloc was tuned."""
    if _state["applied"] is not None:
        return _state["applied"]
    _state["applied"] = _apply()
    return _state["applied"]


def _apply():
    choice = os.environ.get("POPTORCHSIM_HOST_MALLOC", "keep").strip().lower()
    if choice == "system":
        return False
    if choice != "keep":
        logger.warning("POPTORCHSIM_HOST_MALLOC=%r is not 'keep' or 'system': "
                       "malloc is left as it is", choice)
        return False
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    if not any(mallopt(_M_MMAP_THRESHOLD, size) for size in _MMAP_THRESHOLDS):
        return False
    mallopt(_M_TRIM_THRESHOLD, _TRIM_THRESHOLD)
    logger.debug("glibc malloc keeps freed memory for the next step "
                 "(POPTORCHSIM_HOST_MALLOC=system to leave it)")
    return True


def give_back_freed_memory():
    """Where the policy kept freed memory in the heap: returns it to the
    kernel now (``malloc_trim(0)``, well under a millisecond for a small
    heap).  True when it ran."""
    if not _state["applied"]:
        return False
    try:
        trim = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return False
    trim.argtypes = (ctypes.c_size_t,)
    trim(0)
    return True
