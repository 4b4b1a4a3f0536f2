"""Compaction: merges a shard's small archive files of one hour into files of
`file_target_bytes`, so that a reader that lists the archive at any moment, during a
compaction included, counts every message once (on an object store: a reader of the files the
project's listing names; a tool listing the root there may count short for a moment, below).

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

An object store (S3) has no atomic way to replace several objects, and no rename. The
merged file is first uploaded whole (one PUT: complete or absent) to the staging area beside
the root (`<parent>/.<root name>.compacting/stream=.../shard0003/<merged name>`,
`layout.staging_root`), where no reader of the root looks. Then its place is made ready: a
multipart upload to it is begun and its part copied server-side from the staged file
(`Placement`; nothing a listing shows yet). Then the inputs are deleted (one DeleteObjects
request), then the upload is completed (one CompleteMultipartUpload: the object appears
whole, in a request that moves no data), and the staged copy is deleted. Filesystems without
multipart uploads copy the staged file into place instead (one server-side copy). The staged
file is the commit mark: the listing every reader of this project uses
(`layout.list_stream_files`: the archiver's progress, tiered replay, `ArchiveReader`, and
`layout.archive_files` for any other tool) lists it and hides the inputs it covers from the
moment it exists, so these readers see every row exactly once throughout. A crash at any
step leaves a staged file that the next round finishes (`finish_compactions`: delete the
inputs, place it, delete the staged file) and at most a multipart upload, aborted once an
hour old (`abort_stale_uploads`).

A tool that lists the root itself (pyarrow, pandas, polars, DuckDB, Spark) cannot be exact
throughout on an object store, whatever the layout: each request changes one object (a
DeleteObjects request is not atomic either), and which objects such a tool reads depends on
each object's own name alone (pyarrow, pandas and Spark skip names that start with `_` or
`.`; DuckDB's and polars' globs match names). So a request can change the rows of one
visible object only, and the count stays right only if that object's rows stay the same: no
sequence of requests moves the rows of N files into fewer without a state in between that
shows some rows twice (merged file first) or not at all (inputs first). Compaction takes the
second: such a tool sees the inputs, then, between the deletion of the inputs and the
completion of the upload (about two requests' time, whatever the file's size), neither the
inputs nor the merged file (short of those rows, never above), then the merged file. A tool
that must count exactly at any moment reads the files `layout.archive_files` names (Spark:
`storage.spark.read_archive_files`, which reads the staged ones with a `basePath` of their
own). A root
with no parent inside its bucket (`s3://bucket`) has no place beside it: there compaction is
off (`layout.staging_root` is None).

Runs in a worker thread, under the archiver's lock (no file of the shard is written meanwhile).
"""

from __future__ import annotations

