"""Bounded-time soak scenario for the Shardgate broker.

Starts ``python -m shardgate serve`` on a scratch data directory with free loopback ports,
records the broker's resident memory (``VmRSS`` in ``/proc/PID/status``) and open file
descriptors (``/proc/PID/fd``) once it is up, then for ``--minutes`` runs waves of
``--clients`` MQTT clients (3.1.1 and 5.0 mixed) that connect, subscribe, publish at QoS 0/1/2
and vanish: some with a clean DISCONNECT, some by closing (or resetting) the socket with
messages in flight, some after writing half a packet. Some wave clients keep persistent
sessions: MQTT 5 ones with a short session expiry, MQTT 3.1.1 ones from a bounded pool of
client ids (3.1.1 sessions never expire by default) that is cleaned up at the end.

Beside the waves, a few persistent-session *auditor* subscribers (on the default, reliable
stream) each own a topic subtree; publishers write to those subtrees with a unique id in every
payload and remember every id for which they received a PUBACK (QoS 1) or PUBCOMP (QoS 2).
Auditors drop their connection now and then (cleanly or not) and resume their session.

When the time is up the load stops, the auditors drain their sessions, every session is ended
or left to expire, and the script polls the admin API until no connection and no session
remains (with a timeout), lets the broker settle, and reports baseline, peak and final RSS and
fds, CONNECT → CONNACK times (from the CONNECT, the TCP handshake apart; for every client and
for persistent sessions alone), messages acknowledged, messages the auditors received, messages lost (acknowledged but
never received; must be 0) and the errors in the broker's log. Every loop is bounded in count
and in time; everything listens and connects on 127.0.0.1 only.

    python bench/soak.py [--minutes 3] [--clients 200] [--write]
    python bench/soak.py --broker mosquitto     # the same load against mosquitto
    python bench/soak.py --port 1883            # ... against a broker already listening
    python bench/soak.py --probe                # also time CONNECTs outside the generator
    python bench/soak.py --probe --trace        # ... and split each at the broker's timestamps

Every client reads its CONNACK with the kernel's arrival stamp (``SO_TIMESTAMPNS``), so each
CONNECT → CONNACK is reported twice: until the client process read it, and until it reached the
client's socket (the generator's own event loop, or a CPU the probe waited for, left out).
``--trace`` has the broker record when it accepted each connection, first read it and wrote its
CONNACK (`bench/connect_trace/`), and splits every client's span at those times
(`bench/_connect_times.py`).

With ``--broker mosquitto`` the script starts ``mosquitto`` (from PATH) on a free port with a
scratch configuration (anonymous, its default limits, no persistence file); with ``--port`` it
only generates the load. Neither has Shardgate's admin API: connections and sessions are not
counted (the settle step is the ``--settle`` pause alone) and, with ``--port``, no process is
sampled. Against Shardgate the final ``/api/info`` also gives the broker's own view of where a
CONNECT waited (``mqtt_connect_timing``), shown in the table.

``--write`` replaces the ``## Soak`` section of ``bench/RESULTS.md`` (and only that section).
The MQTT client here is a small hand-written one on asyncio streams; it does not import
shardgate, so the broker's codec is not checked against itself.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import itertools
import json
import os
import platform
import random
import re
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from _connect_times import (
    breakdown_rows,
    join,
    load_trace,
    recv_packet,
    recv_packet_blocking,
    stamp_arrivals,
)
from _proc import start_broker

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "bench" / "RESULTS.md"
SECTION = "## Soak"
HOST = "127.0.0.1"

# Packet types (MQTT 3.1.1 §2.2.1, unchanged in 5.0).
CONNECT, CONNACK, PUBLISH, PUBACK, PUBREC, PUBREL, PUBCOMP = 1, 2, 3, 4, 5, 6, 7
SUBSCRIBE, SUBACK, PINGREQ, PINGRESP, DISCONNECT = 8, 9, 12, 13, 14

AUDIT_PREFIX = "soak/audit"
LOAD_TOPICS = 16
RETAINED_TOPICS = 20
POOL_311 = 40  # client ids of the MQTT 3.1.1 persistent sessions (they never expire)
MAX_WAVE_EXPIRY = 12  # seconds, MQTT 5 persistent wave sessions


# ----------------------------------------------------------------------------- encoding
def varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte = n % 128
        n //= 128
        if n:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def utf8(text: str) -> bytes:
    raw = text.encode()
    return struct.pack("!H", len(raw)) + raw


def packet(first: int, body: bytes) -> bytes:
    return bytes([first]) + varint(len(body)) + body


def props(raw: bytes) -> bytes:
    return varint(len(raw)) + raw


@dataclass(slots=True)
class Will:
    topic: str
    payload: bytes
    qos: int


def encode_connect(
    client_id: str,
    version: int,
    clean: bool,
    keepalive: int,
    expiry: int | None = None,
    receive_maximum: int | None = None,
    will: Will | None = None,
) -> bytes:
    flags = 0x02 if clean else 0
    if will is not None:
        flags |= 0x04 | (will.qos << 3)
    body = utf8("MQTT") + bytes([version, flags]) + struct.pack("!H", keepalive)
    if version == 5:
        raw = b""
        if expiry:
            raw += b"\x11" + struct.pack("!I", expiry)
        if receive_maximum:
            raw += b"\x21" + struct.pack("!H", receive_maximum)
        body += props(raw)
    body += utf8(client_id)
    if will is not None:
        if version == 5:
            body += props(b"")
        body += utf8(will.topic) + struct.pack("!H", len(will.payload)) + will.payload
    return packet(CONNECT << 4, body)


def encode_subscribe(packet_id: int, filters: list[tuple[str, int]], version: int) -> bytes:
    body = struct.pack("!H", packet_id)
    if version == 5:
        body += props(b"")
    for topic_filter, qos in filters:
        body += utf8(topic_filter) + bytes([qos])
    return packet((SUBSCRIBE << 4) | 0x02, body)


def encode_publish(
    topic: str, payload: bytes, qos: int, packet_id: int, version: int, retain: bool = False
) -> bytes:
    body = utf8(topic)
    if qos:
        body += struct.pack("!H", packet_id)
    if version == 5:
        body += props(b"")
    return packet((PUBLISH << 4) | (qos << 1) | int(retain), body + payload)


def encode_ack(kind: int, packet_id: int) -> bytes:
    return packet((kind << 4) | (0x02 if kind == PUBREL else 0), struct.pack("!H", packet_id))


def encode_disconnect(version: int, expiry: int | None = None) -> bytes:
    if version == 5 and expiry is not None:
        return packet(DISCONNECT << 4, b"\x00" + props(b"\x11" + struct.pack("!I", expiry)))
    return packet(DISCONNECT << 4, b"")


class PacketReader:
    """Whole packets from a stream: one socket read gives every packet it completed, parsed from
    one buffer (a read per header byte would make the generator, not the broker, the bottleneck
    under a fan-out of large messages)."""

    def __init__(self, reader: asyncio.StreamReader) -> None:
        self.reader = reader
        self.buffer = bytearray()
        self.pending: list[tuple[int, bytes]] = []

    async def packets(self) -> list[tuple[int, bytes]]:
        """At least one packet; raises IncompleteReadError at the end of the stream."""
        while True:
            out, self.pending = self.pending + self._parse(), []
            if out:
                return out
            chunk = await self.reader.read(1 << 18)
            if not chunk:
                raise asyncio.IncompleteReadError(bytes(self.buffer), None)
            self.buffer += chunk

    def _parse(self) -> list[tuple[int, bytes]]:
        buffer = self.buffer
        out: list[tuple[int, bytes]] = []
        pos, end = 0, len(buffer)
        while True:
            length, shift, i = 0, 0, pos + 1
            complete = False
            while i < end and shift <= 21:
                byte = buffer[i]
                i += 1
                length |= (byte & 0x7F) << shift
                shift += 7
                if not byte & 0x80:
                    complete = True
                    break
            if not complete:
                if shift > 21:
                    raise ValueError("malformed remaining length")
                break
            if end - i < length:
                break
            out.append((buffer[pos], bytes(buffer[i:i + length])))
            pos = i + length
        if pos:
            del buffer[:pos]
        return out


def skip_props(body: bytes, pos: int) -> int:
    length = 0
    for shift in range(0, 28, 7):
        byte = body[pos]
        pos += 1
        length |= (byte & 0x7F) << shift
        if not byte & 0x80:
            break
    return pos + length


# ----------------------------------------------------------------------------- accounting
@dataclass
class Stats:
    waves: int = 0
    connects: int = 0
    connect_failures: int = 0
    refused: dict[int, int] = field(default_factory=dict)
    endings: dict[str, int] = field(default_factory=dict)
    published: list[int] = field(default_factory=lambda: [0, 0, 0])
    acked: int = 0
    ack_failures: int = 0  # PUBACK / PUBREC with a reason code >= 0x80
    audited_acked: dict[str, int] = field(default_factory=dict)  # message id -> auditor
    server_disconnects: dict[int, int] = field(default_factory=dict)
    unexpected_close: int = 0
    delivered_to_wave_clients: int = 0
    session_present_wrong: int = 0
    errors: list[str] = field(default_factory=list)
    tcp_connect_s: list[float] = field(default_factory=list)
    # message id -> (publisher client id, QoS, time of the PUBACK / PUBCOMP)
    ack_info: dict[str, tuple[str, int, float]] = field(default_factory=dict)
    t0: float = field(default_factory=time.monotonic)
    connack_s: list[float] = field(default_factory=list)
    # CONNECT → CONNACK of clients resuming or opening a persistent session (clean 0)
    connack_persistent_s: list[float] = field(default_factory=list)
    # The same spans up to the CONNACK's arrival at the client's socket (the kernel's stamp),
    # without the time the generator's loop took to get to it.
    connack_arrived_s: list[float] = field(default_factory=list)
    connack_persistent_arrived_s: list[float] = field(default_factory=list)
    # Per connection: local address, persistent, sent / arrived / read (CLOCK_MONOTONIC), to
    # join with the broker's trace (`--trace`).
    connect_records: list[dict[str, object]] = field(default_factory=list)

    def note_error(self, text: str) -> None:
        if len(self.errors) < 20:
            self.errors.append(text)


class ConnectRefused(Exception):
    pass


class Client:
    """One MQTT connection: QoS 1/2 flows in both directions, acks tracked per packet id."""

    def __init__(
        self,
        port: int,
        client_id: str,
        version: int,
        stats: Stats,
        on_message: Callable[[str, bytes, int], None] | None = None,
        packet_ids: Iterator[int] | None = None,
    ) -> None:
        self.port = port
        self.client_id = client_id
        self.version = version
        self.stats = stats
        self.on_message = on_message
        self.reader: asyncio.StreamReader | None = None
        self.packets: PacketReader | None = None
        self.batch: list[bytes] | None = None
        self.writer: asyncio.StreamWriter | None = None
        self.pending: dict[int, tuple[str | None, int, asyncio.Future[bool]]] = {}
        self.suback: dict[int, asyncio.Future[bytes]] = {}
        self.inbound_qos2: set[int] = set()
        self._ids = packet_ids if packet_ids is not None else itertools.cycle(range(1, 65536))
        self._task: asyncio.Task[None] | None = None
        self._ping: asyncio.Task[None] | None = None
        self.closed = asyncio.Event()
        self.closing = False

    async def connect(
        self,
        *,
        clean: bool,
        keepalive: int = 30,
        expiry: int | None = None,
        receive_maximum: int | None = None,
        will: Will | None = None,
        timeout: float = 15.0,
    ) -> bool:
        """Connect and wait for CONNACK; returns the session-present flag.

        The CONNACK is read from the socket itself (with the kernel's arrival stamp, see
        `bench/_connect_times.py`), then the socket becomes the client's stream."""
        loop = asyncio.get_running_loop()
        started = time.monotonic()
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setblocking(False)
        try:
            await asyncio.wait_for(loop.sock_connect(sock, (HOST, self.port)), timeout)
            self.stats.tcp_connect_s.append(time.monotonic() - started)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            stamp_arrivals(sock)
            local = "{}:{}".format(*sock.getsockname()[:2])
            started = time.monotonic()  # CONNECT → CONNACK, without the TCP handshake
            await loop.sock_sendall(sock, encode_connect(
                self.client_id, self.version, clean, keepalive, expiry, receive_maximum, will))
            data, arrived = await asyncio.wait_for(recv_packet(sock), timeout)
            read = time.monotonic()
            stamp_arrivals(sock, False)
            self.reader, self.writer = await asyncio.open_connection(sock=sock, limit=1 << 22)
        except BaseException:
            sock.close()
            raise
        self.packets = PacketReader(self.reader)
        self.packets.buffer += data
        received = self.packets._parse()
        first, body = received.pop(0)
        self.packets.pending = received  # what came right behind the CONNACK
        if first >> 4 != CONNACK or len(body) < 2:
            self.abort()
            raise ConnectRefused(f"expected CONNACK, got packet type {first >> 4}")
        if body[1] != 0:
            self.abort()
            self.stats.refused[body[1]] = self.stats.refused.get(body[1], 0) + 1
            raise ConnectRefused(f"CONNACK code 0x{body[1]:02x}")
        stats = self.stats
        stats.connects += 1
        stats.connack_s.append(read - started)
        arrived = read if arrived is None else arrived
        stats.connack_arrived_s.append(arrived - started)
        if not clean:
            stats.connack_persistent_s.append(read - started)
            stats.connack_persistent_arrived_s.append(arrived - started)
        stats.connect_records.append(
            {"local": local, "persistent": not clean, "sent": started, "arrived": arrived, "read": read})
        self._task = asyncio.create_task(self._read_loop())
        if keepalive:
            self._ping = asyncio.create_task(self._ping_loop(keepalive / 2))
        return bool(body[0] & 1)

    def _next_id(self) -> int:
        for _ in range(65535):
            packet_id = next(self._ids)
            if packet_id not in self.pending and packet_id not in self.suback:
                return packet_id
        raise RuntimeError("no free packet id")

    def write(self, data: bytes) -> None:
        if self.batch is not None:  # acknowledgements of one read leave in one write
            self.batch.append(data)
        elif self.writer is not None and not self.writer.is_closing():
            self.writer.write(data)

    async def subscribe(self, filters: list[tuple[str, int]], timeout: float = 15.0) -> bytes:
        packet_id = self._next_id()
        future: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()
        self.suback[packet_id] = future
        self.write(encode_subscribe(packet_id, filters, self.version))
        try:
            return await asyncio.wait_for(future, timeout)
        finally:
            self.suback.pop(packet_id, None)

    def publish(
        self, topic: str, payload: bytes, qos: int, message_id: str | None = None, retain: bool = False
    ) -> asyncio.Future[bool] | None:
        """Send a PUBLISH; for QoS 1/2 the future becomes True on PUBACK / PUBCOMP."""
        self.stats.published[qos] += 1
        if qos == 0:
            self.write(encode_publish(topic, payload, 0, 0, self.version, retain))
            return None
        future: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        if self.closed.is_set():
            future.set_result(False)
            return future
        packet_id = self._next_id()
        self.pending[packet_id] = (message_id, qos, future)
        self.write(encode_publish(topic, payload, qos, packet_id, self.version, retain))
        return future

    async def wait_window(self, size: int, timeout: float) -> None:
        """Wait until fewer than ``size`` publishes are unacknowledged (or the time is up)."""
        deadline = time.monotonic() + timeout
        while len(self.pending) >= size and not self.closed.is_set():
            left = deadline - time.monotonic()
            if left <= 0:
                return
            futures = [entry[2] for entry in self.pending.values()]
            await asyncio.wait(futures, timeout=left, return_when=asyncio.FIRST_COMPLETED)

    async def wait_acks(self, timeout: float) -> None:
        futures = [entry[2] for entry in self.pending.values()]
        if futures:
            await asyncio.wait(futures, timeout=timeout)

    def _acked(self, packet_id: int, ok: bool) -> None:
        entry = self.pending.pop(packet_id, None)
        if entry is None:
            return
        message_id, _qos, future = entry
        if ok:
            self.stats.acked += 1
            if message_id is not None:
                auditor = int(message_id.split(".", 1)[0])
                self.stats.audited_acked[message_id] = auditor
                self.stats.ack_info[message_id] = (self.client_id, _qos, time.monotonic())
        else:
            self.stats.ack_failures += 1
        if not future.done():
            future.set_result(ok)

    async def _read_loop(self) -> None:
        assert self.packets is not None
        packets = self.packets
        version = self.version
        try:
            while True:
                received = await packets.packets()
                self.batch = []
                try:
                    for first, body in received:
                        if not self._handle(first, body, version):
                            return
                finally:
                    batch, self.batch = self.batch, None
                    if batch:
                        self.write(b"".join(batch))
        except (asyncio.IncompleteReadError, ConnectionError, OSError):
            if not self.closing:
                self.stats.unexpected_close += 1
        except (ValueError, struct.error, IndexError, UnicodeDecodeError) as exc:
            self.stats.note_error(f"{self.client_id}: bad packet from broker: {exc!r}")
        finally:
            self._finish()

    def _handle(self, first: int, body: bytes, version: int) -> bool:
        """One packet from the broker; False once the broker said DISCONNECT."""
        kind = first >> 4
        if kind == PUBLISH:
            qos = (first >> 1) & 3
            topic_len = struct.unpack_from("!H", body)[0]
            topic = body[2:2 + topic_len].decode()
            pos = 2 + topic_len
            packet_id = 0
            if qos:
                packet_id = struct.unpack_from("!H", body, pos)[0]
                pos += 2
            if version == 5:
                pos = skip_props(body, pos)
            if qos == 2 and packet_id in self.inbound_qos2:
                self.write(encode_ack(PUBREC, packet_id))
                return True
            if self.on_message is not None:
                self.on_message(topic, body[pos:], qos)
            if qos == 1:
                self.write(encode_ack(PUBACK, packet_id))
            elif qos == 2:
                self.inbound_qos2.add(packet_id)
                self.write(encode_ack(PUBREC, packet_id))
        elif kind == PUBREL:
            packet_id = struct.unpack_from("!H", body)[0]
            self.inbound_qos2.discard(packet_id)
            self.write(encode_ack(PUBCOMP, packet_id))
        elif kind in (PUBACK, PUBCOMP):
            packet_id = struct.unpack_from("!H", body)[0]
            self._acked(packet_id, len(body) < 3 or body[2] < 0x80)
        elif kind == PUBREC:
            packet_id = struct.unpack_from("!H", body)[0]
            if len(body) >= 3 and body[2] >= 0x80:
                self._acked(packet_id, False)
            else:
                self.write(encode_ack(PUBREL, packet_id))
        elif kind == SUBACK:
            packet_id = struct.unpack_from("!H", body)[0]
            future = self.suback.get(packet_id)
            if future is not None and not future.done():
                future.set_result(body[2:])
        elif kind == DISCONNECT:
            reason = body[0] if body else 0
            self.stats.server_disconnects[reason] = self.stats.server_disconnects.get(reason, 0) + 1
            return False
        elif kind != PINGRESP:
            self.stats.note_error(f"{self.client_id}: unexpected packet type {kind}")
        return True

    async def _ping_loop(self, interval: float) -> None:
        while not self.closed.is_set():
            await asyncio.sleep(interval)
            self.write(packet(PINGREQ << 4, b""))

    def _finish(self) -> None:
        for _message_id, _qos, future in self.pending.values():
            if not future.done():
                future.set_result(False)
        self.pending.clear()
        for future in self.suback.values():
            if not future.done():
                future.cancel()
        if self._ping is not None:
            self._ping.cancel()
        self.closed.set()
        if self.writer is not None and not self.writer.is_closing():
            self.writer.close()

    async def disconnect(self, expiry: int | None = None) -> None:
        self.closing = True
        self.write(encode_disconnect(self.version, expiry))
        if self.writer is not None:
            with contextlib.suppress(ConnectionError, OSError, asyncio.TimeoutError):
                await asyncio.wait_for(self.writer.drain(), 5)
            self.writer.close()
        await self.stop_reader()

    def abort(self) -> None:
        """Drop the connection at once (RST), whatever is in flight."""
        self.closing = True
        if self.writer is not None:
            self.writer.transport.abort()
        if self._ping is not None:
            self._ping.cancel()

    async def close_socket(self) -> None:
        """Close the socket (FIN) with no DISCONNECT."""
        self.closing = True
        if self.writer is not None:
            self.writer.close()
        await self.stop_reader()

    async def truncate(self, data: bytes) -> None:
        """Write only part of a packet, then close the socket."""
        self.closing = True
        self.write(data)
        if self.writer is not None:
            with contextlib.suppress(ConnectionError, OSError, asyncio.TimeoutError):
                await asyncio.wait_for(self.writer.drain(), 5)
            self.writer.close()
        await self.stop_reader()

    async def stop_reader(self) -> None:
        if self._task is not None:
            try:
                await asyncio.wait_for(asyncio.shield(self._task), 2)
            except (TimeoutError, asyncio.CancelledError):
                self._task.cancel()
        self._finish()


