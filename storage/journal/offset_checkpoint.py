"""One offset of a shard log kept in a small file of the shard's directory, with the leader
epoch of the record before it, after Kafka's offset checkpoint files
(`replication-offset-checkpoint`): the replication layer keeps there how far a replicated
shard was dispatched (`shardgate/cluster/dispatch_checkpoints.py`), so that it survives a
restart. The file lives and dies with the shard's log: an emptied data directory, or a deleted
shard, has none. The epoch tells whether the log read later is still the one the offset was
kept for (KIP-101: a record's offset and epoch name the log before it), as `epochs.py` keeps
them.

The file is text:

    0            version
    1200 3       the offset, the epoch of the record before it (-1: none)

It is replaced atomically (a temporary file, then a rename): a crash of the process leaves the
old offset or the new one. `write(sync=True)` makes the new one durable before the rename;
without it (the frequent background writes) a crash of the machine may also leave a file that
was not written out: empty, or zeros. Such a file, and any file not in the format above, reads
as no offset (`read`: None), never as another number: a caller that reads the offset as "at
least this far" must never get one higher than it wrote. This module knows nothing of what the
offset means.
"""
from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Final

from .epochs import UNDEFINED
from .segment_files import write_all

CHECKPOINT_VERSION: Final = 0

log = logging.getLogger(__name__)


class OffsetCheckpoint:
    """The file `name` in a shard's `directory`, holding one offset and the leader epoch of
    the record before it (module docstring)."""

    __slots__ = ("path",)

    def __init__(self, directory: Path, name: str) -> None:
        self.path = Path(directory) / name

    def read(self) -> tuple[int, int] | None:
        """The offset and epoch written last; None with no file, or one not as this module
        writes it."""
        try:
            data = self.path.read_bytes()
        except FileNotFoundError:
            return None
        except OSError as exc:
            log.warning("%s: cannot be read (%s); taken as no offset", self.path, exc)
            return None
        lines = data.split(b"\n")
        fields = lines[1].split(b" ") if len(lines) == 3 else []
        if (len(fields) != 2 or lines[0] != str(CHECKPOINT_VERSION).encode() or lines[2]
                or not fields[0].isdigit()
                or not (fields[1].isdigit() or fields[1] == str(UNDEFINED).encode())):
            log.warning("%s: not an offset checkpoint (%d bytes); taken as no offset",
                        self.path, len(data))
            return None
        return int(fields[0]), int(fields[1])

    def write(self, offset: int, epoch: int, *, sync: bool = False) -> None:
        """Replace the file with `offset` and `epoch` (atomically; durable first with `sync`).
        OSError if the directory is gone or the disk refuses the write (the old file is left as
        it was)."""
        if offset < 0 or epoch < UNDEFINED:
            raise ValueError(f"{self.path}: offset {offset}, epoch {epoch}")
        final = self.path
        temp = final.with_name(final.name + ".tmp")
        fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            write_all(fd, f"{CHECKPOINT_VERSION}\n{offset} {epoch}\n".encode("ascii"))
            if sync:
                os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(temp, final)
