"""The dispatched marks of the replicated shards kept on disk, so that a node started again
knows them (after Kafka's `replication-offset-checkpoint`): a small file in each shard's
journal directory (`storage/journal/offset_checkpoint.py`, `dispatched-mark-checkpoint`).

A dispatched mark (`dispatch_marks.py`) is an offset below which every record of the shard
was dispatched by some leader and each push of it answered by the node it went to. That is a
fact of the past: once true, it stays true, whoever leads later, so a mark kept on disk stays a
lower bound of how far the shard was dispatched, however old it is. It is read back as "at
least this far", and a new leader that knows no fresher mark in memory (this process has not
been told one since it started: all the shard's nodes were restarted, or the old leader was
this node's own earlier run) hands on from it instead of looking back `REDISPATCH_RECORDS`
(`replicated_shards.inherited_from`). An older mark only means more messages dispatched twice,
never one lost; a mark above what was really dispatched would lose messages for live
subscribers, so only marks are written here, each after it was known (never the high
watermark, nor how far this node itself dispatched before the pushes were answered):
- the node's own mark while it leads the shard (`DispatchMarks.known`),
- the mark its leader told it last while it follows (`ReplicatedShardLog.dispatched_known`,
  already bounded by the high watermark this node knew),
and only when it is above the one kept (the file never goes back, unless the kept one no
longer counts for the log, below).

When: every `SAVE_INTERVAL_S` in the background, for the shards whose mark moved (a write and a
rename, not synced: at most one per shard per interval), and at a clean stop (synced). After a
crash the kept mark lags the last one known by up to an interval plus a fetch round: what a
live subscriber may get twice after such a restart is about that much of the shard's traffic,
not 10,000 records.

Each kept mark names the leader epoch of the record before it in this node's log, and counts
only while the log still holds that record in that epoch (KIP-101: then the log before it is
the one the mark was kept for): a log cut below the mark and written again (an unclean
election) makes it count as none. A mark is kept at most
up to what the journal made durable here, so that a crash of the process leaves the log at
least that long. A mark at or below the log's first offset always counts (the hand-on cannot
start lower). A node whose data directory was lost has no file. Where no kept mark counts,
the shard falls back to the look-back, as before; a file that cannot be read as written (a
machine crash before it was written out) counts as none.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from ..storage.journal.offset_checkpoint import OffsetCheckpoint
from .replica_epochs import EpochCache

log = logging.getLogger(__name__)

Key = tuple[str, int]

CHECKPOINT_FILE = "dispatched-mark-checkpoint"
# How often the marks that moved are written (each shard's file at most once per interval):
# after a crash, what a subscriber may get twice is about this much of a shard's traffic.
SAVE_INTERVAL_S = 0.5
NO_EPOCH = -1


class MarkedLog(Protocol):
    """What a kept mark needs of a shard's journal log (`JournalShardLog`)."""

    @property
    def directory(self) -> Path: ...

    @property
    def low_watermark(self) -> int: ...

    @property
    def next_offset(self) -> int: ...

    @property
    def committed_offset(self) -> int: ...

    @property
    def leader_epochs(self) -> EpochCache: ...


def epoch_at(shard_log: MarkedLog, offset: int) -> int:
    """The leader epoch of the record at `offset` in the log (NO_EPOCH: not known)."""
    if offset < shard_log.low_watermark or offset >= shard_log.next_offset:
        return NO_EPOCH
    epoch = NO_EPOCH
    for entry in shard_log.leader_epochs.entries:
        if entry.start_offset > offset:
            break
        epoch = entry.epoch
    return epoch


def counts(shard_log: MarkedLog, mark: int, epoch: int) -> bool:
    """Whether a mark kept with `epoch` (that of the record before it) is one of this log."""
    return mark <= shard_log.low_watermark or (
        epoch != NO_EPOCH and epoch_at(shard_log, mark - 1) == epoch)


@dataclass(slots=True)
class _Kept:
    directory: Path
    file: OffsetCheckpoint
    mark: tuple[int, int] | None  # the mark in the file and its epoch (None: none)


class KeptMarks:
    """The dispatched marks kept in the shards' directories (see the module docstring)."""

    def __init__(self) -> None:
        self._kept: dict[Key, _Kept] = {}

    def _entry(self, key: Key, directory: Path) -> _Kept:
        kept = self._kept.get(key)
        if kept is None or kept.directory != directory:
            file = OffsetCheckpoint(directory, CHECKPOINT_FILE)
            kept = self._kept[key] = _Kept(directory, file, file.read())
        return kept

    def kept(self, key: Key, shard_log: MarkedLog) -> int | None:
        """The mark kept for the shard whose journal log is `shard_log`, where it counts for
        that log (None: none kept, or not one of this log): read from its file the first
        time."""
        mark = self._entry(key, shard_log.directory).mark
        return mark[0] if mark is not None and counts(shard_log, *mark) else None

    def keep(self, key: Key, shard_log: MarkedLog, mark: int, *, sync: bool = False) -> bool:
        """Write `mark` (at most the log's durable end) to the shard's file if it is above the
        mark kept there, or that one does not count for this log (durably first with `sync`);
        whether it was written."""
        mark = min(mark, shard_log.committed_offset)
        epoch = epoch_at(shard_log, mark - 1)
        if mark > shard_log.low_watermark and epoch == NO_EPOCH:
            return False  # (nothing to name the log before it by)
        kept = self._entry(key, shard_log.directory)
        if kept.mark is not None and mark <= kept.mark[0] and counts(shard_log, *kept.mark):
            return False
        try:
            kept.file.write(mark, epoch, sync=sync)
        except OSError as exc:
            # (a shard deleted meanwhile, or a full disk: the file keeps its older mark)
            log.debug("%s/%d: dispatched mark %d not kept: %s", key[0], key[1], mark, exc)
            return False
        kept.mark = (mark, epoch)
        return True
