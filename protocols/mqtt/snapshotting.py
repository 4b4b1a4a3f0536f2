"""Taking an MQTT session's `SessionSnapshot` (`capture`) and making a session from one
(`rebuild`): what the node's own store keeps of a persistent session and what a cluster hands
to another node, from and into the session's own objects. The value and its encoding are
`snapshot.py`'s; this module reads and writes no store (a rebuilt session's QoS 2 state goes
to the service's).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from ...core.durable import DurableSubscription
from ...core.message import Message, now_ms
from ...core.records import RecordFormatError
from ...core.subscriptions import Subscription, SubscriptionType
from .session import MqttSession, Outgoing, Queued, SubscriptionOptions
from .snapshot import (
    CarriedMessage,
    CursorState,
    InFlight,
    OwnFilter,
    QueuedEntry,
    SessionSnapshot,
    SharedMembership,
    message_record,
    record_message,
)

if TYPE_CHECKING:
    from .service import MqttService


# ------------------------------------------------------------ taking one
def cursor_entries(sub: DurableSubscription) -> tuple[list[CursorState], list[CarriedMessage]]:
    """A durable subscription's cursors and the unacknowledged messages themselves."""
    cursors = []
    messages = []
    for (stream, shard), cursor in sub.cursors.items():
        unacked = sorted(set(cursor.unacked) | set(cursor.pending_redelivery))
        cursors.append(CursorState(stream, shard, cursor.position, unacked))
        for offset in unacked:
            delivery = cursor.unacked.get(offset)
            message = delivery.message if delivery is not None else cursor.restored.get(offset)
            if message is None:
                message = sub.read_message(stream, shard, offset)
            if message is not None:
                messages.append(CarriedMessage(stream, shard, offset, message_record(message)))
    return cursors, messages


def group_of(session: MqttSession, source: Subscription | None) -> str | None:
    """The name of the shared subscription group `source` is, if it is one of `session`'s."""
    if source is None or source is session.subscription:
        return None
    entry = session.shared.get(source.name)
    return source.name if entry is not None and entry[0] is source else None


def capture(session: MqttSession, node: str | None = None, *, group_messages: bool = False,
            local: bool = False) -> SessionSnapshot:
    """The snapshot of `session`. `local`: what the node's own store keeps (subscriptions,
    groups, in-flight packet ids, owner; the store has the rest). With `group_messages` (a
    handover to a live node), also what its shared subscription groups handed it and it has
    not acknowledged, in flight or queued: a group's message stays with the member it was
    given to, as it does on one node while that member is offline [MQTT-4.8.2], so it follows
    the member to its new node (a live group keeps no cursor of its own to replay it from)."""
    sub = session.subscription
    snapshot = SessionSnapshot(
        client_id=session.client_id, node=node, online=session.connection is not None,
        expiry=session.expiry_interval, disconnected_ms=session.disconnected_at_ms,
        taken_ms=now_ms(), owner=session.owner, owned=session.owned,
        generation=session.generation,
        subscriptions=[OwnFilter(f, o) for f, o in sub.filters.items()],
        shared=[SharedMembership(name, shared_sub.type.value, list(shared_sub.filters), o.qos,
                                 o.retain_as_published, o.subscription_id)
                for name, (shared_sub, o) in session.shared.items()],
        inflight=[InFlight(pid, o.message.stream, o.message.shard, o.message.offset, o.qos,
                           o.released, o.retain, list(o.subscription_ids))
                  for pid, o in session.inflight.items()
                  if o.source is sub and o.message.offset >= 0],
    )
    if local:
        return snapshot
    if snapshot.disconnected_ms is None:
        snapshot.disconnected_ms = now_ms()
    if isinstance(sub, DurableSubscription):
        snapshot.cursors, snapshot.messages = cursor_entries(sub)
    if group_messages:
        for pid, o in session.inflight.items():
            group = group_of(session, o.source)
            if group is not None:
                message = o.message
                snapshot.shared_inflight.append(InFlight(
                    pid, message.stream, message.shard, message.offset, o.qos, o.released,
                    o.retain, list(o.subscription_ids), group, message_record(message)))
    # queued messages no cursor holds (non-reliable streams, shared groups): carried as they
    # are, in their order
    for item in session.queue:
        message = item.message
        if item.source is not None and item.source is not sub:
            group = group_of(session, item.source) if group_messages else None
            if group is not None:
                snapshot.queued.append(QueuedEntry(
                    message.stream, message.shard, message.offset, item.qos, item.retain,
                    list(item.subscription_ids), message_record(message), group))
            continue  # without a handover, the queue of a group dies with this node
        cursor = sub.cursors.get((message.stream, message.shard)) if isinstance(sub, DurableSubscription) else None
        if cursor is not None and message.offset in cursor.unacked:
            continue
        snapshot.queued.append(QueuedEntry(
            message.stream, message.shard, message.offset, item.qos, item.retain,
            list(item.subscription_ids), message_record(message)))
    # the QoS 2 ids whose message is committed (one still waiting for its commit may fail: it
    # is a new message if its client sends it again)
    committing = session.qos2_committing
    snapshot.qos2 = sorted(session.inbound_qos2 - committing if committing else session.inbound_qos2)
    return snapshot


