"""Where archive files live: the fsspec filesystem of an archive URL, the Hive-partitioned
paths (`stream=<name>/date=YYYY-MM-DD/hour=H/shard0003/`), the file names that carry a shard
and an offset range, and the listing that rebuilds what the archive holds from those names
alone.

File names are the archive's only bookkeeping: `shard0003-<first>-<last>.parquet` with
20-digit zero-padded offsets (both inclusive). Each shard's files of an hour sit in a
directory of their own (`shard0003/`, not a `key=value` name, so no reader takes it for a
partition): compaction replaces that directory's content in one atomic exchange
(`compaction.py`). The hour is written without a leading zero (`hour=7`), so that every reader
that infers partition types (DuckDB keeps `07` as text) reads an integer; archives written
before hold `hour=07` directories too, and files directly in the hour directory, which are
read the same way. Files still being written locally are dot-named, end in `.tmp` and lie
outside the root (`writing_root`, beside it), so no reader of the root meets them (polars
refuses a directory holding a `.tmp` beside `.parquet` files); older archivers wrote them
inside, which the listing here skips and `stale_temporaries` removes. This module does no
Parquet encoding and keeps no state.
"""

from __future__ import annotations

import contextlib
import os
import re
import time
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import fsspec
from fsspec import AbstractFileSystem
from fsspec.implementations.local import LocalFileSystem

from .settings import ArchiveConfigError, ArchiveSettings

STREAM_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.\-]{0,127}$")
FILE_NAME = re.compile(r"^shard(\d{4,})-(\d{20})-(\d{20})(?:\.c)?\.parquet$")
WRITTEN_GLOB = "shard*[0-9].parquet"
"""The names of the files the archiver writes, not those compaction merged (`.c.parquet`)."""
HOUR_MS = 3_600_000
OBJECT_STORE_PROTOCOLS = frozenset({"s3", "s3a", "gs", "gcs", "abfs", "az", "adl", "oss"})


@dataclass(slots=True, frozen=True, order=True)
class ArchiveFile:
    """One finished archive file, as its name describes it."""

    shard: int
    first_offset: int
    last_offset: int
    path: str
    size: int = 0
    staged: bool = False
    """A merged file in the staging area beside the root (`staging_root`), not yet copied to
    its place: compaction on an object store (`compaction.py`)."""


def check_stream_name(stream: str) -> str:
    if not STREAM_NAME.match(stream):
        raise ValueError(
            f"stream name {stream!r} cannot be archived: 1-128 of [A-Za-z0-9_.-], not "
            "starting with . or -"
        )
    return stream


def file_name(shard: int, first_offset: int, last_offset: int) -> str:
    return f"shard{shard:04d}-{first_offset:020d}-{last_offset:020d}.parquet"


def merged_file_name(shard: int, first_offset: int, last_offset: int) -> str:
    """The name of a file compaction merged (`compaction.py`)."""
    return f"shard{shard:04d}-{first_offset:020d}-{last_offset:020d}.c.parquet"


def parse_file_name(name: str) -> tuple[int, int, int] | None:
    """(shard, first offset, last offset) of an archive file name; None for anything else."""
    match = FILE_NAME.match(name)
    if match is None:
        return None
    shard, first, last = (int(group) for group in match.groups())
    return (shard, first, last) if first <= last else None


def staging_root(root: str) -> str | None:
    """Where compaction stages its files: beside the root (`<parent>/.<root name>.compacting`),
    where no reader of the root looks (polars and DuckDB read dot- and underscore-named files
    inside it); None for a root with no parent (a bare bucket)."""
    parent, _sep, name = root.rstrip("/").rpartition("/")
    if not parent or not name:
        return None
    return f"{parent}/.{name}.compacting"


def writing_root(root: str) -> str | None:
    """Where a local archive's files are written before they are renamed into place: beside
    the root (`<parent>/.<root name>.writing`); None for a root with no parent."""
    parent, _sep, name = root.rstrip("/").rpartition("/")
    if not parent or not name:
        return None
    return f"{parent}/.{name}.writing"


STALE_WRITING_S = 3600.0
"""A temporary in `writing_root` this old was left by a writer that crashed (another node
sharing the root may be writing the younger ones)."""


def stream_dir(root: str, stream: str) -> str:
    return f"{root}/stream={check_stream_name(stream)}"


