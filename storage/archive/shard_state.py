"""`ShardState`: what the archiver knows of one shard it archives (progress, the buffer being
assembled, the file being uploaded, failures and backoff), and how store errors are described.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa

from .buffer import RecordBuffer

_AUTH_ERRORS = (
    "InvalidAccessKeyId", "SignatureDoesNotMatch", "AccessDenied", "NoSuchBucket",
    "InvalidClientTokenId", "ExpiredToken", "AuthorizationHeaderMalformed",
)


@dataclass(slots=True)
class ShardState:
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


@dataclass(slots=True, frozen=True)
class Ahead:
    """The table of one part of a buffer (the records after the parts before it), built
    before the buffer is sealed: a whole row group as soon as it is read, or the last part
    once the buffer is a whole file."""

    rows: int
    key: tuple[Any, ...]
    """What the table was built with (the payload schema, the typed columns, whether payload
    bytes are kept): a seal uses it only while these are the same."""
    table: asyncio.Future[pa.Table]


@dataclass(slots=True)
class EncodingAhead:
    """The Parquet file of a buffer begun before the buffer is sealed: its first `parts`
    tables built ahead are handed to `encoder` (`columns.FileEncoder`) as parts 0, 1, ..., each
    once it is built; `tail` is done when every part handed over is encoded."""

    key: tuple[Any, ...]
    """What the tables were built with (as `Ahead.key`)."""
    encoder: Any
    parts: int = 0
    tail: asyncio.Future[None] | None = None


def retrieve(future: asyncio.Future[Any]) -> None:
    """Take a dropped future's outcome, so that its failure is not reported as lost."""
    if not future.cancelled():
        future.exception()


def forget_ahead(buffer: RecordBuffer, keep: int = 0) -> None:
    """Forget the tables built ahead from `buffer` after its first `keep` (the buffer is
    dropped, or those tables no longer fit it), and the file begun from them if it holds one
    of those."""
    for entry in buffer.ahead[keep:]:
        entry.table.add_done_callback(retrieve)
    del buffer.ahead[keep:]
    forget_encoding(buffer, keep)


def forget_encoding(buffer: RecordBuffer, keep: int = 0) -> None:
    """Drop the file begun from `buffer`'s tables built ahead if it holds more than `keep`."""
    encoding: EncodingAhead | None = buffer.encoding
    if encoding is not None and encoding.parts > keep:
        buffer.encoding = None
        if encoding.tail is not None:
            encoding.tail.add_done_callback(retrieve)


def describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def is_auth_error(exc: BaseException) -> bool:
    if isinstance(exc, PermissionError):
        return True
    text = str(exc)
    return any(code in text for code in _AUTH_ERRORS)
