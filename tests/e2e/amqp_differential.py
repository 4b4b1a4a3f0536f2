"""A differential harness for AMQP 0-9-1: the same scripted scenario against RabbitMQ and
Shardgate, frame by frame, and a comparison of what each broker said.

A scenario is an async function of a `Session`. It opens connections and channels and sends
methods with the session's raw client (pamqp framing on a plain socket, so nothing between the
test and the wire hides or reorders a frame). Each `call` sends its frames, then waits for a
barrier (channel.flow active=true, answered by channel.flow-ok on the same channel, which both
brokers send after the replies to what came before) and records what came back:

- replies (declare-ok with its message and consumer counts, get-ok and its content, close
  frames with reply code, text, class and method) in the order they came, in the transcript;
- frames a broker sends on its own schedule (basic.deliver, basic.return, server-sent
  basic.cancel, connection.blocked) in a per-channel stream, whose order is compared but not
  its interleaving with replies;
- publisher confirms as each publish's outcome (ack or nack, with the requeue bit the broker
  set), since how a broker merges acks into `multiple` ones depends on timing; a returned
  message notes whether its publish was already confirmed (RabbitMQ returns first).

Names a scenario makes with `Session.name` carry a per-run token, and the brokers' generated
names (`amq.ctag-…`, `amq.gen-…`) differ by design, so both are normalised before the
comparison. The harness imports nothing of Shardgate: it only speaks AMQP.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import decimal
import re
import struct
import uuid
from collections.abc import Awaitable, Callable
from typing import Any
from urllib.parse import urlparse

from pamqp import body as pbody
from pamqp import commands
from pamqp import frame as pframe
from pamqp import header as pheader

PROTOCOL_HEADER = b"AMQP\x00\x00\x09\x01"
_FRAME = struct.Struct(">BHI")
READ_TIMEOUT = 10.0

# Frames the broker sends on its own schedule (not as a reply to the call that preceded them).
ASYNC = {"Basic.Deliver", "Basic.Return", "Basic.Ack", "Basic.Nack", "Basic.Cancel",
         "Connection.Blocked", "Connection.Unblocked"}
CONTENT = {"Basic.Deliver", "Basic.Return", "Basic.GetOk"}

_GENERATED = [
    (re.compile(r"amq\.ctag-[A-Za-z0-9_\-.]+"), "amq.ctag-*"),
    (re.compile(r"amq\.gen-[A-Za-z0-9_\-]+"), "amq.gen-*"),
    (re.compile(r"amq\.rabbitmq\.reply-to\.[A-Za-z0-9_\-.=]+"), "amq.rabbitmq.reply-to.*"),
]


class BrokerClosed(Exception):
    """The broker closed the socket."""


def normalise(value: Any, token: str) -> Any:
    """`value` with this run's token and the brokers' generated names replaced."""
    if isinstance(value, str):
        value = value.replace(token, "RUN")
        for pattern, replacement in _GENERATED:
            value = pattern.sub(replacement, value)
        return value
    if isinstance(value, bytes):
        return normalise(value.decode("utf-8", "replace"), token).encode()
    if isinstance(value, dict):
        return {normalise(k, token): normalise(v, token) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [normalise(v, token) for v in value]
    if isinstance(value, datetime.datetime):
        return "<time>"
    if isinstance(value, decimal.Decimal):
        return str(value)
    return value


def method_fields(method: Any) -> dict[str, Any]:
    fields: dict[str, Any] = {}
    for name in getattr(method, "__slots__", ()):
        if name.startswith("_"):
            continue
        fields[name] = getattr(method, name, None)
    return fields


class Connection:
    """One raw AMQP connection of a session: frames out, frames in, nothing hidden."""

    def __init__(self, session: Session, label: str) -> None:
        self.session = session
        self.label = label
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None
        self.buffer = bytearray()
        self.closed = False
        self.open_channels: set[int] = set()
        self.next_channel = 1
        self.frame_max = 131072
        self.server_properties: dict[str, Any] = {}
        self.tune: dict[str, Any] = {}
        # Publisher confirms: channels in confirm mode, their publishes (tag -> routing key
        # and body) and each publish's outcome.
        self.confirming: set[int] = set()
        self.published: dict[int, list[tuple[str, bytes]]] = {}
        self.outcomes: dict[int, dict[int, str]] = {}
        self.returned: dict[int, set[int]] = {}

    # ------------------------------------------------------------------ wire
    def send_raw(self, data: bytes) -> None:
        assert self.writer is not None
        if not self.writer.is_closing():
            self.writer.write(data)

    def send(self, channel: int, method: Any) -> None:
        self.send_raw(pframe.marshal(method, channel))

    def send_content(
        self, channel: int, method: Any, body: bytes, properties: commands.Basic.Properties | None,
    ) -> None:
        if channel in self.confirming and isinstance(method, commands.Basic.Publish):
            self.published.setdefault(channel, []).append((method.routing_key, body))
        properties = properties or commands.Basic.Properties()
        parts = [pframe.marshal(method, channel),
                 pframe.marshal(pheader.ContentHeader(0, len(body), properties), channel)]
        chunk = self.frame_max - 8
        for start in range(0, len(body), chunk):
            parts.append(pframe.marshal(pbody.ContentBody(body[start:start + chunk]), channel))
        self.send_raw(b"".join(parts))

    async def _read_frame(self, timeout: float) -> tuple[int, int, bytes]:
        assert self.reader is not None
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            if len(self.buffer) >= 7:
                frame_type, channel, size = _FRAME.unpack_from(self.buffer, 0)
                if len(self.buffer) >= size + 8:
                    data = bytes(self.buffer[:size + 8])
                    del self.buffer[:size + 8]
                    return frame_type, channel, data
            left = deadline - loop.time()
            if left <= 0:
                raise TimeoutError(f"{self.label}: no frame within {timeout}s")
            try:
                chunk = await asyncio.wait_for(self.reader.read(65536), left)
            except ConnectionError:
                chunk = b""
            if not chunk:
                raise BrokerClosed(f"{self.label}: socket closed by the broker")
            self.buffer += chunk

    async def read(self, timeout: float = READ_TIMEOUT) -> tuple[int, str, dict[str, Any], Any]:
        """One method with its content, if any: (channel, name, fields, content)."""
        while True:
            frame_type, channel, data = await self._read_frame(timeout)
            if frame_type == 8:
                continue
            _, channel, value = pframe.unmarshal(data)
            name = value.name
            fields = method_fields(value)
            content = None
            if name in CONTENT:
                _, _, header = pframe.unmarshal((await self._read_frame(timeout))[2])
                assert isinstance(header, pheader.ContentHeader)
                body = b""
                while len(body) < header.body_size:
                    _, _, part = pframe.unmarshal((await self._read_frame(timeout))[2])
                    body += part.value
                props = {k: v for k, v in method_fields(header.properties).items() if v is not None}
                content = {"properties": props, "body": body}
            return channel, name, fields, content

    # ------------------------------------------------------------------ handshake
    async def open(self, *, channel_max: int = 0, frame_max: int = 0, heartbeat: int = 0,
                   capabilities: dict[str, Any] | None = None, user: str = "guest",
                   password: str = "guest", vhost: str = "/") -> None:
        url = urlparse(self.session.url)
        self.reader, self.writer = await asyncio.open_connection(url.hostname, url.port)
        self.send_raw(PROTOCOL_HEADER)
        _, name, fields, _ = await self.read()
        assert name == "Connection.Start", name
        self.server_properties = fields["server_properties"]
        caps = {"publisher_confirms": True, "consumer_cancel_notify": True,
                "exchange_exchange_bindings": True, "basic.nack": True,
                "connection.blocked": True, "authentication_failure_close": True}
        caps.update(capabilities or {})
        self.send(0, commands.Connection.StartOk(
            client_properties={"product": "differential", "capabilities": caps},
            mechanism="PLAIN", response=f"\x00{user}\x00{password}", locale="en_US",
        ))
        _, name, fields, _ = await self.read()
        if name != "Connection.Tune":
            self.session.record(self, 0, name, fields, None)
            self.closed = True
            return
        self.tune = fields
        self.frame_max = frame_max or fields["frame_max"]
        self.send(0, commands.Connection.TuneOk(
            channel_max=channel_max or fields["channel_max"], frame_max=self.frame_max,
            heartbeat=heartbeat,
        ))
        self.send(0, commands.Connection.Open(virtual_host=vhost))
        await self.settle(0, "Connection.OpenOk")

    async def close(self) -> None:
        if self.writer is None:
            return
        if not self.closed:
            self.send(0, commands.Connection.Close(200, "bye", 0, 0))
            try:
                await self.settle(0, "Connection.CloseOk")
            except (BrokerClosed, TimeoutError, ConnectionError):
                pass
        self.writer.close()
        with contextlib.suppress(ConnectionError):
            await self.writer.wait_closed()
        self.closed = True

    # ------------------------------------------------------------------ scenario steps
    async def channel(self, number: int | None = None) -> int:
        if number is None:
            number = self.next_channel
            self.next_channel += 1
        self.send(number, commands.Channel.Open())
        await self.settle(number, "Channel.OpenOk")
        return number

    async def call(self, channel: int, *methods: Any, content: bytes | None = None,
                   properties: commands.Basic.Properties | None = None,
                   reply: str | None = None) -> None:
        """Send `methods` (a publish gets `content`), then wait for the barrier and record.
        With `reply`, wait for that reply instead of the barrier (RabbitMQ refuses any other
        method while a tx.commit is in progress)."""
        for method in methods:
            if isinstance(method, commands.Basic.Publish):
                self.send_content(channel, method, content or b"", properties)
            else:
                self.send(channel, method)
        if reply is not None:
            await self.settle(channel, reply)
        else:
            await self.barrier(channel)

    async def publish(self, channel: int, exchange: str, routing_key: str, body: bytes = b"",
                      properties: commands.Basic.Properties | None = None, *,
                      mandatory: bool = False, immediate: bool = False,
                      barrier: bool = True) -> None:
        self.send_content(channel, commands.Basic.Publish(
            exchange=exchange, routing_key=routing_key, mandatory=mandatory, immediate=immediate,
        ), body, properties)
        if barrier:
            await self.barrier(channel)

    async def barrier(self, channel: int) -> None:
        if self.closed:
            return
        if channel == 0 or channel not in self.open_channels:
            # Nothing to wait on a closed channel: use a fresh one as the barrier.
            probe = self.next_channel
            self.next_channel += 1
            self.send(probe, commands.Channel.Open())
            await self.settle(probe, "Channel.OpenOk", record_barrier=False)
            self.send(probe, commands.Channel.Close(200, "", 0, 0))
            await self.settle(probe, "Channel.CloseOk", record_barrier=False)
            return
        self.send(channel, commands.Channel.Flow(active=True))
        await self.settle(channel, "Channel.FlowOk", record_barrier=False)

    async def settle(self, channel: int, until: str, *, record_barrier: bool = True) -> None:
        """Read and record until `until` arrives on `channel`, or the channel or connection is
        closed by the broker."""
        while not self.closed:
            try:
                number, name, fields, content = await self.read()
            except BrokerClosed:
                self.session.record(self, 0, "<socket closed>", {}, None)
                self.closed = True
                return
            if number == channel and name == until:
                if name == "Channel.OpenOk":
                    self.open_channels.add(channel)
                if name == "Channel.CloseOk":
                    self.open_channels.discard(channel)
                if record_barrier:
                    self.session.record(self, number, name, fields, content)
                return
            self.session.record(self, number, name, fields, content)
            if name == "Channel.Close":
                self.open_channels.discard(number)
                self.send(number, commands.Channel.CloseOk())
                if number == channel:
                    return
            elif name == "Connection.Close":
                self.send(0, commands.Connection.CloseOk())
                self.closed = True
                return

    async def until(self, channel: int, name: str, count: int = 1,
                    timeout: float = READ_TIMEOUT) -> None:
        """Wait until `count` frames named `name` arrived on `channel` (async frames)."""
        def seen() -> int:
            return sum(1 for entry in self.session.asynchronous.get((self.label, channel), [])
                       if entry[0] == name)

        while seen() < count and not self.closed:
            number, got, fields, content = await self.read(timeout)
            self.session.record(self, number, got, fields, content)


    async def confirmed(self, channel: int, count: int, timeout: float = READ_TIMEOUT) -> None:
        """Wait until `count` publishes on `channel` have their confirm (ack or nack)."""
        while len(self.outcomes.get(channel, {})) < count and not self.closed:
            number, got, fields, content = await self.read(timeout)
            self.session.record(self, number, got, fields, content)


class Session:
    """One scenario run against one broker."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.token = uuid.uuid4().hex[:8]
        self.transcript: list[Any] = []
        self.asynchronous: dict[tuple[str, int], list[Any]] = {}
        self.connections: list[Connection] = []
        self.notes: list[Any] = []

    def name(self, label: str) -> str:
        return f"d-{self.token}-{label}"

    async def connect(self, label: str = "c", **options: Any) -> Connection:
        connection = Connection(self, label)
        self.connections.append(connection)
        await connection.open(**options)
        return connection

    def note(self, *value: Any) -> None:
        """Record a value the scenario worked out itself (a count, a property)."""
        self.transcript.append(("note", *value))

    def record(self, connection: Connection, channel: int, name: str,
               fields: dict[str, Any], content: Any) -> None:
        entry: tuple[Any, ...] = (name, fields, content)
        if name == "Confirm.SelectOk":
            connection.confirming.add(channel)
        if name in ("Basic.Ack", "Basic.Nack") and channel in connection.confirming:
            outcomes = connection.outcomes.setdefault(channel, {})
            sent = len(connection.published.get(channel, []))
            tag = fields["delivery_tag"]
            tags = [t for t in range(1, sent + 1) if t <= tag and t not in outcomes] \
                if fields["multiple"] else [tag]
            outcome = "ack" if name == "Basic.Ack" else f"nack requeue={fields['requeue']}"
            for t in tags:
                outcomes[t] = outcome
            return
        if name == "Basic.Return" and channel in connection.confirming:
            returned = connection.returned.setdefault(channel, set())
            for t, (key, body) in enumerate(connection.published.get(channel, []), 1):
                if t not in returned and key == fields["routing_key"] and body == content["body"]:
                    returned.add(t)
                    confirmed = t in connection.outcomes.get(channel, {})
                    entry = (*entry, "confirmed before the return" if confirmed else "returned first")
                    break
        if name in ASYNC:
            self.asynchronous.setdefault((connection.label, channel), []).append(entry)
        else:
            self.transcript.append((connection.label, channel, *entry))

    async def close(self) -> None:
        for connection in self.connections:
            try:
                await asyncio.wait_for(connection.close(), 5)
            except (TimeoutError, ConnectionError, BrokerClosed):
                pass

    def result(self) -> dict[str, Any]:
        return normalise({
            "confirms": {f"{c.label}/{channel}": dict(sorted(outcomes.items()))
                         for c in self.connections for channel, outcomes in c.outcomes.items()},
            "transcript": self.transcript,
            "asynchronous": {f"{label}/{channel}": entries
                             for (label, channel), entries in sorted(self.asynchronous.items())},
        }, self.token)