# ----------------------------------------------------------------------------- auditors
class Auditor:
    """A persistent-session subscriber of ``soak/audit/<index>/#`` that records every id."""

    def __init__(self, index: int, version: int, qos: int, port: int, stats: Stats, run: str) -> None:
        self.index = index
        self.version = version
        self.qos = qos
        self.port = port
        self.stats = stats
        self.client_id = f"soak-auditor-{run}-{index}"
        self.received: set[str] = set()
        self.deliveries = 0
        self.reconnects = 0
        self.sessions_lost = 0
        self.last_receive = time.monotonic()
        self.client: Client | None = None
        self.events: list[str] = []

    def event(self, text: str) -> None:
        self.events.append(f"{time.monotonic() - self.stats.t0:.2f}s {text}")

    def _on_message(self, topic: str, payload: bytes, qos: int) -> None:
        self.deliveries += 1
        self.last_receive = time.monotonic()
        self.received.add(payload.split(b"|", 1)[0].decode())

    async def _connect(self, first: bool) -> None:
        for attempt in range(20):
            client = Client(self.port, self.client_id, self.version, self.stats, self._on_message)
            try:
                # A 3.1.1 persistent session is clean session 0 from the start (a fresh id).
                present = await client.connect(
                    clean=first and self.version == 5, keepalive=30, expiry=3600 if self.version == 5 else None,
                    receive_maximum=64 if self.version == 5 else None,
                )
            except (TimeoutError, OSError, ConnectRefused) as exc:
                self.stats.note_error(f"auditor {self.index} connect attempt {attempt}: {exc!r}")
                await asyncio.sleep(1)
                continue
            self.client = client
            self.event(f"connected (session present {present})")
            if first:
                granted = await client.subscribe([(f"{AUDIT_PREFIX}/{self.index}/#", self.qos)])
                if granted[-1:] >= b"\x80":
                    raise RuntimeError(f"auditor {self.index}: subscription refused {granted!r}")
            elif not present:
                # The session (and its subscription) is gone: count it and subscribe again.
                self.sessions_lost += 1
                self.stats.note_error(f"auditor {self.index}: session not present on resume")
                await client.subscribe([(f"{AUDIT_PREFIX}/{self.index}/#", self.qos)])
            return
        raise RuntimeError(f"auditor {self.index} could not connect")

    async def start(self) -> None:
        await self._connect(first=True)

    async def churn(self, stop: asyncio.Event, rng: random.Random) -> None:
        """Drop and resume the session every 10-30 s until ``stop`` is set (bounded count)."""
        for _ in range(1000):
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(stop.wait(), rng.uniform(10, 30))
            if stop.is_set():
                return
            await self.drop(rng.choice(["disconnect", "close", "abort"]))
            await asyncio.sleep(rng.uniform(0.5, 4))
            await self._connect(first=False)
            self.reconnects += 1

    async def ensure_connected(self) -> None:
        if self.client is None or self.client.closed.is_set():
            await self._connect(first=False)
            self.reconnects += 1

    async def drop(self, how: str) -> None:
        client = self.client
        self.client = None
        if client is None:
            return
        self.event(f"drop: {how}")
        if how == "disconnect":
            await client.disconnect()
        elif how == "close":
            await client.close_socket()
        else:
            client.abort()
            await client.stop_reader()

    async def end_session(self) -> None:
        """End the persistent session so that nothing is left in the broker."""
        await self.ensure_connected()
        client = self.client
        assert client is not None
        if self.version == 5:
            await client.disconnect(expiry=0)
        else:
            await client.disconnect()
            final = Client(self.port, self.client_id, 4, self.stats)
            await final.connect(clean=True, keepalive=0)
            await final.disconnect()
        self.client = None

    def missing(self) -> set[str]:
        mine = {mid for mid, owner in self.stats.audited_acked.items() if owner == self.index}
        return mine - self.received


