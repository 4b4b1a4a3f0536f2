"""`SessionSnapshot`: an MQTT session's state as one typed value, with its one encoding.

A persistent session is written in two places: the node's own metadata store (what a restart
brings back: subscriptions, shared groups, in-flight packet ids, owner; expiry, cursors and
QoS 2 state have their own columns and tables there) and, in a cluster, etcd and the
`ReleaseSession` answer (everything another node needs to resume it: also its cursors, the
unacknowledged messages themselves, what it had queued, its QoS 2 receive state). Both are a
`SessionSnapshot`, taken by `capture`, turned into bytes by `encode` and back by `decode`,
and made into a session again by `rebuild` (the cluster) or `MqttService.restore_sessions`.

The encoding is JSON, version `SNAPSHOT_VERSION` (2): every entry names its fields. `decode`
also reads what earlier versions wrote, so a restart with old data and a rolling upgrade
work: version 1 (the cluster's snapshots, entries as positional arrays) and the metadata
store's unversioned records (the same positional arrays, fewer keys). A record of a later
version, or one that is not what was written, raises one of `UNREADABLE`: the caller sets
it aside. Sans-IO: nothing here reads or writes a store.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ...core.durable import DurableSubscription
from ...core.message import Message, now_ms
from ...core.records import RecordFormatError, decode_to_message, encode_message
from ...core.subscriptions import Subscription, SubscriptionType
from .session import MqttSession, Outgoing, Queued, SubscriptionOptions

if TYPE_CHECKING:
    from .service import MqttService

SNAPSHOT_VERSION = 2
# What decoding or rebuilding a snapshot raises when it is not what was written.
UNREADABLE = (ValueError, KeyError, TypeError, AttributeError, IndexError, RecordFormatError)


def message_record(message: Message) -> str:
    """A message as a snapshot carries it: the core's record format, base64."""
    return base64.b64encode(encode_message(message)).decode()


def record_message(record: str, stream: str, shard: int, offset: int) -> Message:
    """The message of `message_record`, at its place; RecordFormatError or ValueError when
    the record cannot be read."""
    return decode_to_message(base64.b64decode(record), stream, shard, offset)


def _ids(value: Any) -> list[int]:
    return [int(item) for item in value]


def _optional_int(value: Any) -> int | None:
    return None if value is None else int(value)


@dataclass(slots=True)
class OwnFilter:
    """A topic filter of the session's own subscription, with its options."""

    topic_filter: str
    options: SubscriptionOptions

    def encode(self) -> dict[str, Any]:
        o = self.options
        return {"filter": self.topic_filter, "qos": o.qos, "no_local": o.no_local,
                "rap": o.retain_as_published, "handling": o.retain_handling, "id": o.subscription_id}

    @classmethod
    def decode(cls, entry: Any, version: int) -> OwnFilter:
        if version < 2:
            topic_filter, qos, no_local, rap, handling, sub_id = entry
        else:
            topic_filter, qos, no_local = entry["filter"], entry["qos"], entry["no_local"]
            rap, handling, sub_id = entry["rap"], entry["handling"], entry["id"]
        return cls(str(topic_filter), SubscriptionOptions(
            int(qos), bool(no_local), bool(rap), int(handling), _optional_int(sub_id)))


@dataclass(slots=True)
class SharedMembership:
    """A shared subscription group the session is a member of."""

    name: str
    type: str
    filters: list[str]
    qos: int
    retain_as_published: bool
    subscription_id: int | None

    def encode(self) -> dict[str, Any]:
        return {"name": self.name, "type": self.type, "filters": self.filters, "qos": self.qos,
                "rap": self.retain_as_published, "id": self.subscription_id}

    @classmethod
    def decode(cls, entry: Any, version: int) -> SharedMembership:
        if version < 2:
            name, sub_type, filters, qos, rap, sub_id = entry
        else:
            name, sub_type, filters = entry["name"], entry["type"], entry["filters"]
            qos, rap, sub_id = entry["qos"], entry["rap"], entry["id"]
        return cls(str(name), str(sub_type), [str(f) for f in filters], int(qos), bool(rap),
                   _optional_int(sub_id))


