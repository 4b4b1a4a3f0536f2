"""The event-loop side of a journal shard log's hand-over with the group committer
(`commit.py`): the pending group is taken for a commit pass, and its outcome comes back here:
published (its records readable, its future resolved) once durable under the fsync policy, a
rolled segment sealed, or, after a failed write or fsync, every unpublished group failed and
the log rolled back to its last published state. The I/O itself is `log.py`'s.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, cast

from ..interfaces import StorageFull
from .commit import resolve
from .config import FsyncPolicy
from .log_state import KEYED_SEALED_SEGMENTS, LogState, _Group, _Tail

if TYPE_CHECKING:
    from .log import JournalShardLog


class CommitHandover(LogState):
    def _take_pending(self) -> _Group | None:
        group = self._pending
        if group is not None:
            self._pending = None
            self._inflight = group
            if self._reserve_target > self._reserved:
                group.reserve_to = self._reserve_target
        return group

    def _complete(self, group: _Group | None, synced: bool, error: OSError | None) -> None:
        if self._closed:
            return
        if error is not None:
            self._rollback(error, group)
            return
        if group is not None:
            self._inflight = None
            if group.reserve_to > self._reserved:
                self._reserved = group.reserve_to
            if group.new_segment is not None:
                # The roll fsynced the old segment: its unsynced groups are durable.
                self._publish_unsynced()
                old = self._segments[-1]
                old.seal()
                self._to_seal.append(old)
                self._segments.append(group.new_segment)
                self._bases.append(group.new_segment.base_offset)
                for sealed in self._segments[: -1 - KEYED_SEALED_SEGMENTS]:
                    sealed.key_index = None
            if synced or self.config.fsync is FsyncPolicy.OS:
                self._publish_unsynced()
                self._publish(group)
            else:
                self._unsynced.append(group)
        elif synced:
            self._publish_unsynced()

    def _publish_unsynced(self) -> None:
        for group in self._unsynced:
            self._publish(group)
        self._unsynced = []

    def _publish(self, group: _Group) -> None:
        segment = self._segments[-1]
        assert segment.base_offset == group.segment_base
        segment.size = group.end_pos
        segment.next_offset = group.end_offset
        segment.index_offsets.extend(group.index_offsets)
        segment.index_positions.extend(group.index_positions)
        segment.time_stamps.extend(group.time_stamps)
        segment.time_offsets.extend(group.time_offsets)
        segment.max_timestamp = group.max_ts
        if segment.first_timestamp is None:
            segment.first_timestamp = group.first_ts
        self._committed = group.end_offset
        resolve(group.future)

    def _rollback(self, error: OSError, group: _Group | None) -> None:
        failure = StorageFull(f"journal write failed in {self.directory}: {error}")
        failed = [*self._unsynced, group, self._pending]
        self._unsynced, self._inflight, self._pending = [], None, None
        self._committer.discard_dirty(cast("JournalShardLog", self))
        # The failed offsets may have been seen: they are never handed out again but filled
        # with empty records by the next append.
        if self._next > self._committed:
            self._hole_from = self._committed
        self._tail = _Tail.of(self._segments[-1])
        for failed_group in failed:
            if failed_group is not None:
                resolve(failed_group.future, failure)
