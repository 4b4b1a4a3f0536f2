"""`Archiver`: moves the committed records of reliable streams from the journal into Parquet
files under an fsspec URL, exactly once.

Progress lives nowhere but in the archive's file names: at start (and for each stream it
first meets) the archiver lists the stream's files and continues each shard right after the
highest offset found. A crash after an upload therefore never re-archives those rows, a crash
before one loses nothing (the journal still holds them, and retention keeps them until
`archived_offset` passes them), and a retried upload writes the same name again.

One background task on the event loop reads committed records from the journal in bounded
blocks (one buffer and arrays of positions each: no Python object per record) into a per-shard
buffer, but only once a file is due (enough rows committed, the oldest
record `max_delay_s` old, or `flush`): until then the records stay in the journal, not in
memory. A buffer becomes a file when it reaches the row or byte target, at an hour boundary
(each file lies in one `date=/hour=` partition), or when it holds all that is due. Decoding, Parquet encoding and uploads run in a
worker thread. A failing store is retried with exponential backoff while the lag grows in
`status()`. This module never deletes journal data: the caller feeds `archived_offset` to the
journal's retention.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import random
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

import pyarrow as pa
import pyarrow.compute as pc
from fsspec import AbstractFileSystem

from ..allocators import return_freed_memory
from ..journal import JournalStorage, RecordBlock
from . import compaction, layout, upgrade
from .buffer import RecordBuffer, int64_array
from .columns import RESERVED, build_table, encode_parquet, warm_up
from .settings import ArchiveConfigError, ArchiveSettings, ArchiveUnavailable
from .typed import TypedSchema

log = logging.getLogger(__name__)

StreamList = Callable[[], list[tuple[str, int, str]]]
"""What the archiver archives: (stream name, shard count, schema) of every reliable stream."""
Leads = Callable[[str, int], bool]
"""Whether this node leads a shard (in a cluster only the leader archives it)."""
ContinueLog = Callable[[str, int, int], bool]
"""Make a shard's log, which holds no record, continue at an offset (the archive's next): the
composition root moves the journal log and the broker's shard together; False if it could not."""
RegisteredSchema = Callable[[str], tuple[str, Any, int] | None]
"""A stream's registered schema, if any: (type `json` or `avro`, the schema document, version);
its fields become typed columns (`typed.py`)."""

_AUTH_ERRORS = (
    "InvalidAccessKeyId", "SignatureDoesNotMatch", "AccessDenied", "NoSuchBucket",
    "InvalidClientTokenId", "ExpiredToken", "AuthorizationHeaderMalformed",
)


@dataclass(slots=True)
class _ShardState:
    stream: str
    shard: int
    schema: str
    archived_next: int
    """The first offset not in the archive (derived from the file names)."""
    files: int = 0
    bytes: int = 0
    buffer: RecordBuffer = field(default_factory=RecordBuffer)
    buffer_bytes: int = 0
    uploading: RecordBuffer = field(default_factory=RecordBuffer)
    """The records of the file being uploaded (they precede the buffer, which meanwhile
    reads ahead); back into the buffer if the upload fails."""
    hour_closed: bool = False
    """The journal's next record lies in another hour than the buffer's: seal it now."""
    failures: int = 0
    retry_at: float = 0.0
    last_error: str | None = None
    skipped: int = 0
    """Records the journal had dropped before they could be archived (never archivable)."""
    last_upload_ms: int | None = None
    prebuilt: tuple[RecordBuffer, int, asyncio.Future[pa.Table]] | None = None
    """The table of the buffer (as it was at that length), built while the file before it
    was being uploaded; used by the next seal if the buffer is still the same."""


def _forget(prebuilt: tuple[RecordBuffer, int, asyncio.Future[pa.Table]] | None) -> None:
    """Forget a table built ahead (its buffer was dropped or changed)."""
    if prebuilt is not None:
        # Retrieve its outcome once done, so that a failed build is not reported as lost.
        prebuilt[2].add_done_callback(lambda f: f.cancelled() or f.exception())


