"""What every bridge shares, whatever the remote speaks: the core consumer, the outbox, the echo
guard and the reconnect loop.

A bridge reads its **out** filters through a durable core subscription (`$<kind>/<name>`) whose
cursor advances only once the remote has acknowledged a message; it takes messages into a
`core.outbox.Outbox` (reliable ones are never dropped: the cursor waits; others are bounded,
the oldest dropped and counted by reason). Messages the bridge itself brought **in** carry its
producer protocol and name, and are never sent back out (the echo guard). One task keeps a
connection to the remote, with exponential back-off between attempts, reported once per outage
by `logs.ReconnectReport`.

A subclass says how to connect (`_connect`), what to do on a live connection (`_serve`: send
the outbox, receive what comes in) and how to close (`_close`); `_next_batch` and `settle` are
the outbox side of sending.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Generic, TypeVar
from urllib.parse import urlparse

from ..core.durable import DurableOptions, DurableSubscription
from ..core.message import Message
from ..core.outbox import EXPIRED, QUEUE_FULL, Outbox, OutboxEntry
from ..logs import DropReport, ReconnectReport

if TYPE_CHECKING:
    from ..core.edge import Edge
    from ..core.subscriptions import Subscription

Connection = TypeVar("Connection")

# Outbox entries whose topic is outside `local_prefix`, or messages from the remote whose topic
# is outside `remote_prefix`: acknowledged, not forwarded.
OUTSIDE_PREFIX = "outside_prefix"
# Messages from the remote that the local core refused (an ACL, a schema, a full disk) after
# the remote was told they had arrived.
REFUSED_LOCALLY = "refused_locally"
# How long the sender waits for the outbox before it checks the connection again.
IDLE_CHECK_S = 1.0
CLOSE_TIMEOUT_S = 2.0


@dataclass(slots=True)
class BridgeSettingsBase:
    """The fields of every bridge entry of the configuration."""

    name: str
    remote: str
    # Local topic filters forwarded to the remote.
    out: list[str] = field(default_factory=list)
    local_prefix: str = ""
    # Messages handed to the remote and not yet acknowledged by it, at most.
    window: int = 256
    # Memory bound for messages of non-reliable streams while the remote is slow or away.
    max_queued: int = 100_000
    reconnect_min_s: float = 0.2
    reconnect_max_s: float = 10.0

    # The allowed range of each numeric setting, inclusive (None: no bound), checked by the
    # configuration loader with the file, the name and the value.
    RANGES: ClassVar[dict[str, tuple[float | None, float | None]]] = {
        "window": (1, 65535),
        "max_queued": (1, None),
        "reconnect_min_s": (0.001, None),
        "reconnect_max_s": (0.001, None),
    }


class BridgeBase(Generic[Connection]):
    """A running bridge: `start()` on the node's loop, `await stop()`; the core calls `deliver`."""

    # Set by each kind: the producer protocol of what it brings in, and its name in logs,
    # consumer ids and the out subscription's name.
    producer_protocol = ""
    kind = ""
    # URL schemes the remote may have, and what the settings must name besides `out`.
    schemes: tuple[str, ...] = ()
    nothing_to_do = "no out topic filters"
    log = logging.getLogger(__name__)

    def __init__(self, edge: Edge, settings: BridgeSettingsBase) -> None:
        if not settings.out and not self._brings_in(settings):
            raise ValueError(f"{self.kind} {settings.name!r}: {self.nothing_to_do}")
        if urlparse(settings.remote).scheme not in self.schemes:
            raise ValueError(f"{self.kind} {settings.name!r}: remote must be a "
                             f"{self.schemes[0]}:// URL")
        # The front door: publishes and subscriptions go through it.
        self.edge = edge
        self.name = settings.name
        self._base_settings = settings
        self.outbox = Outbox(settings.max_queued, self._reliable, edge.stats,
                             on_drop=self._dropped)
        # Messages from the remote that were not brought in, by reason.
        self.drops_in: Counter[str] = Counter()
        self._drop_report = DropReport(self.log, f"{self.kind} {settings.name}")
        check_filters_under_prefix(self.kind, settings.name, "out", settings.out,
                                   "local_prefix", settings.local_prefix, self.log)
        self.connected = False
        # Counters for the admin API and metrics.
        self.forwarded_out = 0
        self.forwarded_in = 0
        self.connects = 0
        self._wakeup = asyncio.Event()
        self._subscription: Subscription | None = None
        self._task: asyncio.Task[None] | None = None
        self._report = ReconnectReport(self.log, f"{self.kind} {self.name}")

    def _brings_in(self, settings: BridgeSettingsBase) -> bool:
        """Whether `settings` bring messages in from the remote."""
        return False

    @property
    def dropped(self) -> int:
        return self.outbox.dropped + sum(self.drops_in.values())

    @property
    def _id_prefix(self) -> str:
        return self.kind.replace(" ", "-")

    # ------------------------------------------------------------------ core Consumer
    @property
    def consumer_id(self) -> str:
        return f"{self._id_prefix}:{self.name}"

    @property
    def available(self) -> bool:
        # The cursor of a reliable stream waits until the window has room.
        return self.connected and len(self.outbox) < self._base_settings.window

    def deliver(self, message: Message, subscription: Subscription, filters: Sequence[str]) -> None:
        if message.producer_protocol == self.producer_protocol and message.producer_id == self.name:
            subscription.ack(message)  # brought in by this bridge: never echo it back
            return
        if self.outbox.put(message, subscription) is not None:
            self._wakeup.set()

    def _reliable(self, message: Message) -> bool:
        stream = self.edge.streams.get(message.stream)
        return stream is not None and stream.reliable and message.offset >= 0

    def _dropped(self, reason: str, total: int) -> None:
        """An outgoing message dropped (counted by the outbox): logged, rate-limited."""
        detail = ("messages of non-reliable streams beyond max_queued" if reason == QUEUE_FULL
                  else "not under local_prefix" if reason == OUTSIDE_PREFIX else "")
        self._drop_report.dropped("out", reason, None, detail)

    def dropped_in(self, reason: str, topic: str, detail: str = "") -> None:
        """A message from the remote not brought in: counted by reason (the broker's statistics
        and `status()["drops_in"]`, the metric `shardgate_bridge_dropped_messages_total`) and
        logged, rate-limited."""
        self.drops_in[reason] += 1
        self.edge.stats.drop(reason)
        self._drop_report.dropped("in", reason, topic, detail)

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        out = self._base_settings.out
        if out:
            # (its outbox keeps messages of non-reliable streams under `max_queued`)
            options = DurableOptions(ack_timeout_s=None, consumers_queue=True)
            sub = self.edge.durable_subscription(
                f"${self._id_prefix}/{self.name}", options=options, owner=self,
            )
            # Restored from the metadata store after a restart: take it over.
            sub.take_over(self, options)
            for topic_filter in list(sub.filters):
                if topic_filter not in out:
                    self.edge.remove_filter(sub, topic_filter)
            for topic_filter in out:
                self.edge.add_filter(sub, topic_filter)
            self.edge.attach(sub, self)
            self._subscription = sub
        self._task = asyncio.get_running_loop().create_task(
            self._run(), name=f"{self._id_prefix}-{self.name}")

    async def stop(self) -> None:
        """Stop forwarding; the durable subscription stays, so what the remote did not
        acknowledge is sent when the bridge next runs."""
        task = self._task
        if task is not None:
            # Cancelled again until it ends: on Python 3.11 a cancellation that arrives as an
            # inner `wait_for` completes can be swallowed, and the reconnect loop would go on.
            while not task.done():
                task.cancel()
                await asyncio.wait({task}, timeout=CLOSE_TIMEOUT_S + 1)
            with contextlib.suppress(asyncio.CancelledError, Exception):
                task.result()
            self._task = None
        if self._subscription is not None:
            self.edge.detach(self._subscription, self)
        lost = self.outbox.unreliable
        if lost:
            self.log.warning("%s %s: stopped with %d messages of non-reliable streams not "
                             "forwarded", self.kind, self.name, lost)

    @property
    def backlog(self) -> int:
        """Messages not yet acknowledged by the remote: behind the cursor on reliable streams,
        plus those of non-reliable streams queued in memory."""
        sub = self._subscription
        lag = sub.lag() if isinstance(sub, DurableSubscription) else 0
        return lag + self.outbox.unreliable

    def status(self) -> dict[str, Any]:
        return {
            "name": self.name, "remote": urlparse(self._base_settings.remote).hostname,
            "connected": self.connected, "queued": self.backlog, "dropped": self.dropped,
            "drops": dict(self.outbox.drops), "drops_in": dict(self.drops_in),
            "forwarded_out": self.forwarded_out, "forwarded_in": self.forwarded_in,
            "connects": self.connects,
        }

    # ------------------------------------------------------------------ the connection loop
    async def _connect(self) -> Connection:
        raise NotImplementedError

    async def _serve(self, connection: Connection) -> None:
        """Run on a live connection until it fails (raise) or is lost; call `_ready` once the
        connection can take messages."""
        raise NotImplementedError

    async def _close(self, connection: Connection) -> None:
        raise NotImplementedError

    def _remote_label(self) -> str:
        """host:port of the remote, without the credentials the URL may hold."""
        url = urlparse(self._base_settings.remote)
        return f"{url.hostname}:{url.port}" if url.port else str(url.hostname)

    async def _run(self) -> None:
        settings = self._base_settings
        delay = settings.reconnect_min_s
        while True:
            try:
                connection = await self._connect()
            except Exception as exc:  # client libraries raise many kinds
                self._report.failed(exc, settings.reconnect_max_s)
                await asyncio.sleep(delay)
                delay = min(delay * 2, settings.reconnect_max_s)
                continue
            delay = settings.reconnect_min_s
            self.connects += 1
            self._report.connected(self._remote_label())
            try:
                await self._serve(connection)
            except asyncio.CancelledError:
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(self._close(connection), CLOSE_TIMEOUT_S)
                raise
            except Exception as exc:
                self._report.lost(exc)
            finally:
                self.connected = False
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._close(connection), CLOSE_TIMEOUT_S)
            await asyncio.sleep(settings.reconnect_min_s)

    def _ready(self) -> None:
        """The connection takes messages: the cursor resumes from where the remote stopped it."""
        self.connected = True
        if self._subscription is not None:
            self._subscription.wake()

    # ------------------------------------------------------------------ the outbox side
    async def _next_batch(self, count: int) -> list[OutboxEntry]:
        """Up to `count` entries at the head of the outbox; empty after `IDLE_CHECK_S` without
        any, so the sender can check its connection."""
        if not self.outbox.entries:
            self._wakeup.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wakeup.wait(), IDLE_CHECK_S)
        return self.outbox.head(count)

    def _remote_topic(self, entry: OutboxEntry, remote_prefix: str = "") -> str | None:
        """The topic `entry` goes to on the remote; None when it is not sent (outside
        `local_prefix`, or expired): then it is skipped, its reason counted."""
        message = entry.message
        topic = rewrite_topic(message.topic, self._base_settings.local_prefix, remote_prefix)
        if topic is None:
            self.outbox.skip(entry, OUTSIDE_PREFIX)
        elif message.expired():
            self.outbox.skip(entry, EXPIRED)
            return None
        return topic

    def settle(self, entries: Sequence[OutboxEntry]) -> None:
        """The remote has `entries` (or they were skipped): the cursor moves on, the window has
        room again."""
        for entry in entries:
            self.outbox.settle(entry)
        if self._subscription is not None:
            self._subscription.wake()

    async def _publish_in(self, message: Message) -> None:
        """Publish what came in from the remote into the local core; returns once it is
        accepted (journaled on a reliable stream); raises when it is not."""
        pending = self.edge.publish(message)
        if pending is not None:
            await pending
        self.forwarded_in += 1