# ----------------------------------------------------------------------------- waves
class Load:
    def __init__(
        self, port: int, stats: Stats, first_auditor: int, auditors: int, run: str, seed: int
    ) -> None:
        self.port = port
        self.stats = stats
        self.first_auditor = first_auditor
        self.auditors = auditors
        self.run = run
        self.rng = random.Random(seed)
        self.seq = itertools.count()
        self.used_pool: set[int] = set()
        # A resumed session keeps the QoS 2 packet ids for which the broker sent PUBREC and
        # got no PUBREL; a new PUBLISH reusing one is a retransmission to the broker
        # [MQTT-4.3.3] and is not delivered again. A real client keeps that state across
        # connections; here each pooled client id keeps one packet-id sequence instead, so a
        # new message never reuses an id its session may still hold.
        self.pool_ids: dict[str, Iterator[int]] = {}

    def _payload(self, message_id: str) -> bytes:
        size = self.rng.choice([16, 64, 64, 256, 1024, 1024, 4096, 16384])
        return (message_id + "|").encode() + b"x" * size

    async def wave_client(self, wave: int, index: int) -> None:
        rng = self.rng
        stats = self.stats
        version = rng.choice([4, 5])
        persistent = rng.random() < 0.4
        expiry = None
        if persistent and version == 4:
            slot = rng.randrange(POOL_311)
            self.used_pool.add(slot)
            client_id = f"soak-{self.run}-p311-{slot}"
        else:
            client_id = f"soak-{self.run}-w{wave}-c{index}"
            if persistent:
                expiry = rng.randint(2, MAX_WAVE_EXPIRY)
        will = None
        if rng.random() < 0.15:
            will = Will(f"soak/load/{rng.randrange(LOAD_TOPICS)}", b"will-" + client_id.encode(), rng.choice([0, 1]))

        def on_message(topic: str, payload: bytes, qos: int) -> None:
            stats.delivered_to_wave_clients += 1

        await asyncio.sleep(rng.uniform(0, 1.0))
        ending = rng.choices(["disconnect", "close", "abort", "truncated"], [40, 20, 20, 20])[0]
        if ending == "truncated" and rng.random() < 0.25:
            # Half a CONNECT, then gone.
            try:
                _reader, writer = await asyncio.wait_for(asyncio.open_connection(HOST, self.port), 10)
            except (TimeoutError, OSError):
                stats.connect_failures += 1
                return
            data = encode_connect(client_id, version, True, 30)
            writer.write(data[: rng.randrange(1, len(data))])
            with contextlib.suppress(ConnectionError, OSError, asyncio.TimeoutError):
                await asyncio.wait_for(writer.drain(), 5)
            writer.close()
            stats.endings["truncated CONNECT"] = stats.endings.get("truncated CONNECT", 0) + 1
            return
        packet_ids = None
        if persistent and version == 4:
            packet_ids = self.pool_ids.setdefault(client_id, itertools.cycle(range(1, 65536)))
        client = Client(self.port, client_id, version, stats, on_message, packet_ids)
        try:
            await client.connect(clean=not persistent, keepalive=10, expiry=expiry, will=will)
        except (TimeoutError, OSError, ConnectRefused) as exc:
            stats.connect_failures += 1
            stats.note_error(f"{client_id}: connect failed: {exc!r}")
            return
        try:
            if rng.random() < 0.5:
                if rng.random() < 0.3:
                    filters = [("soak/load/#", rng.randrange(3))]
                else:
                    filters = [(f"soak/load/{rng.randrange(LOAD_TOPICS)}", rng.randrange(3))
                               for _ in range(rng.randint(1, 3))]
                await client.subscribe(filters)
            window = rng.choice([1, 4, 16])
            for _ in range(rng.randint(0, 40)):
                if client.closed.is_set():
                    break
                qos = rng.choices([0, 1, 2], [20, 50, 30])[0]
                target = rng.random()
                if target < 0.6:
                    auditor = self.first_auditor + rng.randrange(self.auditors)
                    message_id = f"{auditor}.{next(self.seq)}"
                    topic = f"{AUDIT_PREFIX}/{auditor}/{wave}/{index}"
                    client.publish(topic, self._payload(message_id), qos, message_id if qos else None)
                elif target < 0.95:
                    client.publish(f"soak/load/{rng.randrange(LOAD_TOPICS)}", self._payload("load"), qos)
                else:
                    client.publish(f"soak/retained/{rng.randrange(RETAINED_TOPICS)}", b"r" * 32,
                                   min(qos, 1), retain=True)
                await client.wait_window(window, 10)
                if rng.random() < 0.3:
                    await asyncio.sleep(rng.uniform(0, 0.05))
            await asyncio.sleep(rng.uniform(0, 1.0))
        except (TimeoutError, asyncio.CancelledError, ConnectionError, OSError) as exc:
            stats.note_error(f"{client_id}: {exc!r}")
        stats.endings[ending] = stats.endings.get(ending, 0) + 1
        if ending == "disconnect":
            await client.wait_acks(5)
            await client.disconnect()
        elif ending == "close":
            await client.close_socket()
        elif ending == "abort":
            client.abort()
            await client.stop_reader()
        else:
            cut = encode_publish("soak/load/0", b"y" * 200, 1, 1, version)
            await client.truncate(cut[: rng.randrange(1, len(cut))])

    async def wave(self, wave: int, clients: int) -> None:
        self.stats.waves += 1
        tasks = [asyncio.create_task(self.wave_client(wave, i)) for i in range(clients)]
        done, pending = await asyncio.wait(tasks, timeout=60)
        for task in pending:
            task.cancel()
            self.stats.note_error(f"wave {wave}: a client did not finish in 60 s")
        for task in done:
            exc = task.exception()
            if exc is not None:
                self.stats.note_error(f"wave {wave}: {exc!r}")

    async def cleanup(self) -> None:
        """Clear retained messages and end the pooled MQTT 3.1.1 persistent sessions."""
        client = Client(self.port, f"soak-{self.run}-cleanup", 4, self.stats)
        await client.connect(clean=True, keepalive=0)
        for n in range(RETAINED_TOPICS):
            client.publish(f"soak/retained/{n}", b"", 1, retain=True)
        await client.wait_acks(10)
        await client.disconnect()
        for slot in sorted(self.used_pool):
            pooled = Client(self.port, f"soak-{self.run}-p311-{slot}", 4, self.stats)
            await pooled.connect(clean=True, keepalive=0)
            await pooled.disconnect()


