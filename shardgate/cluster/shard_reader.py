"""Replaying a reliable shard that another node owns: durable cursors that moved here.

A reliable shard's log is on its owner's disk; offsets are the owner's, so a durable cursor
(`position` plus unacknowledged offsets) means the same thing on every node. When a cursor
comes here from another node (an MQTT persistent session taken over, see `sessions.py`), what
it has not delivered yet is in the owner's log: `OwnerLog` reads it from there with the
`ReadShard` call (`state_rpc.py`), only the records matching the subscription's filters, in
batches, and then hands over to the live pushes:

- each reply says up to where it read (`next`), whether that was the end of the owner's
  committed log (`caught_up`) and whether the owner already had this node's routes for the
  filters (`routed`). Once both hold, every later match is pushed here by the owner (after its
  commit), so from that offset on (`handoff`) the cursor reads the pushes this node receives
  (the data plane's `ReceivedLog` of the shard, created before the routes were advertised);
- if the pushes' window has slid past the cursor (a long stall), it reads from the owner again.

Replay and live dispatch meet by offset in the durable subscription, so nothing is delivered
twice and nothing is skipped. Nothing here blocks: `read` answers from what was fetched and
starts the next fetch; `commit_waiter` is the future the subscription waits on meanwhile.
"""

from __future__ import annotations

import asyncio
import logging
from bisect import bisect_left
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from ..core.records import RecordFormatError, record_topic
from ..core.topics import filter_matches
from ..storage.interfaces import StoredRecord
from .routes import Route
from .state_rpc import StateCallError, StateRpc

if TYPE_CHECKING:
    from ..core.broker import Broker
    from .data_plane import DataPlane
    from .received import ReceivedLog

log = logging.getLogger(__name__)

FETCH_RECORDS = 512
SCAN_RECORDS = 8192
FETCH_TIMEOUT_S = 5.0
# A reply that said "not routed yet": ask again this soon (routes are debounced by ~20 ms).
ROUTE_WAIT_S = 0.05
RETRY_MIN_S = 0.2
RETRY_MAX_S = 2.0


async def serve_read(broker: Broker, plane: DataPlane, request: dict[str, Any]) -> tuple[dict[str, Any], list[StoredRecord]]:
    """The owner's side of `ReadShard`: matching records of its shard from `from` on."""
    name, index = str(request["stream"]), int(request["shard"])
    start = int(request.get("from", 0))
    limit = max(1, min(int(request.get("max", FETCH_RECORDS)), FETCH_RECORDS))
    filters = [str(f) for f in request.get("filters", [])]
    stream = broker.streams.get(name)
    if stream is None or index >= len(stream.shards) or not plane.serves(name, index):
        return {"error": f"node {plane.node_id} does not own {name}/{index} now"}, []
    shard_log = stream.shards[index].log
    if shard_log is None:
        return {"error": f"{name} is not a reliable stream"}, []
    since_ms = request.get("since_ms")
    if since_ms is not None:
        start = max(start, shard_log.offset_for_timestamp(int(since_ms)))
    # the routes first: a message stored after this check is pushed to the caller when routed
    routes = plane.remote.routes_of(str(request.get("node", "")))
    routed = all(Route(topic_filter) in routes for topic_filter in filters)

    def wanted(record: StoredRecord) -> bool:
        try:
            topic = record_topic(record.data)
        except RecordFormatError:
            return False
        return any(filter_matches(topic_filter, topic) for topic_filter in filters)

    records: list[StoredRecord] = []
    position = start
    caught_up = False
    if position < shard_log.low_watermark:
        archive = broker.archive
        if archive is None:
            log.warning("cluster: %s/%d@%d is gone from the journal; a remote cursor resumes at %d",
                        name, index, position, shard_log.low_watermark)
            position = shard_log.low_watermark
        else:
            archived = await archive.read_async(name, index, position, FETCH_RECORDS)
            archived = [record for record in archived if record.offset >= position]
            if archived:
                records = [record for record in archived if wanted(record)]
                return {"next": archived[-1].offset + 1, "caught_up": False, "routed": routed}, records
            position = shard_log.low_watermark
    scanned = 0
    while len(records) < limit and scanned < SCAN_RECORDS:
        batch = shard_log.read(position, FETCH_RECORDS)
        if not batch:
            caught_up = True
            break
        for record in batch:
            if record.offset < position:
                continue
            scanned += 1
            position = record.offset + 1
            if wanted(record):
                records.append(record)
                if len(records) >= limit:
                    break
    header = {"next": position, "caught_up": caught_up, "routed": routed}
    if caught_up:
        # a replicated shard's leader that has not committed what earlier epochs held yet
        header["settled"] = bool(getattr(shard_log, "settled", True))
    return header, records


class OwnerLogs:
    """The data plane's `plane_ports.OwnerReads` over the shared-state calls: an `OwnerLog`
    for each cursor that reads a shard another node owns."""

    def __init__(self, rpc: StateRpc) -> None:
        self.rpc = rpc

    def owner_log(self, plane: DataPlane, stream: str, shard: int, start: int,
                  filters: Callable[[], Sequence[str]], since_ms: int | None) -> OwnerLog:
        return OwnerLog(self.rpc, plane, stream, shard, start, filters, since_ms)


