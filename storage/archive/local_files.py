"""Writing an archive file on a local disk all at once: a temporary file, fsynced, renamed over
the file, the directory fsynced. The temporary is written outside the archive root where the
caller says (`layout.writing_root`, beside the root): a reader that opens the root's directory
(polars refuses a directory holding files of two extensions, DuckDB's and polars' globs read
dot-named files) never meets it. No archive logic.
"""

from __future__ import annotations

import contextlib
import errno
import os
import uuid


def write_local_atomically(path: str, data: bytes, temp_dir: str | None = None) -> None:
    """Write a dot-named temporary file in `temp_dir` (created if missing; default: beside
    `path`), fsync it, rename it over `path` and fsync the directory: readers see the whole
    file or nothing. If `temp_dir` is on another filesystem than `path` (the root is a mount
    point), the temporary goes beside `path` instead."""
    directory, name = os.path.split(path)
    created = _make_dirs(directory)
    if temp_dir is not None:
        os.makedirs(temp_dir, exist_ok=True)
    temp = os.path.join(temp_dir or directory, f".{name}.{uuid.uuid4().hex[:12]}.tmp")
    fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        try:
            view = memoryview(data)
            while view:
                written = os.write(fd, view)
                view = view[written:]
            os.fsync(fd)
        finally:
            os.close(fd)
        try:
            os.replace(temp, path)
        except OSError as exc:
            if exc.errno != errno.EXDEV or temp_dir is None:
                raise
            os.unlink(temp)
            write_local_atomically(path, data)
            return
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temp)
        raise
    for synced in (directory, *created):
        _fsync_dir(synced)


def _make_dirs(directory: str) -> list[str]:
    """Create `directory` and its missing parents; returns the parents of what was created
    (their entries must be fsynced too)."""
    missing = []
    current = directory
    while not os.path.isdir(current):
        missing.append(current)
        parent = os.path.dirname(current)
        if parent == current:
            break
        current = parent
    os.makedirs(directory, exist_ok=True)
    return [os.path.dirname(path) for path in missing]


def _fsync_dir(directory: str) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