import calendar
import contextlib
import ctypes
import errno
import logging
import os
import re
import shutil
import time
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
MAX_COPY_PART = 5 * 2**30
"""S3: UploadPartCopy copies at most 5 GiB per part."""
STALE_UPLOAD_S = 3600.0
"""A multipart upload of a merged file this old was left by a compaction that stopped."""
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
    file, make its place ready, delete its inputs, publish it in place (see the module
    docstring); returns how many files were replaced."""
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
        data = merge(run, stream, compression_level, row_group_rows, fs)
        fs.pipe_file(staged, data)
        placement = Placement.prepare(fs, staged, f"{directory}/{name}", len(data))
        try:
            fs.rm([entry.path for entry in run])
        except BaseException:
            placement.abort()
            raise
        placement.publish()
        fs.rm_file(staged)
        replaced += len(run)
    return replaced


class Placement:
    """A staged merged file made ready to appear at its place under the root, so that the
    moment a plain reader of the root counts short (from the deletion of the inputs until the
    merged file appears) lasts one small request, whatever the file's size.

    On S3 (s3fs) a multipart upload to the place is begun and its part copied server-side
    from the staged file (UploadPartCopy) before the inputs are deleted; `publish` completes
    it (CompleteMultipartUpload: the object appears whole, in one request that moves no
    data). Elsewhere, or when the upload cannot be used, `publish` copies the staged file
    (one server-side copy, which takes longer the larger the file)."""

    def __init__(self, fs: AbstractFileSystem, staged: str, target: str,
                 upload: tuple[str, str, str, list[dict[str, object]]] | None = None) -> None:
        self.fs = fs
        self.staged = staged
        self.target = target
        self.upload = upload
        """(bucket, key, upload id, parts) of the multipart upload ready to complete."""

    @classmethod
    def prepare(cls, fs: AbstractFileSystem, staged: str, target: str, size: int) -> Placement:
        call = getattr(fs, "call_s3", None)
        if call is None or not callable(getattr(fs, "split_path", None)) or size <= 0:
            return cls(fs, staged, target)
        bucket, key, _version = fs.split_path(target)
        source = fs._strip_protocol(staged)
        try:
            upload_id = call("create_multipart_upload", Bucket=bucket, Key=key)["UploadId"]
        except OSError as exc:
            log.info("archive compaction: no multipart upload for %s (%s): copying instead",
                     target, exc)
            return cls(fs, staged, target)
        placement = cls(fs, staged, target, (bucket, key, upload_id, []))
        try:
            for number, start in enumerate(range(0, size, MAX_COPY_PART), start=1):
                last = min(size, start + MAX_COPY_PART) - 1
                part = call("upload_part_copy", Bucket=bucket, Key=key, UploadId=upload_id,
                            PartNumber=number, CopySource=source,
                            CopySourceRange=f"bytes={start}-{last}")
                placement.upload[3].append(  # type: ignore[index]
                    {"PartNumber": number, "ETag": part["CopyPartResult"]["ETag"]})
        except OSError as exc:  # (a store without UploadPartCopy, say)
            placement.abort()
            log.info("archive compaction: cannot copy %s into an upload (%s): copying instead",
                     staged, exc)
            return cls(fs, staged, target)
        except BaseException:
            placement.abort()
            raise
        return placement

    def publish(self) -> None:
        """Make the merged file appear at its place."""
        if self.upload is not None:
            bucket, key, upload_id, parts = self.upload
            try:
                self.fs.call_s3(  # type: ignore[attr-defined]
                    "complete_multipart_upload", Bucket=bucket, Key=key, UploadId=upload_id,
                    MultipartUpload={"Parts": parts})
                self.fs.invalidate_cache(self.target)
                return
            except OSError as exc:  # (aborted meanwhile, e.g. by `abort_stale_uploads`)
                log.info("archive compaction: completing the upload of %s failed (%s): "
                         "copying instead", self.target, exc)
                self.upload = None
        self.fs.copy(self.staged, self.target)

    def abort(self) -> None:
        """Give the multipart upload up (the merged file stays staged: the next round
        finishes it)."""
        if self.upload is None:
            return
        bucket, key, upload_id, _parts = self.upload
        self.upload = None
        try:
            self.fs.call_s3(  # type: ignore[attr-defined]
                "abort_multipart_upload", Bucket=bucket, Key=key, UploadId=upload_id)
        except OSError as exc:
            log.info("archive compaction: cannot abort the upload of %s: %s", key, exc)


def abort_stale_uploads(fs: AbstractFileSystem, root: str, stream: str,
                        older_than_s: float = STALE_UPLOAD_S, now: float | None = None) -> int:
    """Abort the multipart uploads of merged files that a compaction stopped half-way left
    (S3 keeps and bills their parts until then) once `older_than_s` old: the store's
    `Initiated` time of the upload against `now` (seconds since the epoch; default the
    clock's). Younger ones may belong to a compaction running now on another node. Returns
    how many were aborted."""
    call = getattr(fs, "call_s3", None)
    if call is None or not callable(getattr(fs, "split_path", None)):
        return 0
    bucket, prefix, _version = fs.split_path(layout.stream_dir(root, stream) + "/")
    oldest = (time.time() if now is None else now) - older_than_s
    aborted = 0
    try:
        listing = call("list_multipart_uploads", Bucket=bucket, Prefix=prefix)
    except OSError as exc:
        log.info("archive compaction: cannot list multipart uploads under %s: %s", prefix, exc)
        return 0
    for upload in listing.get("Uploads", []):
        key = upload.get("Key", "")
        initiated = upload.get("Initiated")
        if not key.endswith(".c.parquet") or initiated is None or initiated.timestamp() > oldest:
            continue
        with contextlib.suppress(OSError):
            call("abort_multipart_upload", Bucket=bucket, Key=key, UploadId=upload["UploadId"])
            aborted += 1
    return aborted


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
            placement = Placement.prepare(fs, entry.path, layout.placed_path(root, entry),
                                          entry.size)
            if covered:
                try:
                    fs.rm(covered)
                except BaseException:
                    placement.abort()
                    raise
                removed += len(covered)
            placement.publish()
        fs.rm_file(entry.path)
    abort_stale_uploads(fs, root, stream)
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