def partition_dir(root: str, stream: str, timestamp_ms: int) -> str:
    """The `date=/hour=` directory (UTC) of a record published at `timestamp_ms`."""
    stamp = time.gmtime(timestamp_ms // 1000)
    return f"{stream_dir(root, stream)}/date={stamp.tm_year:04d}-{stamp.tm_mon:02d}-{stamp.tm_mday:02d}/hour={stamp.tm_hour}"


def shard_dir_name(shard: int) -> str:
    return f"shard{shard:04d}"


def shard_dir(root: str, stream: str, shard: int, timestamp_ms: int) -> str:
    """The directory of `shard`'s files of the hour of `timestamp_ms`."""
    return f"{partition_dir(root, stream, timestamp_ms)}/{shard_dir_name(shard)}"


def hour_of(timestamp_ms: int) -> int:
    return timestamp_ms // HOUR_MS


def filesystem_options(url: str, settings: ArchiveSettings) -> dict[str, Any]:
    """fsspec keyword arguments for `url` from the settings (S3: endpoint, region, keys)."""
    options: dict[str, Any] = {}
    scheme = url_scheme(url)
    if scheme in ("s3", "s3a"):
        client_kwargs: dict[str, Any] = {}
        endpoint = settings.endpoint_url or os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get(
            "AWS_ENDPOINT_URL"
        )
        if endpoint:
            client_kwargs["endpoint_url"] = endpoint
        region = settings.region or os.environ.get("AWS_REGION") or os.environ.get(
            "AWS_DEFAULT_REGION"
        )
        if region:
            client_kwargs["region_name"] = region
        if client_kwargs:
            options["client_kwargs"] = client_kwargs
        if settings.access_key_id:
            options["key"] = settings.access_key_id
        if settings.secret_access_key:
            options["secret"] = settings.secret_access_key
        # Listings must see files written by other processes (the broker, a reader).
        options["use_listings_cache"] = False
    options.update(settings.storage_options)
    return options


def url_scheme(url: str) -> str:
    if "::" in url:  # a chained URL, e.g. simplecache::s3://...
        url = url.rsplit("::", 1)[-1]
    return urlsplit(url).scheme or "file"


def open_filesystem(
    url: str, settings: ArchiveSettings | None = None
) -> tuple[AbstractFileSystem, str]:
    """The filesystem and root path of an archive URL; ArchiveConfigError when the scheme is
    unknown or its fsspec implementation is not installed."""
    settings = settings or ArchiveSettings()
    if not url:
        raise ArchiveConfigError("the archive URL is empty")
    scheme = url_scheme(url)
    try:
        fsspec.get_filesystem_class(scheme)
    except ValueError as exc:
        raise ArchiveConfigError(
            f"archive URL {url!r}: unknown scheme {scheme!r} (use file://, s3:// or another "
            "fsspec filesystem)"
        ) from exc
    except ImportError as exc:
        raise ArchiveConfigError(
            f"archive URL {url!r}: the {scheme!r} filesystem needs a package that is not "
            f"installed: {exc}"
        ) from exc
    try:
        fs, root = fsspec.core.url_to_fs(url, **filesystem_options(url, settings))
    except (ValueError, TypeError, ImportError) as exc:
        raise ArchiveConfigError(f"archive URL {url!r}: {exc}") from exc
    root = root.rstrip("/")
    if is_local(fs):
        root = os.path.abspath(root)
    elif not root:
        raise ArchiveConfigError(f"archive URL {url!r} names no bucket or directory")
    return fs, root


def _protocols(fs: AbstractFileSystem) -> tuple[str, ...]:
    return tuple(fs.protocol) if isinstance(fs.protocol, tuple | list) else (fs.protocol,)


def is_local(fs: AbstractFileSystem) -> bool:
    """A local disk, written with temp file, fsync and rename."""
    return isinstance(fs, LocalFileSystem) and any(p in ("file", "local") for p in _protocols(fs))


def is_object_store(fs: AbstractFileSystem) -> bool:
    return any(protocol in OBJECT_STORE_PROTOCOLS for protocol in _protocols(fs))


def is_merged(entry: ArchiveFile) -> bool:
    """A file compaction wrote (`...<last>.c.parquet`)."""
    return entry.path.endswith(".c.parquet")


def superseded(files: list[ArchiveFile]) -> list[ArchiveFile]:
    """The files (of `files`, sorted) whose offsets a merged file of their shard holds: on an
    object store compaction stages the merged file first, then deletes its inputs, then copies
    it into place, so a merged file (staged or in place) is the commit mark of its compaction
    and hides what its name covers; a staged file is hidden by its copy in place."""
    merged: dict[int, list[tuple[int, int]]] = {}
    in_place: set[tuple[int, int, int]] = set()
    for entry in files:
        if is_merged(entry):
            merged.setdefault(entry.shard, []).append((entry.first_offset, entry.last_offset))
            if not entry.staged:
                in_place.add((entry.shard, entry.first_offset, entry.last_offset))
    if not merged:
        return []
    out = []
    for entry in files:
        if entry.staged and (entry.shard, entry.first_offset, entry.last_offset) in in_place:
            out.append(entry)
            continue
        own = (entry.first_offset, entry.last_offset) if is_merged(entry) else None
        for first, last in merged.get(entry.shard, ()):
            # (a merged file is hidden by a larger one: a compaction that merged it again)
            if (first, last) != own and first <= entry.first_offset and entry.last_offset <= last:
                out.append(entry)
                break
    return out


def list_stream_files(fs: AbstractFileSystem, root: str, stream: str,
                      include_superseded: bool = False) -> list[ArchiveFile]:
    """Every finished archive file of `stream`, sorted by (shard, first offset). Files whose
    name is not an archive file name (dot-named temporaries included) are ignored, and so are
    files a merged file supersedes (`superseded`) unless `include_superseded`. On an object
    store the merged files compaction staged (`staging_root`) are listed too (`staged`): they
    hold rows whose inputs may be deleted already."""
    files = _find_files(fs, stream_dir(root, stream))
    staging = None if is_local(fs) else staging_root(root)
    if staging is not None:
        files += [entry for entry in _find_files(fs, stream_dir(staging, stream), staged=True)
                  if is_merged(entry)]
    files.sort()
    if include_superseded:
        return files
    hidden = set(superseded(files))
    return [entry for entry in files if entry not in hidden] if hidden else files


def archive_files(url: str, stream: str | None = None,
                  settings: ArchiveSettings | None = None) -> list[str]:
    """The URLs of the files that hold every archived row of `stream` (None: of every
    stream) once, at this moment, compactions included: the listing the project's readers
    use (`list_stream_files`). A tool given these paths counts exactly where one that lists
    the root itself may, during a compaction on an object store, count short for a moment
    (`compaction.py`). Hive partitions are read from the paths (`stream=`, `date=`, `hour=`;
    a merged file not yet in place is listed in the staging area beside the root, under the
    same partition directories; Spark reads them with `storage.spark.read_archive_files`).
    A path can vanish before it is read (compacted meanwhile): ask again."""
    fs, root = open_filesystem(url, settings)
    if stream is not None:
        streams = [stream]
    else:
        try:
            entries = fs.ls(root, detail=False)
        except FileNotFoundError:
            entries = []
        streams = sorted(name.rstrip("/").rsplit("/", 1)[-1][len("stream="):] for name in entries
                         if name.rstrip("/").rsplit("/", 1)[-1].startswith("stream="))
    paths = [entry.path for name in streams if STREAM_NAME.match(name)
             for entry in list_stream_files(fs, root, name)]
    return paths if is_local(fs) else [fs.unstrip_protocol(path) for path in paths]


def _find_files(fs: AbstractFileSystem, directory: str, staged: bool = False) -> list[ArchiveFile]:
    try:
        fs.invalidate_cache(directory)
    except Exception:  # noqa: BLE001 - caching is an optimisation of some filesystems only
        pass
    try:
        found = fs.find(directory, detail=True)
    except FileNotFoundError:
        return []
    files = []
    for path, info in found.items():
        relative = path[len(directory):]
        if "/." in relative or "/_" in relative:
            continue  # hidden: a temporary, a directory being built
        name = path.rsplit("/", 1)[-1]
        parsed = parse_file_name(name)
        if parsed is None:
            continue
        shard, first, last = parsed
        files.append(ArchiveFile(shard, first, last, path, int(info.get("size") or 0), staged))
    return files


def placed_path(root: str, entry: ArchiveFile) -> str:
    """Where a staged merged file goes (its path under the root)."""
    staging = staging_root(root)
    if not entry.staged or staging is None or not entry.path.startswith(staging + "/"):
        return entry.path
    return root + entry.path[len(staging):]


def stale_temporaries(fs: AbstractFileSystem, root: str, stream: str) -> list[str]:
    """Dot-named temporary files left in a local archive by a writer that crashed: in the
    stream's directories (older archivers) and, an hour old, in `writing_root`."""
    if not is_local(fs):
        return []
    directory = stream_dir(root, stream)
    stale = []
    for dirpath, _dirnames, filenames in os.walk(directory):
        stale += [os.path.join(dirpath, name) for name in filenames
                  if name.startswith(".shard") and name.endswith(".tmp")]
    writing = writing_root(root)
    if writing is not None and os.path.isdir(writing):
        old = time.time() - STALE_WRITING_S
        for name in os.listdir(writing):
            path = os.path.join(writing, name)
            with contextlib.suppress(OSError):
                if (name.startswith(".shard") and name.endswith(".tmp")
                        and os.stat(path).st_mtime < old):
                    stale.append(path)
    return stale