Scenario = Callable[[Session], Awaitable[None]]


async def run(url: str, scenario: Scenario) -> dict[str, Any]:
    session = Session(url)
    try:
        await scenario(session)
    finally:
        await session.close()
    return session.result()


def differences(expected: Any, actual: Any, path: str = "") -> list[str]:
    """Where `actual` (Shardgate) differs from `expected` (RabbitMQ), one line each."""
    if isinstance(expected, dict) and isinstance(actual, dict):
        out = []
        for key in sorted(set(expected) | set(actual), key=str):
            if key not in actual:
                out.append(f"{path}/{key}: missing (RabbitMQ: {expected[key]!r})")
            elif key not in expected:
                out.append(f"{path}/{key}: extra {actual[key]!r}")
            else:
                out.extend(differences(expected[key], actual[key], f"{path}/{key}"))
        return out
    if isinstance(expected, list) and isinstance(actual, list):
        out = []
        for index in range(max(len(expected), len(actual))):
            if index >= len(actual):
                out.append(f"{path}[{index}]: missing (RabbitMQ: {expected[index]!r})")
            elif index >= len(expected):
                out.append(f"{path}[{index}]: extra {actual[index]!r}")
            else:
                out.extend(differences(expected[index], actual[index], f"{path}[{index}]"))
        return out
    if expected != actual:
        return [f"{path}: {actual!r} (RabbitMQ: {expected!r})"]
    return []