# ----------------------------------------------------------------------------- broker
def free_port() -> int:
    with socket.socket() as sock:
        sock.bind((HOST, 0))
        return int(sock.getsockname()[1])


def rss_bytes(pid: int, field_name: str = "VmRSS") -> int:
    """``VmRSS`` (or ``RssAnon``: heap, without mapped files) of ``pid``, in bytes."""
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return 0
    match = re.search(rf"^{field_name}:\s+(\d+) kB", text, re.M)
    return int(match.group(1)) * 1024 if match else 0


def open_fds(pid: int) -> int:
    try:
        return len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return 0


def http_json(port: int, path: str) -> dict[str, object]:
    with urllib.request.urlopen(f"http://{HOST}:{port}{path}", timeout=5) as response:
        return dict(json.loads(response.read()))


@dataclass
class Sample:
    t: float
    rss: int
    fds: int
    connections: int | None = None
    sessions: int | None = None
    anon: int = 0


class Monitor:
    def __init__(self, pid: int | None, http_port: int | None) -> None:
        self.pid = pid
        self.http_port = http_port
        self.samples: list[Sample] = []
        self.start = time.monotonic()

    async def info(self) -> dict[str, object] | None:
        if self.http_port is None:
            return None
        try:
            return await asyncio.to_thread(http_json, self.http_port, "/api/info")
        except (OSError, ValueError):
            return None

    async def sample(self) -> Sample:
        info = await self.info()
        pid = self.pid
        sample = Sample(time.monotonic() - self.start, rss_bytes(pid) if pid else 0,
                        open_fds(pid) if pid else 0, anon=rss_bytes(pid, "RssAnon") if pid else 0)
        if info is not None:
            connections = info.get("connections") or {}
            assert isinstance(connections, dict)
            sample.connections = sum(int(v) for v in connections.values())
            sessions = info.get("sessions")
            sample.sessions = int(sessions) if isinstance(sessions, int) else None
        self.samples.append(sample)
        return sample

    async def run(self, stop: asyncio.Event, interval: float = 1.0) -> None:
        for _ in range(100_000):
            await self.sample()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(stop.wait(), interval)
            if stop.is_set():
                return


