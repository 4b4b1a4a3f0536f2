"""The journal's open files, at most `limit` at once: a file is opened when a read or write
needs it and the least recently used ones are closed past the limit, as RabbitMQ's file handle
cache and PostgreSQL's virtual file descriptors do. A journal of many shards (19 streams of
1,024 partitions: a segment and a reservation file each) would otherwise hold a descriptor
per file for its whole life, and past the process's limit no client could connect.

A `FileHandle` is pinned while in use (`with handle as fd:`); a pinned file is never closed
under its user, so the descriptor number cannot be reused for another file meanwhile. Both
the event loop (reads) and the committer's worker thread (writes, fsyncs) use handles: the
one lock guards the table, never the I/O. A file closed and opened again keeps everything
written through it (fsync applies to the file, not to the descriptor).
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from pathlib import Path
from typing import Final

DEFAULT_OPEN_FILES: Final = 1024
"""The default of `journal.max_open_files`."""


class OpenFiles:
    """The table of one journal's open files (shared by its shard logs)."""

    __slots__ = ("limit", "_lock", "_open", "opened", "closed")

    def __init__(self, limit: int = DEFAULT_OPEN_FILES) -> None:
        if limit < 1:
            raise ValueError("the journal needs at least one open file")
        self.limit = limit
        self._lock = threading.Lock()
        # open handles, least recently used first
        self._open: OrderedDict[FileHandle, None] = OrderedDict()
        self.opened = 0  # counters (tests, metrics)
        self.closed = 0

    def __len__(self) -> int:
        return len(self._open)

    def handle(self, path: Path | str, flags: int, fd: int = -1) -> FileHandle:
        """A handle of `path`, opened with `flags` when used; `fd`: already open (counted)."""
        handle = FileHandle(self, str(path), flags)
        if fd >= 0:
            with self._lock:
                handle.fd = fd
                self._open[handle] = None
                self.opened += 1
                self._evict()
        return handle

    def _evict(self) -> None:
        """Close least recently used, unpinned files until at most `limit` are open (the lock
        is held). Pinned files stay: then more may be open for a moment."""
        excess = len(self._open) - self.limit
        if excess <= 0:
            return
        for handle in list(self._open):
            if handle.pins:
                continue
            del self._open[handle]
            fd, handle.fd = handle.fd, -1
            self.closed += 1
            try:
                os.close(fd)
            except OSError:
                pass
            excess -= 1
            if not excess:
                return


class FileHandle:
    """One journal file, open while used or recently used (see the module docstring)."""

    __slots__ = ("files", "path", "flags", "fd", "pins", "closing")

    def __init__(self, files: OpenFiles, path: str, flags: int) -> None:
        self.files = files
        self.path = path
        self.flags = flags
        self.fd = -1
        self.pins = 0
        self.closing = False  # closed for good once its last user is done

    def __enter__(self) -> int:
        files = self.files
        with files._lock:
            if self.fd < 0:
                self.fd = os.open(self.path, self.flags)
                files._open[self] = None
                files.opened += 1
                self.pins += 1
                files._evict()
            else:
                files._open.move_to_end(self)
                self.pins += 1
            return self.fd

    def __exit__(self, *exc: object) -> None:
        files = self.files
        with files._lock:
            self.pins -= 1
            if self.closing and not self.pins:
                fd = self._forget()
            else:
                fd = -1
                if len(files._open) > files.limit:
                    files._evict()
        if fd >= 0:
            os.close(fd)

    def _forget(self) -> int:
        """Out of the table (the lock is held); the descriptor to close, or -1."""
        self.files._open.pop(self, None)
        fd, self.fd = self.fd, -1
        if fd >= 0:
            self.files.closed += 1
        return fd

    def close(self) -> None:
        """Close the file for good (its segment is deleted or its log closed); a user still
        inside `with` keeps it until it is done."""
        with self.files._lock:
            if self.pins:
                self.closing = True
                return
            fd = self._forget()
        if fd >= 0:
            os.close(fd)

    @property
    def is_open(self) -> bool:
        return self.fd >= 0


_default: OpenFiles | None = None


def default_files() -> OpenFiles:
    """The table of segments opened without one (a shard log made on its own, tests)."""
    global _default
    if _default is None:
        _default = OpenFiles()
    return _default
