"""Test clients: a paho-mqtt wrapper that waits on conditions, and a raw-socket MQTT client
built on the project's codec for byte-level protocol checks."""

from __future__ import annotations

import queue
import socket
import threading
import time
from typing import Any

import paho.mqtt.client as mqtt
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties
from shardgate.protocols.mqtt import packets as p
from shardgate.protocols.mqtt.codec import PacketParser, encode

V311 = mqtt.MQTTv311
V5 = mqtt.MQTTv5
TIMEOUT = 10.0


class Paho:
    """A connected paho client whose received messages land in a queue."""

    def __init__(self, port: int, client_id: str = "", protocol: int = V5, *, clean: bool = True,
                 session_expiry: int | None = None, keepalive: int = 60, will: dict | None = None,
                 connect_properties: dict[str, Any] | None = None, transport: str = "tcp",
                 username: str | None = None, password: str | None = None,
                 connect: bool = True, tls: dict | None = None, host: str = "127.0.0.1",
                 reconnect: bool = True) -> None:
        self.protocol = protocol
        self.host = host
        self.client = mqtt.Client(
            mqtt.CallbackAPIVersion.VERSION2, client_id=client_id, protocol=protocol,
            transport=transport, clean_session=None if protocol == V5 else clean,
            reconnect_on_failure=reconnect,
        )
        self.port = port
        self.messages: queue.Queue[mqtt.MQTTMessage] = queue.Queue()
        self.connack: queue.Queue[tuple[Any, Any, Any]] = queue.Queue()
        self.disconnects: queue.Queue[tuple[Any, Any]] = queue.Queue()
        self.subacks: dict[int, list[Any]] = {}
        self.unsubacks: dict[int, Any] = {}
        self._lock = threading.Condition()
        self.client.on_connect = self._on_connect
        self.client.on_message = lambda c, u, m: self.messages.put(m)
        self.client.on_subscribe = self._on_subscribe
        self.client.on_unsubscribe = self._on_unsubscribe
        self.client.on_disconnect = lambda c, u, f, rc, props: self.disconnects.put((rc, props))
        if username is not None:
            self.client.username_pw_set(username, password)
        if tls is not None:
            self.client.tls_set(**tls)
        if will is not None:
            self.client.will_set(**will)
        self._clean = clean
        self._session_expiry = session_expiry
        self._keepalive = keepalive
        self._connect_properties = connect_properties or {}
        if connect:
            self.connect()

    def connect(self, clean: bool | None = None) -> tuple[Any, Any, Any]:
        clean = self._clean if clean is None else clean
        kwargs: dict[str, Any] = {"keepalive": self._keepalive}
        if self.protocol == V5:
            props = Properties(PacketTypes.CONNECT)
            if self._session_expiry is not None:
                props.SessionExpiryInterval = self._session_expiry
            for key, value in self._connect_properties.items():
                setattr(props, key, value)
            kwargs["properties"] = props
            kwargs["clean_start"] = clean
        self.client.connect(self.host, self.port, **kwargs)
        self.client.loop_start()
        result = self.connack.get(timeout=TIMEOUT)
        return result

    def _on_connect(self, client: Any, userdata: Any, flags: Any, rc: Any, props: Any) -> None:
        self.connack.put((flags, rc, props))

    def _on_subscribe(self, client: Any, userdata: Any, mid: int, codes: list[Any], props: Any) -> None:
        with self._lock:
            self.subacks[mid] = codes
            self._lock.notify_all()

    def _on_unsubscribe(self, client: Any, userdata: Any, mid: int, codes: Any, props: Any) -> None:
        with self._lock:
            self.unsubacks[mid] = codes
            self._lock.notify_all()

    def subscribe(self, topic: str | list, qos: int = 0, **kwargs: Any) -> list[Any]:
        if self.protocol == V5 and isinstance(topic, str) and "options" not in kwargs:
            kwargs["options"] = mqtt.SubscribeOptions(qos=qos)
            result, mid = self.client.subscribe(topic, **kwargs)
        elif isinstance(topic, str) and "options" in kwargs:
            result, mid = self.client.subscribe(topic, **kwargs)
        else:
            result, mid = self.client.subscribe(topic, qos, **kwargs)
        assert result == mqtt.MQTT_ERR_SUCCESS
        with self._lock:
            assert self._lock.wait_for(lambda: mid in self.subacks, TIMEOUT), "no SUBACK"
            return self.subacks[mid]

    def unsubscribe(self, topic: str) -> Any:
        result, mid = self.client.unsubscribe(topic)
        with self._lock:
            assert self._lock.wait_for(lambda: mid in self.unsubacks, TIMEOUT), "no UNSUBACK"
            return self.unsubacks[mid]

    def publish(self, topic: str, payload: bytes | str = b"", qos: int = 0, retain: bool = False,
                properties: Properties | None = None, wait: bool = True) -> mqtt.MQTTMessageInfo:
        info = self.client.publish(topic, payload, qos, retain, properties)
        if wait and qos > 0:
            info.wait_for_publish(TIMEOUT)
            assert info.is_published()
        return info

    def expect(self, timeout: float = TIMEOUT) -> mqtt.MQTTMessage:
        return self.messages.get(timeout=timeout)

    def expect_n(self, count: int, timeout: float = TIMEOUT) -> list[mqtt.MQTTMessage]:
        return [self.expect(timeout) for _ in range(count)]

    def expect_none(self, within: float = 0.3) -> None:
        """Assert nothing arrives; used only after a message that was sent later did arrive,
        or as a bounded negative check."""
        try:
            message = self.messages.get(timeout=within)
        except queue.Empty:
            return
        raise AssertionError(f"unexpected message on {message.topic}: {message.payload!r}")

    def disconnect(self, properties: Properties | None = None, reasoncode: Any = None) -> None:
        self.client.disconnect(reasoncode=reasoncode, properties=properties)
        self.client.loop_stop()

    def drop(self) -> None:
        """Vanish without DISCONNECT: the broker sees the socket close."""
        self.client.loop_stop()
        sock = self.client.socket()
        if sock is not None:
            sock.close()