MOSQUITTO_CONF = """\
listener {port} 127.0.0.1
allow_anonymous true
persistence false
log_dest stdout
log_type error
log_type warning
"""


def start_mosquitto(work: Path, log_path: Path) -> tuple[subprocess.Popen[bytes], dict[str, int]]:
    """mosquitto on a free loopback port, its defaults otherwise (max_queued_messages 1000,
    max_inflight_messages 20); sessions in memory."""
    port = free_port()
    conf = work / "mosquitto.conf"
    conf.write_text(MOSQUITTO_CONF.format(port=port))
    log = log_path.open("wb")
    proc = subprocess.Popen(["mosquitto", "-c", str(conf)], stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"mosquitto exited with {proc.returncode}:\n{log_path.read_text()[-3000:]}")
        with contextlib.suppress(OSError), socket.create_connection((HOST, port), timeout=1):
            return proc, {"mqtt": port}
        time.sleep(0.1)
    proc.kill()
    raise RuntimeError("mosquitto did not listen within 20 s")


class External:
    """A broker this script did not start (``--port``): nothing to sample or stop."""

    pid = None
    returncode = 0

    def poll(self) -> int | None:
        return None


def stop_broker(proc: subprocess.Popen[bytes]) -> int:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
            return -9
    return int(proc.returncode)


# ----------------------------------------------------------------------------- scenario
@dataclass
class Report:
    command: str
    minutes: float
    clients: int
    rounds: int
    baseline: Sample
    peak_rss: int
    peak_anon: int
    peak_fds: int
    peak_connections: int
    peak_sessions: int
    after_round: list[Sample]
    final: Sample
    settled: bool
    stats: Stats
    auditors: list[Auditor]
    lost: int
    log_tracebacks: int
    log_errors: int
    log_warnings: int
    log_excerpt: list[str]
    exit_code: int
    timeline: list[Sample]
    final_info: dict[str, object] | None
    max_loop_lag: float
    broker: str = "shardgate"
    probe: dict[str, object] = field(default_factory=dict)
    # Per-connection broker timestamps (`--trace`), by client address.
    trace: dict[str, list[dict[str, float]]] = field(default_factory=dict)


def probe_connects(port: int, seconds: float, interval: float = 0.05) -> dict[str, object]:
    """CONNECT → CONNACK seen by one client outside the generator's event loop (run in its own
    process by ``--probe``): blocking sockets, one connection every `interval`, in turn a clean
    session (3.1.1), a new persistent session (5.0, expiry 2 s) and a resumed persistent session
    (3.1.1, the same client id each time, ended at the end). Each span is taken twice: until
    this process read the CONNACK (``times``), and until the CONNACK reached its socket (the
    kernel's stamp, ``arrived``), which leaves out how long this process waited for a CPU."""
    def exchange(data: bytes, sock: socket.socket) -> tuple[bytes, float | None]:
        sock.sendall(data)
        return recv_packet_blocking(sock)

    times: dict[str, list[float]] = {"clean": [], "new persistent": [], "resumed persistent": []}
    arrived_times: dict[str, list[float]] = {kind: [] for kind in times}
    records: list[dict[str, object]] = []
    deadline = time.monotonic() + seconds
    for n in itertools.count():
        if time.monotonic() >= deadline:
            break
        kind = ("clean", "new persistent", "resumed persistent")[n % 3]
        if kind == "clean":
            connect = encode_connect(f"soak-probe-c{n}", 4, True, 30)
        elif kind == "new persistent":
            connect = encode_connect(f"soak-probe-n{n}", 5, False, 30, expiry=2)
        else:
            connect = encode_connect("soak-probe-resumed", 4, False, 30)
        try:
            with socket.create_connection((HOST, port), timeout=30) as sock:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                stamp_arrivals(sock)
                started = time.monotonic()
                _reply, arrived = exchange(connect, sock)
                read = time.monotonic()
                arrived = read if arrived is None else arrived
                times[kind].append(read - started)
                arrived_times[kind].append(arrived - started)
                records.append({"local": "{}:{}".format(*sock.getsockname()[:2]), "kind": kind,
                                "persistent": kind != "clean", "sent": started, "arrived": arrived,
                                "read": read})
                sock.sendall(encode_disconnect(4 if kind != "new persistent" else 5))
        except OSError:
            pass
        time.sleep(interval)
    with contextlib.suppress(OSError), socket.create_connection((HOST, port), timeout=30) as sock:
        exchange(encode_connect("soak-probe-resumed", 4, True, 30), sock)  # ends that session
        sock.sendall(encode_disconnect(4))
    return {"times": times, "arrived": arrived_times, "records": records}


def start_probe(port: int, seconds: float) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, str(Path(__file__).resolve()), "--probe-child", str(port), str(seconds)],
        stdout=subprocess.PIPE,
    )