T = TypeVar("T")
ARCHIVE_THREADS = 2
"""An archiver's worker threads: one builds the next file's table while another encodes and
writes the current one."""
RELEASE_WAIT_S = 1.0


class _Workers:
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


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def _is_auth_error(exc: BaseException) -> bool:
    if isinstance(exc, PermissionError):
        return True
    text = str(exc)
    return any(code in text for code in _AUTH_ERRORS)


class Archiver:
    """Archives the journal's reliable streams into Parquet (see the module docstring)."""

    def __init__(
        self,
        journal: JournalStorage,
        url: str,
        streams: StreamList,
        settings: ArchiveSettings | None = None,
        *,
        filesystem: AbstractFileSystem | None = None,
        registered_schema: RegisteredSchema | None = None,
        shard_log: Callable[[str, int], Any] | None = None,
        leads: Leads | None = None,
        continue_log: ContinueLog | None = None,
    ) -> None:
        self.journal = journal
        # where a shard is read (default: the journal's log); in a cluster, a replicated
        # shard's log below its high watermark where this node leads it, None elsewhere (a
        # follower's copy is not archived: its leader archives it)
        self._shard_log = shard_log
        self._leads = leads
        self._continue_log = continue_log
        self._registered_schema = registered_schema
        self._typed: dict[str, TypedSchema] = {}
        self.url = url
        self.settings = settings or ArchiveSettings()
        fs, root = layout.open_filesystem(url, self.settings)
        self.fs: AbstractFileSystem = filesystem if filesystem is not None else fs
        self.root = root
        self._local = layout.is_local(self.fs)
        self._object_store = layout.is_object_store(self.fs)
        self._streams = streams
        self._shards: dict[tuple[str, int], _ShardState] = {}
        self._listed: dict[str, dict[int, tuple[int, int, int]]] = {}
        self._listed_at: dict[str, float] = {}
        """When each stream was listed (monotonic): a shard this node starts to lead is listed
        again, since its previous leader wrote files meanwhile."""
        self._list_errors: dict[str, str] = {}
        self._invalid: set[str] = set()
        """Streams whose names cannot be archived (reported in status, never retried)."""
        self._upgraded: set[str] = set()
        """Streams whose older-format files are rewritten (`upgrade.py`), in this process."""
        self._upgrade_failed: set[str] = set()
        self._compaction = self.settings.compaction and (self._local or self._object_store)
        self._next_compaction = 0.0
        self._lock = asyncio.Lock()
        self._task: asyncio.Task[None] | None = None
        self._wake = asyncio.Event()
        self._stopping = False
        self._workers = _Workers()

    # -- lifecycle ----------------------------------------------------------------------

    async def start(self) -> None:
        """List the archive (a clear ArchiveConfigError for bad credentials or a missing
        bucket), then archive in a background task. An unreachable store is not an error
        here: the task keeps retrying and `status()` shows it."""
        await asyncio.to_thread(self._check_store)
        if self._compaction and self._local:
            await asyncio.to_thread(compaction.clear_staging, self.root)
        await self._discover(raise_auth=True)
        await self._workers.run(warm_up)
        await self._workers.release()
        self._stopping = False
        self._task = asyncio.get_running_loop().create_task(self._run(), name="archiver")

    def wake(self) -> None:
        """Run the next pass now (the shards this node leads may have changed)."""
        self._wake.set()

    async def stop(self, flush: bool = True) -> None:
        """Stop the background task; with `flush`, first archive everything committed (trying
        for up to `stop_timeout_s`; what is left stays in the journal)."""
        self._stopping = True
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if flush:
            try:
                await self.flush(timeout=self.settings.stop_timeout_s)
            except ArchiveUnavailable as exc:
                log.error("archive not complete at stop (the journal keeps the rest): %s", exc)
        for state in self._shards.values():  # tables built ahead for files not sealed
            _forget(state.prebuilt)
            state.prebuilt = None
        self._workers.close()

    async def flush(self, timeout: float | None = None) -> None:
        """Make the journal durable, then archive every record committed so far (sealing
        partial files), retrying a failing store with backoff. Raises ArchiveUnavailable if
        that is not done within `timeout` seconds (None: keep trying)."""
        await self.journal.flush()
        deadline = None if timeout is None else time.monotonic() + timeout
        targets: dict[tuple[str, int], int] = {}
        while True:
            async with self._lock:
                await self._discover()
                for key in self._shards:  # what is committed when the flush first sees it
                    if key not in targets:
                        targets[key] = self._committed(key)
                await self._pass(force=True, ignore_backoff=True, targets=targets)
                missing = [
                    state for key, state in self._shards.items()
                    if state.archived_next < targets.get(key, 0)
                ]
                unknown = [
                    name for name in self._wanted_streams()
                    if name not in self._listed and name not in self._invalid
                ]
            if not missing and not unknown:
                return
            delays = [state.retry_at - time.monotonic() for state in missing]
            wait = max(0.01, min(delays, default=self.settings.retry_initial_s))
            if deadline is not None and time.monotonic() + wait > deadline:
                errors = [f"{s.stream}/{s.shard}: {s.last_error}" for s in missing]
                errors += [f"{name}: {self._list_errors.get(name)}" for name in unknown]
                raise ArchiveUnavailable("archive flush did not complete: " + "; ".join(errors))
            await asyncio.sleep(wait)

    def _typed_for(self, stream: str) -> TypedSchema | None:
        """The typed columns of `stream`'s latest registered schema (built once per version);
        None without one, or when it cannot be mapped (logged; the file is then untyped)."""
        if self._registered_schema is None:
            return None
        registered = self._registered_schema(stream)
        if registered is None:
            return None
        kind, document, version = registered
        typed = self._typed.get(stream)
        if typed is None or typed.version != version or typed.kind != kind:
            try:
                typed = TypedSchema(kind, document, version, RESERVED)
            except Exception as exc:  # noqa: BLE001 - an unmappable schema: archive untyped
                log.warning("stream %s: schema version %d gives no typed columns: %s",
                            stream, version, _describe(exc))
                return None
            self._typed[stream] = typed
        return typed

    # -- what the rest of the broker asks -------------------------------------------------

    def archived_offset(self, stream: str, shard: int) -> int:
        """The first offset of the shard not yet archived: the journal may delete below it.
        0 while the archive's listing of the stream is not known."""
        state = self._shards.get((stream, shard))
        if state is not None:
            return state.archived_next
        listed = self._listed.get(stream)
        if listed is None:
            return 0
        entry = listed.get(shard)
        return entry[0] if entry else 0

    @property
    def files_written(self) -> int:
        """Files written so far, over every shard: background work whose leftovers an idle
        broker hands back once more (`Persistence.check_idle`) when this changes."""
        return sum(state.files for state in self._shards.values())

    def status(self) -> list[dict[str, Any]]:
        """Per stream and shard: journal range, archived range, lag (records and ms), files,
        bytes, buffered records and the last upload error."""
        now_ms = int(time.time() * 1000)
        out = []
        for name, shard_count, _schema in self._wanted_streams_with_shards():
            for shard in range(shard_count):
                state = self._shards.get((name, shard))
                shard_log = None if name in self._invalid else self._open_log(name, shard)
                low = shard_log.low_watermark if shard_log is not None else 0
                committed = shard_log.committed_offset if shard_log is not None else 0
                archived_next = state.archived_next if state is not None else None
                lag = None if archived_next is None else max(0, committed - archived_next)
                oldest_ms = None
                pending = None if state is None else (state.uploading or state.buffer)
                if pending:
                    oldest_ms = pending[0].timestamp_ms
                elif lag and shard_log is not None and archived_next is not None:
                    first = shard_log.read(max(archived_next, low), 1)
                    oldest_ms = first[0].timestamp_ms if first else None
                out.append({
                    "stream": name,
                    "shard": shard,
                    "journal_low": low,
                    "journal_next": committed,
                    "archived_next": archived_next,
                    "archived_up_to": None if archived_next is None else archived_next - 1,
                    "lag_records": lag,
                    "lag_ms": None if oldest_ms is None else max(0, now_ms - oldest_ms),
                    "files": state.files if state is not None else 0,
                    "bytes": state.bytes if state is not None else 0,
                    "buffered": (len(state.uploading) + len(state.buffer)
                                 if state is not None else 0),
                    "failures": state.failures if state is not None else 0,
                    "last_error": (state.last_error if state is not None
                                   else self._list_errors.get(name)),
                    "skipped": state.skipped if state is not None else 0,
                    "last_upload_ms": state.last_upload_ms if state is not None else None,
                })
        return out

    # -- the background task ----------------------------------------------------------------

    async def _run(self) -> None:
        interval = self.settings.poll_interval_s
        while not self._stopping:
            try:
                async with self._lock:
                    await self._discover()
                    await self._pass(force=False, ignore_backoff=False)
                await self.upgrade()
                if self._compaction and time.monotonic() >= self._next_compaction:
                    self._next_compaction = time.monotonic() + self.settings.compact_interval_s
                    await self.compact()
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("archiver pass failed")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), interval)
            self._wake.clear()

    async def upgrade(self) -> int:
        """Rewrite the older-format files of every stream listed so far (once per stream and
        process; see `upgrade.py`); returns how many files were rewritten."""
        rewritten = 0
        for name in list(self._listed):
            if name in self._upgraded:
                continue
            try:
                rewritten += await self._workers.run(
                    upgrade.upgrade_stream, self.fs, self.root, name, self._put,
                    self.settings.compression_level)
            except Exception as exc:
                if name not in self._upgrade_failed:  # retried each pass, logged once
                    log.warning("archive of stream %s: older files not rewritten yet: %s",
                                name, _describe(exc))
                self._upgrade_failed.add(name)
                continue
            self._upgraded.add(name)
        return rewritten

    async def compact(self, now_ms: int | None = None) -> int:
        """Merge small files of every listed stream whose hour ended `compact_after_s` ago
        (`compaction.py`: local disks and object stores); returns how many files were
        replaced. Each shard directory is compacted under the archiver's lock, so no file of
        it is written meanwhile."""
        if not self._compaction:
            return 0
        settings = self.settings
        replaced = 0
        for name in list(self._listed):
            if not self._local:  # what a compaction that stopped half-way left behind
                async with self._lock:
                    await self._workers.run(compaction.finish_compactions, self.fs, self.root, name)
            files = await self._workers.run(layout.list_stream_files, self.fs, self.root, name)
            for directory, entries in compaction.shard_directories(files).items():
                end = compaction.hour_end_ms(directory)
                now = int(time.time() * 1000) if now_ms is None else now_ms
                if end is None or end + settings.compact_after_s * 1000 > now or len(entries) < 2:
                    continue
                if not compaction.plan(entries, settings.file_target_bytes):
                    continue
                if self._leads is not None and not self._leads(name, entries[0].shard):
                    continue  # in a cluster a shard's leader compacts it, as it archives it
                async with self._lock:
                    try:
                        if not self._local:
                            replaced += await self._workers.run(
                                compaction.compact_object_store, self.fs, self.root, name, entries,
                                settings.file_target_bytes, settings.compression_level,
                                settings.row_group_rows)
                            continue
                        replaced += await self._workers.run(
                            compaction.compact_directory, self.root, name, directory, entries,
                            settings.file_target_bytes, settings.compression_level,
                            settings.row_group_rows)
                    except compaction.CompactionUnsupported as exc:
                        log.warning("archive compaction is off: %s", exc)
                        self._compaction = False
                        return replaced
                    except FileNotFoundError:
                        continue  # listed before a change: the next round lists again
        return replaced

    def _wanted_streams_with_shards(self) -> list[tuple[str, int, str]]:
        return [(name, int(count), str(schema)) for name, count, schema in self._streams()]

    def _wanted_streams(self) -> list[str]:
        return [name for name, _count, _schema in self._wanted_streams_with_shards()]

    async def _discover(self, raise_auth: bool = False) -> None:
        """List the archive for every stream not listed yet, and register the shards this node
        leads (all of them outside a cluster); a shard it no longer leads is forgotten, and one
        it starts to lead is listed anew and its log continues after the archive's files."""
        began = time.monotonic()
        for name, shard_count, schema in self._wanted_streams_with_shards():
            if name not in self._listed:
                try:
                    layout.check_stream_name(name)
                    self._listed[name] = await asyncio.to_thread(self._list_stream, name)
                    self._listed_at[name] = time.monotonic()
                    self._list_errors.pop(name, None)
                except ValueError as exc:
                    self._list_errors[name] = str(exc)
                    self._invalid.add(name)
                    continue
                except Exception as exc:
                    if raise_auth and _is_auth_error(exc):
                        raise ArchiveConfigError(
                            f"archive {self.url!r}: access refused ({_describe(exc)}); check "
                            "the credentials, the region and that the bucket exists"
                        ) from exc
                    self._list_errors[name] = _describe(exc)
                    log.warning("cannot list archive of stream %s: %s", name, _describe(exc))
                    continue
            for shard in range(shard_count):
                key = (name, shard)
                state = self._shards.get(key)
                if self._leads is not None and not self._leads(name, shard):
                    if state is not None:  # another node archives it from now on
                        del self._shards[key]
                        _forget(state.prebuilt)
                    continue
                if state is not None:
                    state.schema = schema
                    continue
                if self._leads is not None and self._listed_at.get(name, 0.0) < began:
                    try:  # its previous leader may have written files since the last listing
                        self._listed[name] = await asyncio.to_thread(self._list_stream, name)
                        self._listed_at[name] = time.monotonic()
                    except Exception as exc:
                        self._list_errors[name] = _describe(exc)
                        log.warning("cannot list archive of stream %s: %s", name, _describe(exc))
                        break
                archived_next, files, size = self._listed[name].get(shard, (0, 0, 0))
                state = self._shards[key] = _ShardState(name, shard, schema, archived_next,
                                                        files, size)
                self._continue_after_archive(state)

    def _continue_after_archive(self, state: _ShardState) -> None:
        """A log that holds no record but ends before the archive's files (a new owner of the
        shard, or this node after losing its disk) continues at the archive's next offset, so
        that an offset never names two messages and the files' sequence goes on. A log that
        holds records and ends before them is reported (its records there are not archived)."""
        stream, shard, archived_next = state.stream, state.shard, state.archived_next
        shard_log = self._open_log(stream, shard)
        if shard_log is None or shard_log.next_offset >= archived_next:
            return
        if self._continue_log is not None and self._continue_log(stream, shard, archived_next):
            log.info("%s/%d: the journal holds no record; it continues after the archive, at "
                     "offset %d", stream, shard, archived_next)
            return
        state.last_error = (
            f"the archive holds offsets up to {archived_next - 1} but the journal ends at "
            f"{shard_log.next_offset - 1}: another journal wrote to this archive URL?")
        log.error("%s/%d: %s", stream, shard, state.last_error)

    def _check_store(self) -> None:
        """Refuse a missing bucket or refused credentials now, with a clear message; an
        unreachable store only gets a warning (the background task retries)."""
        try:
            if self._local:
                os.makedirs(self.root, exist_ok=True)
            elif self._object_store:
                self.fs.info(self.root.split("/", 1)[0])
        except FileNotFoundError as exc:
            raise ArchiveConfigError(
                f"archive {self.url!r}: the bucket {self.root.split('/', 1)[0]!r} does not exist"
            ) from exc
        except Exception as exc:
            if _is_auth_error(exc):
                raise ArchiveConfigError(
                    f"archive {self.url!r}: access refused ({_describe(exc)}); check the "
                    "credentials, the region and that the bucket exists"
                ) from exc
            log.warning("archive %s not reachable at start (retrying): %s", self.url, _describe(exc))

    def _list_stream(self, stream: str) -> dict[int, tuple[int, int, int]]:
        """Per shard: (first offset not archived, file count, bytes), from the file names."""
        for path in layout.stale_temporaries(self.fs, self.root, stream):
            with contextlib.suppress(OSError):
                os.unlink(path)
        shards: dict[int, tuple[int, int, int]] = {}
        for entry in layout.list_stream_files(self.fs, self.root, stream):
            archived_next, files, size = shards.get(entry.shard, (0, 0, 0))
            shards[entry.shard] = (
                max(archived_next, entry.last_offset + 1), files + 1, size + entry.size
            )
        return shards

    def _open_log(self, stream: str, shard: int) -> Any:
        try:
            if self._shard_log is not None:
                return self._shard_log(stream, shard)
            return self.journal.open_shard(stream, shard)
        except Exception:  # a closed journal, a deleted stream
            return None

    def _committed(self, key: tuple[str, int]) -> int:
        shard_log = self._open_log(*key)
        return shard_log.committed_offset if shard_log is not None else 0

    async def _pass(self, force: bool, ignore_backoff: bool,
                    targets: dict[tuple[str, int], int] | None = None) -> None:
        """One round over every shard: read what is new, seal the files that are due. With
        `force`, a partial file is sealed too, but only while the shard has not archived up
        to its offset in `targets` (what was committed when a flush began): records that
        arrive during the flush's uploads wait for their own file to be due, rather than
        become one more small file each."""
        for key, state in list(self._shards.items()):
            if not ignore_backoff and time.monotonic() < state.retry_at:
                continue
            shard_log = self._open_log(state.stream, state.shard)
            if shard_log is None:
                continue

            def forced(state: _ShardState = state, key: tuple[str, int] = key) -> bool:
                return force and (targets is None or state.archived_next < targets.get(key, 0))

            if not (forced() or state.buffer or self._file_due_soon(state, shard_log)):
                continue
            while True:
                await self._fill(state, shard_log)
                if not self._due(state, forced()):
                    break
                if not await self._seal(state, shard_log):
                    break
                if not (forced() or state.buffer or self._file_due_soon(state, shard_log)):
                    break

    def _file_due_soon(self, state: _ShardState, shard_log: Any) -> bool:
        """Whether to read records into memory now: only once a file will be due, because
        enough rows are committed or the oldest record not archived is `max_delay_s` old.
        Until then the records stay in the journal, not in the broker's memory (the byte
        target then cuts the files when they are written)."""
        start = state.archived_next
        committed = shard_log.committed_offset
        if committed <= start:
            return False
        if committed - start >= self.settings.target_rows:
            return True
        head = shard_log.read(start, 1)
        if not head or head[0].offset != start:
            return True  # a gap or an error: let _fill report it
        return time.time() * 1000 - head[0].timestamp_ms >= self.settings.max_delay_s * 1000

    async def _fill(self, state: _ShardState, shard_log: Any) -> None:
        """Read committed records after the buffer (and after the file being uploaded), up
        to the file targets, stopping at an hour boundary. Yields to the event loop between
        journal reads."""
        settings = self.settings
        while (
            not state.hour_closed
            and len(state.buffer) < settings.target_rows
            and state.buffer_bytes < settings.target_bytes
        ):
            start = state.archived_next + len(state.uploading) + len(state.buffer)
            committed = shard_log.committed_offset
            if start >= committed:
                if (start > committed and not state.buffer and not state.uploading
                        and state.last_error is None):
                    state.last_error = (
                        f"the archive holds offsets up to {start - 1} but the journal only "
                        f"{committed - 1}: another journal wrote to this archive URL?"
                    )
                    log.error("%s/%d: %s", state.stream, state.shard, state.last_error)
                return
            want = min(settings.read_batch, settings.target_rows - len(state.buffer))
            batch = shard_log.read_block(start, want)
            if not batch:
                return
            if batch.first_offset != start:
                if state.buffer:
                    state.hour_closed = True  # seal before the gap
                    return
                if state.uploading:
                    return  # skip the gap once that upload is done
                state.skipped += batch.first_offset - start
                log.error(
                    "%s/%d: offsets %d..%d left the journal before they were archived",
                    state.stream, state.shard, start, batch.first_offset - 1,
                )
                state.archived_next = batch.first_offset
            self._take(state, batch)
            await asyncio.sleep(0)

    def _take(self, state: _ShardState, batch: RecordBlock) -> None:
        """Append the head of `batch` that lies in the buffer's hour and fits the byte target
        (the record reaching the target included) to the buffer (array kernels over the
        block's positions and timestamps, no loop per record)."""
        buffer = state.buffer
        times = batch.timestamps
        hour = layout.hour_of(buffer[0].timestamp_ms if buffer else times[0])
        low, high = hour * layout.HOUR_MS, (hour + 1) * layout.HOUR_MS
        hour_end = len(batch)
        stamps = int64_array(times)
        if pc.min(stamps).as_py() < low or pc.max(stamps).as_py() >= high:
            outside = pc.invert(pc.and_(pc.greater_equal(stamps, low), pc.less(stamps, high)))
            hour_end = pc.index(outside, True).as_py()
        sizes = pc.cumulative_sum(pc.subtract(
            int64_array(batch.ends[:hour_end]), int64_array(batch.starts[:hour_end])))
        room = self.settings.target_bytes - state.buffer_bytes
        take = hour_end
        if hour_end and sizes[-1].as_py() >= room:
            take = pc.sum(pc.less(sizes, room)).as_py() + 1
        elif hour_end < len(batch):
            state.hour_closed = True
        buffer.extend(batch[:take] if take < len(batch) else batch)
        state.buffer_bytes += sizes[take - 1].as_py() if take else 0

    def _full(self, state: _ShardState) -> bool:
        """Whether the buffer is a whole file: no more records will join it."""
        settings = self.settings
        return bool(state.buffer) and (
            state.hour_closed
            or len(state.buffer) >= settings.target_rows
            or state.buffer_bytes >= settings.target_bytes
        )

    def _due(self, state: _ShardState, force: bool) -> bool:
        if not state.buffer:
            return False
        settings = self.settings
        if (
            force
            or state.hour_closed
            or len(state.buffer) >= settings.target_rows
            or state.buffer_bytes >= settings.target_bytes
        ):
            return True
        age_ms = time.time() * 1000 - state.buffer[0].timestamp_ms
        return age_ms >= settings.max_delay_s * 1000

    async def _seal(self, state: _ShardState, shard_log: Any = None) -> bool:
        """Upload the buffer as one file; on failure schedule a retry. True if uploaded.

        The work runs in a worker thread, in two steps: decoding the records into an Arrow
        table (short compute kernels, each taking the GIL back: the event loop waits rather
        than contend), then Parquet encoding and the write (long calls without the GIL),
        during which the buffer, emptied, reads ahead from `shard_log`; when what it read is
        a whole file, its table is built meanwhile too, for the next seal. Files of a shard are
        still uploaded one after the other, in offset order (progress is the highest offset
        among the files). If the upload fails or is cancelled, what was read ahead is dropped
        and the file's records become the buffer again."""
        records = state.buffer
        saved = (records, state.buffer_bytes, state.hour_closed)
        first, last = records[0].offset, records[-1].offset
        directory = layout.shard_dir(self.root, state.stream, state.shard, records[0].timestamp_ms)
        path = f"{directory}/{layout.file_name(state.shard, first, last)}"
        prebuilt, state.prebuilt = state.prebuilt, None
        state.uploading = records
        state.buffer, state.buffer_bytes, state.hour_closed = RecordBuffer(), 0, False
        upload: asyncio.Future[int] | None = None
        try:
            if prebuilt is not None and prebuilt[0] is records and prebuilt[1] == len(records):
                table = await prebuilt[2]
            else:
                _forget(prebuilt)
                table = await self._workers.run(
                    build_table, state.stream, state.shard, state.schema, records,
                    self._typed_for(state.stream), self.settings.keep_typed_payload,
                )
            upload = asyncio.ensure_future(self._workers.run(
                self._write_file, path, state.stream, state.shard, table, first, last
            ))
            if shard_log is not None:
                with contextlib.suppress(Exception):  # a read error shows on the next pass
                    await self._fill(state, shard_log)
                if self._full(state):  # build the next file's table while this one uploads
                    state.prebuilt = (state.buffer, len(state.buffer), self._workers.run(
                        build_table, state.stream, state.shard, state.schema, state.buffer,
                        self._typed_for(state.stream), self.settings.keep_typed_payload,
                    ))
            size = await upload
            del table, prebuilt  # the built-ahead future held the table too
            await self._workers.release()
            return_freed_memory()
        except BaseException as exc:
            _forget(state.prebuilt)
            state.prebuilt = None
            state.buffer, state.buffer_bytes, state.hour_closed = saved
            if not isinstance(exc, Exception):
                if upload is not None:
                    upload.cancel()
                raise
            state.failures += 1
            delay = min(
                self.settings.retry_max_s,
                self.settings.retry_initial_s * 2 ** min(state.failures - 1, 20),
            )
            state.retry_at = time.monotonic() + delay * random.uniform(0.8, 1.2)
            state.last_error = _describe(exc)
            log.warning(
                "archive upload of %s failed (attempt %d, retry in %.1fs): %s",
                path, state.failures, delay, state.last_error,
            )
            return False
        finally:
            state.uploading = RecordBuffer()
        state.archived_next = last + 1
        state.files += 1
        state.bytes += size
        state.failures = 0
        state.retry_at = 0.0
        state.last_error = None
        state.last_upload_ms = int(time.time() * 1000)
        if state.buffer and not self._due(state, False):
            # What was read ahead during the upload goes back to the journal until a file is
            # due: a broker idle after a burst holds no records in memory meanwhile.
            _forget(state.prebuilt)
            state.prebuilt = None
            state.buffer, state.buffer_bytes, state.hour_closed = RecordBuffer(), 0, False
        return True

    # -- worker thread ------------------------------------------------------------------

    def _write_file(
        self, path: str, stream: str, shard: int, table: pa.Table, first: int, last: int
    ) -> int:
        data = encode_parquet(
            table,
            compression_level=self.settings.compression_level,
            row_group_rows=self.settings.row_group_rows,
            metadata={
                "shardgate.stream": stream,
                "shardgate.shard": str(shard),
                "shardgate.first_offset": str(first),
                "shardgate.last_offset": str(last),
            },
        )
        self._put(path, data)
        return len(data)

    def _put(self, path: str, data: bytes) -> None:
        """Make `data` visible at `path` all at once (replacing a previous upload)."""
        if self._local:
            write_local_atomically(path, data)
            return
        try:
            self.fs.pipe_file(path, data)
        except FileNotFoundError:
            if self._object_store:
                raise
            self.fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
            self.fs.pipe_file(path, data)


def write_local_atomically(path: str, data: bytes) -> None:
    """Write a dot-named temporary file beside `path`, fsync it, rename it over `path` and
    fsync the directory: readers see the whole file or nothing."""
    directory, name = os.path.split(path)
    created = _make_dirs(directory)
    temp = os.path.join(directory, f".{name}.{uuid.uuid4().hex[:12]}.tmp")
    fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        try:
            view = memoryview(data)
            while view:
                written = os.write(fd, view)
                view = view[written:]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(temp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temp)
        raise
    for synced in (directory, *created):
        _fsync_dir(synced)


def _make_dirs(directory: str) -> list[str]:
    """Create `directory` and its missing parents; returns the parents of what was created
    (their entries must be fsynced too)."""
    missing = []
    current = directory
    while not os.path.isdir(current):
        missing.append(current)
        parent = os.path.dirname(current)
        if parent == current:
            break
        current = parent
    os.makedirs(directory, exist_ok=True)
    return [os.path.dirname(path) for path in missing]


def _fsync_dir(directory: str) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
