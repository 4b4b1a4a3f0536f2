"""Group commit: one committer per journal writes and fsyncs the buffered groups of every dirty
shard in a worker thread, while the event loop keeps accepting appends for the next group.

A *pass* takes the pending group of each dirty shard log, runs `os.write` for each, then (under
the `always` policy, or when the `interval` policy's timer is due) an fsync of each file written
since the last fsync, all in one worker-thread call. Under `always`, where the platform allows,
a group's write and its fsync are one system call (`segment.write_durably`): the worker leaves
and retakes the GIL once per file instead of twice. Back on the event loop it publishes what
became durable and resolves the groups' futures, or rolls a shard back when its I/O failed. One
pass is in flight at a time; appends that arrive meanwhile form the next group.

`flush_sync` does the same synchronously for use without a running event loop (tools, tests,
shutdown). A journal is driven from one thread (its event loop, or a synchronous caller) plus
this module's worker thread; calling it from several threads at once is not supported.

This module decides *when* I/O happens; the shard log (`log.py`) decides *what* is written.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ..interfaces import LatencyHistogram, StorageFull
from .config import FsyncPolicy, JournalConfig
from .handles import OpenFiles

if TYPE_CHECKING:
    from .log import JournalShardLog, _Group

log = logging.getLogger(__name__)


@dataclass(slots=True)
class CommitStats:
    """Counters for benchmarks and metrics."""

    passes: int = 0
    groups: int = 0
    records: int = 0
    bytes: int = 0
    fsyncs: int = 0
    failures: int = 0
    fsync_latency: LatencyHistogram = field(default_factory=LatencyHistogram)


@dataclass(slots=True, eq=False)
class _Pass:
    items: list[tuple[JournalShardLog, _Group | None]]
    sync: bool
    started: float
    durable_writes: set[JournalShardLog] = field(default_factory=set)
    """Logs whose group is written and made durable in one call (no separate fsync)."""
    errors: dict[JournalShardLog, OSError] = field(default_factory=dict)
    io_done: bool = False
    completed: bool = False


def resolve(future: asyncio.Future[None] | None, error: BaseException | None = None) -> None:
    """Resolve a group future from whichever thread completes the group."""
    if future is None or future.done():
        return
    loop = future.get_loop()
    if loop.is_closed():
        return
    try:
        running: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
    except RuntimeError:
        running = None
    if running is loop:
        _settle(future, error)
    else:
        loop.call_soon_threadsafe(_settle, future, error)


def _settle(future: asyncio.Future[None], error: BaseException | None) -> None:
    if future.done():
        return
    if error is None:
        future.set_result(None)
    else:
        future.set_exception(error)


class GroupCommitter:
    """Writes and fsyncs the groups of all shard logs of one journal (see module docstring)."""

    def __init__(self, config: JournalConfig) -> None:
        self.policy = config.fsync
        # the open files of the journal's shard logs, at most `max_open_files` (`handles.py`)
        self.files = OpenFiles(config.max_open_files)
        # why every shard log refuses appends now (the disk alarm), or None
        self.refusing: str | None = None
        self.interval = config.fsync_interval_ms / 1000
        self.stats = CommitStats()
        self._logs: dict[JournalShardLog, None] = {}
        self._dirty: dict[JournalShardLog, None] = {}
        self._needs_sync: dict[JournalShardLog, None] = {}
        self._io_lock = threading.Lock()
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="journal-commit")
        self._loop: asyncio.AbstractEventLoop | None = None
        self._task: asyncio.Task[None] | None = None
        self._wake: asyncio.Event | None = None
        self._inflight: _Pass | None = None
        self._last_sync = time.monotonic()
        self._sync_requested = False
        self._closed = False

    # -- registration -------------------------------------------------------------------

    @property
    def io_lock(self) -> threading.Lock:
        """Held by the worker while it writes: a log changing its files outside a commit pass
        (`JournalShardLog.truncate_to`) holds it too."""
        return self._io_lock

    def register(self, shard_log: JournalShardLog) -> None:
        self._logs[shard_log] = None

    def unregister(self, shard_log: JournalShardLog) -> None:
        """Forget a log (closing or deleted). Waits for any pass in flight to finish its I/O."""
        with self._io_lock:
            self._logs.pop(shard_log, None)
            self._dirty.pop(shard_log, None)
            self._needs_sync.pop(shard_log, None)

    def mark_dirty(self, shard_log: JournalShardLog) -> None:
        """A log has a new pending group: schedule a pass (when an event loop runs)."""
        self._dirty[shard_log] = None
        self._kick()

    def discard_dirty(self, shard_log: JournalShardLog) -> None:
        self._dirty.pop(shard_log, None)

    # -- the asynchronous committer -------------------------------------------------------

    def _kick(self) -> None:
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return  # synchronous use: flush_sync() writes
        if self._closed:
            return
        if self._task is None or self._task.done() or self._loop is not loop:
            self._loop = loop
            self._wake = asyncio.Event()
            self._task = loop.create_task(self._run(), name="journal-group-commit")
        elif self._wake is not None:
            self._wake.set()

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        wake = self._wake
        assert wake is not None
        stranded = self._inflight
        if stranded is not None:
            # A pass started on an event loop that stopped before completing it.
            await loop.run_in_executor(self._executor, self._do_io, stranded)
            self._complete(stranded)
        while not self._closed:
            if not self._dirty:
                if not (self.policy is FsyncPolicy.INTERVAL and self._needs_sync):
                    return
                delay = self._last_sync + self.interval - time.monotonic()
                if delay > 0 and not self._sync_requested:
                    wake.clear()
                    try:
                        await asyncio.wait_for(wake.wait(), delay)
                    except TimeoutError:
                        pass
                    continue
            commit_pass = self._take_pass(force_sync=False)
            if not commit_pass.items:
                continue
            self._inflight = commit_pass
            await loop.run_in_executor(self._executor, self._do_io, commit_pass)
            self._complete(commit_pass)

    async def flush(self) -> None:
        """Wait until everything appended to any log so far is durable under the policy
        (an `interval` journal fsyncs at once instead of waiting for its timer)."""
        waiters = [w for w in (lg.commit_waiter() for lg in list(self._logs)) if w is not None]
        if not waiters:
            return
        self._sync_requested = True
        self._kick()
        # shielded: a cancelled flush must not cancel the groups' futures others wait on
        await asyncio.shield(asyncio.gather(*waiters))

    # -- passes ---------------------------------------------------------------------------

    def _take_pass(self, *, force_sync: bool) -> _Pass:
        now = time.monotonic()
        sync = (
            force_sync
            or self.policy is FsyncPolicy.ALWAYS
            or (
                self.policy is FsyncPolicy.INTERVAL
                and (self._sync_requested or now >= self._last_sync + self.interval)
            )
        )
        items: list[tuple[JournalShardLog, _Group | None]] = []
        for shard_log in self._dirty:
            group = shard_log._take_pending()
            if group is not None:
                items.append((shard_log, group))
        self._dirty.clear()
        durable_writes: set[JournalShardLog] = set()
        if sync:
            self._sync_requested = False
            taken = {shard_log for shard_log, _ in items}
            if self.policy is FsyncPolicy.ALWAYS:
                # Nothing written earlier waits for an fsync: each group's write can be durable
                # by itself (one system call, see `write_durably`).
                durable_writes = {lg for lg in taken if lg not in self._needs_sync}
            items.extend((lg, None) for lg in self._needs_sync if lg not in taken)
        return _Pass(items, sync, now, durable_writes)

    def _do_io(self, commit_pass: _Pass) -> None:
        with self._io_lock:
            self._do_io_locked(commit_pass)

    def _do_io_locked(self, commit_pass: _Pass) -> None:
        """Worker side of a pass: every write, then every fsync. Never touches futures."""
        if commit_pass.io_done:
            return
        errors = commit_pass.errors
        durable_writes = commit_pass.durable_writes
        stats = self.stats
        for shard_log, group in commit_pass.items:
            shard_log._io_write_seals()
            if group is None:
                continue
            try:
                if shard_log in durable_writes:
                    started = time.perf_counter()
                    shard_log._io_write(group, durable=True)
                    stats.fsync_latency.observe(time.perf_counter() - started)
                    stats.fsyncs += 1
                else:
                    shard_log._io_write(group)
            except OSError as exc:
                errors[shard_log] = exc
                shard_log._io_undo()
        if commit_pass.sync:
            for shard_log, _ in commit_pass.items:
                if shard_log in errors or shard_log in durable_writes:
                    continue
                try:
                    started = time.perf_counter()
                    shard_log._io_sync()
                    self.stats.fsync_latency.observe(time.perf_counter() - started)
                    self.stats.fsyncs += 1
                except OSError as exc:
                    errors[shard_log] = exc
                    shard_log._io_undo()
        commit_pass.io_done = True

    def _complete(self, commit_pass: _Pass) -> None:
        """Event-loop side of a pass: publish, resolve futures, roll back failed logs."""
        if commit_pass.completed:
            return
        commit_pass.completed = True
        if self._inflight is commit_pass:
            self._inflight = None
        if commit_pass.sync:
            self._last_sync = commit_pass.started
        stats = self.stats
        stats.passes += 1
        for shard_log, group in commit_pass.items:
            error = commit_pass.errors.get(shard_log)
            if error is not None:
                stats.failures += 1
                log.error("journal write failed in %s: %s", shard_log.directory, error)
            elif group is not None:
                stats.groups += 1
                stats.records += group.end_offset - group.first_offset
                stats.bytes += len(group.buf)
            shard_log._complete(group, commit_pass.sync and error is None, error)
            if error is None:
                if commit_pass.sync:
                    self._needs_sync.pop(shard_log, None)
                elif group is not None and shard_log in self._logs:
                    self._needs_sync[shard_log] = None

    def flush_sync(self) -> None:
        """Write and fsync everything appended so far, in the calling thread.

        Raises StorageFull if some log could not be written (that log is rolled back as an
        asynchronous pass would, its waiters failed)."""
        errors: list[OSError] = []
        with self._io_lock:
            inflight = self._inflight
            if inflight is not None:
                self._do_io_locked(inflight)
                self._complete(inflight)
                errors.extend(inflight.errors.values())
            commit_pass = self._take_pass(force_sync=True)
            if commit_pass.items:
                self._do_io_locked(commit_pass)
                self._complete(commit_pass)
                errors.extend(commit_pass.errors.values())
            for shard_log in self._logs:
                shard_log._io_write_seals()
        if errors:
            raise StorageFull(f"journal write failed: {errors[0]}") from errors[0]

    def close(self) -> None:
        """Flush what is pending, then stop the committer and its worker thread."""
        if self._closed:
            return
        try:
            self.flush_sync()
        finally:
            self._closed = True
            task = self._task
            if task is not None and not task.done():
                loop = task.get_loop()
                try:
                    running: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
                except RuntimeError:
                    running = None
                if running is loop:
                    task.cancel()
                elif not loop.is_closed():
                    loop.call_soon_threadsafe(task.cancel)
            self._executor.shutdown(wait=True)