async def loop_lag(stop: asyncio.Event, out: list[float]) -> None:
    """The generator's own event-loop lag (a late tick means the generator, not the broker,
    was the bottleneck)."""
    for _ in range(1_000_000):
        before = time.monotonic()
        await asyncio.sleep(0.1)
        out.append(time.monotonic() - before - 0.1)
        if stop.is_set():
            return


async def one_round(
    args: argparse.Namespace, number: int, ports: dict[str, int], proc: subprocess.Popen[bytes] | External,
    monitor: Monitor, stats: Stats,
) -> tuple[list[Auditor], int, bool]:
    """Auditors, waves for minutes/rounds, drain, end every session, wait until idle."""
    run = f"{os.getpid()}r{number}"
    first = number * args.auditors  # auditor indices (and their topics) are unique per run
    auditors = [Auditor(first + i, 5 if i % 2 == 0 else 4, 2 if i % 4 < 2 else 1, ports["mqtt"],
                        stats, run) for i in range(args.auditors)]
    for auditor in auditors:
        await auditor.start()
    stop_churn = asyncio.Event()
    churn_rng = random.Random(args.seed + 1 + number)
    churn = [asyncio.create_task(a.churn(stop_churn, churn_rng)) for a in auditors]

    load = Load(ports["mqtt"], stats, first, args.auditors, run, args.seed + 100 * number)
    deadline = time.monotonic() + args.minutes * 60 / args.rounds
    for wave in range(args.max_waves):
        if time.monotonic() >= deadline or proc.poll() is not None:
            break
        await load.wave(wave, args.clients)
        if wave % 10 == 0:
            last = monitor.samples[-1]
            print(f"round {number} wave {wave}: RSS {last.rss / 2**20:.1f} MiB, {last.fds} fds, "
                  f"{last.connections} connections, {last.sessions} sessions, "
                  f"{stats.acked} acked, {len(stats.audited_acked)} audited", file=sys.stderr)
    print(f"round {number}: load stopped; draining auditors", file=sys.stderr)
    stop_churn.set()
    await asyncio.wait(churn, timeout=60)
    await load.cleanup()

    # Auditors drain their sessions: until nothing is missing or nothing arrives for 15 s.
    for auditor in auditors:
        await auditor.ensure_connected()
    drain_deadline = time.monotonic() + 180
    while time.monotonic() < drain_deadline:
        missing = sum(len(a.missing()) for a in auditors)
        quiet = min(time.monotonic() - a.last_receive for a in auditors)
        if missing == 0 or quiet > 15:
            break
        await asyncio.sleep(0.5)
    lost = sum(len(a.missing()) for a in auditors)
    for auditor in auditors:
        await auditor.end_session()

    # Settle: every connection gone and every session ended or expired.
    settle_deadline = time.monotonic() + MAX_WAVE_EXPIRY + 90
    settled = False
    if "http" not in ports:  # no admin API to count them: wait for the wave sessions to expire
        await asyncio.sleep(MAX_WAVE_EXPIRY)
        settled = True
    while not settled and time.monotonic() < settle_deadline:
        sample = monitor.samples[-1] if monitor.samples else None
        if sample is not None and sample.connections == 0 and sample.sessions == 0:
            settled = True
            break
        await asyncio.sleep(1)
    await asyncio.sleep(args.settle)
    return auditors, lost, settled


async def scenario(args: argparse.Namespace, command: str) -> Report:
    work = Path(tempfile.mkdtemp(prefix="shardgate-soak-"))
    log_path = work / "broker.log"
    log_path.touch()
    trace_path = work / "connect-trace.jsonl"
    proc: subprocess.Popen[bytes] | External
    if args.port:
        proc, ports = External(), {"mqtt": args.port}
    elif args.broker == "mosquitto":
        proc, ports = start_mosquitto(work, log_path)
    elif args.trace:
        # Only the broker gets the trace hook (bench/connect_trace/sitecustomize.py).
        saved = {name: os.environ.get(name) for name in ("PYTHONPATH", "SOAK_CONNECT_TRACE")}
        os.environ["PYTHONPATH"] = os.pathsep.join(
            [str(REPO / "bench" / "connect_trace"), *filter(None, [saved["PYTHONPATH"]])])
        os.environ["SOAK_CONNECT_TRACE"] = str(trace_path)
        try:
            proc, ports = start_broker(work / "data", log_path, http_port=free_port())
        finally:
            for name, value in saved.items():
                if value is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = value
    else:
        proc, ports = start_broker(work / "data", log_path, http_port=free_port())
    stats = Stats()
    lags: list[float] = []
    probe_times: dict[str, object] = {}
    probe: subprocess.Popen[bytes] | None = None
    try:
        monitor = Monitor(proc.pid, ports.get("http"))
        await asyncio.sleep(2)
        baseline = await monitor.sample()
        probe = start_probe(ports["mqtt"], args.minutes * 60) if args.probe else None
        print(f"baseline: RSS {baseline.rss / 2**20:.1f} MiB, {baseline.fds} fds", file=sys.stderr)
        stop_monitor = asyncio.Event()
        monitor_task = asyncio.create_task(monitor.run(stop_monitor))
        lag_task = asyncio.create_task(loop_lag(stop_monitor, lags))
        auditors: list[Auditor] = []
        after_round: list[Sample] = []
        lost = 0
        settled = True
        for number in range(args.rounds):
            if proc.poll() is not None:
                break
            mine, round_lost, round_settled = await one_round(args, number, ports, proc, monitor, stats)
            auditors += mine
            lost += round_lost
            settled &= round_settled
            after_round.append(await monitor.sample())
            last = after_round[-1]
            print(f"after round {number}: RSS {last.rss / 2**20:.1f} MiB, {last.fds} fds, "
                  f"lost so far {lost}", file=sys.stderr)
        if probe is not None:
            out, _ = await asyncio.to_thread(probe.communicate, timeout=120)
            probe_times = json.loads(out or b"{}")
        stop_monitor.set()
        await monitor_task
        await lag_task
        final = after_round[-1] if after_round else await monitor.sample()
        final_info = await monitor.info()
    finally:
        if probe is not None and probe.poll() is None:
            probe.kill()  # the run failed before the probe's report was read
            probe.wait(10)
        exit_code = 0 if isinstance(proc, External) else stop_broker(proc)
    trace = load_trace(trace_path) if args.trace else {}
    text = log_path.read_text(errors="replace")
    lines = text.splitlines()
    excerpt: list[str] = []
    for i, line in enumerate(lines):
        if line.startswith("Traceback") and len(excerpt) < 60:
            excerpt.extend(lines[max(0, i - 1):i + 25])
    samples = monitor.samples
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)
    else:
        print(f"kept {work}", file=sys.stderr)
    return Report(
        command=command, minutes=args.minutes, clients=args.clients, rounds=args.rounds,
        baseline=baseline, peak_rss=max(s.rss for s in samples),
        peak_anon=max(s.anon for s in samples), peak_fds=max(s.fds for s in samples),
        peak_connections=max((s.connections or 0) for s in samples),
        peak_sessions=max((s.sessions or 0) for s in samples), after_round=after_round,
        final=final, settled=settled, stats=stats, auditors=auditors, lost=lost,
        log_tracebacks=sum(1 for line in lines if line.startswith("Traceback")),
        log_errors=sum(1 for line in lines if " ERROR " in line or " CRITICAL " in line),
        log_warnings=sum(1 for line in lines if " WARNING " in line),
        log_excerpt=excerpt, exit_code=exit_code, timeline=samples, final_info=final_info,
        max_loop_lag=max(lags, default=0.0), probe=probe_times, trace=trace,
        broker=f"port {args.port}" if args.port else args.broker,
    )


# ----------------------------------------------------------------------------- output
def mib(n: int) -> str:
    return f"{n / 2**20:.1f}"


