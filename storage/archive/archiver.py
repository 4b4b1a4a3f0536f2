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
(each file lies in one `date=/hour=` partition), or when it holds all that is due. Decoding, Parquet encoding and uploads run in
worker threads: a buffer's row groups are built (decoded) as soon as their records are read,
two at a time, and each is Parquet-encoded (which releases the GIL) as soon as it is built,
two at a time as a Parquet file of its own, so that a file is mostly encoded while its last
records are still read on the event loop (`_build_ahead`, `_encode_ahead`). At the seal the row
groups still missing are built and encoded the same way, and the parts are stitched into the
file, with the footer entries known only then (the last offset): byte for byte the file one
Parquet writer writes of the whole table (`_build_and_write`, `columns.FileEncoder`). A failing
store is retried with exponential backoff while the lag grows in
`status()`. This module never deletes journal data: the caller feeds `archived_offset` to the
journal's retention.

This module holds the lifecycle, the background task and the write path; the state and the
store access are `store.py`'s, listing, status, upgrade and compaction `maintenance.py`'s, the
worker threads `workers.py`'s, a shard's state `shard_state.py`'s and the atomic local write
`local_files.py`'s (`write_local_atomically` is still importable from here).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import random
import time
from typing import Any

import numpy as np
import pyarrow as pa

from ..allocators import return_freed_memory
from ..journal import RecordBlock
from . import compaction, layout
from .buffer import RecordBuffer
from .columns import FileEncoder, build_table, warm_up
from .local_files import write_local_atomically
from .maintenance import ArchiveMaintenance
from .settings import ArchiveUnavailable
from .shard_state import (
    Ahead,
    EncodingAhead,
    ShardState,
    describe,
    forget_ahead,
    forget_encoding,
    retrieve,
)
from .store import ContinueLog, Leads, RegisteredSchema, StreamList, log
from .workers import ENCODE_THREADS

__all__ = ["ContinueLog", "Leads", "RegisteredSchema", "StreamList", "Archiver",
           "write_local_atomically"]

BUILDS_AHEAD = 2
"""Row groups of a file being built at once (the workers' third thread encodes), and at most
as many started ahead while a buffer fills."""


def _read_buffer(size: int) -> pa.Buffer:
    """A buffer for a journal read, from the system allocator, whose heap hands the pages
    of the last file's reads to the next one's (Arrow's pool returns freed blocks of this
    size to the system, and a page fault per 4 KiB follows each read)."""
    return pa.allocate_buffer(size, memory_pool=pa.system_memory_pool())