def publish_props(**values: Any) -> Properties:
    props = Properties(PacketTypes.PUBLISH)
    for key, value in values.items():
        setattr(props, key, value)
    return props


class RawClient:
    """Bytes on a socket, packets decoded with the project's codec (server direction)."""

    def __init__(self, port: int, version: int = 4, host: str = "127.0.0.1") -> None:
        self.sock = socket.create_connection((host, port), timeout=TIMEOUT)
        self.parser = PacketParser()
        self.parser.version = version
        self.version = version
        self.pending: list[Any] = []

    def send(self, data: bytes | p.Packet) -> None:
        if not isinstance(data, bytes | bytearray):
            data = encode(data, self.version)
        self.sock.sendall(data)

    def connect(self, client_id: str = "raw", clean: bool = True, keep_alive: int = 60,
                properties: p.Properties | None = None, will: p.Will | None = None) -> p.Connack:
        name = "MQIsdp" if self.version == 3 else "MQTT"
        self.send(p.Connect(name, self.version, clean, keep_alive, client_id, will,
                            properties=properties or p.Properties()))
        connack = self.receive()
        assert isinstance(connack, p.Connack), connack
        return connack

    def receive(self, timeout: float = TIMEOUT) -> Any:
        """The next packet; None if the server closed the connection."""
        deadline = time.monotonic() + timeout
        while not self.pending:
            self.sock.settimeout(max(0.01, deadline - time.monotonic()))
            try:
                data = self.sock.recv(65536)
            except TimeoutError:
                raise AssertionError("no packet from the server in time") from None
            except ConnectionResetError:
                return None
            if not data:
                return None
            self.pending.extend(self.parser.feed(data))
        return self.pending.pop(0)

    def receive_until_closed(self, timeout: float = TIMEOUT) -> list[Any]:
        packets = []
        while True:
            packet = self.receive(timeout)
            if packet is None:
                return packets
            packets.append(packet)

    def close(self) -> None:
        self.sock.close()
