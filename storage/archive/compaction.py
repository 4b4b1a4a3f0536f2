"""Compaction: merges a shard's small archive files of one hour into files of
`file_target_bytes`, so that a reader that lists the archive at any moment, during a
compaction included, counts every message once.

How a reader never sees a merged file beside the files it replaces: each shard's files of an
hour live in a directory of their own (`.../hour=H/shard0003/`, see `layout`). Compaction
builds the directory's next content in a staging directory outside the archive root
(`<root>/../.<root name>.compacting/`, so that no glob under the root finds it): the merged
files, and hard links to the files it keeps. Then one `renameat2(RENAME_EXCHANGE)` swaps the
two directories: every listing sees either the old files or the new ones. The old content,
now in the staging directory, is deleted. A crash leaves at most a staging directory, deleted
at the next start (before the exchange the inputs are still in place; after it, they are
superseded). A reader that listed the old files and opens one after the exchange gets "file
not found" and must list again; it never counts a row twice.

Merged files are named `shard0003-<first>-<last>.c.parquet`: the offset range of their inputs
(progress and tiered replay read them as any file), marked so that a Spark Structured
Streaming query, which remembers files by path, can skip them (`storage.spark`); an hour is
compacted only `compact_after_s` after it ended, and a streaming query must run more often.

An object store (S3) has no atomic way to replace several objects, and no rename. There a
reader must never see a merged file beside its inputs, so the merged file is first uploaded
whole (one PUT: complete or absent) to the staging area beside the root
(`<parent>/.<root name>.compacting/stream=.../shard0003/<merged name>`, `layout.staging_root`),
where no reader of the root looks; then the inputs are deleted (one DeleteObjects request);
then the staged file is copied into its place (one server-side CopyObject: the object appears
whole) and the staged copy deleted. The staged file is the commit mark: the listing every
reader of this project uses (`layout.list_stream_files`: the archiver's progress, tiered
replay, `ArchiveReader`) lists it and hides the inputs it covers from the moment it exists,
so these readers see every row exactly once throughout. A tool that lists the root itself
(pyarrow, pandas, polars, DuckDB, Spark) sees the inputs, then, between the delete and the
copy (two requests), neither the inputs nor the merged file: for that moment a count is short
of those rows, never above; then the merged file. A crash at any step leaves a staged file
that the next round finishes (`finish_compactions`: delete the inputs, copy, delete the staged
file). A root with no parent inside its bucket (`s3://bucket`) has no place beside it: there
compaction is off (`layout.staging_root` is None).

Runs in a worker thread, under the archiver's lock (no file of the shard is written meanwhile).
"""

from __future__ import annotations

import calendar
import ctypes
import errno
import logging
import os
import re
import shutil
import uuid
from collections.abc import Iterable

import pyarrow as pa
import pyarrow.parquet as pq
from fsspec import AbstractFileSystem

from . import layout
from .columns import encode_parquet

log = logging.getLogger(__name__)

RENAME_EXCHANGE = 2
"""linux/fs.h: atomically exchange the two paths."""
AT_FDCWD = -100
_HOUR_DIR = re.compile(r"/date=(\d{4})-(\d{2})-(\d{2})/hour=(\d{1,2})/shard\d{4,}$")


class CompactionUnsupported(OSError):
    """The filesystem cannot exchange two directories atomically."""


def _renameat2() -> object | None:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.renameat2
    except (OSError, AttributeError):
        return None


def exchange(first: str, second: str) -> None:
    """Swap the directories at `first` and `second` in one atomic step."""
    call = _renameat2()
    if call is None:
        raise CompactionUnsupported(errno.ENOSYS, "renameat2 is not available")
    result = call(AT_FDCWD, os.fsencode(first), AT_FDCWD, os.fsencode(second),  # type: ignore[operator]
                  RENAME_EXCHANGE)
    if result != 0:
        code = ctypes.get_errno()
        if code in (errno.EINVAL, errno.ENOSYS, errno.EXDEV, errno.ENOTSUP):
            raise CompactionUnsupported(code, f"cannot exchange {first} and {second}: "
                                              f"{os.strerror(code)}")
        raise OSError(code, os.strerror(code), second)