@dataclass(slots=True)
class CursorState:
    """Where the session's durable cursor of one shard is: the next offset to deliver and the
    offsets delivered but not acknowledged (in the shard's owner's numbering)."""

    stream: str
    shard: int
    position: int
    unacked: list[int]

    def encode(self) -> dict[str, Any]:
        return {"stream": self.stream, "shard": self.shard, "position": self.position,
                "unacked": self.unacked}

    @classmethod
    def decode(cls, entry: Any, version: int) -> CursorState:
        if version < 2:
            stream, shard, position, unacked = entry
        else:
            stream, shard = entry["stream"], entry["shard"]
            position, unacked = entry["position"], entry["unacked"]
        return cls(str(stream), int(shard), int(position), _ids(unacked))


@dataclass(slots=True)
class CarriedMessage:
    """A message the snapshot carries (an unacknowledged one of a cursor), as its record."""

    stream: str
    shard: int
    offset: int
    record: str

    def encode(self) -> dict[str, Any]:
        return {"stream": self.stream, "shard": self.shard, "offset": self.offset,
                "record": self.record}

    @classmethod
    def decode(cls, entry: Any, version: int) -> CarriedMessage:
        if version < 2:
            stream, shard, offset, record = entry
        else:
            stream, shard, offset, record = entry["stream"], entry["shard"], entry["offset"], entry["record"]
        return cls(str(stream), int(shard), int(offset), str(record))


@dataclass(slots=True)
class InFlight:
    """A QoS 1/2 message in flight to the client under `packet_id`. Of the session's own
    subscription (`group` None: its message comes with the cursors) or of a shared group
    (`group` named, the message in `record`)."""

    packet_id: int
    stream: str
    shard: int
    offset: int
    qos: int
    released: bool
    retain: bool
    subscription_ids: list[int]
    group: str | None = None
    record: str | None = None

    def encode(self) -> dict[str, Any]:
        encoded = {"pid": self.packet_id, "stream": self.stream, "shard": self.shard,
                   "offset": self.offset, "qos": self.qos, "released": self.released,
                   "retain": self.retain, "ids": self.subscription_ids}
        if self.group is not None:
            encoded.update(group=self.group, record=self.record)
        return encoded

    @classmethod
    def decode(cls, entry: Any, version: int, *, shared: bool = False) -> InFlight:
        group = record = None
        if version < 2:
            if shared:
                pid, group, stream, shard, offset, qos, released, retain, ids, record = entry
            else:
                pid, stream, shard, offset, qos, released, retain, ids = entry
        else:
            pid, stream, shard, offset = entry["pid"], entry["stream"], entry["shard"], entry["offset"]
            qos, released, retain, ids = entry["qos"], entry["released"], entry["retain"], entry["ids"]
            group, record = entry.get("group"), entry.get("record")
        return cls(int(pid), str(stream), int(shard), int(offset), int(qos), bool(released),
                   bool(retain), _ids(ids), None if group is None else str(group),
                   None if record is None else str(record))


@dataclass(slots=True)
class QueuedEntry:
    """A message queued for the session that no cursor holds (a non-reliable stream's, or a
    shared group's: `group` names it)."""

    stream: str
    shard: int
    offset: int
    qos: int
    retain: bool
    subscription_ids: list[int]
    record: str
    group: str | None = None

    def encode(self) -> dict[str, Any]:
        encoded = {"stream": self.stream, "shard": self.shard, "offset": self.offset,
                   "qos": self.qos, "retain": self.retain, "ids": self.subscription_ids,
                   "record": self.record}
        if self.group is not None:
            encoded["group"] = self.group
        return encoded

    @classmethod
    def decode(cls, entry: Any, version: int) -> QueuedEntry:
        if version < 2:
            stream, shard, offset, qos, retain, ids, record, *rest = entry
            group = rest[0] if rest else None
        else:
            stream, shard, offset = entry["stream"], entry["shard"], entry["offset"]
            qos, retain, ids, record = entry["qos"], entry["retain"], entry["ids"], entry["record"]
            group = entry.get("group")
        return cls(str(stream), int(shard), int(offset), int(qos), bool(retain), _ids(ids),
                   str(record), None if group is None else str(group))


