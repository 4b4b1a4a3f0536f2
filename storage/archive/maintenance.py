"""`ArchiveMaintenance`: what the archiver does besides writing files: finding the shards this
node archives and where each continues (the archive's file names are its only progress),
`status()`, rewriting files of an older format (`upgrade.py`) and compaction
(`compaction.py`). `Archiver` (archiver.py) builds on it.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from . import compaction, layout, upgrade
from .settings import ArchiveConfigError
from .shard_state import ShardState, describe, forget_ahead, is_auth_error
from .store import ArchiveStore, log


class ArchiveMaintenance(ArchiveStore):
    """Listing, status, upgrade and compaction (see the module docstring)."""

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
                                name, describe(exc))
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
                    if raise_auth and is_auth_error(exc):
                        raise ArchiveConfigError(
                            f"archive {self.url!r}: access refused ({describe(exc)}); check "
                            "the credentials, the region and that the bucket exists"
                        ) from exc
                    self._list_errors[name] = describe(exc)
                    log.warning("cannot list archive of stream %s: %s", name, describe(exc))
                    continue
            for shard in range(shard_count):
                key = (name, shard)
                state = self._shards.get(key)
                if self._leads is not None and not self._leads(name, shard):
                    if state is not None:  # another node archives it from now on
                        del self._shards[key]
                        forget_ahead(state.buffer)
                    continue
                if state is not None:
                    state.schema = schema
                    continue
                if self._leads is not None and self._listed_at.get(name, 0.0) < began:
                    try:  # its previous leader may have written files since the last listing
                        self._listed[name] = await asyncio.to_thread(self._list_stream, name)
                        self._listed_at[name] = time.monotonic()
                    except Exception as exc:
                        self._list_errors[name] = describe(exc)
                        log.warning("cannot list archive of stream %s: %s", name, describe(exc))
                        break
                archived_next, files, size = self._listed[name].get(shard, (0, 0, 0))
                state = self._shards[key] = ShardState(name, shard, schema, archived_next,
                                                        files, size)
                self._continue_after_archive(state)

    def _continue_after_archive(self, state: ShardState) -> None:
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
