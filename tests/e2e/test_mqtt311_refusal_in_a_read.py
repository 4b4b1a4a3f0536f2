"""MQTT 3.1.1 has no negative PUBACK: a PUBLISH the broker refuses (here a schema violation)
closes the connection. The PUBLISHes that came after it in the same socket read must not take
effect either: not stored, not delivered. A real paho 3.1.1 client publishes through a relay
that holds its bytes and hands them to the broker in one write, so that they arrive in one
read."""

from __future__ import annotations

import socket
import threading

from shardgate.config import StreamEntry
from tests.conftest import wait_for
from tests.mqtt_clients import V311, Paho


class CorkingRelay:
    """A TCP relay from one client to the broker; while `held`, the client's bytes are kept
    and `release()` passes them on in one write."""

    def __init__(self, target_port: int) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.target_port = target_port
        self.held = False
        self.buffer = bytearray()
        self.lock = threading.Condition()
        self.upstream: socket.socket | None = None
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        client, _ = self.listener.accept()
        upstream = socket.create_connection(("127.0.0.1", self.target_port))
        with self.lock:
            self.upstream = upstream
        threading.Thread(target=self._to_broker, args=(client, upstream), daemon=True).start()
        threading.Thread(target=self._to_client, args=(upstream, client), daemon=True).start()

    def _to_broker(self, client: socket.socket, upstream: socket.socket) -> None:
        try:
            while data := client.recv(65536):
                with self.lock:
                    if self.held:
                        self.buffer += data
                        self.lock.notify_all()
                    else:
                        upstream.sendall(data)
        except OSError:
            pass

    def _to_client(self, upstream: socket.socket, client: socket.socket) -> None:
        try:
            while data := upstream.recv(65536):
                client.sendall(data)
        except OSError:
            pass
        try:  # the broker closed: so does the client's side
            client.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    def wait_held(self, ending: bytes) -> None:
        with self.lock:
            assert self.lock.wait_for(lambda: self.buffer.endswith(ending), 10), "not sent"

    def release(self) -> None:
        with self.lock:
            self.held = False
            assert self.upstream is not None
            self.upstream.sendall(bytes(self.buffer))
            self.buffer.clear()

    def close(self) -> None:
        self.listener.close()
        if self.upstream is not None:
            self.upstream.close()


def test_nothing_after_a_refused_publish_in_the_same_read_is_processed(broker_factory) -> None:
    broker = broker_factory(streams=[StreamEntry("readings", schema="json", routes=["readings/#"])])
    watcher = Paho(broker.mqtt_port, "watcher", V311)
    watcher.subscribe([("readings/#", 1), ("plain/#", 1)])
    relay = CorkingRelay(broker.mqtt_port)
    publisher = Paho(relay.port, "publisher", V311)
    try:
        with relay.lock:
            relay.held = True
        publisher.publish("readings/t", b'{"n": 1}', 1, wait=False)
        publisher.publish("readings/t", b"not json", 1, wait=False)  # refused: closes
        publisher.publish("readings/t", b'{"n": 3}', 1, wait=False)
        publisher.publish("plain/t", b"after the refusal", 1, wait=False)
        relay.wait_held(b"after the refusal")
        relay.release()
        wait_for(lambda: not publisher.client.is_connected())
        # Markers sent afterwards on another connection: once both arrived, anything the
        # broker had accepted from the read would have arrived before them (order per topic).
        other = Paho(broker.mqtt_port, "other", V311)
        other.publish("readings/t", b'{"marker": true}', 1)
        other.publish("plain/t", b"marker", 1)
        got: list[tuple[str, bytes]] = []
        while (("readings/t", b'{"marker": true}') not in got) or (("plain/t", b"marker") not in got):
            message = watcher.expect()
            got.append((message.topic, message.payload))
        assert got.index(("readings/t", b'{"n": 1}')) == 0
        assert sorted(got[1:]) == [("plain/t", b"marker"), ("readings/t", b'{"marker": true}')]
        other.disconnect()
    finally:
        publisher.client.loop_stop()
        relay.close()
        watcher.disconnect()