class OwnerLog:
    """A read-only `ShardLog` over a shard another node owns, for one durable cursor (see the
    module docstring). `since_ms`: start at the owner's first record at or after that time
    (a cursor that had no position on this shard)."""

    # the data plane leaves such a log in place (it does not repoint it to its ReceivedLog)
    remote_shard = True

    def __init__(self, rpc: StateRpc, plane: DataPlane, stream: str, shard: int, start: int,
                 filters: Callable[[], Sequence[str]], since_ms: int | None = None) -> None:
        self.rpc = rpc
        self.plane = plane
        self.stream = stream
        self.shard = shard
        self.filters = filters
        self.since_ms = since_ms
        # created now, before this node advertises the cursor's filters: it holds every push
        self.received: ReceivedLog = plane.received_log(stream, shard)
        self._offsets: list[int] = []
        self._records: list[StoredRecord] = []
        self._fetched_next = start
        self._want = start
        # from here on the pushes are complete for the filters (None: still fetching)
        self.handoff: int | None = None
        self._fetch: asyncio.Future[None] | None = None
        self._fetching: asyncio.Task[None] | None = None
        self._retry = RETRY_MIN_S

    # ------------------------------------------------------------ ShardLog
    @property
    def low_watermark(self) -> int:
        return 0  # what the owner no longer has in its journal, it reads from its archive

    @property
    def next_offset(self) -> int:
        if self.handoff is None:
            # never reached while fetching, so the cursor does not go live before the handoff
            return max(self._fetched_next, self._want) + 1
        return max(self.handoff, self.received.next_offset)

    @property
    def deliverable_end(self) -> int:
        """Everything read here was committed by the shard's owner."""
        return self.next_offset

    def read(self, from_offset: int, max_records: int = 1000) -> list[StoredRecord]:
        if from_offset > self._want:
            self._want = from_offset
        # forget what the cursor has passed
        passed = bisect_left(self._offsets, from_offset)
        if passed:
            del self._offsets[:passed]
            del self._records[:passed]
        if self._records:
            return self._records[:max_records]
        handoff = self.handoff
        if handoff is not None:
            received = self.received
            start = max(from_offset, handoff)
            if start >= received.low_watermark or not len(received):
                return received.read(start, max_records)
            # the pushes' window slid past the cursor: read from the owner again
            log.info("cluster: %s/%d: pushes from %d are gone here; reading the owner again",
                     self.stream, self.shard, start)
            self.handoff = None
            self._fetched_next = start
        self._start_fetch()
        return []

    def commit_waiter(self) -> asyncio.Future[None] | None:
        if self.handoff is None:
            self._start_fetch()
        fetch = self._fetch
        return fetch if fetch is not None and not fetch.done() else None

    def append(self, records: Sequence[tuple[int, bytes]]) -> int:
        raise NotImplementedError("a shard another node owns is written there")

    def offset_for_timestamp(self, timestamp_ms: int) -> int:
        return self._fetched_next

    def delete_before(self, offset: int) -> int:
        return 0

    def close(self) -> None:
        self._offsets.clear()
        self._records.clear()

    # ------------------------------------------------------------ fetching
    def _start_fetch(self) -> None:
        if self._fetch is not None and not self._fetch.done():
            return
        loop = asyncio.get_running_loop()
        self._fetch = loop.create_future()
        # (kept: the loop holds a task only weakly)
        self._fetching = loop.create_task(self._run_fetch(self._fetch))

    async def _run_fetch(self, done: asyncio.Future[None]) -> None:
        try:
            wait = 0.0
            try:
                wait = await self._fetch_once()
            except Exception as exc:  # noqa: BLE001 - retried; the cursor waits meanwhile
                # the first failure of a run is a warning; the retries while the owner stays
                # away (every 0.2 to 2 s per cursor) are debug, until a read succeeds again
                first = self._retry == RETRY_MIN_S
                log.log(logging.WARNING if first else logging.DEBUG,
                        "cluster: reading %s/%d from its owner failed: %s; retrying",
                        self.stream, self.shard, exc)
                wait = self._retry
                self._retry = min(self._retry * 2, RETRY_MAX_S)
            if wait:
                await asyncio.sleep(wait)
        finally:
            # also when cancelled (grpc.aio cancels a call whose channel closes under it): the
            # subscription waiting on `done` pumps again and starts the next read
            if not done.done():
                done.set_result(None)

    async def _fetch_once(self) -> float:
        """One ReadShard call; returns how long to wait before the cursor reads again."""
        assignment = self.plane.view.leader(self.stream, self.shard)
        if assignment is None or assignment.leader == self.plane.node_id:
            return RETRY_MIN_S  # unplaced, or moving here (the data plane repoints the cursor)
        filters = list(self.filters())
        if not filters:
            return ROUTE_WAIT_S  # no filters yet: a handoff now would pass over what they want
        request: dict[str, Any] = {
            "stream": self.stream, "shard": self.shard, "from": self._fetched_next,
            "max": FETCH_RECORDS, "filters": filters, "node": self.plane.node_id,
        }
        if self.since_ms is not None:
            request["since_ms"] = self.since_ms
        try:
            header, records = await self.rpc.read_shard(assignment.leader, request, FETCH_TIMEOUT_S)
        except StateCallError as exc:
            raise RuntimeError(str(exc)) from None
        if "error" in header:
            raise RuntimeError(header["error"])
        self._retry = RETRY_MIN_S
        self.since_ms = None
        for record in records:
            if record.offset >= self._fetched_next and (not self._offsets or record.offset > self._offsets[-1]):
                self._offsets.append(record.offset)
                self._records.append(record)
        self._fetched_next = max(self._fetched_next, int(header["next"]))
        if header.get("caught_up"):
            if header.get("routed"):
                self.handoff = self._fetched_next
                return 0.0
            return ROUTE_WAIT_S
        return 0.0