def machine() -> str:
    model = "unknown CPU"
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                                text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        commit = "unknown"
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    return (f"{os.cpu_count()} CPUs (nproc), {model}; Linux {platform.release()}; "
            f"Python {platform.python_version()}; shardgate @ {commit}; "
            f"{datetime.date.today().isoformat()}; load average at the end {load}")


def quantile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def table(report: Report) -> str:
    s = report.stats
    b, f = report.baseline, report.final
    rounds = " → ".join(mib(r.rss) for r in report.after_round)
    rounds_anon = " → ".join(mib(r.anon) for r in report.after_round)
    round_fds = " → ".join(str(r.fds) for r in report.after_round)
    audited_received = sum(len(a.received) for a in report.auditors)
    deliveries = sum(a.deliveries for a in report.auditors)
    endings = ", ".join(f"{k} {v:,}" for k, v in sorted(s.endings.items()))
    rows = [
        "| resource | baseline | peak | final | final − baseline |",
        "|---|---:|---:|---:|---:|",
        f"| broker RSS (MiB) | {mib(b.rss)} | {mib(report.peak_rss)} | {mib(f.rss)} | "
        f"{(f.rss - b.rss) / 2**20:+.1f} |",
        f"| broker open fds | {b.fds} | {report.peak_fds} | {f.fds} | {f.fds - b.fds:+d} |",
        f"| broker RssAnon (MiB, heap) | {mib(b.anon)} | {mib(report.peak_anon)} | {mib(f.anon)} | "
        f"{(f.anon - b.anon) / 2**20:+.1f} |",
        f"| idle after each round: RSS; RssAnon (MiB); fds | | | {rounds}; {rounds_anon}; "
        f"{round_fds} | |",
        f"| MQTT connections | {b.connections} | {report.peak_connections} | {f.connections} | "
        f"{(f.connections or 0) - (b.connections or 0):+d} |",
        f"| MQTT sessions | {b.sessions} | {report.peak_sessions} | {f.sessions} | "
        f"{(f.sessions or 0) - (b.sessions or 0):+d} |",
        "",
        "| load and delivery | count |",
        "|---|---:|",
        f"| waves × clients | {s.waves:,} × {report.clients} |",
        f"| MQTT connections accepted (CONNACK 0) | {s.connects:,} |",
        f"| connections refused / failed | {sum(s.refused.values()):,} / {s.connect_failures:,} |",
        f"| TCP connect p50 / p99 / max (ms) | {quantile(s.tcp_connect_s, 0.5) * 1e3:.1f} / "
        f"{quantile(s.tcp_connect_s, 0.99) * 1e3:.1f} / {max(s.tcp_connect_s, default=0) * 1e3:,.0f} |",
        f"| CONNECT → CONNACK p50 / p99 / max (ms) | {quantile(s.connack_s, 0.5) * 1e3:.1f} / "
        f"{quantile(s.connack_s, 0.99) * 1e3:.1f} / {max(s.connack_s, default=0) * 1e3:,.0f} |",
        f"| CONNECT → CONNACK, persistent sessions ({len(s.connack_persistent_s):,}), p50 / p99 / max (ms) | "
        f"{quantile(s.connack_persistent_s, 0.5) * 1e3:.1f} / "
        f"{quantile(s.connack_persistent_s, 0.99) * 1e3:.1f} / "
        f"{max(s.connack_persistent_s, default=0) * 1e3:,.0f} |",
        f"| CONNECT → CONNACK at the clients' sockets (kernel stamp), p50 / p99 / max (ms) | "
        f"{quantile(s.connack_arrived_s, 0.5) * 1e3:.1f} / {quantile(s.connack_arrived_s, 0.99) * 1e3:.1f} / "
        f"{max(s.connack_arrived_s, default=0) * 1e3:,.0f} |",
        f"| the same, persistent sessions, p50 / p99 / max (ms) | "
        f"{quantile(s.connack_persistent_arrived_s, 0.5) * 1e3:.1f} / "
        f"{quantile(s.connack_persistent_arrived_s, 0.99) * 1e3:.1f} / "
        f"{max(s.connack_persistent_arrived_s, default=0) * 1e3:,.0f} |",
        f"| generator event-loop lag, max (ms) | {report.max_loop_lag * 1e3:,.0f} |",
        *broker_timing_rows(report.final_info),
        *probe_rows(report.probe),
        f"| how wave clients left | {endings} |",
        f"| PUBLISH sent (QoS 0 / 1 / 2) | {s.published[0]:,} / {s.published[1]:,} / {s.published[2]:,} |",
        f"| acknowledged (PUBACK / PUBCOMP) | {s.acked:,} |",
        f"| acknowledged, audited topics | {len(s.audited_acked):,} |",
        f"| received by the auditors (distinct ids, incl. unacknowledged) | {audited_received:,} |",
        f"| auditor deliveries (with QoS 1 duplicates) | {deliveries:,} |",
        f"| auditor session resumptions / sessions lost | "
        f"{sum(a.reconnects for a in report.auditors)} / {sum(a.sessions_lost for a in report.auditors)} |",
        f"| **lost (acknowledged, never received)** | **{report.lost:,}** |",
        f"| negative acks (reason ≥ 0x80) | {s.ack_failures:,} |",
        f"| broker log: Traceback / ERROR / WARNING lines | {report.log_tracebacks} / "
        f"{report.log_errors} / {report.log_warnings} |",
        f"| broker exit code after SIGTERM | {report.exit_code} |",
        *trace_rows(report),
    ]
    return "\n".join(rows)


def probe_rows(probe: dict[str, object]) -> list[str]:
    rows = []
    for key, what in (("times", "read by the probe"), ("arrived", "at the probe's socket")):
        by_kind = probe.get(key)
        if not isinstance(by_kind, dict):
            continue
        everything = [t for times in by_kind.values() for t in times]
        for label, times in [("every kind", everything), *by_kind.items()]:
            if times:
                rows.append(f"| probe outside the generator ({label}, {len(times):,}), CONNECT → CONNACK "
                            f"{what}, p50 / p99 / max (ms) | {quantile(times, 0.5) * 1e3:.1f} / "
                            f"{quantile(times, 0.99) * 1e3:.1f} / {max(times) * 1e3:,.0f} |")
    return rows


def trace_rows(report: Report) -> list[str]:
    """Each client's CONNECT → CONNACK split at the broker's timestamps (`--trace`)."""
    if not report.trace:
        return []
    rows = ["", "| where CONNECT → CONNACK went (ms) | p50 / p99 | mean of the slowest 1 % |",
            "|---|---:|---:|"]
    generator = join(report.stats.connect_records, report.trace)  # type: ignore[arg-type]
    rows += breakdown_rows("generator, persistent", [j for j in generator if j["persistent"]])
    rows += breakdown_rows("generator, clean", [j for j in generator if not j["persistent"]])
    records = report.probe.get("records")
    if isinstance(records, list):
        probe = join(records, report.trace)
        rows += breakdown_rows("probe, persistent", [j for j in probe if j["persistent"]])
        rows += breakdown_rows("probe, clean", [j for j in probe if not j["persistent"]])
    return rows


def broker_timing_rows(info: dict[str, object] | None) -> list[str]:
    """The broker's own view of CONNECT → CONNACK (``mqtt_connect_timing`` of /api/info)."""
    timing = (info or {}).get("mqtt_connect_timing")
    if not isinstance(timing, dict):
        return []
    names = {
        "read_to_connack_written_ms": "in the broker: CONNECT read → CONNACK written",
        "persistent_read_to_connack_written_ms": "in the broker, persistent sessions",
        "read_to_session_open_ms": "in the broker: read → session open",
        "session_open_to_connack_written_ms": "in the broker: session open → CONNACK written",
        "of_which_metadata_commit_wait_ms": "in the broker: of which metadata commit (fsync) wait",
        "event_loop_lag_ms": "broker event-loop lag (20 ms timer lateness)",
    }
    rows = []
    for key, label in names.items():
        figures = timing.get(key)
        if isinstance(figures, dict):
            rows.append(f"| {label} ({int(figures['count']):,}), p50 / p99 / max (ms) | "
                        f"{figures['p50']:.1f} / {figures['p99']:.1f} / {figures['max']:,.0f} |")
    return rows