def staging_root(root: str) -> str:
    """The local staging directory (`layout.staging_root`)."""
    parent, name = os.path.split(root.rstrip("/"))
    return os.path.join(parent, f".{name}.compacting")


def clear_staging(root: str) -> None:
    """Delete what a compaction that crashed left (see the module docstring)."""
    shutil.rmtree(staging_root(root), ignore_errors=True)


def hour_end_ms(directory: str) -> int | None:
    """When the hour of a shard directory ends (ms since the epoch); None for another path."""
    match = _HOUR_DIR.search(directory)
    if match is None:
        return None
    year, month, day, hour = (int(group) for group in match.groups())
    return (calendar.timegm((year, month, day, hour, 0, 0)) + 3600) * 1000


def plan(files: list[layout.ArchiveFile], target_bytes: int,
         versions: list[bytes | None] | None = None) -> list[list[layout.ArchiveFile]]:
    """Runs of consecutive files (offset order) to merge: at least two each, their sizes
    adding up to at most `target_bytes`, of one schema version each (`versions`, per file: a
    file's rows are rebuilt into payloads with the schema in its footer); a file of the target
    size or more stays alone."""
    runs: list[list[layout.ArchiveFile]] = []
    current: list[layout.ArchiveFile] = []
    size = 0
    for index, entry in enumerate(files):
        other_version = bool(current) and versions is not None and versions[index] != versions[index - 1]
        if current and (size + entry.size > target_bytes or entry.size >= target_bytes
                        or other_version):
            if len(current) > 1:
                runs.append(current)
            current, size = [], 0
        if entry.size >= target_bytes:
            continue
        current.append(entry)
        size += entry.size
    if len(current) > 1:
        runs.append(current)
    return runs


def schema_versions(files: list[layout.ArchiveFile],
                    fs: AbstractFileSystem | None = None) -> list[bytes | None]:
    """The registered schema version in each file's footer (None: an untyped file)."""
    out = []
    for entry in files:
        metadata = pq.read_metadata(entry.path, filesystem=fs).metadata or {}
        out.append(metadata.get(b"shardgate.schema.version"))
    return out


def shard_directories(files: Iterable[layout.ArchiveFile]) -> dict[str, list[layout.ArchiveFile]]:
    """The files of each shard directory (files of the older layout, directly in an hour
    directory, are left alone)."""
    out: dict[str, list[layout.ArchiveFile]] = {}
    for entry in files:
        if entry.staged:
            continue
        directory, _name = entry.path.rsplit("/", 1)
        if directory.rsplit("/", 1)[-1] == layout.shard_dir_name(entry.shard):
            out.setdefault(directory, []).append(entry)
    for entries in out.values():
        entries.sort()
    return out


def merge(run: list[layout.ArchiveFile], stream: str, compression_level: int,
          row_group_rows: int, fs: AbstractFileSystem | None = None) -> bytes:
    """One Parquet file holding the rows of `run`, in offset order."""
    tables = [pq.read_table(entry.path, filesystem=fs) for entry in run]
    table = pa.concat_tables(tables, promote_options="default")
    return encode_parquet(table, compression_level=compression_level,
                          row_group_rows=row_group_rows, metadata={
                              "shardgate.stream": stream,
                              "shardgate.shard": str(run[0].shard),
                              "shardgate.first_offset": str(run[0].first_offset),
                              "shardgate.last_offset": str(run[-1].last_offset),
                              "shardgate.compacted_from": str(len(run)),
                          })


