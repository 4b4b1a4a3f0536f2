"""Persistent sessions whose node stops gracefully (SIGTERM) while their clients resume them on
another node at once: each client gets its own session back, whatever the leaving node's
handover of its offline sessions does meanwhile. Found by the fault run
(`bench/cluster_chaos.py`, seed 3): the leaving node handed a session, offline to it, to a
third node (its handover spreads sessions over the live nodes); that node claimed it after the
client's new node had claimed it and took it from there while the client's CONNECT waited,
so the CONNACK said no session present and everything published for the session from then
on was lost to its client. In the other order, the client's node asked the third node, still
taking the session, to release it and got nothing. Real etcd, three nodes, paho MQTT 5."""

from __future__ import annotations

import signal
import threading
from pathlib import Path
from typing import Any

from tests.e2e.cluster_fixtures import EtcdServer, protocol_node, settled_nodes, wait_settled
from tests.mqtt_clients import V5, Paho

# Replicated shards, as a cluster has them by default (3 replicas, 2 in sync).
WORK = '[[streams]]\nname = "work"\nmode = "reliable"\npartitions = 3\nroutes = ["work/#"]\n'
# sessions on the leaving node: its handover sends every other one to the node their clients
# do not come back to, and the clients and the handover race for each of them
SESSIONS = 8


class Resumer:
    """A persistent session's client on the leaving node that, as soon as its connection ends,
    resumes the session on `to` (in its own thread, as the clients of a stopping node do)."""

    def __init__(self, client_id: str, on: int, to: int) -> None:
        self.client_id = client_id
        self.first = Paho(on, client_id, V5, clean=True, session_expiry=3600)
        self.first.subscribe("work/#", 1)
        self.to = to
        self.resumed: Paho | None = None
        self.flags: Any = None
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._resume, daemon=True)
        self.thread.start()

    def _resume(self) -> None:
        try:
            self.first.disconnects.get(timeout=60)
            self.resumed = Paho(self.to, self.client_id, V5, clean=False, session_expiry=3600,
                                connect=False)
            self.flags, _reason, _props = self.resumed.connect()
            self.first.client.loop_stop()  # (paho waits a second before it would reconnect)
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            self.error = exc

    def join(self) -> Paho:
        self.thread.join(90)
        assert not self.thread.is_alive(), f"{self.client_id} did not resume in time"
        if self.error is not None:
            raise AssertionError(f"{self.client_id} failed: {self.error!r}") from self.error
        assert self.resumed is not None
        return self.resumed


def test_sessions_resumed_elsewhere_while_their_node_stops_are_not_taken_by_its_handover(
        etcd: EtcdServer, tmp_path: Path) -> None:
    nodes = [protocol_node(tmp_path, name, etcd.url, WORK).start() for name in ("n1", "n2", "n3")]
    with settled_nodes(nodes) as (n1, n2, n3):
        resumers = [Resumer(f"leaver-{index}", n2.mqtt_port, n3.mqtt_port)
                    for index in range(SESSIONS)]
        publisher = Paho(n1.mqtt_port, "producer", V5)
        publisher.publish("work/before", "before", qos=1)
        for resumer in resumers:
            assert resumer.first.expect(timeout=20).payload == b"before"
        assert n2.proc is not None
        n2.proc.send_signal(signal.SIGTERM)
        resumed = [resumer.join() for resumer in resumers]
        lost = [resumer.client_id for resumer in resumers if not resumer.flags.session_present]
        assert not lost, f"sessions gone at their resume on n3: {lost}"
        assert n2.proc.wait(30) == 0
        wait_settled([n1, n3])
        # each session is the client's (on n3), not a copy left on another node
        publisher.publish("work/after", "after", qos=1)
        for client in resumed:
            assert client.expect(timeout=20).payload == b"after"
            client.expect_none(within=0.5)
            client.disconnect()
        publisher.disconnect()
