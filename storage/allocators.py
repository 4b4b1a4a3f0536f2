"""The native allocators under Python's own: glibc's malloc and Arrow's memory pool.

Both keep what a burst of load freed, for reuse: glibc the free pages of its heaps, Arrow's
pool (mimalloc or jemalloc) its pages per thread. An idle broker would hold that for good, so
`return_freed_memory` hands it back to the system; the broker calls it when idle and the
archiver after each file. Off glibc, only Arrow's part applies.

`tune_malloc`, called once by `shardgate serve`, keeps glibc from holding large buffers in its
heaps: by default glibc raises its mmap threshold each time a large mmapped block is freed (up
to 32 MiB), so after the first archive file or journal read every buffer up to that size is
carved from a heap, where a long-lived small block next to it pins the pages. A fixed threshold
of 4 MiB sends every larger block to its own mapping, returned when freed; two arenas at most
keep the worker threads from spreading free memory over one heap each. The threshold is not
lower, and a heap keeps up to 8 MiB free at its top (the trim threshold) rather than 128 KiB,
because Arrow's Parquet writer allocates a zstd workspace of 1 to 2 MiB for every data page it
compresses and frees it after: mapped afresh, or trimmed and grown again, each time, that costs
a page fault per 4 KiB, about 13,000 faults (and zeroed pages) for an archive file of 200,000
rows, a fifth of its CPU time. The idle broker's `return_freed_memory` hands all free heap
pages back anyway.

`release_free_pools` does for Python's own small-object allocator (pymalloc) what `malloc_trim`
does for glibc. pymalloc carves 16 KiB pools out of 1 MiB arenas and returns an arena only
once every block in it is free: after a load, a few dozen long-lived objects made during it
(retained messages, statement caches, timers) keep its arenas, whose other pools are free but
resident. It hands back the pages of those free pools (all but the first page of each, which
holds the pool's header) and marks each such pool as not carved for any size class, so that
reusing it initialises it afresh in that first page. It relies on CPython 3.11's pool layout
and runs only there (64-bit Linux, pymalloc without debug hooks), after checking that layout
on live objects; it must run on a thread holding the GIL with no other pymalloc user, which
every Python thread is, and is called by the idle broker only.
"""

from __future__ import annotations

import ctypes
import gc
import os
import struct
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
M_TRIM_THRESHOLD = -1
MMAP_THRESHOLD_BYTES = 4 * 1024 * 1024
"""Fixed (setting it turns the dynamic raise off): above a zstd workspace (see above)."""
TRIM_THRESHOLD_BYTES = 8 * 1024 * 1024
"""Free memory a heap keeps at its top (glibc's default: 128 KiB) between two idle trims."""
ARENA_MAX = 2


def tune_malloc() -> bool:
    """Fix glibc's mmap and trim thresholds and cap its arenas (see the module docstring),
    unless the environment already sets them (MALLOC_MMAP_THRESHOLD_, MALLOC_TRIM_THRESHOLD_,
    MALLOC_ARENA_MAX). False off glibc."""
    if _GLIBC is None:
        return False
    if "MALLOC_MMAP_THRESHOLD_" not in os.environ:
        _GLIBC.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)
    if "MALLOC_TRIM_THRESHOLD_" not in os.environ:
        _GLIBC.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES)
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


POOL_SIZE = 16 * 1024
ARENA_SIZE = 1024 * 1024
"""pymalloc's pool and arena sizes on 64-bit CPython 3.11 (`Objects/obmalloc.c`)."""
SMALL_REQUEST_THRESHOLD = 512
_PAGE_SIZE = 4096
_POOL_HEADER = struct.Struct("<I4xQQQIIII")
"""`struct pool_header`: ref.count (a union with a pointer), freeblock, nextpool, prevpool,
arenaindex, szidx, nextoffset, maxnextoffset."""
_DUMMY_SIZE_INDEX = 0xFFFF
"""The size class of a pool not initialised yet: its next use sets it up afresh."""
_MADV_DONTNEED = 4


class _PoolHeader(ctypes.Structure):
    _fields_ = [("count", ctypes.c_uint32), ("padding", ctypes.c_uint32),
                ("freeblock", ctypes.c_void_p), ("nextpool", ctypes.c_void_p),
                ("prevpool", ctypes.c_void_p), ("arenaindex", ctypes.c_uint32),
                ("szidx", ctypes.c_uint32), ("nextoffset", ctypes.c_uint32),
                ("maxnextoffset", ctypes.c_uint32)]


