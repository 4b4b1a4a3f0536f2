"""`ShardState`: what the archiver knows of one shard it archives (progress, the buffer being
assembled, the file being uploaded, failures and backoff), and how store errors are described.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

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
    prebuilt: tuple[RecordBuffer, int, asyncio.Future[pa.Table]] | None = None
    """The table of the buffer (as it was at that length), built while the file before it
    was being uploaded; used by the next seal if the buffer is still the same."""


def forget_prebuilt(prebuilt: tuple[RecordBuffer, int, asyncio.Future[pa.Table]] | None) -> None:
    """Forget a table built ahead (its buffer was dropped or changed)."""
    if prebuilt is not None:
        # Retrieve its outcome once done, so that a failed build is not reported as lost.
        prebuilt[2].add_done_callback(lambda f: f.cancelled() or f.exception())


def describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def is_auth_error(exc: BaseException) -> bool:
    if isinstance(exc, PermissionError):
        return True
    text = str(exc)
    return any(code in text for code in _AUTH_ERRORS)
