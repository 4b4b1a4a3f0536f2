"""The Parquet archive of reliable streams in object storage (fsspec): the `Archiver` that
moves committed journal records into Hive-partitioned Parquet files exactly once, and the
`ArchiveReader` that serves them back for tiered replay.

Layout: `<url>/stream=<name>/date=YYYY-MM-DD/hour=H/shard0003/shard0003-<first>-<last>.parquet`
(`layout`); `archive_files` names the files that hold each row once at any moment.
"""

# ruff: noqa: E402 - the compiled build is chosen before any module imports `footer`
import os

from ...core.native import use_compiled_if_current

# The Parquet footer stitching (`footer.py`, a Thrift reader in Python) runs compiled when
# `pip install` built it from this source: it is on the path of every archive file's seal.
use_compiled_if_current("shardgate.storage.archive.footer_native", os.path.dirname(__file__))

from .archiver import Archiver, StreamList, write_local_atomically
from .columns import ARROW_SCHEMA, DECODED_COLUMN, build_table, records_from_table
from .layout import (
    ArchiveFile,
    archive_files,
    file_name,
    list_stream_files,
    open_filesystem,
    parse_file_name,
)
from .reader import ArchiveReader
from .settings import ArchiveConfigError, ArchiveError, ArchiveSettings, ArchiveUnavailable

__all__ = [
    "ARROW_SCHEMA",
    "DECODED_COLUMN",
    "ArchiveConfigError",
    "ArchiveError",
    "ArchiveFile",
    "ArchiveReader",
    "ArchiveSettings",
    "ArchiveUnavailable",
    "Archiver",
    "archive_files",
    "StreamList",
    "build_table",
    "file_name",
    "list_stream_files",
    "open_filesystem",
    "parse_file_name",
    "records_from_table",
    "write_local_atomically",
]
