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
ARCHIVE_THREADS = 3
"""An archiver's worker threads: two build a file's row groups (or the next file's table)
while the third encodes and writes those already built."""
RELEASE_WAIT_S = 1.0


class Workers:
    """The archiver's worker threads, where tables are built and encoded. Arrow's allocator
    (mimalloc) keeps what a thread frees for that thread, and a buffer freed by another thread
    (the event loop dropping a table) waits for its owner to look: `release` has every worker
    return its free pages, which `release_unused` on the event loop does not reach (an idle
    broker kept 7–40 MiB of Arrow pages with nothing allocated)."""

    def __init__(self) -> None:
        self._pool: ThreadPoolExecutor | None = None

    def run(self, fn: Callable[..., T], *args: Any) -> asyncio.Future[T]:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(ARCHIVE_THREADS, thread_name_prefix="shardgate-archive")
        return asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    async def release(self) -> None:
        """Every worker returns Arrow's free pages (each call waits at a barrier until all
        have started, so that each runs in a different thread)."""
        barrier = threading.Barrier(ARCHIVE_THREADS, timeout=RELEASE_WAIT_S)
        await asyncio.gather(*(self.run(_release_in_thread, barrier) for _ in range(ARCHIVE_THREADS)))

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False)
            self._pool = None


def _release_in_thread(barrier: threading.Barrier) -> None:
    try:
        barrier.wait()
    except threading.BrokenBarrierError:
        pass  # a worker still busy: its pages go at the next release
    pa.default_memory_pool().release_unused()