class Archiver(ArchiveMaintenance):
    """Archives the journal's reliable streams into Parquet (see the module docstring): the
    lifecycle, the background task and the write path (reading a shard's committed records
    into a buffer, sealing it as a file); listing, status, upgrade and compaction are
    `ArchiveMaintenance`'s, the state and store access `ArchiveStore`'s."""

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
            forget_ahead(state.buffer)
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

    # -- the background task ----------------------------------------------------------------

    async def _run(self) -> None:
        interval = self.settings.poll_interval_s
        while not self._stopping:
            try:
                async with self._lock:
                    await self._discover()
                    await self._pass(force=False, ignore_backoff=False)
                    await self._release_when_idle()
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

    async def _release_when_idle(self) -> None:
        """Hand the memory freed since files were written back to the system (Arrow's pool,
        its threads' caches, glibc's heaps), once a pass holds no record in memory: not after
        each file, since the next file of a burst reuses those pages (fresh memory costs a
        page fault per 4 KiB page, about 3 us on a virtual machine: a fifth of the archive's
        CPU time when every file paid for its whole size)."""
        if not self._memory_to_release or any(
                state.buffer or state.uploading for state in self._shards.values()):
            return
        self._memory_to_release = False
        await self._workers.release()
        return_freed_memory()

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

            def forced(state: ShardState = state, key: tuple[str, int] = key) -> bool:
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

    def _file_due_soon(self, state: ShardState, shard_log: Any) -> bool:
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

    async def _fill(self, state: ShardState, shard_log: Any) -> None:
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
            batch = shard_log.read_block(start, want, allocate=_read_buffer)
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
            self._build_ahead(state)
            await asyncio.sleep(0)

    def _take(self, state: ShardState, batch: RecordBlock) -> None:
        """Append the head of `batch` that lies in the buffer's hour and fits the byte target
        (the record reaching the target included) to the buffer (numpy over the block's
        position and timestamp arrays, without a copy: no loop per record, and a few
        microseconds a block, on the event loop that reads the journal)."""
        buffer = state.buffer
        times = np.frombuffer(batch.timestamps, np.int64)
        first = buffer.blocks[0].timestamps[0] if buffer else int(times[0])
        hour = layout.hour_of(first)
        low, high = hour * layout.HOUR_MS, (hour + 1) * layout.HOUR_MS
        hour_end = len(batch)
        if times.min() < low or times.max() >= high:
            hour_end = int(((times < low) | (times >= high)).argmax())
        sizes = np.cumsum(np.frombuffer(batch.ends, np.int64)[:hour_end]
                          - np.frombuffer(batch.starts, np.int64)[:hour_end])
        room = self.settings.target_bytes - state.buffer_bytes
        take = hour_end
        if hour_end and sizes[-1] >= room:
            take = int(np.count_nonzero(sizes < room)) + 1
        elif hour_end < len(batch):
            state.hour_closed = True
        buffer.extend(batch[:take] if take < len(batch) else batch)
        state.buffer_bytes += int(sizes[take - 1]) if take else 0

    def _build_key(self, state: ShardState) -> tuple[Any, ...]:
        """What a table of the shard's records is built with now (see `Ahead.key`)."""
        return (state.schema, self._typed_for(state.stream), self.settings.keep_typed_payload)

    def _build_ahead(self, state: ShardState, last: bool = False) -> None:
        """Start building the buffer's row groups that are whole (`row_group_rows` records)
        and not started yet, at most `BUILDS_AHEAD` unfinished at once; with `last` (the
        buffer is a whole file: no record will join it), its last part too. A file's
        table is then mostly built, and encoded (`_encode_ahead`), while its records are still
        being read, or while the file before it is uploaded. The seal uses what was built and
        the file begun (`_build_and_write`)."""
        buffer = state.buffer
        rows = self.settings.row_group_rows
        key = self._build_key(state)
        if buffer.ahead and buffer.ahead[0].key != key:  # a new schema version meanwhile
            forget_ahead(buffer)
        started = sum(entry.rows for entry in buffer.ahead)
        if started == len(buffer) or (buffer.ahead and buffer.ahead[-1].rows < rows):
            return  # all built, or the last part is (a buffer that was a whole file)
        if len(buffer) - started < rows and not last:
            return
        parts = buffer.split(rows)[len(buffer.ahead):]
        for part in parts:
            if len(part) < rows and not last:
                break
            if sum(not entry.table.done() for entry in buffer.ahead) >= BUILDS_AHEAD:
                break
            buffer.ahead.append(Ahead(len(part), key, self._workers.run(
                build_table, state.stream, state.shard, state.schema, part, key[1], key[2])))
        self._encode_ahead(state, buffer, key)

    def _encode_ahead(self, state: ShardState, buffer: RecordBuffer, key: tuple[Any, ...]) -> None:
        """Hand the tables built ahead of `buffer` that are not yet to its file's encoder,
        beginning the file with the first: each is encoded (Parquet encoding releases the GIL)
        once it is built, two at once, while the journal is still being read. The footer
        entries known only at the seal (the last offset) are added then."""
        if not buffer.ahead:
            return
        encoding: EncodingAhead | None = buffer.encoding
        if encoding is None:
            settings = self.settings
            encoding = buffer.encoding = EncodingAhead(key, FileEncoder(
                compression_level=settings.compression_level,
                row_group_rows=settings.row_group_rows,
                metadata=self._file_metadata(state.stream, state.shard, buffer[0].offset)))
        for entry in buffer.ahead[encoding.parts:]:
            encoding.tail = asyncio.ensure_future(self._encode_after(
                encoding.tail, entry.table, encoding.encoder, encoding.parts))
            encoding.parts += 1

    async def _encode_after(self, previous: asyncio.Future[None] | None,
                            table: asyncio.Future[pa.Table], encoder: FileEncoder,
                            index: int) -> None:
        """Encode `table` as part `index` of the file once it is built (beside the part before
        it, on the other encoding thread), then wait for `previous` (the parts before it): done
        when every part up to this one is encoded; fails if one failed. Shielded: dropping this
        encode never cancels the build."""
        try:
            built = await asyncio.shield(table)
            await self._workers.encode(encoder.write, built, index)
        except BaseException:
            if previous is not None:
                previous.add_done_callback(retrieve)
            raise
        if previous is not None:
            await asyncio.shield(previous)

    def _built_ahead(self, state: ShardState, records: RecordBuffer,
                     parts: list[RecordBuffer]) -> list[asyncio.Future[pa.Table]]:
        """The tables built ahead of the first `parts` of `records`, as long as they were
        built as a table of them would be now (the rest are forgotten)."""
        key = self._build_key(state)
        usable = []
        for entry, part in zip(records.ahead, parts, strict=False):
            if entry.key != key or entry.rows != len(part):
                break
            usable.append(entry)
        forget_ahead(records, len(usable))
        records.ahead = []  # the seal holds them now, and drops each once it is encoded
        return [entry.table for entry in usable]

    async def _build_and_write(self, state: ShardState, records: RecordBuffer, path: str) -> int:
        """Build the table of `records` and write it as the file `path`; returns its size.
        A file of several row groups is built a row group's records at a time, `BUILDS_AHEAD`
        parts at once (those built ahead, `_build_ahead`, are taken as they are, and the file
        begun from them, `_encode_ahead`, is continued), and each part is encoded as soon as
        it is built, two at once (at most `ENCODE_THREADS` built parts wait for their encoding):
        decoding and Parquet encoding overlap on the worker threads, and the Parquet file
        stitched from the parts is, byte for byte, the one `encode_parquet` writes of the whole
        table."""
        settings = self.settings
        stream, shard = state.stream, state.shard
        first, last = records[0].offset, records[-1].offset
        typed = self._typed_for(stream)
        parts = records.split(settings.row_group_rows)
        begun: EncodingAhead | None = records.encoding
        records.encoding = None
        built = self._built_ahead(state, records, parts)
        if begun is not None and (begun.key != self._build_key(state) or begun.parts > len(built)):
            records.encoding = begun
            forget_encoding(records)
            begun = None
        encoding: asyncio.Future[None] | None = None
        index = 0
        if begun is not None:  # the file was begun while its records were read
            encoder, encoding, index = begun.encoder, begun.tail, begun.parts
            built = built[begun.parts:]
        builds: collections.deque[asyncio.Future[pa.Table]] = collections.deque(built)
        if len(parts) == 1 and begun is None:
            try:
                table = await (builds.popleft() if builds else self._workers.run(
                    build_table, stream, shard, state.schema, records, typed,
                    settings.keep_typed_payload))
            finally:
                for build in builds:
                    build.add_done_callback(retrieve)
            return await self._workers.run(self._write_file, path, stream, shard, table,
                                           first, last)
        if begun is None:
            encoder = FileEncoder(compression_level=settings.compression_level,
                                  row_group_rows=settings.row_group_rows,
                                  metadata=self._file_metadata(stream, shard, first))
        upcoming = iter(parts[(begun.parts if begun else 0) + len(built):])

        def build_next() -> None:
            part = next(upcoming, None)
            if part is not None:
                builds.append(self._workers.run(build_table, stream, shard, state.schema, part,
                                                typed, settings.keep_typed_payload))

        encodes: collections.deque[asyncio.Future[None]] = collections.deque()
        if encoding is not None:
            encodes.append(encoding)
        try:
            for _ in range(BUILDS_AHEAD - sum(not build.done() for build in builds)):
                build_next()
            while builds:
                table = await builds.popleft()
                build_next()
                encodes.append(self._workers.encode(encoder.write, table, index))
                index += 1
                del table
                while len(encodes) > ENCODE_THREADS:  # built tables wait in memory no longer
                    await encodes.popleft()
            while encodes:
                await encodes.popleft()
            data = await self._workers.encode(
                encoder.finish, self._file_metadata(stream, shard, first, last))
            await self._workers.run(self._put, path, data)
            return len(data)
        finally:
            for future in (*builds, *encodes):  # a failed or cancelled file: what runs is dropped
                future.add_done_callback(retrieve)

    def _full(self, state: ShardState) -> bool:
        """Whether the buffer is a whole file: no more records will join it."""
        settings = self.settings
        return bool(state.buffer) and (
            state.hour_closed
            or len(state.buffer) >= settings.target_rows
            or state.buffer_bytes >= settings.target_bytes
        )

    def _due(self, state: ShardState, force: bool) -> bool:
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

    async def _seal(self, state: ShardState, shard_log: Any = None) -> bool:
        """Upload the buffer as one file; on failure schedule a retry. True if uploaded.

        The work runs in worker threads (`_build_and_write`): decoding the records into
        Arrow tables, a row group's records at a time, two at once, while the row groups
        already built are Parquet-encoded, two at once (long calls without the GIL), then the
        write; the parts built ahead while the buffer filled (`_build_ahead`) are not built
        again, nor encoded again (`_encode_ahead`). Meanwhile the buffer, emptied, reads ahead
        from `shard_log`, building and encoding its row groups ahead too, and its last part
        when what it read is a whole file, for the next seal. Files of a shard are
        still uploaded one after the other, in offset order (progress is the highest offset
        among the files). If the upload fails or is cancelled, what was read ahead is dropped
        and the file's records become the buffer again."""
        records = state.buffer
        saved = (records, state.buffer_bytes, state.hour_closed)
        first, last = records[0].offset, records[-1].offset
        directory = layout.shard_dir(self.root, state.stream, state.shard, records[0].timestamp_ms)
        path = f"{directory}/{layout.file_name(state.shard, first, last)}"
        state.uploading = records
        state.buffer, state.buffer_bytes, state.hour_closed = RecordBuffer(), 0, False
        upload: asyncio.Future[int] | None = None
        try:
            upload = asyncio.ensure_future(self._build_and_write(state, records, path))
            if shard_log is not None:
                with contextlib.suppress(Exception):  # a read error shows on the next pass
                    await self._fill(state, shard_log)
                if self._full(state):  # build the next file's last part while this one uploads
                    self._build_ahead(state, last=True)
            size = await upload
            self._memory_to_release = True
        except BaseException as exc:
            forget_ahead(state.buffer)
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
            state.last_error = describe(exc)
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
            forget_ahead(state.buffer)
            state.buffer, state.buffer_bytes, state.hour_closed = RecordBuffer(), 0, False
        return True
