"""Pure pieces of moving MQTT sessions between nodes: the registry entry that names the
session's owner (`keys.SessionEntry`, applied by revision in the view), the merge of what the
old node's stand-in took with what came directly (`sessions.in_shard_order`), and the records
in etcd that cannot be restored (`set_aside`)."""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass, field

import pytest
from shardgate.core.message import Message
from shardgate.protocols.mqtt.session import MqttSession, Queued

from shardgate.cluster import keys
from shardgate.cluster.control import EtcdClusterView
from shardgate.cluster.etcd import KeyValue
from shardgate.cluster.session_release import in_shard_order
from shardgate.cluster.set_aside import SetAside, decode_record


def test_the_registry_entry_carries_the_owner_and_refuses_other_users() -> None:
    entry = keys.SessionEntry("n1", "alice", owned=True)
    assert keys.SessionEntry.from_json(entry.to_json()) == entry
    assert entry.refuses("bob") and entry.refuses(None) and not entry.refuses("alice")
    anonymous = keys.SessionEntry("n1", None, owned=True)
    assert anonymous.refuses("alice") and not anonymous.refuses(None)
    # an entry written before owners were kept is anyone's
    legacy = keys.SessionEntry.from_json(keys.encode({"node": "n2"}))
    assert legacy == keys.SessionEntry("n2") and not legacy.refuses("bob")


def test_the_view_keeps_the_entry_of_the_latest_revision() -> None:
    view = EtcdClusterView("n1")
    assert view.note_session("c", keys.SessionEntry("n2", "alice", True), 10)
    assert not view.note_session("c", keys.SessionEntry("n3", "bob", True), 9)  # older: ignored
    assert view.sessions["c"] == "n2" and view.session_entries["c"].owner == "alice"
    assert view.note_session("c", None, 11)
    assert "c" not in view.sessions and "c" not in view.session_entries


@dataclass
class QueueOf:
    """What `in_shard_order` reads and writes of a session: its queue and its queued bytes."""

    queue: deque[Queued] = field(default_factory=deque)
    queued_bytes: int = 0

    # the session's own method, which reads and writes only these two fields
    replace_queued_from = MqttSession.replace_queued_from

    def add(self, shard: int, offset: int, stream: str = "fast") -> None:
        message = Message(f"t/{shard}", f"{shard}@{offset}".encode(), stream=stream, shard=shard,
                          offset=offset, publish_time_ms=1000 + offset)
        self.queue.append(Queued(message, 1, False, (), None))
        self.queued_bytes += len(message.payload)

    def order(self) -> list[str]:
        return [item.message.payload.decode() for item in self.queue]


def test_a_moved_sessions_window_is_put_in_shard_order_each_message_once() -> None:
    session = QueueOf()
    session.add(0, 1)  # from the snapshot: before the window, never touched
    session.add(0, 0)
    # the window: pushes that came directly (0@5, 1@2, 0@6), then the stand-in's (0@3..0@5, 1@1)
    for shard, offset in [(0, 5), (1, 2), (0, 6), (0, 3), (0, 4), (0, 5), (1, 1)]:
        session.add(shard, offset)
    before = session.queued_bytes
    dropped = in_shard_order(session, 2, lambda stream: stream == "journaled")  # type: ignore[arg-type]
    assert dropped == 1  # 0@5 came both ways
    assert session.order() == ["0@1", "0@0", "0@3", "1@1", "0@4", "0@5", "0@6", "1@2"]
    assert session.queued_bytes == before - len(b"0@5")
    assert sum(len(item.message.payload) for item in session.queue) == session.queued_bytes


def test_reliable_streams_are_left_as_they_are() -> None:
    session = QueueOf()
    for offset in (2, 1, 1):
        session.add(0, offset, stream="journaled")
    assert in_shard_order(session, 0, lambda stream: stream == "journaled") == 0  # type: ignore[arg-type]
    assert session.order() == ["0@2", "0@1", "0@1"]


def test_records_that_are_not_json_objects_are_unreadable() -> None:
    assert decode_record(b'{"node": "n1"}') == {"node": "n1"}
    for raw in (b"{not json", b'"a string"', b"[1, 2]", b"\xff"):
        with pytest.raises(ValueError):
            decode_record(raw)


def test_a_record_set_aside_is_logged_once_per_version(caplog: pytest.LogCaptureFixture) -> None:
    set_aside = SetAside(logging.getLogger("test.set_aside"))
    kv = KeyValue("/x.state/wills/w", b'"bad"', 7, 7, 0)
    with caplog.at_level(logging.ERROR, "test.set_aside"):
        for _ in range(3):
            set_aside("an MQTT will", kv, ValueError("a JSON str, not an object"))
        set_aside("an MQTT will", KeyValue(kv.key, b"[]", 7, 8, 0), ValueError("changed"))
    lines = [record.getMessage() for record in caplog.records]
    assert len(lines) == 2 and set_aside.count == 2
    assert lines[0].startswith("an MQTT will (etcd key /x.state/wills/w) cannot be restored, set aside")
    assert lines[0].endswith("stored as b'\"bad\"'")