# ------------------------------------------------------------ resuming one
# Puts a snapshot's cursors on the session's durable subscription (before its filters are
# added); returns the carried messages by (stream, shard, offset).
PlaceCursors = Callable[[DurableSubscription, SessionSnapshot], dict[tuple[str, int, int], Message]]


def rebuild(service: MqttService, snapshot: SessionSnapshot, place: PlaceCursors,
            unreadable: Callable[[CarriedMessage | InFlight | QueuedEntry, Exception], None]
            ) -> MqttSession:
    """A session of `service` made again from a snapshot another node took, offline (its
    connection is about to attach), and kept in `service.sessions`. A carried message that
    cannot be read is told to `unreadable` and left out; a snapshot that is not what was
    written raises one of `UNREADABLE`, and nothing of it is left in the broker."""
    client_id = snapshot.client_id
    session = MqttSession(service, client_id, durable=True)
    try:
        _fill(service, session, snapshot, place, unreadable)
    except BaseException:
        session.discard()  # what was made of it leaves the broker
        raise
    service.sessions[client_id] = session
    return session


def _read(entry: CarriedMessage | InFlight | QueuedEntry,
          unreadable: Callable[[CarriedMessage | InFlight | QueuedEntry, Exception], None]
          ) -> Message | None:
    if entry.record is None:
        return None
    try:
        return record_message(entry.record, entry.stream, entry.shard, entry.offset)
    except (RecordFormatError, ValueError) as exc:
        unreadable(entry, exc)
        return None


def _fill(service: MqttService, session: MqttSession, snapshot: SessionSnapshot,
          place: PlaceCursors,
          unreadable: Callable[[CarriedMessage | InFlight | QueuedEntry, Exception], None]) -> None:
    edge = service.edge
    session.expiry_interval = snapshot.expiry
    session.disconnected_at_ms = snapshot.disconnected_ms
    session.generation = snapshot.generation + 1  # a move: later than anything taken before
    if snapshot.owned:
        session.owner, session.owned = snapshot.owner, True
    sub = session.subscription
    assert isinstance(sub, DurableSubscription)
    handed = place(sub, snapshot)
    for own in snapshot.subscriptions:
        edge.add_filter(sub, own.topic_filter, own.options)
    edge.attach(sub, session)
    for group in snapshot.shared:
        shared_sub = edge.subscription(group.name, SubscriptionType(group.type))
        for topic_filter in group.filters:
            edge.add_filter(shared_sub, topic_filter)
        edge.attach(shared_sub, session)
        session.shared[group.name] = (shared_sub, SubscriptionOptions(
            group.qos, False, group.retain_as_published, 0, group.subscription_id))
    for flight in snapshot.inflight:
        message = handed.get((flight.stream, flight.shard, flight.offset))
        if message is None:
            continue
        session.inflight[flight.packet_id] = Outgoing(
            message, flight.qos, flight.retain, tuple(flight.subscription_ids), sub, flight.released)
        sub.adopt(message, session)
    for flight in snapshot.shared_inflight:
        entry = session.shared.get(flight.group or "")
        message = _read(flight, unreadable)
        if entry is not None and message is not None and flight.packet_id not in session.inflight:
            session.inflight[flight.packet_id] = Outgoing(
                message, flight.qos, flight.retain, tuple(flight.subscription_ids), entry[0],
                flight.released)
    for queued in snapshot.queued:
        source: Subscription | None = sub
        if queued.group is not None:
            entry = session.shared.get(queued.group)
            if entry is None:
                continue
            source = entry[0]
        message = _read(queued, unreadable)
        if message is not None:
            session._enqueue(Queued(message, queued.qos, queued.retain,
                                    tuple(queued.subscription_ids), source))
    session.inbound_qos2 = set(snapshot.qos2)
    if session.inbound_qos2 and service.store is not None:
        service.store.save_qos2([(snapshot.client_id, packet_id, True)
                                 for packet_id in session.inbound_qos2])


def carried_by_place(messages: Iterable[CarriedMessage],
                     unreadable: Callable[[CarriedMessage, Exception], None]
                     ) -> dict[tuple[str, int], list[Message]]:
    """The carried messages that can be read, by (stream, shard), in their order."""
    found: dict[tuple[str, int], list[Message]] = {}
    for entry in messages:
        try:
            message = record_message(entry.record, entry.stream, entry.shard, entry.offset)
        except (RecordFormatError, ValueError) as exc:
            unreadable(entry, exc)
            continue
        found.setdefault((entry.stream, entry.shard), []).append(message)
    return found
