"""The native allocators under Python's own: glibc's malloc and Arrow's memory pool.

Both keep what a burst of load freed, for reuse: glibc the free pages of its heaps, Arrow's
pool (mimalloc or jemalloc) its pages per thread. An idle broker would hold that for good, so
`return_freed_memory` hands it back to the system; the broker calls it when idle and the
archiver after each file. Off glibc, only Arrow's part applies.

`tune_malloc`, called once by `shardgate serve`, keeps glibc from holding large buffers in its
heaps at all: by default glibc raises its mmap threshold each time a large mmapped block is
freed (up to 32 MiB), so after the first archive file or journal read every buffer up to that
size is carved from a heap, where a long-lived small block next to it pins the pages. A fixed
threshold sends every block of 128 KiB or more to its own mapping, returned when freed; two
arenas at most keep the worker threads from spreading free memory over one heap each.
"""

from __future__ import annotations

import ctypes
import os
import sys
from collections.abc import Callable


def _glibc() -> ctypes.CDLL | None:
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:  # not a glibc system
        return None
    return libc if hasattr(libc, "malloc_trim") and hasattr(libc, "mallopt") else None


_GLIBC = _glibc()
_MALLOC_TRIM: Callable[[int], int] | None = _GLIBC.malloc_trim if _GLIBC is not None else None
M_MMAP_THRESHOLD = -3
M_ARENA_MAX = -8
MMAP_THRESHOLD_BYTES = 128 * 1024
"""glibc's initial threshold, made fixed (setting it turns the dynamic raise off)."""
ARENA_MAX = 2


def tune_malloc() -> bool:
    """Fix glibc's mmap threshold and cap its arenas (see the module docstring), unless the
    environment already sets them (MALLOC_MMAP_THRESHOLD_, MALLOC_ARENA_MAX). False off glibc."""
    if _GLIBC is None:
        return False
    if "MALLOC_MMAP_THRESHOLD_" not in os.environ:
        _GLIBC.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)
    if "MALLOC_ARENA_MAX" not in os.environ:
        _GLIBC.mallopt(M_ARENA_MAX, ARENA_MAX)
    return True


def return_freed_memory() -> None:
    """Hand the free pages of Arrow's pool (when pyarrow is loaded) and of glibc's heaps (all
    arenas) back to the system."""
    arrow = sys.modules.get("pyarrow")
    if arrow is not None:
        arrow.default_memory_pool().release_unused()
    if _MALLOC_TRIM is not None:
        _MALLOC_TRIM(0)
