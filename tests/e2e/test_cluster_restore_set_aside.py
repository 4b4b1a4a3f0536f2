"""Cluster state in etcd follows the rule of every restore (`core/restoring.py`,
`test_restore_set_aside.py` for one node): a record that cannot be restored (an MQTT session
snapshot, a will, a delayed message) is logged once with what it was and set aside, left in
etcd untouched, and everything else is restored: the good will and delayed message planted
beside the bad ones are published, and a client whose snapshot is unreadable gets a new
session, without a traceback in any log. Real etcd, two `shardgate serve --cluster` nodes."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from shardgate.core.message import Message, now_ms
from shardgate.protocols.mqtt import packets as p

from shardgate.cluster import keys
from shardgate.cluster.delayed import record
from shardgate.cluster.etcd import EtcdClient
from shardgate.cluster.wills import will_state
from tests.conftest import wait_for
from tests.e2e.cluster_fixtures import ClusterNodeProcess, EtcdServer
from tests.mqtt_clients import V5, Paho, RawClient

Cluster = Callable[..., list[ClusterNodeProcess]]
STATE = "/shardgate/test.state/"  # the fixtures' cluster is named "test"
SET_ASIDE = "cannot be restored, set aside"


def plant(etcd: EtcdServer, records: dict[str, bytes]) -> None:
    async def put() -> None:
        client = EtcdClient([etcd.url])
        try:
            for key, value in records.items():
                await client.put(key, value)
        finally:
            await client.close()

    asyncio.run(put())


def logs(nodes: list[ClusterNodeProcess]) -> str:
    return "".join(node.log_path.read_text(errors="replace") for node in nodes)


def resumes_anew(port: int, client_id: str) -> None:
    raw = RawClient(port, 5)
    try:
        raw.send(p.Connect("MQTT", 5, False, 60, client_id,
                           properties=p.Properties(session_expiry_interval=3600)))
        connack = raw.receive()
        assert isinstance(connack, p.Connack), connack
        assert connack.reason_code == 0 and not connack.session_present, connack
    finally:
        raw.close()


def test_unreadable_cluster_records_are_set_aside_and_the_rest_is_restored(
        cluster: Cluster, etcd: EtcdServer) -> None:
    now = now_ms()
    good_will = will_state("gone-client", p.Will("last/words", b"bye", 1, True, p.Properties()),
                           node="n9", lease=1, delay=0, expiry=0, disconnected_ms=now)
    plant(etcd, {
        STATE + "sessions/ghost": b"{not json",
        STATE + "sessions/shape": keys.encode({
            "client_id": "shape", "node": "n9", "expiry": 3600, "disconnected_ms": now,
            "taken_ms": now, "subscriptions": [["a filter alone"]]}),
        STATE + "wills/bad-will": b'"just a string"',
        STATE + "wills/gone-client": keys.encode(good_will),
        STATE + "delayed/n9/bad": b'{"at": "soon"}',
        STATE + "delayed/n9/good": record(Message("later/x", b"delayed", qos=1, retain=True),
                                          now + 500, "n9", 1),
    })
    n1, n2 = cluster(2)
    # the good will and the good delayed message of the departed node n9 are published
    watcher = Paho(n1.mqtt_port, "watcher", V5)
    watcher.subscribe("last/#", 1)
    watcher.subscribe("later/#", 1)
    got: dict[str, bytes] = {}

    def both() -> bool:
        try:
            message = watcher.expect(timeout=0.2)
        except Exception:  # noqa: BLE001 - queue.Empty: nothing yet
            return False
        got[message.topic] = message.payload
        return len(got) == 2

    wait_for(both, timeout=60, interval=0.05)
    assert got == {"last/words": b"bye", "later/x": b"delayed"}
    # a client whose snapshot cannot be read gets a new session, on either node
    resumes_anew(n2.mqtt_port, "ghost")
    resumes_anew(n1.mqtt_port, "shape")
    for what in ("wills/bad-will", "delayed/n9/bad", "sessions/ghost"):
        wait_for(lambda what=what: f"(etcd key {STATE}{what}) {SET_ASIDE}" in logs([n1, n2]),
                 timeout=30, interval=0.1)
    assert f"MQTT session 'shape' {SET_ASIDE}" in logs([n1, n2])
    # set aside, not deleted: they stay in etcd for an operator to look at
    assert etcd.keys(STATE + "wills/bad-will") and etcd.keys(STATE + "delayed/n9/bad")
    assert "Traceback" not in logs([n1, n2])
    watcher.disconnect()