def _madvise_function() -> Callable[[int, int, int], int] | None:
    if _GLIBC is None or sys.platform != "linux":
        return None
    function = ctypes.PyDLL("libc.so.6").madvise  # PyDLL: the call keeps the GIL
    function.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    function.restype = ctypes.c_int
    return function  # type: ignore[no-any-return]


def _pymalloc_layout_known() -> bool:
    """Whether this interpreter's small objects come from pymalloc pools laid out as above."""
    return (
        sys.implementation.name == "cpython" and sys.version_info[:2] == (3, 11)
        and sys.maxsize > 2**32 and not hasattr(sys, "gettotalrefcount")
        and os.environ.get("PYTHONMALLOC", "pymalloc") == "pymalloc" and not sys.flags.dev_mode
        and _madvise_function() is not None
    )


def _read_header(memory: int, pool: int) -> tuple[int, ...] | None:
    """The pool header at `pool`, read through /proc/self/mem (an unmapped address gives None
    instead of a fault)."""
    try:
        data = os.pread(memory, _POOL_HEADER.size, pool)
    except OSError:
        return None
    if len(data) != _POOL_HEADER.size:
        return None
    return _POOL_HEADER.unpack(data)


def _valid_pool(header: tuple[int, ...], size_index: int) -> bool:
    """A header pymalloc wrote for a pool of blocks of size class `size_index`."""
    _count, _free, _next, _prev, _arena, index, next_offset, max_next_offset = header
    block = (size_index + 1) * 16
    return (index == size_index and max_next_offset == POOL_SIZE - block
            and block <= next_offset <= POOL_SIZE)


def release_free_pools() -> int:
    """Hand back the pages of pymalloc's free pools in arenas that live objects keep (see the
    module docstring); returns how many pools. 0 where the layout is not CPython 3.11's.

    Arenas are found through the pools of the live objects the collector tracks (their headers
    checked against each object's size class); every 16 KiB step within an arena's reach whose
    header names the same arena, no block in use and a valid size class is a free pool. Each is
    checked again right before it is marked and advised, with nothing allocated in between;
    the arena cannot be freed meanwhile, since `objects` holds a live block in it."""
    if not _pymalloc_layout_known():
        return 0
    madvise = _madvise_function()
    assert madvise is not None
    objects = gc.get_objects()
    memory = os.open("/proc/self/mem", os.O_RDONLY)
    try:
        live_pools: dict[int, int] = {}  # pool -> size class of a live object in it
        for obj in objects:
            size = sys.getsizeof(obj, 0)
            if 0 < size <= SMALL_REQUEST_THRESHOLD:
                live_pools.setdefault(id(obj) & ~(POOL_SIZE - 1), (size - 1) >> 4)
        reach: dict[int, tuple[int, int]] = {}  # arena index -> lowest, highest live pool
        for pool, size_index in live_pools.items():
            header = _read_header(memory, pool)
            if header is None or header[0] == 0 or not _valid_pool(header, size_index):
                continue
            low, high = reach.get(header[4], (pool, pool))
            reach[header[4]] = (min(low, pool), max(high, pool))
        if not reach:
            return 0
        free: list[tuple[_PoolHeader, int, int]] = []
        for arena, (low, high) in reach.items():
            for pool in range(high - ARENA_SIZE + POOL_SIZE, low + ARENA_SIZE, POOL_SIZE):
                if pool in live_pools:
                    continue
                header = _read_header(memory, pool)
                if header is None or header[0] != 0 or header[4] != arena or header[5] >= 32:
                    continue
                if _valid_pool(header, header[5]):
                    free.append((_PoolHeader.from_address(pool), header[5], pool + _PAGE_SIZE))
    finally:
        os.close(memory)
    released = 0
    interval = sys.getswitchinterval()
    sys.setswitchinterval(60.0)
    try:
        for header_view, size_index, pages in free:
            # No allocation between this check and the mark: both values are small ints.
            if header_view.count == 0 and header_view.szidx == size_index:
                header_view.szidx = _DUMMY_SIZE_INDEX
                madvise(pages, POOL_SIZE - _PAGE_SIZE, _MADV_DONTNEED)
                released += 1
    finally:
        sys.setswitchinterval(interval)
    del objects
    return released