@dataclass(slots=True)
class SessionSnapshot:
    """Everything needed to resume an MQTT session here or on another node (module docstring).
    `owned` False: the session was made before owners were kept (its first user claims it)."""

    client_id: str = ""
    node: str | None = None
    online: bool = False
    expiry: int = 0
    disconnected_ms: int | None = None
    taken_ms: int = 0  # 0: not known
    subscriptions: list[OwnFilter] = field(default_factory=list)
    shared: list[SharedMembership] = field(default_factory=list)
    cursors: list[CursorState] = field(default_factory=list)
    messages: list[CarriedMessage] = field(default_factory=list)
    inflight: list[InFlight] = field(default_factory=list)
    shared_inflight: list[InFlight] = field(default_factory=list)
    queued: list[QueuedEntry] = field(default_factory=list)
    qos2: list[int] = field(default_factory=list)
    owner: str | None = None
    owned: bool = False

    # ------------------------------------------------------------ encoding
    def to_dict(self) -> dict[str, Any]:
        encoded: dict[str, Any] = {
            "version": SNAPSHOT_VERSION, "client_id": self.client_id, "node": self.node,
            "online": self.online, "expiry": self.expiry, "disconnected_ms": self.disconnected_ms,
            "taken_ms": self.taken_ms,
            "subscriptions": [entry.encode() for entry in self.subscriptions],
            "shared": [entry.encode() for entry in self.shared],
            "cursors": [entry.encode() for entry in self.cursors],
            "messages": [entry.encode() for entry in self.messages],
            "inflight": [entry.encode() for entry in self.inflight],
            "shared_inflight": [entry.encode() for entry in self.shared_inflight],
            "queued": [entry.encode() for entry in self.queued],
            "qos2": self.qos2,
        }
        if self.owned:  # the user who made it goes with it
            encoded["owner"] = self.owner
        return encoded

    def encode(self) -> bytes:
        return json.dumps(self.to_dict(), separators=(",", ":"), sort_keys=True).encode()

    @classmethod
    def decode(cls, raw: bytes | str | dict[str, Any]) -> SessionSnapshot:
        """A snapshot of any version written so far (module docstring); one of `UNREADABLE`
        when `raw` is not one."""
        state = json.loads(raw) if isinstance(raw, bytes | str) else raw
        if not isinstance(state, dict):
            raise ValueError(f"a JSON {type(state).__name__}, not an object")
        version = int(state.get("version", 0))
        if version > SNAPSHOT_VERSION:
            raise ValueError(f"a session snapshot of version {version}, newer than this node "
                             f"reads ({SNAPSHOT_VERSION})")
        owner = state.get("owner")
        node = state.get("node")
        return cls(
            client_id=str(state.get("client_id", "")),
            node=None if node is None else str(node),
            online=bool(state.get("online", False)),
            expiry=int(state.get("expiry", 0)),
            disconnected_ms=_optional_int(state.get("disconnected_ms")),
            taken_ms=int(state.get("taken_ms") or 0),
            subscriptions=[OwnFilter.decode(e, version) for e in state.get("subscriptions", [])],
            shared=[SharedMembership.decode(e, version) for e in state.get("shared", [])],
            cursors=[CursorState.decode(e, version) for e in state.get("cursors", [])],
            messages=[CarriedMessage.decode(e, version) for e in state.get("messages", [])],
            inflight=[InFlight.decode(e, version) for e in state.get("inflight", [])],
            shared_inflight=[InFlight.decode(e, version, shared=True)
                             for e in state.get("shared_inflight", [])],
            queued=[QueuedEntry.decode(e, version) for e in state.get("queued", [])],
            qos2=_ids(state.get("qos2", [])),
            owner=None if owner is None else str(owner),
            owned="owner" in state,
        )


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
    snapshot.qos2 = sorted(session.inbound_qos2)
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
