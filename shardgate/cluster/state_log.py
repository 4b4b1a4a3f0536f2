"""`StateLog`: keyed state of this node that must outlive it, kept in a replicated internal
stream, as Kafka keeps consumer offsets in its compacted `__consumer_offsets` topic.

What it is for: state that lives on one node's metadata store and changes at message speed
(an MQTT session's QoS 2 exactly-once state), which another node must find after a SIGKILL of
that node, and which etcd (about a thousand writes a second for the whole cluster) must not
get per message. Each record is the whole current value of one key (the newest wins), written
as a message on `$internal/<kind>/<key>` to the reliable stream `INTERNAL_STREAM`, routed
there by `$internal/<kind>/#` (three levels: the journal's key index keeps each key apart), of
`REPLICAS` replicas with `MIN_INSYNC` in sync (capped by the live nodes, as any stream's).
Only the broker publishes there (producer protocol `core.kept_state.INTERNAL_PRODUCER`); a
client's publish to `$internal/` is refused, and no subscription sees the records unless it
names `$internal/` itself (a leading wildcard never matches a `$` topic, MQTT-4.7.2-1).

The API (`kind` names the user of the log, e.g. `mqtt-sessions`; keys are any strings):

- `StateLog(node, broker, kind, indexed=False)`: nothing is created until the first `put`
  (a cluster whose users never write has no such stream); then the stream and the kind's
  route are made here (`ensure`, through the broker's topology sink, so etcd and every node
  get them), and the batch waits (at most `RETRY_S`) until the controller has placed the shard.
- `put(key, value, epoch=None) -> asyncio.Future[None]`: `value` is bytes, or a callable
  made into bytes when the batch is written (the state as it is then; None: nothing to
  write). With an `epoch` (its owner's, e.g. a queue home's), the record is stamped with it
  and the writer's sequence number (`state_index.stamp`), which `latest(max_epoch=)` reads. Every
  put of one loop turn goes in one `publish_many` (one append per shard, forwarded to its
  leader when another node leads it), a key once per turn; the future (shared by the turn's
  puts) is done once every record of the batch is committed (below the high watermark, on
  `MIN_INSYNC` replicas). A batch refused or not committed (a leader changing) is written
  again with the next one for up to `RETRY_S`, then its future fails (`ShardUnavailable`,
  ...): no task and no await per put.
- `await latest(key, since_ms) -> bytes | None`: the newest value of `key` written from
  `since_ms` on (the journal's time index; the writer's clock), read from the shard's leader
  (here or through `ReadShard`) once that leader has committed everything earlier epochs
  held (`settled`); raises `journal_search.ShardUnreadable` when that cannot be known now.
  With `max_epoch`: the newest value of the highest epoch up to `max_epoch` (so never a
  later record of an earlier owner: a zombie home's), the newest by its writer's sequence
  number within an epoch (`state_index.py`).
- `indexed=True`: `latest` reads through a `state_index.StateIndex` kept in memory (the
  newest record of each key and epoch of this kind): the first `latest` reads the stream
  from `since_ms`, each later one only what was appended since, so a node taking over many
  queues reads the stream once, not once per queue.

Compaction is the user's: the log keeps records for `RETENTION_MS` (an hour), and a user
that needs a key longer writes it again within that time (the MQTT sessions' etcd
checkpoints, every 0.5 to 2 s; the AMQP queues' refresh, every 10 minutes). It must not:
keep anything in memory per key beyond a turn's batch (besides an indexed kind's index), or
read the stream at start.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING
from urllib.parse import quote

from ..core.errors import CoreError, ShardUnavailable
from ..core.kept_state import INTERNAL_PREFIX, INTERNAL_PRODUCER
from ..core.message import Message
from ..core.streams import DispatchMode, RoutingRule, StreamConfig
from .journal_search import ShardUnreadable, latest_on_topic
from .state_index import StateIndex, stamp

if TYPE_CHECKING:
    from ..core.broker import Broker
    from .control import ClusterNode

log = logging.getLogger(__name__)

INTERNAL_STREAM = "_internal.state"
REPLICAS = 3
MIN_INSYNC = 2
RETENTION_MS = 3_600_000
# How long a batch is tried (the stream's shard being placed at its first use, a leader
# changing, too few replicas in sync), again every RETRY_CHECK_S, before its puts fail.
RETRY_S = 10.0
RETRY_CHECK_S = 0.05


Payload = bytes | Callable[[], bytes | None]


@dataclass(slots=True, frozen=True)
class Stamped:
    """A put's value with the epoch its record is stamped with."""

    value: Payload
    epoch: int


