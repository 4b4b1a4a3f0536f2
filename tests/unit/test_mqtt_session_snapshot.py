"""`SessionSnapshot` (protocols/mqtt/snapshot.py): one typed MQTT session snapshot for the
node's own store and the cluster alike, its versioned encoding, and the formats earlier
versions wrote (read back the same)."""

from __future__ import annotations

import json

import pytest
from shardgate.core.message import Message
from shardgate.protocols.mqtt.session import SubscriptionOptions
from shardgate.protocols.mqtt.snapshot import (
    SNAPSHOT_VERSION,
    UNREADABLE,
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

RECORD = message_record(Message("a/b", b"payload", qos=1))

# As `cluster/sessions.py` wrote a snapshot to etcd before version 2 (version 1: positional).
VERSION_1 = {
    "version": 1, "node": "n1", "client_id": "c1", "online": False, "expiry": 3600,
    "disconnected_ms": 1_000, "taken_ms": 2_000,
    "subscriptions": [["a/#", 1, False, True, 2, 7], ["b", 0, True, False, 0, None]],
    "shared": [["$share/g/x", "shared", ["x/#"], 1, False, None]],
    "cursors": [["events", 0, 12, [10, 11]]],
    "messages": [["events", 0, 10, RECORD]],
    "inflight": [[3, "events", 0, 10, 1, False, False, [7]]],
    "queued": [["live", 1, 4, 1, False, [], RECORD], ["live", 1, 5, 1, True, [], RECORD, "$share/g/x"]],
    "qos2": [9, 4],
    "shared_inflight": [[5, "$share/g/x", "live", 2, 8, 2, True, False, [], RECORD]],
    "owner": "alice",
}

# As `MqttService` wrote a persistent session to the metadata store before version 2
# (no version; expiry and disconnect time are columns of the store).
STORED_BEFORE = {
    "subscriptions": [["s/good", 1, False, False, 0, None]],
    "shared": [["$share/g/s", "shared", ["s/#"], 0, True, 3]],
    "inflight": [[1, "s", 0, 42, 1, True, False, []]],
}

EXPECTED = SessionSnapshot(
    client_id="c1", node="n1", online=False, expiry=3600, disconnected_ms=1_000, taken_ms=2_000,
    subscriptions=[OwnFilter("a/#", SubscriptionOptions(1, False, True, 2, 7)),
                   OwnFilter("b", SubscriptionOptions(0, True, False, 0, None))],
    shared=[SharedMembership("$share/g/x", "shared", ["x/#"], 1, False, None)],
    cursors=[CursorState("events", 0, 12, [10, 11])],
    messages=[CarriedMessage("events", 0, 10, RECORD)],
    inflight=[InFlight(3, "events", 0, 10, 1, False, False, [7])],
    shared_inflight=[InFlight(5, "live", 2, 8, 2, True, False, [], "$share/g/x", RECORD)],
    queued=[QueuedEntry("live", 1, 4, 1, False, [], RECORD),
            QueuedEntry("live", 1, 5, 1, True, [], RECORD, "$share/g/x")],
    qos2=[9, 4], owner="alice", owned=True,
)


def test_a_snapshot_written_by_version_1_reads_as_the_same_typed_snapshot() -> None:
    assert SessionSnapshot.decode(json.dumps(VERSION_1).encode()) == EXPECTED


def test_a_snapshot_comes_back_equal_from_its_encoding_and_names_its_fields() -> None:
    encoded = EXPECTED.encode()
    assert SessionSnapshot.decode(encoded) == EXPECTED
    state = json.loads(encoded)
    assert state["version"] == SNAPSHOT_VERSION == 2
    assert state["subscriptions"][0] == {"filter": "a/#", "options": {
        "qos": 1, "no_local": False, "rap": True, "handling": 2, "id": 7}}
    assert state["cursors"] == [{"place": {"stream": "events", "shard": 0}, "position": 12,
                                 "unacked": [10, 11]}]
    assert state["messages"] == [{"place": {"stream": "events", "shard": 0, "offset": 10},
                                  "record": RECORD}]
    # the top-level keys other readers look at keep their names and meaning
    assert (state["node"], state["online"], state["owner"]) == ("n1", False, "alice")


def test_a_session_store_record_of_an_earlier_version_reads_back() -> None:
    snapshot = SessionSnapshot.decode(json.dumps(STORED_BEFORE).encode())
    assert snapshot.subscriptions == [OwnFilter("s/good", SubscriptionOptions(1))]
    assert snapshot.shared == [SharedMembership("$share/g/s", "shared", ["s/#"], 0, True, 3)]
    assert snapshot.inflight == [InFlight(1, "s", 0, 42, 1, True, False, [])]
    assert not snapshot.owned and snapshot.owner is None  # claimed by its first user
    owned = SessionSnapshot.decode(json.dumps({**STORED_BEFORE, "owner": None}).encode())
    assert owned.owned and owned.owner is None  # an anonymous client's


def test_an_unowned_snapshot_writes_no_owner() -> None:
    snapshot = SessionSnapshot(client_id="c", owner=None, owned=False)
    assert "owner" not in json.loads(snapshot.encode())
    assert not SessionSnapshot.decode(snapshot.encode()).owned


@pytest.mark.parametrize("raw", [
    b"{not json", b'"a string"', b'{"subscriptions": [["a filter alone"]]}',
    b'{"version": 2, "cursors": [{"place": {"stream": "s"}}]}', b'{"version": 1, "qos2": ["x"]}',
])
def test_what_is_not_a_snapshot_is_refused_as_unreadable(raw: bytes) -> None:
    with pytest.raises(UNREADABLE):
        SessionSnapshot.decode(raw)


def test_a_snapshot_of_a_later_version_is_refused_not_misread() -> None:
    with pytest.raises(ValueError, match="version 3"):
        SessionSnapshot.decode(json.dumps({"version": 3, "subscriptions": []}).encode())


def test_a_carried_message_keeps_its_content_and_place() -> None:
    message = record_message(RECORD, "events", 0, 10)
    assert (message.topic, message.payload, message.qos) == ("a/b", b"payload", 1)
    assert (message.stream, message.shard, message.offset) == ("events", 0, 10)


def test_no_entry_of_version_2_unpacks_as_its_version_1_array() -> None:
    """A node of an earlier version unpacks each entry as its positional array: handed a
    version 2 snapshot, it fails on any entry (and sets the snapshot aside) rather than
    misread it."""
    encoded = EXPECTED.to_dict()
    for key, entries in VERSION_1.items():
        if key in ("qos2",) or not isinstance(entries, list):
            continue
        for old, new in zip(entries, encoded[key], strict=True):
            assert len(new) < len(old), (key, new)