def verdict(report: Report) -> list[str]:
    problems = []
    if report.lost:
        problems.append(f"{report.lost} acknowledged messages were never received")
    if report.log_tracebacks:
        problems.append(f"{report.log_tracebacks} tracebacks in the broker log")
    if not report.settled:
        problems.append("connections/sessions did not return to 0 in time")
    if report.final.fds > report.baseline.fds + 2:
        problems.append(f"open fds grew {report.baseline.fds} → {report.final.fds}")
    if report.exit_code != 0:
        problems.append(f"broker exit code {report.exit_code}")
    if len(report.after_round) > 1:
        first, last = report.after_round[0].rss, report.after_round[-1].rss
        if last > first + max(16 * 2**20, first // 10):
            problems.append(f"idle RSS kept growing between rounds ({mib(first)} → {mib(last)} MiB)")
    if sum(a.sessions_lost for a in report.auditors):
        problems.append("an auditor's persistent session was not present on resume")
    return problems


def section(report: Report) -> str:
    lines = [
        SECTION,
        "",
        f"Recorded by `{report.command}` ({report.minutes:g} minutes of load in {report.rounds} "
        f"rounds, waves of {report.clients} clients; after each round the broker is left idle "
        "until it has no connection and no session, and measured).",
        "",
        f"- Machine: {machine()}.",
        ("- Broker: `python -m shardgate serve` with defaults on a scratch data directory (default "
         "stream reliable, journaled); RSS is `VmRSS` of its process, fds are `/proc/PID/fd` entries."
         if report.broker == "shardgate" else
         f"- Broker: {report.broker} (" + ("its defaults, no persistence file; " if report.broker ==
                                            "mosquitto" else "") + "no admin API: connections and "
         "sessions not counted)."),
        "- Each wave: clients half MQTT 3.1.1, half 5.0; 40 % persistent sessions (5.0: expiry "
        f"2–{MAX_WAVE_EXPIRY} s; 3.1.1: a pool of {POOL_311} client ids, ended at the end), 15 % with a will; "
        "half subscribe to `soak/load/…`; each publishes 0–40 messages (QoS 0/1/2 = 20/50/30 %, "
        "16 B–16 KiB, windows of 1/4/16), 60 % to audited topics; then leaves: DISCONNECT 40 %, "
        "socket closed (FIN) 20 %, reset (RST) 20 %, a truncated packet then close 20 %. A pooled "
        "3.1.1 client id keeps one packet-id sequence across its connections, as a client with "
        "persistent state would: a QoS 2 PUBLISH reusing a packet id that the resumed session still "
        "holds (PUBREC sent, no PUBREL) is a retransmission [MQTT-4.3.3] and not delivered again.",
        f"- {len(report.auditors)} auditors (persistent sessions, 3.1.1 and 5.0, QoS 1 and 2) drop their "
        "connection every 10–30 s (DISCONNECT, FIN or RST) and resume; at the end they drain, then "
        "every session is ended or left to expire, and the final figures are taken once the broker "
        "reports 0 connections and 0 sessions (plus a settling pause).",
        "",
        table(report),
        "",
    ]
    problems = verdict(report)
    lines.append("Verdict: " + ("no loss, no broker error, fds back to baseline." if not problems
                                else "; ".join(problems) + "."))
    lines.append("")
    return "\n".join(lines)


def write_section(text: str) -> None:
    """Replace only the ``## Soak`` section of RESULTS.md (re-read just before writing)."""
    current = RESULTS.read_text() if RESULTS.exists() else "# Benchmark results\n"
    pattern = re.compile(rf"^{re.escape(SECTION)}\s*$.*?(?=^## |\Z)", re.M | re.S)
    if pattern.search(current):
        updated = pattern.sub(lambda _m: text + "\n", current, count=1)
    else:
        updated = current.rstrip("\n") + "\n\n" + text
    RESULTS.write_text(updated.rstrip("\n") + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=3.0, help="time under load (default 3)")
    parser.add_argument("--clients", type=int, default=200, help="clients per wave (default 200)")
    parser.add_argument("--auditors", type=int, default=4, help="persistent auditor sessions (default 4)")
    parser.add_argument("--rounds", type=int, default=2,
                        help="load rounds, each followed by an idle measurement (default 2)")
    parser.add_argument("--max-waves", type=int, default=10_000, help="upper bound on waves")
    parser.add_argument("--settle", type=float, default=10.0, help="seconds to wait once idle")
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--keep", action="store_true", help="keep the scratch directory and broker log")
    parser.add_argument("--write", action="store_true", help="update the ## Soak section of RESULTS.md")
    parser.add_argument("--broker", choices=["shardgate", "mosquitto"], default="shardgate",
                        help="the broker to start and load (default shardgate)")
    parser.add_argument("--probe", action="store_true",
                        help="also time CONNECT → CONNACK from a separate process with blocking "
                             "sockets (one connection every 50 ms), outside the generator's loop")
    parser.add_argument("--probe-child", nargs=2, metavar=("PORT", "SECONDS"), help=argparse.SUPPRESS)
    parser.add_argument("--trace", action="store_true",
                        help="record per-connection timestamps in the broker (accept, first read, "
                             "CONNACK written; bench/connect_trace) and split each client's "
                             "CONNECT → CONNACK at them")
    parser.add_argument("--port", type=int, default=0,
                        help="load a broker already listening on this 127.0.0.1 port instead")
    args = parser.parse_args(argv)
    if args.probe_child:
        print(json.dumps(probe_connects(int(args.probe_child[0]), float(args.probe_child[1]))))
        return 0
    command = "python bench/soak.py " + " ".join(argv if argv is not None else sys.argv[1:])
    try:
        import uvloop

        report = uvloop.run(scenario(args, command.strip()))
    except ImportError:
        report = asyncio.run(scenario(args, command.strip()))
    text = section(report)
    print(text)
    if report.stats.errors:
        print("client-side notes:\n  " + "\n  ".join(report.stats.errors), file=sys.stderr)
    for auditor in report.auditors:
        missing = auditor.missing()
        if missing:
            print(f"auditor {auditor.index} ({auditor.client_id}, MQTT "
                  f"{'5.0' if auditor.version == 5 else '3.1.1'}, QoS {auditor.qos}) is missing "
                  f"{len(missing)}:", file=sys.stderr)
            for message_id in sorted(missing)[:10]:
                publisher, qos, acked_at = report.stats.ack_info[message_id]
                print(f"  {message_id}: published by {publisher} at QoS {qos}, acknowledged at "
                      f"{acked_at - report.stats.t0:.2f}s", file=sys.stderr)
            print("  auditor connection events: " + "; ".join(auditor.events), file=sys.stderr)
    if report.log_excerpt:
        print("broker log excerpt:\n" + "\n".join(report.log_excerpt), file=sys.stderr)
    timeline = " ".join(f"{s.t:.0f}s:{mib(s.rss)}MiB/{s.fds}fd/{s.connections}c/{s.sessions}s"
                        for s in report.timeline[::10])
    print(f"timeline: {timeline}", file=sys.stderr)
    print(f"final /api/info: {json.dumps(report.final_info)}", file=sys.stderr)
    if args.write and args.broker == "shardgate" and not args.port:
        write_section(text)
    return 1 if report.lost or report.log_tracebacks or report.exit_code != 0 else 0


if __name__ == "__main__":
    sys.exit(main())
