"""Per-connection CONNECT timestamps inside a `shardgate serve` started by `bench/soak.py --trace`.

Measurement only, never part of the broker: `soak.py --trace` puts this folder first on the
broker's PYTHONPATH and names an output file in ``SOAK_CONNECT_TRACE``; Python then runs
this module at start (as ``sitecustomize``), and it wraps, without changing what they do:

- ``socket.socket.accept`` (what the MQTT listener, `protocols/listener.py`, accepts with):
  when the broker took the connection from the kernel's accept queue;
- ``MqttProtocol.socket_accepted`` (when the listener hands it the accepted socket) or, for a
  connection not made there, ``MqttProtocol.connection_made``: when the connection was made;
- ``MqttProtocol.data_received``: when the broker first read the connection's bytes;
- ``MqttConnection._connack_written``: the connection's own marks (read, session open,
  commit durable) and when the CONNACK was handed to the socket.

Every timestamp is ``CLOCK_MONOTONIC`` (``time.perf_counter`` and ``time.monotonic`` on
Linux), so the soak's clients, in other processes, can join them by their local address. The
records are written as JSON lines when the broker exits. Without ``SOAK_CONNECT_TRACE``
this module does nothing.
"""

from __future__ import annotations

import atexit
import json
import os
import socket
import time

_PATH = os.environ.get("SOAK_CONNECT_TRACE")
_TURNS_PATH = os.environ.get("SOAK_TURN_TRACE")


def _install(path: str) -> None:
    from shardgate.protocols.mqtt import connection as mqtt_connection
    from shardgate.protocols.mqtt import server as mqtt_server

    clock = time.perf_counter
    accepted: dict[str, float] = {}
    made: dict[str, float] = {}
    first_read: dict[str, float] = {}
    records: list[dict[str, object]] = []

    original_accept = socket.socket.accept

    def accept(self: socket.socket) -> tuple[socket.socket, object]:
        conn, address = original_accept(self)
        if isinstance(address, tuple):
            accepted[f"{address[0]}:{address[1]}"] = clock()
        return conn, address

    socket.socket.accept = accept  # type: ignore[method-assign]

    protocol = mqtt_server.MqttProtocol
    original_made = protocol.connection_made
    original_received = protocol.data_received

    def connection_made(self: mqtt_server.MqttProtocol, transport: object) -> None:
        # Recorded first: making the connection may read and answer its CONNECT at once. A
        # connection made at its accept (`socket_accepted`) was recorded there.
        peer = transport.get_extra_info("peername")  # type: ignore[attr-defined]
        if isinstance(peer, tuple) and self.connection is None:
            made[f"{peer[0]}:{peer[1]}"] = clock()
        original_made(self, transport)  # type: ignore[arg-type]

    original_accepted = getattr(protocol, "socket_accepted", None)
    if original_accepted is not None:
        def socket_accepted(self: mqtt_server.MqttProtocol, sock: socket.socket) -> None:
            try:
                peer = sock.getpeername()
            except OSError:
                peer = None
            if isinstance(peer, tuple):
                made[f"{peer[0]}:{peer[1]}"] = clock()
            original_accepted(self, sock)

        protocol.socket_accepted = socket_accepted  # type: ignore[method-assign]

    def data_received(self: mqtt_server.MqttProtocol, data: bytes) -> None:
        connection = self.connection
        if connection is not None and connection.remote not in first_read:
            first_read[connection.remote] = clock()
        original_received(self, data)

    protocol.connection_made = connection_made  # type: ignore[method-assign]
    protocol.data_received = data_received  # type: ignore[method-assign]

    mqtt = mqtt_connection.MqttConnection
    original_written = mqtt._connack_written

    def connack_written(self: mqtt_connection.MqttConnection) -> None:
        marks = self._connect_marks
        if marks is not None:
            remote = self.remote
            records.append({
                "remote": remote, "client_id": self.client_id,
                "persistent": self.session_expiry_at_connect != 0,
                "accepted": accepted.pop(remote, 0.0), "made": made.pop(remote, 0.0),
                "first_read": first_read.pop(remote, 0.0), "read": marks[0], "opened": marks[1],
                "durable": marks[2], "written": clock(),
            })
        original_written(self)

    mqtt._connack_written = connack_written  # type: ignore[method-assign]

    def dump() -> None:
        with open(path, "w") as out:
            for record in records:
                out.write(json.dumps(record) + "\n")

    atexit.register(dump)
    if _TURNS_PATH:
        _trace_turns(_TURNS_PATH)


def _trace_turns(path: str) -> None:
    """With ``SOAK_TURN_TRACE`` set too: the end of every event-loop iteration from the first
    accept on (a timer due at once that sets itself again: libuv runs it after the iteration's
    I/O callbacks), as doubles in a file, so iteration lengths can be read off. Diagnostic
    only: the pending timer makes every poll non-blocking, so the loop spins while idle."""
    import asyncio
    from array import array

    ends = array("d")
    clock = time.perf_counter
    original_accept = socket.socket.accept
    started = []

    def tick() -> None:
        ends.append(clock())
        asyncio.get_running_loop().call_later(0, tick)

    def accept(self: socket.socket) -> tuple[socket.socket, object]:
        if not started:
            started.append(True)
            asyncio.get_running_loop().call_later(0, tick)
        return original_accept(self)

    socket.socket.accept = accept  # type: ignore[method-assign]

    def dump() -> None:
        with open(path, "wb") as out:
            ends.tofile(out)

    atexit.register(dump)


if _PATH:
    _install(_PATH)
