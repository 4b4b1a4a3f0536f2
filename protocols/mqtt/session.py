"""An MQTT session: the state that outlives a network connection.

A session is the core `Consumer` for its own subscription (all its non-shared topic filters)
and for each shared subscription it joined. It keeps the outbound in-flight window (QoS 1/2
messages sent but not yet acknowledged), a bounded queue of messages waiting for that window
or for the client to come back, and the inbound QoS 2 packet ids not yet released.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ...core.durable import DurableOptions, DurableSubscription
from ...core.message import Message, now_ms
from ...core.outbox import QUEUE_BYTES, SLOW_SUBSCRIBER
from ...core.subscriptions import Subscription
from ...core.topics import filter_matches

if TYPE_CHECKING:
    from .connection import MqttConnection
    from .service import MqttService

log = logging.getLogger(__name__)

NEVER_EXPIRES = 0xFFFFFFFF
# The queue of every session that never queued anything (an empty deque costs 600 bytes, and
# most sessions never queue): only `_enqueue` adds, and it gives the session its own first.
_NO_QUEUE: deque[Queued] = deque()
# Packet ids of QoS 2 publishes received and not yet released, shared by every session and
# connection that has none (an empty set is 216 bytes, and most clients never publish at QoS 2):
# only its reads and removals may reach it (`discard`, `clear`, `in`, `len`); whoever adds
# takes a set of its own first (`open_packet_ids`).
NO_PACKET_IDS: set[int] = set()


def open_packet_ids(ids: set[int]) -> set[int]:
    """`ids` itself, or a new set of its own in place of the shared empty `NO_PACKET_IDS`:
    what to add a packet id to."""
    return set() if ids is NO_PACKET_IDS else ids


@dataclass(slots=True)
class SubscriptionOptions:
    qos: int
    no_local: bool = False
    retain_as_published: bool = False
    retain_handling: int = 0
    subscription_id: int | None = None


@dataclass(slots=True)
class Outgoing:
    """One QoS 1/2 message in flight to the client."""

    message: Message
    qos: int
    retain: bool
    subscription_ids: tuple[int, ...]
    source: Subscription | None = None
    # False: waiting for PUBACK/PUBREC; True: PUBREL sent, waiting for PUBCOMP.
    released: bool = False


@dataclass(slots=True)
class Queued:
    message: Message
    qos: int
    retain: bool
    subscription_ids: tuple[int, ...]
    source: Subscription | None = None


class SessionOfAnotherUser(Exception):
    """Cluster mode: the client id's session, held on another node, belongs to another user;
    the CONNECT is refused as on the holder (`mqtt.session_takeover_by_other_user`)."""


class MqttSession:
    def __init__(self, service: MqttService, client_id: str, durable: bool = False) -> None:
        self.service = service
        self.client_id = client_id
        self.connection: MqttConnection | None = None
        self.expiry_interval = 0
        self.disconnected_at_ms: int | None = None
        self.durable = durable
        # The user who made the session (None: an anonymous client), once known: another
        # user's CONNECT with this client id does not get it (`MqttService.owned_by_other`).
        # A session saved before owners were kept is claimed by the first user to resume it.
        self.owner: str | None = None
        self.owned = False
        name = f"mqtt:{client_id}"
        edge = service.edge
        if durable:
            # Offline messages stay in the journal; the session's cursors replay them.
            self.subscription: Subscription = edge.durable_subscription(
                name, options=DurableOptions(ack_timeout_s=None, redeliver_on_leave=False, consumers_queue=True), owner=self
            )
        else:
            self.subscription = edge.subscription(name, owner=self)
        # Shared subscription name -> (subscription, this member's options).
        self.shared: dict[str, tuple[Subscription, SubscriptionOptions]] = {}
        self.inflight: dict[int, Outgoing] = {}
        self.queue: deque[Queued] = _NO_QUEUE  # a deque of its own from the first message
        # The payload bytes of `queue` (`mqtt.max_queued_bytes` bounds them).
        self.queued_bytes = 0
        self.inbound_qos2: set[int] = NO_PACKET_IDS  # a set of its own from the first
        # Of those, the ones whose message waits for its commit: not yet to be told to another
        # node as received (`snapshotting.capture`), since the commit may fail.
        self.qos2_committing: set[int] = NO_PACKET_IDS
        # How many times the session moved to another node (`snapshotting.rebuild`): orders
        # its snapshots and replicated records, whoever's clock took them.
        self.generation = 0
        self._last_packet_id = 0
        self.dropped = 0
        # When the queue of this online session passed half its limit (back-pressure), if it has.
        self.congested_since: float | None = None

    def __repr__(self) -> str:
        return f"MqttSession({self.client_id!r})"

    # ------------------------------------------------------------------ core Consumer
    @property
    def consumer_id(self) -> str:
        return self.client_id

    @property
    def available(self) -> bool:
        connection = self.connection
        return (
            connection is not None and not self.queue and len(self.inflight) < connection.send_window
            and not self.service.draining and connection.output_room()
        )

    def deliver(self, message: Message, subscription: Subscription, filters: Sequence[str]) -> None:
        if subscription is self.subscription and len(filters) == 1:
            # The common case, one plain filter of the session's own: no loop, and a QoS 0
            # message goes straight to the connection.
            options: SubscriptionOptions = subscription.filters[filters[0]]
            if not options.no_local and not options.subscription_id:
                qos = options.qos if options.qos < message.qos else message.qos
                retain = message.retain if options.retain_as_published else False
                connection = self.connection
                if qos or connection is None:
                    self.send_message(message, qos, retain, (), subscription)
                    return
                if not connection.send_publish(message, 0, retain, (), None, False):
                    self.dropped += 1
                if subscription.durable:
                    subscription.ack(message)
                return
        if subscription is self.subscription:
            qos = -1
            retain_as_published = False
            ids: list[int] | None = None
            own = subscription.filters
            for topic_filter in filters:
                options = own[topic_filter]
                if (
                    options.no_local
                    and message.producer_id == self.client_id
                    and message.producer_protocol == "mqtt"
                ):
                    continue  # [MQTT-3.8.3-3]
                if options.qos > qos:
                    qos = options.qos
                retain_as_published |= options.retain_as_published
                if options.subscription_id:
                    if ids is None:
                        ids = []
                    ids.append(options.subscription_id)
            if qos < 0:
                return
            subscription_ids = tuple(ids) if ids else ()
        else:
            entry = self.shared.get(subscription.name)
            if entry is None:
                return
            options = entry[1]
            qos = options.qos
            retain_as_published = options.retain_as_published
            subscription_ids = (options.subscription_id,) if options.subscription_id else ()
        if message.qos < qos:
            qos = message.qos
        retain = message.retain if retain_as_published else False
        self.send_message(message, qos, retain, subscription_ids, subscription)

    # ------------------------------------------------------------------ outbound flow
    def send_message(
        self,
        message: Message,
        qos: int,
        retain: bool,
        subscription_ids: tuple[int, ...] = (),
        source: Subscription | None = None,
    ) -> None:
        connection = self.connection
        if connection is None:
            if qos == 0 and not self.service.settings.queue_qos0_offline:
                if source is not None:
                    source.ack(message)
                return
            self._enqueue(Queued(message, qos, retain, subscription_ids, source))
            return
        if qos == 0:
            if not connection.send_publish(message, 0, retain, subscription_ids, None, False):
                self.dropped += 1
            if source is not None and source.durable:  # live subscriptions take no acks
                source.ack(message)
            return
        if self.queue or len(self.inflight) >= connection.send_window or self.service.draining:
            self._enqueue(Queued(message, qos, retain, subscription_ids, source))
            return
        self._send_inflight(connection, message, qos, retain, subscription_ids, source)

    def _send_inflight(
        self,
        connection: MqttConnection,
        message: Message,
        qos: int,
        retain: bool,
        subscription_ids: tuple[int, ...],
        source: Subscription | None = None,
    ) -> None:
        packet_id = self._next_packet_id()
        self.inflight[packet_id] = Outgoing(message, qos, retain, subscription_ids, source)
        dup = isinstance(source, DurableSubscription) and source.handed_out_before(message)
        if not connection.send_publish(message, qos, retain, subscription_ids, packet_id, dup):
            # Too large for the client [MQTT-3.1.2-25]: discarded as if delivered.
            del self.inflight[packet_id]
            if source is not None:
                source.ack(message)

    def _enqueue(self, item: Queued) -> None:
        queued = len(self.queue)
        settings = self.service.settings
        limit = settings.max_queued_messages
        byte_limit = settings.max_queued_bytes
        queued_bytes = self.queued_bytes
        if self.connection is not None and (
                queued >= limit >> 1 or (byte_limit and queued_bytes >= byte_limit >> 1)):
            # Online but behind: hold the publisher rather than drop beyond the limit.
            self.service.congested(self)
        if queued >= limit or (byte_limit and queued_bytes >= byte_limit):
            # The first limit reached applies (mosquitto's max_queued_messages / _bytes).
            self.dropped += 1
            self.service.dropped(self, SLOW_SUBSCRIBER if queued >= limit else QUEUE_BYTES)
            if item.source is not None:
                item.source.ack(item.message)
            return
        if self.queue is _NO_QUEUE:
            self.queue = deque()
        self.queue.append(item)
        self.queued_bytes = queued_bytes + len(item.message.payload)

    def caught_up(self) -> bool:
        """Whether the queue is back below a quarter of both its limits (where the publishers
        held for it are released)."""
        settings = self.service.settings
        return len(self.queue) <= settings.max_queued_messages >> 2 and (
            not settings.max_queued_bytes or self.queued_bytes <= settings.max_queued_bytes >> 2)

    def forget_queued(self, gone: Sequence[Subscription] = ()) -> int:
        """Drop the queued messages that no filter of this session takes any more (filters
        removed, shared subscriptions in `gone` left): they are acknowledged to their
        subscription, never sent. Returns how many were dropped."""
        if not self.queue:
            return 0
        own = self.subscription
        filters = list(own.filters)
        kept: deque[Queued] = deque()
        dropped = 0
        for item in self.queue:
            source = item.source
            if source is not None and source in gone:
                wanted = False
            elif source is None or source is own:
                wanted = any(filter_matches(f, item.message.topic) for f in filters)
            else:
                wanted = True
            if wanted:
                kept.append(item)
                continue
            dropped += 1
            self.queued_bytes -= len(item.message.payload)
            if source is not None:
                source.ack(item.message)
        if dropped:
            self.queue = kept
        return dropped

    def replace_queued_from(self, start: int, kept: Sequence[Queued]) -> None:
        """Replace the queued messages from position `start` on with `kept` (some of them,
        reordered), keeping the queue's byte count true."""
        queue = self.queue
        for _ in range(len(queue) - start):
            self.queued_bytes -= len(queue.pop().message.payload)
        queue.extend(kept)
        self.queued_bytes += sum(len(item.message.payload) for item in kept)

    def _next_packet_id(self) -> int:
        packet_id = self._last_packet_id
        for _ in range(65535):
            packet_id = packet_id % 65535 + 1
            if packet_id not in self.inflight:
                self._last_packet_id = packet_id
                return packet_id
        raise RuntimeError("no free packet identifier")

    def drain(self) -> None:
        """Send queued messages while the client's window has room (none once the server
        drains for a graceful stop)."""
        connection = self.connection
        if connection is None or self.service.draining:
            return
        queue = self.queue
        window = connection.send_window
        now = now_ms()
        while queue and (queue[0].qos == 0 or len(self.inflight) < window):
            item = queue.popleft()
            self.queued_bytes -= len(item.message.payload)
            if item.message.expired(now):
                if item.source is not None:
                    item.source.ack(item.message)
                continue
            if item.qos == 0:
                connection.send_publish(item.message, 0, item.retain, item.subscription_ids, None, False)
                if item.source is not None:
                    item.source.ack(item.message)
            else:
                self._send_inflight(
                    connection, item.message, item.qos, item.retain, item.subscription_ids, item.source
                )
            if not connection.open:
                return
        if self.congested_since is not None and self.caught_up():
            self.service.relieved(self)
        if not queue and self.durable:
            self.subscription.wake()

    def output_drained(self) -> None:
        """The client read most of its output (see `MqttConnection.output_room`): release the
        publishers held for it, and resume the replay of its backlog."""
        if self.congested_since is not None and self.caught_up():
            self.service.relieved(self)
        if self.durable:
            self.subscription.wake()

    def acknowledge(self, packet_id: int) -> bool:
        """PUBACK (QoS 1) or PUBCOMP (QoS 2) received; frees the slot."""
        outgoing = self.inflight.pop(packet_id, None)
        if outgoing is None:
            return False
        if outgoing.source is not None:
            outgoing.source.ack(outgoing.message)
        if self.queue:
            self.drain()
        elif self.durable:
            self.subscription.wake()
        return True

    def received(self, packet_id: int, failed: bool) -> bool:
        """PUBREC received. Returns True if a PUBREL must be sent."""
        outgoing = self.inflight.get(packet_id)
        if outgoing is None:
            return False
        if failed:
            self.acknowledge(packet_id)
            return False
        outgoing.released = True
        if self.durable:
            # Saved before PUBREL goes out: after a restart this message is only ever
            # released, never published again [MQTT-4.3.3], so QoS 2 stays exactly once.
            self.service.save_session(self)
            self.service.exactly_once_changed(self)
        return True

    def resend_inflight(self) -> None:
        """On a resumed session: resend unacknowledged PUBLISH (DUP) and PUBREL [MQTT-4.4.0-1]."""
        connection = self.connection
        if connection is None:
            return
        for packet_id, outgoing in list(self.inflight.items()):
            if outgoing.released:
                connection.send_pubrel(packet_id)
            else:
                # Resent even if it expired since: onward delivery has started, and expiry
                # only removes messages not yet sent [MQTT-3.3.2-5].
                connection.send_publish(
                    outgoing.message, outgoing.qos, outgoing.retain,
                    outgoing.subscription_ids, packet_id, True,
                )
        self.drain()

    # ------------------------------------------------------------------ lifecycle
    def discard(self) -> None:
        """End the session: leave every subscription, forget queued and in-flight messages."""
        edge = self.service.edge
        edge.remove_subscription(self.subscription.name)
        for subscription, _ in self.shared.values():
            edge.detach(subscription, self)
            if not subscription.consumers:
                edge.remove_subscription(subscription.name)
        self.shared.clear()
        self.inflight.clear()
        if self.durable:
            self.service.forget_session(self.client_id)
        self.queue.clear()
        self.queued_bytes = 0
        self.inbound_qos2.clear()
        self.qos2_committing.clear()
        # No cycle left between the session and its (removed) subscription: both are freed
        # at once by reference counting, not left for the cycle collector.
        subscription = self.subscription
        subscription.consumers.clear()
        if subscription.owner is self:
            subscription.belongs_to(None)
