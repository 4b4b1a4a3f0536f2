"""Rewriting archive files of an older format (1 and 2, which had a `stream` column beside the
`stream=` partition, so that pyarrow and pandas refused the archive root) into the current one.

Each file is rewritten under its own name, in one atomic replacement (a rename on a local
disk, one PUT on an object store), so a reader sees the old file or the new one, never both
and never neither; the rows do not change. Files are rewritten newest first, so the oldest
file of a shard is the last one rewritten: when it is of the current format, the shard is done,
and a later start checks one footer per shard only. This module never deletes a file.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import pyarrow.parquet as pq
from fsspec import AbstractFileSystem

from . import layout
from .columns import encode_parquet, upgrade_table

log = logging.getLogger(__name__)

Put = Callable[[str, bytes], None]
"""Makes bytes visible at a path all at once (the archiver's `_put`)."""


def is_current(fs: AbstractFileSystem, path: str) -> bool:
    """Whether the file at `path` has the current columns (no `stream`, a
    `native_properties`): its footer alone is read."""
    with fs.open(path, "rb") as handle:
        names = pq.read_schema(handle).names
    return "stream" not in names and "native_properties" in names


def upgrade_file(fs: AbstractFileSystem, path: str, put: Put, compression_level: int = 3) -> None:
    """Rewrite one older-format file under the same name."""
    with fs.open(path, "rb") as handle:
        table = pq.read_table(handle)
    metadata = {
        key.decode(): value.decode()
        for key, value in (table.schema.metadata or {}).items()
        if key.startswith(b"shardgate.") and key != b"shardgate.archive.format"
    }
    put(path, encode_parquet(upgrade_table(table), compression_level=compression_level,
                             metadata=metadata or {"shardgate.upgraded": "1"}))


def upgrade_stream(fs: AbstractFileSystem, root: str, stream: str, put: Put,
                   compression_level: int = 3) -> int:
    """Rewrite the stream's older-format files (see the module docstring); returns how many."""
    by_shard: dict[int, list[layout.ArchiveFile]] = {}
    for entry in layout.list_stream_files(fs, root, stream):
        by_shard.setdefault(entry.shard, []).append(entry)
    rewritten = 0
    for files in by_shard.values():
        if is_current(fs, files[0].path):
            continue
        for entry in reversed(files):
            if not is_current(fs, entry.path):
                upgrade_file(fs, entry.path, put, compression_level)
                rewritten += 1
    if rewritten:
        log.info("archive of stream %s: %d files rewritten in the current format", stream,
                 rewritten)
    return rewritten