Value = Payload | Stamped


def state_topic(kind: str, key: str) -> str:
    """The topic of `key`'s records: `$internal/<kind>/<key>`, the key percent-encoded (no
    `/`, `+`, `#` or NUL reaches the topic)."""
    return f"{INTERNAL_PREFIX}{kind}/{quote(key, safe='')}"


def internal_stream_config() -> StreamConfig:
    return StreamConfig(INTERNAL_STREAM, mode=DispatchMode.RELIABLE, partitions=1,
                        retention_ms=RETENTION_MS, replicas=REPLICAS,
                        min_insync_replicas=MIN_INSYNC)


class StateLog:
    """One kind of keyed state in the replicated internal stream (module docstring)."""

    def __init__(self, node: ClusterNode, broker: Broker, kind: str, *, indexed: bool = False) -> None:
        self.node = node
        self.broker = broker
        self.kind = kind
        self.route = f"{INTERNAL_PREFIX}{kind}/#"
        self.index = self._new_index() if indexed else None
        self._seq = time.time_ns()
        self._pending: dict[str, Value] = {}
        self._ensured = False
        # futures of earlier batches that failed and ride on the pending one, and when the
        # oldest of them was first tried
        self._carried: list[asyncio.Future[None]] = []
        self._started = 0.0
        self._batch: asyncio.Future[None] | None = None
        self.written = 0
        self.failed = 0

    def ensure(self) -> bool:
        """The internal stream and this kind's route exist here (and so in etcd); idempotent:
        called as the node joins and again before each use until it held."""
        broker = self.broker
        try:
            if INTERNAL_STREAM not in broker.streams:
                broker.create_stream(internal_stream_config())
            if broker.stream_for_topic(state_topic(self.kind, "-")).config.name != INTERNAL_STREAM:
                broker.add_route(RoutingRule(self.route, INTERNAL_STREAM))
        except CoreError as exc:
            log.warning("cluster: the internal stream %s for %s: %s", INTERNAL_STREAM, self.kind, exc)
            return False
        return True

    # ------------------------------------------------------------ writing
    def put(self, key: str, value: Payload, epoch: int | None = None) -> asyncio.Future[None]:
        """Write `key`'s value in this turn's batch; the batch's future (module docstring)."""
        self._pending[key] = value if epoch is None else Stamped(value, epoch)
        batch = self._batch
        if batch is None:
            loop = asyncio.get_running_loop()
            batch = self._batch = loop.create_future()
            self._started = loop.time()
            loop.call_soon(self._flush)
        return batch

    def _placed(self) -> bool:
        """Whether the stream exists here and its shard has a leader (made at first use)."""
        if not self._ensured:
            self._ensured = self.ensure()
        return self._ensured and self.node.view.leader(INTERNAL_STREAM, 0) is not None

    def _flush(self) -> None:
        batch = self._batch
        if batch is None:
            return
        loop = asyncio.get_running_loop()
        started = self._started
        if not self._placed():
            if loop.time() - started < RETRY_S:
                loop.call_later(RETRY_CHECK_S, self._flush)  # the batch goes on filling
                return
            self._pending, self._batch, carried, self._carried = {}, None, self._carried, []
            self._fail([batch, *carried], ShardUnavailable(f"{INTERNAL_STREAM} has no leader"))
            return
        pending, self._pending = self._pending, {}
        futures = [batch, *self._carried]
        self._batch, self._carried = None, []
        messages = []
        for key, value in pending.items():
            headers = None
            if isinstance(value, Stamped):
                self._seq = max(self._seq + 1, time.time_ns())
                headers = stamp(value.epoch, self._seq)
                value = value.value
            data = value() if callable(value) else value
            if data is not None:
                # QoS 1: a forwarded QoS 0 message is answered once the leader has it, not
                # once it is committed
                messages.append(Message(state_topic(self.kind, key), data, qos=1, headers=headers,
                                        producer_protocol=INTERNAL_PRODUCER,
                                        producer_id=self.node.node_id))
        if not messages:
            _settle(futures, None)
            return
        try:
            outcomes = self.broker.publish_many(messages, counted=False)
        except Exception as exc:  # noqa: BLE001 - tried again, then told to every put
            self._retry(pending, futures, started, exc)
            return
        waiting: set[asyncio.Future[None]] = set()
        for outcome in outcomes:
            if isinstance(outcome, BaseException):
                self._retry(pending, futures, started, outcome)
                return
            if outcome is not None:
                waiting.add(outcome)
        self.written += len(messages)
        if not waiting:
            _settle(futures, None)
            return
        left = [len(waiting)]

        def committed(future: asyncio.Future[None]) -> None:
            if left[0] <= 0:
                return
            error = CoreError("cancelled") if future.cancelled() else future.exception()
            if error is not None:
                left[0] = 0
                self._retry(pending, futures, started, error)
                return
            left[0] -= 1
            if not left[0]:
                _settle(futures, None)

        for future in waiting:
            future.add_done_callback(committed)

    def _retry(self, pending: dict[str, Value], futures: list[asyncio.Future[None]],
               started: float, error: BaseException) -> None:
        """A batch was refused or not committed (a leader changing, too few in sync): its keys
        are written again with the next batch (their callables taken anew) until `RETRY_S`
        after the first attempt, then its puts fail."""
        loop = asyncio.get_running_loop()
        if loop.time() - started >= RETRY_S:
            self._fail(futures, error)
            return
        for key, value in pending.items():
            self._pending.setdefault(key, value)
        if self._batch is None:
            self._batch, *carried = futures
            self._carried.extend(carried)
            self._started = started
            loop.call_later(RETRY_CHECK_S, self._flush)
        else:  # joins the batch being made (its flush is scheduled)
            self._carried.extend(futures)
            self._started = min(self._started, started)

    def _fail(self, futures: list[asyncio.Future[None]], error: BaseException) -> None:
        self.failed += 1
        log.warning("cluster: %s state not replicated: %s", self.kind, error)
        _settle(futures, error)

    # ------------------------------------------------------------ reading
    def _new_index(self) -> StateIndex:
        return StateIndex(self.node, self.broker, INTERNAL_STREAM, f"{INTERNAL_PREFIX}{self.kind}/",
                          RETENTION_MS)

    async def latest(self, key: str, since_ms: int, timeout_s: float = 5.0, *,
                     max_epoch: int | None = None) -> bytes | None:
        """The newest value of `key` written from `since_ms` on; with `max_epoch`, of the
        highest epoch up to it (module docstring)."""
        if INTERNAL_STREAM not in self.broker.streams:
            if INTERNAL_STREAM in self.node.view.streams:
                raise ShardUnreadable(f"{INTERNAL_STREAM} is not known here yet")
            return None  # never written in this cluster
        if not self._ensured:
            self._ensured = self.ensure()
        if self.index is not None or max_epoch is not None:
            index = self.index if self.index is not None else self._new_index()
            found = await index.latest(key, since_ms, max_epoch, timeout_s)
            return None if found is None else found[1]
        message = await latest_on_topic(self.node, self.broker, state_topic(self.kind, key),
                                        since_ms, timeout_s, settled=True)
        return None if message is None else message.payload


def _settle(futures: list[asyncio.Future[None]], error: BaseException | None) -> None:
    for future in futures:
        if future.done():
            continue
        if error is None:
            future.set_result(None)
        else:
            future.set_exception(error)
            future.exception()  # retrieved: each put's caller decides what it means
