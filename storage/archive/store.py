"""`ArchiveStore`: the archiver's state (its shards, what it listed of the archive, its worker
threads) and its access to the store and the journal: checking and listing the archive, opening
a shard's log, writing one Parquet file (atomically on a local disk), the typed columns of a
stream. `Archiver` (archiver.py) builds on it; the archive's layout is `layout.py`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import Callable
from typing import Any

import pyarrow as pa
from fsspec import AbstractFileSystem

from ..journal import JournalStorage
from . import layout
from .columns import RESERVED, encode_parquet
from .local_files import write_local_atomically
from .settings import ArchiveConfigError, ArchiveSettings
from .shard_state import ShardState, describe, is_auth_error
from .typed import TypedSchema
from .workers import Workers

log = logging.getLogger("shardgate.storage.archive.archiver")

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


class ArchiveStore:
    """The archiver's state and its store access (see the module docstring)."""

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
        self._shards: dict[tuple[str, int], ShardState] = {}
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
        self._workers = Workers()
        self._memory_to_release = False
        """Files were written since memory was last handed back (`_release_when_idle`)."""

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
                            stream, version, describe(exc))
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

    def _wanted_streams_with_shards(self) -> list[tuple[str, int, str]]:
        return [(name, int(count), str(schema)) for name, count, schema in self._streams()]

    def _wanted_streams(self) -> list[str]:
        return [name for name, _count, _schema in self._wanted_streams_with_shards()]

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
            if is_auth_error(exc):
                raise ArchiveConfigError(
                    f"archive {self.url!r}: access refused ({describe(exc)}); check the "
                    "credentials, the region and that the bucket exists"
                ) from exc
            log.warning("archive %s not reachable at start (retrying): %s", self.url, describe(exc))

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

    def _write_file(
        self, path: str, stream: str, shard: int, table: pa.Table, first: int, last: int
    ) -> int:
        data = encode_parquet(
            table,
            compression_level=self.settings.compression_level,
            row_group_rows=self.settings.row_group_rows,
            metadata=self._file_metadata(stream, shard, first, last),
        )
        self._put(path, data)
        return len(data)

    @staticmethod
    def _file_metadata(stream: str, shard: int, first: int,
                       last: int | None = None) -> dict[str, str]:
        """The footer entries of an archive file of a shard's offsets `first..last` (without
        `last`: those known when the file begins, before its last record is read)."""
        entries = {
            "shardgate.stream": stream,
            "shardgate.shard": str(shard),
            "shardgate.first_offset": str(first),
        }
        if last is not None:
            entries["shardgate.last_offset"] = str(last)
        return entries

    def _put(self, path: str, data: bytes) -> None:
        """Make `data` visible at `path` all at once (replacing a previous upload)."""
        if self._local:
            write_local_atomically(path, data, layout.writing_root(self.root))
            return
        try:
            self.fs.pipe_file(path, data)
        except FileNotFoundError:
            if self._object_store:
                raise
            self.fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
            self.fs.pipe_file(path, data)
