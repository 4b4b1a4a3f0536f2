"""Writing an archive file on a local disk all at once: a temporary file beside it, fsynced,
renamed over it, the directory fsynced. No archive logic.
"""

from __future__ import annotations

import contextlib
import os
import uuid


def write_local_atomically(path: str, data: bytes) -> None:
    """Write a dot-named temporary file beside `path`, fsync it, rename it over `path` and
    fsync the directory: readers see the whole file or nothing."""
    directory, name = os.path.split(path)
    created = _make_dirs(directory)
    temp = os.path.join(directory, f".{name}.{uuid.uuid4().hex[:12]}.tmp")
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
        os.replace(temp, path)
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
