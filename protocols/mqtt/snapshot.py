"""`SessionSnapshot`: an MQTT session's state as one typed value, with its one encoding.

A persistent session is written in two places: the node's own metadata store (what a restart
brings back: subscriptions, shared groups, in-flight packet ids, owner; expiry, cursors and
QoS 2 state have their own columns and tables there) and, in a cluster, etcd and the
`ReleaseSession` answer (everything another node needs to resume it: also its cursors, the
unacknowledged messages themselves, what it had queued, its QoS 2 receive state). Both are a
`SessionSnapshot`, taken by `capture`, turned into bytes by `encode` and back by `decode`,
and made into a session again by `rebuild` (the cluster) or `MqttService.restore_sessions`
(`capture` and `rebuild` are in `snapshotting.py`).

The encoding is JSON, version `SNAPSHOT_VERSION` (2): every entry names its fields, a
message's or cursor's stream, shard and offset together as its `place`, a filter's options
together as `options`. `decode` also reads what earlier versions wrote, so a restart with old
data and a rolling upgrade work: version 1 (the cluster's snapshots, entries as positional
arrays) and the metadata store's unversioned records (the same positional arrays, fewer
keys). A record of a later version, or one that is not what was written, raises one of
`UNREADABLE`: the caller sets it aside.

Nodes of earlier versions read version 1 only. No entry of version 2 has as many fields as
its positional form had, so such a node, handed a version 2 snapshot during a rolling
upgrade, fails to unpack it and sets it aside (its client gets a new session there, as for
any snapshot it cannot restore) rather than misreading it; the session's state is lost only
if its client resumes on a node not yet upgraded. Sans-IO: nothing here reads or writes a
store.
"""

from __future__ import annotations

import base64
import json
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ...core.message import Message
from ...core.records import RecordFormatError, decode_to_message, encode_message
from .session import SubscriptionOptions

if TYPE_CHECKING:
    pass

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


def _place(stream: str, shard: int, offset: int | None = None) -> dict[str, Any]:
    """Where a message or a cursor is: its stream and shard (and the message's offset)."""
    place: dict[str, Any] = {"stream": stream, "shard": shard}
    if offset is not None:
        place["offset"] = offset
    return place


def _at(entry: Any) -> tuple[Any, Any, Any]:
    place = entry["place"]
    return place["stream"], place["shard"], place.get("offset")


@dataclass(slots=True)
class OwnFilter:
    """A topic filter of the session's own subscription, with its options."""

    topic_filter: str
    options: SubscriptionOptions

    def encode(self) -> dict[str, Any]:
        o = self.options
        return {"filter": self.topic_filter, "options": {
            "qos": o.qos, "no_local": o.no_local, "rap": o.retain_as_published,
            "handling": o.retain_handling, "id": o.subscription_id}}

    @classmethod
    def decode(cls, entry: Any, version: int) -> OwnFilter:
        if version < 2:
            topic_filter, qos, no_local, rap, handling, sub_id = entry
        else:
            topic_filter, options = entry["filter"], entry["options"]
            qos, no_local, rap = options["qos"], options["no_local"], options["rap"]
            handling, sub_id = options["handling"], options["id"]
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
        return {"name": self.name, "type": self.type, "filters": self.filters, "options": {
            "qos": self.qos, "rap": self.retain_as_published, "id": self.subscription_id}}

    @classmethod
    def decode(cls, entry: Any, version: int) -> SharedMembership:
        if version < 2:
            name, sub_type, filters, qos, rap, sub_id = entry
        else:
            name, sub_type, filters, options = entry["name"], entry["type"], entry["filters"], entry["options"]
            qos, rap, sub_id = options["qos"], options["rap"], options["id"]
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
        return {"place": _place(self.stream, self.shard), "position": self.position,
                "unacked": self.unacked}

    @classmethod
    def decode(cls, entry: Any, version: int) -> CursorState:
        if version < 2:
            stream, shard, position, unacked = entry
        else:
            stream, shard, _offset = _at(entry)
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
        return {"place": _place(self.stream, self.shard, self.offset), "record": self.record}

    @classmethod
    def decode(cls, entry: Any, version: int) -> CarriedMessage:
        if version < 2:
            stream, shard, offset, record = entry
        else:
            (stream, shard, offset), record = _at(entry), entry["record"]
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
        encoded = {"pid": self.packet_id, "place": _place(self.stream, self.shard, self.offset),
                   "qos": self.qos, "released": self.released, "retain": self.retain,
                   "ids": self.subscription_ids}
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
            pid, (stream, shard, offset) = entry["pid"], _at(entry)
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
        encoded = {"place": _place(self.stream, self.shard, self.offset), "qos": self.qos,
                   "retain": self.retain, "ids": self.subscription_ids, "record": self.record}
        if self.group is not None:
            encoded["group"] = self.group
        return encoded

    @classmethod
    def decode(cls, entry: Any, version: int) -> QueuedEntry:
        if version < 2:
            stream, shard, offset, qos, retain, ids, record, *rest = entry
            group = rest[0] if rest else None
        else:
            stream, shard, offset = _at(entry)
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
    # How many times the session moved between nodes (`MqttSession.generation`): of two
    # snapshots of one session, the one of the higher generation is the newer, and within a
    # generation (one holder, one clock) the later `taken_ms`.
    generation: int = 0

    def newer_than(self, other: SessionSnapshot) -> bool:
        """Whether this snapshot of a session was taken after `other` (see `generation`)."""
        return (self.generation, self.taken_ms) > (other.generation, other.taken_ms)

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
        if self.generation:
            encoded["generation"] = self.generation
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
            generation=int(state.get("generation") or 0),
        )
