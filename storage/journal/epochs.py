"""The leader-epoch checkpoint of a shard log, after Kafka's KIP-101.

Each time a shard gets a new leader, the leader epoch grows; the leader records the pair
(epoch, first offset it writes under that epoch). The list of pairs, in increasing epoch and
start offset, says which leader wrote which part of the log. A follower (or a leader coming
back) asks its leader "where does my latest epoch end in your log?" (`end_offset_for`) and
truncates its own log there, instead of trusting its high watermark: that is what keeps two
replicas from diverging after a failover.

The file `leader-epoch-checkpoint` in the shard's directory is text, as Kafka's:

    0            version
    2            number of entries
    1 0          epoch start offset
    3 1200

It is replaced atomically on every change (temporary file, fsync, rename, fsync of the
directory): a crash leaves the old list or the new one. No file means no entry. This module
knows nothing of leaders or nodes: the replication layer calls it.
"""

from __future__ import annotations

import os
from bisect import bisect_right
from pathlib import Path
from typing import Final, NamedTuple

from ..interfaces import StorageError
from .segment import fsync_directory, write_all

CHECKPOINT_FILE: Final = "leader-epoch-checkpoint"
CHECKPOINT_VERSION: Final = 0
UNDEFINED: Final = -1
"""The epoch and offset `end_offset_for` answers when the log knows no epoch that early."""


class EpochEntry(NamedTuple):
    """Leader epoch `epoch` wrote its first record at `start_offset`."""

    epoch: int
    start_offset: int


class EpochEndOffset(NamedTuple):
    """The answer to "where does epoch E end": the largest epoch at or below E that the log
    knows, and the offset one past its last record (the start of the next epoch, or the log
    end for the latest). Both UNDEFINED when E is older than every known epoch."""

    epoch: int
    end_offset: int


class CorruptCheckpoint(StorageError):
    """The checkpoint file cannot be read: its path and what is wrong."""


class LeaderEpochCache:
    """The (epoch, start offset) list of one shard log, kept in `directory` (module docstring).
    Not thread-safe: the event loop owns it."""

    __slots__ = ("directory", "_entries")

    def __init__(self, directory: Path) -> None:
        self.directory = Path(directory)
        self._entries: list[EpochEntry] = self._load()

    @property
    def path(self) -> Path:
        return self.directory / CHECKPOINT_FILE

    @property
    def entries(self) -> tuple[EpochEntry, ...]:
        return tuple(self._entries)

    @property
    def latest_epoch(self) -> int:
        """The newest epoch, or UNDEFINED when there is none."""
        return self._entries[-1].epoch if self._entries else UNDEFINED

    def assign(self, epoch: int, start_offset: int) -> bool:
        """Record that `epoch` starts at `start_offset` (a new leader's first write). An epoch
        already known, or older than the latest, changes nothing. Entries at or after
        `start_offset` (written by earlier epochs and now truncated) are dropped. Returns
        whether the list changed (then it is durable when this returns)."""
        if epoch < 0 or start_offset < 0:
            raise ValueError(f"leader epoch {epoch} at offset {start_offset}: both must be >= 0")
        if self._entries and epoch <= self._entries[-1].epoch:
            return False
        kept = [entry for entry in self._entries if entry.start_offset < start_offset]
        self._store([*kept, EpochEntry(epoch, start_offset)])
        return True

    def end_offset_for(self, epoch: int, log_end_offset: int) -> EpochEndOffset:
        """Where `epoch` ends in this log, whose end is `log_end_offset` (see EpochEndOffset):
        for the latest epoch (or a newer one) the log end; for an older epoch the start offset
        of the first epoch after the largest known epoch at or below it."""
        entries = self._entries
        if not entries or epoch < entries[0].epoch:
            return EpochEndOffset(UNDEFINED, UNDEFINED)
        if epoch >= entries[-1].epoch:
            return EpochEndOffset(entries[-1].epoch, log_end_offset)
        index = bisect_right(entries, epoch, key=lambda entry: entry.epoch) - 1
        return EpochEndOffset(entries[index].epoch, entries[index + 1].start_offset)

    def truncate_from(self, offset: int) -> bool:
        """The log was truncated to `offset` (its records at and after it are gone): drop the
        epochs that start at or after it. Returns whether the list changed."""
        kept = [entry for entry in self._entries if entry.start_offset < offset]
        if len(kept) == len(self._entries):
            return False
        self._store(kept)
        return True

    def truncate_until(self, offset: int) -> bool:
        """The log's records before `offset` were deleted (retention): drop the epochs that
        end before it; the one spanning it now starts there. Returns whether it changed."""
        entries = self._entries
        index = bisect_right(entries, offset, key=lambda entry: entry.start_offset) - 1
        if index < 0 or (index == 0 and entries[0].start_offset == offset):
            return False
        self._store([EpochEntry(entries[index].epoch, offset), *entries[index + 1:]])
        return True

    def clear(self) -> None:
        """Forget every epoch (the log was emptied and will be fetched again)."""
        if self._entries:
            self._store([])

    # -- the file ---------------------------------------------------------------------------

    def _load(self) -> list[EpochEntry]:
        try:
            text = self.path.read_text(encoding="ascii")
        except FileNotFoundError:
            return []
        except (OSError, UnicodeDecodeError) as exc:
            raise CorruptCheckpoint(f"{self.path}: {exc}") from exc
        lines = text.split("\n")
        try:
            if int(lines[0]) != CHECKPOINT_VERSION:
                raise CorruptCheckpoint(f"{self.path}: version {lines[0]!r} is not "
                                        f"{CHECKPOINT_VERSION}")
            count = int(lines[1])
            entries = []
            for line in lines[2:2 + count]:
                epoch, start = line.split(" ")
                entries.append(EpochEntry(int(epoch), int(start)))
        except (ValueError, IndexError) as exc:
            raise CorruptCheckpoint(f"{self.path}: {exc}") from exc
        if len(entries) != count or any(
            later.epoch <= earlier.epoch or later.start_offset < earlier.start_offset
            for earlier, later in zip(entries, entries[1:], strict=False)
        ):
            raise CorruptCheckpoint(f"{self.path}: {count} entries expected, in increasing "
                                    "epoch and start offset")
        return entries

    def _store(self, entries: list[EpochEntry]) -> None:
        lines = [str(CHECKPOINT_VERSION), str(len(entries))]
        lines += [f"{entry.epoch} {entry.start_offset}" for entry in entries]
        final = self.path
        temp = final.with_name(final.name + ".tmp")
        fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            write_all(fd, ("\n".join(lines) + "\n").encode("ascii"))
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(temp, final)
        fsync_directory(self.directory)
        self._entries = entries