def rewrite_topic(topic: str, strip: str, add: str) -> str | None:
    """`topic` with the prefix `strip` removed and `add` put in front; None when `topic` does
    not start with `strip`."""
    if strip:
        if not topic.startswith(strip):
            return None
        topic = topic[len(strip):]
    return add + topic


def check_filters_under_prefix(kind: str, name: str, direction: str, filters: Sequence[str],
                               setting: str, prefix: str, log: logging.Logger) -> None:
    """Each direction's filters name topics of the side its messages are read from, prefix
    included (`out`: local topics under `local_prefix`; `inbound`: remote topics under
    `remote_prefix`). A filter that can match nothing under the prefix is refused; one with
    wildcards that reaches beyond it is taken with a warning (what falls outside is dropped,
    counted and logged)."""
    if not prefix:
        return
    for topic_filter in filters:
        if topic_filter.startswith(prefix):
            continue
        if not _may_match_under(topic_filter, prefix):
            raise ValueError(
                f"{kind} {name!r}: {direction} filter {topic_filter!r} is not under {setting} "
                f"{prefix!r}, so nothing it matches could be forwarded; {direction} filters name "
                f"topics as they are on that side, prefix included: write "
                f"{prefix + topic_filter!r}")
        log.warning("%s %s: %s filter %r reaches beyond %s %r; messages outside it are dropped "
                    "(counted as outside_prefix)", kind, name, direction, topic_filter, setting, prefix)


def _may_match_under(topic_filter: str, prefix: str) -> bool:
    """Whether `topic_filter` can match some topic that starts with `prefix`."""
    *whole, partial = prefix.split("/")
    levels = topic_filter.split("/")
    for index, level in enumerate([*whole, partial]):
        if index >= len(levels):
            return False
        wanted = levels[index]
        if wanted == "#":
            return True
        if wanted == "+":
            continue
        if index < len(whole):
            if wanted != level:
                return False
        elif not wanted.startswith(level):
            return False
    return True
