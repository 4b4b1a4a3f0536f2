"""The state every part of a journal shard log shares: `LogState` (the attributes
`JournalShardLog.__init__` sets, declared here for the parts), `_Tail` (where the next record
will land) and `_Group` (records framed between two commit passes).

`JournalShardLog` (`log.py`) is assembled from parts over this state: `log_ends.py` (retention,
deletion, truncation, a new start) and `log_handover.py` (the event-loop side of the hand-over
with the committer). The parts are base classes, so an append or a read costs no extra call.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from pathlib import Path

from .commit import GroupCommitter
from .config import JournalConfig
from .epochs import LeaderEpochCache
from .handles import OpenFiles
from .keyindex import KeyFunction
from .record import Checksum
from .reservation import OffsetReservation
from .segment import Segment

KEYED_SEALED_SEGMENTS = 2
"""Sealed segments that may have a key index (the newest): older ones are read by scanning,
so the key indexes of a shard cover at most this many segments besides the active one."""


@dataclass(slots=True)
class _Tail:
    """Where the next appended record will land: the projected end of the active segment,
    counting groups that are buffered or in flight, and its index state there."""

    base_offset: int
    pos: int
    last_index_pos: int
    max_ts: int | None
    last_time_ts: int | None
    first_ts: int | None

    @classmethod
    def of(cls, segment: Segment) -> _Tail:
        return cls(
            segment.base_offset,
            segment.size,
            segment.index_positions[-1] if segment.index_positions else 0,
            segment.max_timestamp,
            segment.time_stamps[-1] if segment.time_stamps else None,
            segment.first_timestamp,
        )


class _Group:
    """Records appended between two commit passes, framed and ready to write."""

    __slots__ = (
        "first_offset",
        "end_offset",
        "buf",
        "start_pos",
        "end_pos",
        "segment_base",
        "roll",
        "index_offsets",
        "index_positions",
        "time_stamps",
        "time_offsets",
        "max_ts",
        "first_ts",
        "future",
        "new_segment",
        "reserve_to",
    )

    def __init__(self, first_offset: int, tail: _Tail, roll: bool) -> None:
        self.first_offset = first_offset
        self.end_offset = first_offset
        self.buf = bytearray()
        self.start_pos = tail.pos
        self.end_pos = tail.pos
        self.segment_base = tail.base_offset
        self.roll = roll
        self.index_offsets: list[int] = []
        self.index_positions: list[int] = []
        self.time_stamps: list[int] = []
        self.time_offsets: list[int] = []
        self.max_ts: int | None = tail.max_ts
        self.first_ts: int | None = tail.first_ts
        self.future: asyncio.Future[None] | None = None
        self.new_segment: Segment | None = None
        self.reserve_to = 0


class LogState:
    """What every part of `JournalShardLog` reads and changes (set by its `__init__`)."""

    directory: Path
    config: JournalConfig
    leader_epochs: LeaderEpochCache
    _owns_committer: bool
    _committer: GroupCommitter
    _files: OpenFiles
    _crc: Checksum
    _key_of: KeyFunction | None
    _closed: bool
    _segments: list[Segment]
    _bases: list[int]
    _next: int
    _committed: int
    _reservation: OffsetReservation
    _reserved: int
    _reserve_target: int
    _hole_from: int | None
    _tail: _Tail
    _pending: _Group | None
    _inflight: _Group | None
    _unsynced: list[_Group]
    _to_seal: list[Segment]
    _io_segment: Segment
    _broken: OSError | None
    _max_pending: int
    _index_interval: int
