"""The archiver's worker threads, where tables are built and Parquet files encoded and
written, and the handing back of Arrow's free pages that each of them keeps. No archive logic.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import pyarrow as pa

T = TypeVar("T")
ARCHIVE_THREADS = 2
"""Threads that build tables (two row groups of a file at once, or the next file's) and run
the archiver's other work (uploads, listings, compaction)."""
ENCODE_THREADS = 2
"""Threads that only Parquet-encode (`encode`): a row group built is encoded at once, never
queued behind builds that hold the GIL, so that encoding overlaps them and the journal's
reading; two row groups of a file are encoded at once, each as a file of its own that the
file's encoder stitches (`columns.FileEncoder`), since one Parquet writer encodes on one
thread."""
RELEASE_WAIT_S = 1.0


class Workers:
    """The archiver's worker threads, where tables are built and encoded. Arrow's allocator
    (mimalloc) keeps what a thread frees for that thread, and a buffer freed by another thread
    (the event loop dropping a table) waits for its owner to look: `release` has every worker
    return its free pages, which `release_unused` on the event loop does not reach (an idle
    broker kept 7–40 MiB of Arrow pages with nothing allocated)."""

    def __init__(self) -> None:
        self._pool: ThreadPoolExecutor | None = None
        self._encode_pool: ThreadPoolExecutor | None = None

    def run(self, fn: Callable[..., T], *args: Any) -> asyncio.Future[T]:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(ARCHIVE_THREADS, thread_name_prefix="shardgate-archive")
        return asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    def encode(self, fn: Callable[..., T], *args: Any) -> asyncio.Future[T]:
        """Run a Parquet encoding step (started in submission order, `ENCODE_THREADS` at once)."""
        if self._encode_pool is None:
            self._encode_pool = ThreadPoolExecutor(
                ENCODE_THREADS, thread_name_prefix="shardgate-archive-encode")
        return asyncio.get_running_loop().run_in_executor(self._encode_pool, fn, *args)

    async def release(self) -> None:
        """Every worker returns Arrow's free pages (each call waits at a barrier until all
        of its pool's have started, so that each runs in a different thread)."""
        builders = threading.Barrier(ARCHIVE_THREADS, timeout=RELEASE_WAIT_S)
        encoders = threading.Barrier(ENCODE_THREADS, timeout=RELEASE_WAIT_S)
        await asyncio.gather(
            *(self.run(_release_in_thread, builders) for _ in range(ARCHIVE_THREADS)),
            *(self.encode(_release_in_thread, encoders) for _ in range(ENCODE_THREADS)),
        )

    def close(self) -> None:
        for pool in (self._pool, self._encode_pool):
            if pool is not None:
                pool.shutdown(wait=False)
        self._pool = self._encode_pool = None


def _release_in_thread(barrier: threading.Barrier) -> None:
    try:
        barrier.wait()
    except threading.BrokenBarrierError:
        pass  # a worker still busy: its pages go at the next release
    pa.default_memory_pool().release_unused()
