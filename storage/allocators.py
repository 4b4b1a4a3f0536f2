"""The native allocators under Python's own: glibc's malloc and Arrow's memory pool.

Both keep what a burst of load freed, for reuse: glibc the free pages of its heaps, Arrow's
pool (mimalloc or jemalloc) its pages per thread. An idle broker would hold that for good, so
`return_freed_memory` hands it back to the system; the broker calls it when idle and the
archiver after each file. Off glibc, only Arrow's part applies.
"""

from __future__ import annotations

import ctypes
import sys
from collections.abc import Callable


def _glibc_malloc_trim() -> Callable[[int], int] | None:
    try:
        return ctypes.CDLL("libc.so.6").malloc_trim  # type: ignore[no-any-return]
    except (OSError, AttributeError):  # not glibc
        return None


_MALLOC_TRIM = _glibc_malloc_trim()


def return_freed_memory() -> None:
    """Hand the free pages of Arrow's pool (when pyarrow is loaded) and of glibc's heaps (all
    arenas) back to the system."""
    arrow = sys.modules.get("pyarrow")
    if arrow is not None:
        arrow.default_memory_pool().release_unused()
    if _MALLOC_TRIM is not None:
        _MALLOC_TRIM(0)