def compact_directory(root: str, stream: str, directory: str,
                      files: list[layout.ArchiveFile], target_bytes: int,
                      compression_level: int = 3, row_group_rows: int = 64 * 1024) -> int:
    """Merge the small files of one shard directory (see the module docstring); returns how
    many files were replaced (0: nothing to do)."""
    if not plan(files, target_bytes):
        return 0
    runs = plan(files, target_bytes, schema_versions(files))
    if not runs:
        return 0
    staging = staging_root(root)
    os.makedirs(staging, exist_ok=True)
    building = os.path.join(staging, uuid.uuid4().hex)
    os.mkdir(building)
    try:
        merged = {entry.path for run in runs for entry in run}
        for name in os.listdir(directory):
            path = os.path.join(directory, name)
            if path not in merged and not name.startswith("."):
                os.link(path, os.path.join(building, name))
        for run in runs:
            name = layout.merged_file_name(run[0].shard, run[0].first_offset, run[-1].last_offset)
            _write(os.path.join(building, name),
                   merge(run, stream, compression_level, row_group_rows))
        _fsync_dir(building)
        exchange(building, directory)
        _fsync_dir(os.path.dirname(directory))
        _fsync_dir(staging)
    finally:
        shutil.rmtree(building, ignore_errors=True)  # after the exchange: the old files
    return len(merged)


def compact_object_store(fs: AbstractFileSystem, root: str, stream: str,
                         files: list[layout.ArchiveFile], target_bytes: int,
                         compression_level: int = 3, row_group_rows: int = 64 * 1024) -> int:
    """Merge the small files of one shard directory on an object store: stage each merged
    file, delete its inputs, copy it into place (see the module docstring); returns how many
    files were replaced."""
    staging = layout.staging_root(root)
    if staging is None:
        raise CompactionUnsupported(errno.ENOTSUP, f"the archive root {root!r} has no parent "
                                    "directory to stage merged files in (use a prefix, e.g. "
                                    "s3://bucket/archive)")
    files = [entry for entry in files if not entry.staged]
    if not plan(files, target_bytes):
        return 0
    runs = plan(files, target_bytes, schema_versions(files, fs))
    replaced = 0
    for run in runs:
        directory = run[0].path.rsplit("/", 1)[0]
        name = layout.merged_file_name(run[0].shard, run[0].first_offset, run[-1].last_offset)
        staged = f"{staging}{directory[len(root):]}/{name}"
        fs.pipe_file(staged, merge(run, stream, compression_level, row_group_rows, fs))
        fs.rm([entry.path for entry in run])
        fs.copy(staged, f"{directory}/{name}")
        fs.rm_file(staged)
        replaced += len(run)
    return replaced


def finish_compactions(fs: AbstractFileSystem, root: str, stream: str) -> int:
    """Finish what compactions that stopped half-way left (see the module docstring): each
    staged file's inputs deleted, the file copied into place (unless it is there already) and
    the staged copy deleted; files a merged file in place covers deleted. Returns how many
    files were deleted."""
    files = layout.list_stream_files(fs, root, stream, include_superseded=True)
    removed = 0
    for entry in files:
        if not entry.staged:
            continue
        inside = any(f.shard == entry.shard and f.first_offset <= entry.first_offset
                     and entry.last_offset <= f.last_offset for f in files
                     if layout.is_merged(f) and not f.staged)
        if not inside:  # (in place already, or merged again since: only the staged copy goes)
            covered = [f.path for f in files if not f.staged and f.shard == entry.shard
                       and entry.first_offset <= f.first_offset and f.last_offset <= entry.last_offset]
            if covered:
                fs.rm(covered)
                removed += len(covered)
            fs.copy(entry.path, layout.placed_path(root, entry))
        fs.rm_file(entry.path)
    files = layout.list_stream_files(fs, root, stream, include_superseded=True)
    hidden = layout.superseded([entry for entry in files if not entry.staged])
    if hidden:
        fs.rm([entry.path for entry in hidden])
    return removed + len(hidden)


def _write(path: str, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_dir(directory: str) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
