"""Settings of a process that computes on the CPU (a rank on the CPU accelerator, the profiler).

PyTorch's CPU tensors come from glibc's ``malloc``. By default glibc hands blocks above a
moving threshold straight back to the kernel when they are freed (``munmap``) and trims free
memory off the top of the heap, so the next activation of that size is fresh memory that the
kernel must fault in and zero, page by page. A frozen tower run without autograd frees every
intermediate at once and paid that on every layer (page faults and system time dominated a
frozen tower's forward; docs/design.md has the figures) until the freed memory stays in the process
(what jemalloc/tcmalloc, often preloaded for CPU PyTorch, and the accelerators' caching allocators
do). ``keep_freed_memory`` sets that with ``mallopt``:
blocks up to 32 MB (glibc's largest heap allocation) come from the heap and the heap is never
trimmed, so a rank's resident memory stays at its peak, as on an accelerator.

``MMPIPE_CPU_MALLOC=default`` leaves glibc's settings alone.
"""
from __future__ import annotations

import os

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc <malloc.h>
MMAP_THRESHOLD = 32 << 20  # glibc refuses more on 64-bit (HEAP_MAX_SIZE / 2)
TRIM_THRESHOLD = 2**31 - 1  # mallopt takes an int: never trim in practice

_done = False


def keep_freed_memory() -> bool:
    """Make glibc's malloc keep freed memory in this process (see the module doc); True when it
    took effect (glibc present, not switched off), False otherwise. Safe to call more than once."""
    global _done
    if _done:
        return True
    if os.environ.get("MMPIPE_CPU_MALLOC", "").lower() == "default":
        return False
    import ctypes
    import ctypes.util
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc (macOS, musl without mallopt): nothing to set
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    _done = bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) & bool(mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))
    return _done
