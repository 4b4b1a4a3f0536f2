"""MQTT 3.1.1 load generator for broker benchmarks.

A minimal hand-written MQTT 3.1.1 client on raw asyncio sockets (uvloop when installed), built
to cost the generator as little CPU as possible, since the broker under test and the generator
share the same few cores:

- packets are encoded once (CONNECT, SUBSCRIBE, PUBLISH with a fixed topic and payload) and
  written many at a time, one ``transport.write`` per batch;
- the receive side scans the byte stream and parses fixed headers only (plus the topic length,
  packet identifier and timestamp where a scenario needs them) to count PUBLISH and PUBACK
  packets and answer QoS 1 deliveries with batched PUBACKs;
- QoS 1 publishers keep a window of unacknowledged messages (``--window``); every publisher
  also stops when the subscribers lag too far behind (``--max-lag``), so no broker is flooded
  into unbounded buffering.

Modes (each prints one JSON object on stdout and exits; every loop has a deadline):

- ``throughput``: P publishers → one topic → S subscribers, delivered msg/s counted at the
  subscribers over a fixed window after a warm-up;
- ``latency``: one publisher at a fixed rate, the send time (monotonic ns) in the first 8
  payload bytes, latency measured at the subscriber; p50/p99/p99.9/max;
- ``idle``: N idle connections, the broker's RSS delta per connection (``--broker-pid``).

Subscribers can run in a separate process (``--split``) so the generator may use another core.

This module speaks only the wire protocol; it must not import shardgate, so that it measures
any broker the same way. Packet layouts cite the sections of the MQTT 3.1.1 specification.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import multiprocessing as mp
import os
import resource
import secrets
import sys
import time
from array import array
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from enum import IntEnum
from multiprocessing.sharedctypes import RawArray
from typing import Any

PID_SPACE = 4096
"""Packet identifiers cycle through 1..PID_SPACE (well above any publish window)."""

CONNECT_TIMEOUT = 15.0


class PacketType(IntEnum):
    """Control packet types (MQTT 3.1.1 §2.2.1, table 2.1)."""

    CONNECT = 1
    CONNACK = 2
    PUBLISH = 3
    PUBACK = 4
    SUBSCRIBE = 8
    SUBACK = 9
    PINGREQ = 12
    PINGRESP = 13
    DISCONNECT = 14


PINGREQ = b"\xc0\x00"  # §3.12
DISCONNECT = b"\xe0\x00"  # §3.14


class BenchError(Exception):
    """A scenario could not run (connection refused, handshake rejected, timeout)."""


# --------------------------------------------------------------------------- encoding


def encode_remaining_length(n: int) -> bytes:
    """Variable byte integer of the fixed header (§2.2.3)."""
    out = bytearray()
    while True:
        byte, n = n % 128, n // 128
        out.append(byte | 0x80 if n else byte)
        if not n:
            return bytes(out)


def _string(s: str) -> bytes:
    raw = s.encode()
    return len(raw).to_bytes(2, "big") + raw  # §1.5.3


def encode_connect(client_id: str, keepalive: int = 60, clean_session: bool = True) -> bytes:
    """CONNECT with protocol level 4, no will, no credentials (§3.1)."""
    flags = 0x02 if clean_session else 0x00
    body = _string("MQTT") + bytes([4, flags]) + keepalive.to_bytes(2, "big") + _string(client_id)
    return bytes([PacketType.CONNECT << 4]) + encode_remaining_length(len(body)) + body


def encode_subscribe(packet_id: int, topic_filter: str, qos: int) -> bytes:
    """SUBSCRIBE with one topic filter; the fixed header flags are 0b0010 (§3.8)."""
    body = packet_id.to_bytes(2, "big") + _string(topic_filter) + bytes([qos])
    return bytes([PacketType.SUBSCRIBE << 4 | 0x02]) + encode_remaining_length(len(body)) + body


def encode_publish(topic: str, payload: bytes, qos: int = 0, packet_id: int = 0) -> bytes:
    """PUBLISH, no DUP, no RETAIN (§3.3)."""
    body = _string(topic) + (packet_id.to_bytes(2, "big") if qos else b"") + payload
    return bytes([PacketType.PUBLISH << 4 | qos << 1]) + encode_remaining_length(len(body)) + body


def publish_prefix(topic: str, qos: int, payload_size: int) -> bytes:
    """Fixed header and topic of a PUBLISH whose payload has ``payload_size`` bytes.

    A QoS 1 packet is then ``prefix + packet_id(2) + payload``; QoS 0 is ``prefix + payload``.
    """
    topic_part = _string(topic)
    length = len(topic_part) + (2 if qos else 0) + payload_size
    return bytes([PacketType.PUBLISH << 4 | qos << 1]) + encode_remaining_length(length) + topic_part


# --------------------------------------------------------------------------- client


class BenchClient(asyncio.Protocol):
    """One MQTT connection; its ``data_received`` counts packets by their fixed headers.

    ``counters[slot]`` mirrors ``received`` so that another task or process can watch the
    delivery progress without touching this object.
    """

    def __init__(
        self,
        counters: Sequence[int] | None = None,
        slot: int = 0,
        latencies: array | None = None,
        latency_from_ns: int = 0,
    ) -> None:
        loop = asyncio.get_running_loop()
        self.loop = loop
        self.transport: asyncio.Transport | None = None
        self.buf = bytearray()
        self.received = 0
        self.acked = 0
        self.inflight = 0
        self.pending = bytearray(PID_SPACE + 1)
        self.pongs = 0
        self.counters = counters
        self.slot = slot
        self.latencies = latencies
        self.latency_from_ns = latency_from_ns
        self.connack: asyncio.Future[int] = loop.create_future()
        self.suback: asyncio.Future[int] = loop.create_future()
        self.closed: asyncio.Future[None] = loop.create_future()
        self.waiter: asyncio.Future[None] | None = None
        self.paused = False

    # asyncio.Protocol -------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # uvloop's is no subclass
        transport.set_write_buffer_limits(high=256 * 1024)

    def connection_lost(self, exc: Exception | None) -> None:
        for fut in (self.connack, self.suback):
            if not fut.done():
                fut.set_exception(BenchError(f"connection lost: {exc}"))
                fut.exception()  # mark retrieved: nobody may be waiting any more
        if not self.closed.done():
            self.closed.set_result(None)
        self.wake()

    def pause_writing(self) -> None:
        self.paused = True

    def resume_writing(self) -> None:
        self.paused = False
        self.wake()

    def data_received(self, data: bytes) -> None:  # noqa: C901 - one flat hot loop on purpose
        if self.buf:
            self.buf += data
            buf: bytes | bytearray = self.buf
        else:
            buf = data
        n = len(buf)
        pos = 0
        received = 0
        acked = 0
        acks: bytearray | None = None
        lat = self.latencies
        now = time.monotonic_ns() if lat is not None else 0
        pending = self.pending
        while n - pos >= 2:
            header = buf[pos]
            b = buf[pos + 1]
            if b < 0x80:
                length = b
                body = pos + 2
            else:  # multi-byte remaining length (§2.2.3)
                length = b & 0x7F
                shift = 7
                i = pos + 2
                while i < n:
                    b = buf[i]
                    i += 1
                    length |= (b & 0x7F) << shift
                    shift += 7
                    if b < 0x80:
                        break
                else:
                    break
                body = i
            end = body + length
            if end > n:
                break
            kind = header >> 4
            if kind == 3:  # PUBLISH
                received += 1
                if header & 0x06 or lat is not None:
                    off = body + 2 + ((buf[body] << 8) | buf[body + 1])
                    if header & 0x06:  # QoS 1: answer with PUBACK (§3.4)
                        if acks is None:
                            acks = bytearray()
                        acks += b"\x40\x02"
                        acks += buf[off:off + 2]
                        off += 2
                    if lat is not None:
                        sent_ns = int.from_bytes(buf[off:off + 8], "big")
                        if sent_ns >= self.latency_from_ns:
                            lat.append(now - sent_ns)
            elif kind == 4:  # PUBACK
                pid = (buf[body] << 8) | buf[body + 1]
                if pending[pid]:
                    pending[pid] = 0
                    acked += 1
            elif kind == 2:  # CONNACK: return code in byte 2 (§3.2.2.3)
                if not self.connack.done():
                    self.connack.set_result(buf[body + 1])
            elif kind == 9:  # SUBACK: granted QoS or 0x80 (§3.9.3)
                if not self.suback.done():
                    self.suback.set_result(buf[end - 1])
            elif kind == 13:  # PINGRESP
                self.pongs += 1
                self.wake()
            pos = end
        if buf is data:
            if pos < n:
                self.buf = bytearray(data[pos:])
        elif pos:
            del self.buf[:pos]
        if received:
            self.received += received
            if self.counters is not None:
                self.counters[self.slot] = self.received  # type: ignore[index]
        if acks is not None and self.transport is not None:
            self.transport.write(acks)
        if acked:
            self.acked += acked
            self.inflight -= acked
            self.wake()

    # helpers ----------------------------------------------------------------------
    def wake(self) -> None:
        """Release whoever awaits ``wait()`` (window room, drain, pong, or stop)."""
        waiter = self.waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def wait(self, timeout: float = 0.1) -> None:
        """Wait until woken, or at most ``timeout`` seconds."""
        self.waiter = fut = self.loop.create_future()
        handle = self.loop.call_later(timeout, self.wake)
        try:
            await fut
        finally:
            handle.cancel()
            self.waiter = None

    def write(self, data: bytes | bytearray) -> None:
        if self.transport is None or self.transport.is_closing():
            raise BenchError("connection closed")
        self.transport.write(data)

    async def subscribe(self, topic_filter: str, qos: int) -> None:
        self.write(encode_subscribe(1, topic_filter, qos))
        granted = await asyncio.wait_for(self.suback, CONNECT_TIMEOUT)
        if granted == 0x80:
            raise BenchError(f"subscription to {topic_filter!r} refused")

    async def close(self) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.write(DISCONNECT)
            self.transport.close()
        try:
            await asyncio.wait_for(self.closed, 2.0)
        except (TimeoutError, BenchError):
            if self.transport is not None:
                self.transport.abort()


async def connect(
    host: str,
    port: int,
    client_id: str,
    keepalive: int = 60,
    **client_kwargs: Any,
) -> BenchClient:
    """Open a TCP connection and complete the CONNECT/CONNACK handshake."""
    loop = asyncio.get_running_loop()
    _, client = await asyncio.wait_for(
        loop.create_connection(lambda: BenchClient(**client_kwargs), host, port), CONNECT_TIMEOUT
    )
    client.write(encode_connect(client_id, keepalive))
    code = await asyncio.wait_for(client.connack, CONNECT_TIMEOUT)
    if code != 0:
        client.transport.abort()  # type: ignore[union-attr]
        raise BenchError(f"CONNACK return code {code}")
    return client


# --------------------------------------------------------------------------- flow control


@dataclass
class Flow:
    """State shared by the publishers of one run: stop flag, sent count, lag control.

    Lag is counted in deliveries: ``sent × fanout − delivered``. When it stays above the
    limit with no delivery progress for ``stall_s``, the outstanding messages are written off
    as dropped by the broker (QoS 0 allows that) and publishing resumes.
    """

    counters: Sequence[int]
    fanout: int
    max_lag: int
    stall_s: float = 0.5
    stop: bool = False
    sent: int = 0
    written_off: int = 0
    last_delivered: int = 0
    last_progress: float = field(default_factory=time.monotonic)
    clients: list[BenchClient] = field(default_factory=list)

    def delivered(self) -> int:
        return sum(self.counters)

    def over_lag(self) -> bool:
        delivered = self.delivered()
        lag = self.sent * self.fanout - self.written_off - delivered
        if lag <= self.max_lag * self.fanout:
            return False
        now = time.monotonic()
        if delivered != self.last_delivered:
            self.last_delivered = delivered
            self.last_progress = now
        elif now - self.last_progress > self.stall_s:
            self.written_off += lag
            self.last_progress = now
            return False
        return True

    def halt(self) -> None:
        self.stop = True
        for client in self.clients:
            client.wake()


async def publish_qos0(client: BenchClient, packet: bytes, batch: int, flow: Flow) -> None:
    """Flood with pre-encoded QoS 0 packets, ``batch`` per write, within the lag limit."""
    chunk = packet * batch
    while not flow.stop:
        if client.paused:
            await client.wait()
        elif flow.over_lag():
            await asyncio.sleep(0.001)
        else:
            client.write(chunk)
            flow.sent += batch
            await asyncio.sleep(0)


def qos1_packets(topic: str, payload: bytes) -> list[bytes]:
    """Every QoS 1 packet of a publisher, pre-encoded, indexed by packet identifier."""
    prefix = publish_prefix(topic, 1, len(payload))
    return [b""] + [prefix + pid.to_bytes(2, "big") + payload for pid in range(1, PID_SPACE + 1)]


async def publish_qos1(
    client: BenchClient, packets: list[bytes], window: int, flow: Flow, batch: int = 64
) -> None:
    """Publish at QoS 1 keeping at most ``window`` messages unacknowledged."""
    pending = client.pending
    pid = 0
    while not flow.stop:
        room = min(window - client.inflight, batch)
        if room <= 0 or client.paused:
            await client.wait()
            continue
        if flow.over_lag():
            await asyncio.sleep(0.001)
            continue
        parts = []
        for _ in range(room):
            nxt = pid % PID_SPACE + 1
            if pending[nxt]:
                break
            pid = nxt
            pending[pid] = 1
            parts.append(packets[pid])
        if not parts:
            await client.wait()
            continue
        client.inflight += len(parts)
        client.write(b"".join(parts))
        flow.sent += len(parts)
        await asyncio.sleep(0)


async def publish_paced(
    client: BenchClient,
    topic: str,
    payload_size: int,
    qos: int,
    rate: float,
    window: int,
    flow: Flow,
    tick_s: float = 0.001,
) -> None:
    """Publish ``rate`` msg/s, each payload starting with its send time (monotonic ns)."""
    prefix = publish_prefix(topic, qos, payload_size)
    filler = b"\x00" * (payload_size - 8)
    pending = client.pending
    pid = 0
    start = time.monotonic()
    while not flow.stop:
        due = int((time.monotonic() - start) * rate) - flow.sent
        if due <= 0 or client.paused:
            await asyncio.sleep(tick_s)
            continue
        if qos:
            due = min(due, window - client.inflight)
            if due <= 0:
                await client.wait()
                continue
        parts = []
        stamp = time.monotonic_ns().to_bytes(8, "big")
        for _ in range(due):
            if qos:
                nxt = pid % PID_SPACE + 1
                if pending[nxt]:
                    break
                pid = nxt
                pending[pid] = 1
                parts.append(prefix + pid.to_bytes(2, "big") + stamp + filler)
            else:
                parts.append(prefix + stamp + filler)
        if qos:
            client.inflight += len(parts)
        client.write(b"".join(parts))
        flow.sent += len(parts)
        await asyncio.sleep(tick_s)


# --------------------------------------------------------------------------- subscribers


@dataclass
class SubscriberPlan:
    """What the subscriber side of a run does; picklable for ``--split``."""

    host: str
    port: int
    topic: str
    qos: int
    count: int
    deadline: float
    """time.monotonic() after which the subscribers stop whatever happens."""
    latency_from_ns: int = -1
    """Record latencies of messages sent at or after this monotonic ns; -1: no latencies."""
    run_id: str = ""


async def run_subscribers(
    plan: SubscriberPlan,
    counters: Sequence[int],
    on_ready: Callable[[], None],
    should_stop: Callable[[], bool],
) -> dict[str, Any]:
    """Connect and subscribe ``plan.count`` clients, count until told to stop."""
    latencies = array("q") if plan.latency_from_ns >= 0 else None
    clients = [
        await connect(
            plan.host, plan.port, f"sub-{plan.run_id}-{i}",
            counters=counters, slot=i, latencies=latencies,
            latency_from_ns=max(plan.latency_from_ns, 0),
        )
        for i in range(plan.count)
    ]
    try:
        for client in clients:
            await client.subscribe(plan.topic, plan.qos)
        on_ready()
        while not should_stop() and time.monotonic() < plan.deadline:
            await asyncio.sleep(0.02)
    finally:
        await asyncio.gather(*(c.close() for c in clients), return_exceptions=True)
    return latency_summary(latencies) if latencies is not None else {}


def _subscriber_process(
    plan: SubscriberPlan, counters: Sequence[int], ready: Any, stop: Any, results: Any
) -> None:
    """Entry point of the ``--split`` child process."""
    try:
        summary = run_loop(run_subscribers(plan, counters, ready.set, stop.is_set))
        results.send({"ok": True, **summary})
    except Exception as exc:  # reported to the parent, which fails the run
        results.send({"ok": False, "error": f"{type(exc).__name__}: {exc}"})


def latency_summary(samples: array) -> dict[str, Any]:
    """Percentiles in milliseconds of latency samples in nanoseconds."""
    if not samples:
        return {"samples": 0}
    ordered = sorted(samples)

    def pct(p: float) -> float:
        return ordered[min(len(ordered) - 1, int(p / 100 * len(ordered)))] / 1e6

    return {
        "samples": len(ordered),
        "p50_ms": pct(50),
        "p99_ms": pct(99),
        "p999_ms": pct(99.9),
        "max_ms": ordered[-1] / 1e6,
    }


class SubscriberSide:
    """The subscribers of a run, in this event loop or in a child process (``split``)."""

    def __init__(self, plan: SubscriberPlan, split: bool) -> None:
        self.plan = plan
        self.split = split
        self.counters = RawArray("Q", plan.count)
        self._task: asyncio.Task[dict[str, Any]] | None = None
        self._ready = asyncio.Event()
        self._stop = False
        if split:
            ctx = mp.get_context("spawn")
            self._mp_ready = ctx.Event()
            self._mp_stop = ctx.Event()
            self._parent_end, child_end = ctx.Pipe(duplex=False)
            self._process = ctx.Process(
                target=_subscriber_process,
                args=(plan, self.counters, self._mp_ready, self._mp_stop, child_end),
                daemon=True,
            )

    async def start(self) -> None:
        if self.split:
            self._process.start()
            while not self._mp_ready.is_set():
                if not self._process.is_alive() or time.monotonic() > self.plan.deadline:
                    raise BenchError(f"subscribers did not start: {self._receive()}")
                await asyncio.sleep(0.01)
        else:
            self._task = asyncio.ensure_future(
                run_subscribers(self.plan, self.counters, self._ready.set, lambda: self._stop)
            )
            ready = asyncio.ensure_future(self._ready.wait())
            await asyncio.wait({self._task, ready}, return_when=asyncio.FIRST_COMPLETED)
            ready.cancel()
            if self._task.done():
                self._task.result()  # raises the connection error
                raise BenchError("subscribers ended early")

    def _receive(self, timeout: float = 0.0) -> dict[str, Any]:
        if self._parent_end.poll(timeout):
            return self._parent_end.recv()
        return {"ok": False, "error": "no result from subscriber process"}

    async def finish(self) -> dict[str, Any]:
        if self.split:
            self._mp_stop.set()
            result = await asyncio.get_running_loop().run_in_executor(None, self._receive, 10.0)
            self._process.join(5)
            if self._process.is_alive():
                self._process.kill()
            if not result.pop("ok", False):
                raise BenchError(result.get("error", "subscriber process failed"))
            return result
        self._stop = True
        assert self._task is not None
        return await asyncio.wait_for(self._task, 10)


# --------------------------------------------------------------------------- /proc readings


def _descendants(pid: int) -> list[int]:
    found = [pid]
    for p in found:
        try:
            for task in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{task}/children") as fh:
                    found.extend(int(c) for c in fh.read().split())
        except OSError:
            pass
    return found


def tree_rss_bytes(pid: int) -> int:
    """Resident set size of a process and its descendants (VmRSS in /proc/PID/status)."""
    total = 0
    for p in _descendants(pid):
        try:
            with open(f"/proc/{p}/status") as fh:
                for line in fh:
                    if line.startswith("VmRSS:"):
                        total += int(line.split()[1]) * 1024
                        break
        except OSError:
            pass
    return total


def tree_cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process and its descendants (/proc/PID/stat)."""
    ticks = 0
    for p in _descendants(pid):
        try:
            with open(f"/proc/{p}/stat") as fh:
                fields = fh.read().rsplit(")", 1)[1].split()
            ticks += int(fields[11]) + int(fields[12])  # utime, stime (proc(5) fields 14, 15)
        except (OSError, IndexError, ValueError):
            pass
    return ticks / os.sysconf("SC_CLK_TCK")


def system_busy_seconds() -> float:
    """CPU time all cores spent busy since boot (first line of /proc/stat, proc(5))."""
    try:
        with open("/proc/stat") as fh:
            values = [int(v) for v in fh.readline().split()[1:]]
    except (OSError, ValueError):
        return 0.0
    # user nice system idle iowait irq softirq steal ...: all but idle and iowait are busy
    return (sum(values[:8]) - values[3] - values[4]) / os.sysconf("SC_CLK_TCK")


class CpuMeter:
    """CPU share (1.0 = one core) of the broker, the generator and everything else.

    ``other_cpu`` is what the rest of the machine used meanwhile: a benchmark sharing its
    cores with other work is not worth much, and this says how much there was.
    """

    def __init__(self, broker_pid: int | None) -> None:
        self.broker_pid = broker_pid
        self.start()

    def _read(self) -> tuple[float, float, float, float]:
        broker = tree_cpu_seconds(self.broker_pid) if self.broker_pid else 0.0
        return time.monotonic(), broker, tree_cpu_seconds(os.getpid()), system_busy_seconds()

    def start(self) -> None:
        self._t0 = self._read()

    def stop(self) -> dict[str, float]:
        t1 = self._read()
        wall = max(t1[0] - self._t0[0], 1e-9)
        broker, generator, system = ((t1[i] - self._t0[i]) / wall for i in (1, 2, 3))
        out = {"generator_cpu": round(generator, 3)}
        if self.broker_pid:
            out["broker_cpu"] = round(broker, 3)
            out["other_cpu"] = round(max(system - broker - generator, 0.0), 3)
        return out


def raise_fd_limit(wanted: int) -> int:
    """Raise the soft RLIMIT_NOFILE towards ``wanted`` (capped by the hard limit)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
    if soft != resource.RLIM_INFINITY and soft < target:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        return target
    return soft


# --------------------------------------------------------------------------- modes


async def mode_throughput(args: argparse.Namespace) -> dict[str, Any]:
    run_id = secrets.token_hex(4)
    topic = f"bench/{run_id}/t"
    payload = b"x" * args.payload
    budget = args.warmup + args.duration + 30.0
    plan = SubscriberPlan(
        args.sub_host or args.host, args.sub_port or args.port, topic, args.qos, args.subscribers,
        deadline=time.monotonic() + budget, run_id=run_id,
    )
    subs = SubscriberSide(plan, args.split)
    await subs.start()
    flow = Flow(subs.counters, fanout=args.subscribers,
                max_lag=args.max_lag or (10_000 if args.qos == 0 else 500))
    pubs = [await connect(args.host, args.port, f"pub-{run_id}-{i}")
            for i in range(args.publishers)]
    flow.clients = pubs
    if args.qos == 0:
        packet = encode_publish(topic, payload, 0)
        tasks = [asyncio.ensure_future(publish_qos0(c, packet, args.batch, flow)) for c in pubs]
    else:
        tasks = [
            asyncio.ensure_future(
                publish_qos1(c, qos1_packets(topic, payload), args.window, flow, args.batch)
            )
            for c in pubs
        ]
    try:
        await _sleep_watching(tasks, args.warmup)
        d0, t0 = flow.delivered(), time.monotonic()
        s0, a0 = flow.sent, sum(c.acked for c in pubs)
        cpu = CpuMeter(args.broker_pid)
        await _sleep_watching(tasks, args.duration)
        d1, t1 = flow.delivered(), time.monotonic()
        s1, a1 = flow.sent, sum(c.acked for c in pubs)
        usage = cpu.stop()
    finally:
        flow.halt()
        await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 10)
        await asyncio.gather(*(c.close() for c in pubs), return_exceptions=True)
        await subs.finish()
    elapsed = t1 - t0
    result = {
        "mode": "throughput",
        "qos": args.qos,
        "publishers": args.publishers,
        "subscribers": args.subscribers,
        "elapsed_s": round(elapsed, 3),
        "delivered": d1 - d0,
        "rate": round((d1 - d0) / elapsed, 1),
        "published_rate": round((s1 - s0) / elapsed, 1),
        "written_off": flow.written_off,
        **usage,
    }
    if args.qos:
        result["acked_rate"] = round((a1 - a0) / elapsed, 1)
    return result


async def _sleep_watching(tasks: list[asyncio.Task[None]], seconds: float) -> None:
    """Sleep, but fail at once if a publisher task dies."""
    done, _ = await asyncio.wait(tasks, timeout=seconds, return_when=asyncio.FIRST_COMPLETED)
    for task in done:
        task.result()
        raise BenchError("publisher stopped early")


async def mode_latency(args: argparse.Namespace) -> dict[str, Any]:
    if args.payload < 8:
        raise BenchError("latency needs a payload of at least 8 bytes")
    run_id = secrets.token_hex(4)
    topic = f"bench/{run_id}/lat"
    budget = args.warmup + args.duration + 30.0
    # The measured window starts at a planned instant (connection set-up + warm-up), fixed in
    # advance so that a subscriber in a child process knows it too.
    plan = SubscriberPlan(
        args.sub_host or args.host, args.sub_port or args.port, topic, args.qos, 1, deadline=time.monotonic() + budget,
        latency_from_ns=time.monotonic_ns() + int((args.warmup + 2.0) * 1e9), run_id=run_id,
    )
    subs = SubscriberSide(plan, args.split)
    await subs.start()
    flow = Flow(subs.counters, fanout=1, max_lag=args.max_lag or 1_000_000)
    pub = await connect(args.host, args.port, f"pub-{run_id}")
    flow.clients = [pub]
    task = asyncio.ensure_future(
        publish_paced(pub, topic, args.payload, args.qos, args.rate, args.window, flow)
    )
    try:
        # measure from the planned start for a fixed duration
        wait = (plan.latency_from_ns - time.monotonic_ns()) / 1e9
        await _sleep_watching([task], max(wait, 0.0))
        s0, d0 = flow.sent, flow.delivered()
        cpu = CpuMeter(args.broker_pid)
        await _sleep_watching([task], args.duration)
        s1, d1 = flow.sent, flow.delivered()
        usage = cpu.stop()
    finally:
        flow.halt()
        await asyncio.wait_for(asyncio.gather(task, return_exceptions=True), 10)
        await asyncio.sleep(0.5)  # let the messages still in flight arrive
        await pub.close()
        summary = await subs.finish()
    return {
        "mode": "latency",
        "qos": args.qos,
        "target_rate": args.rate,
        "published_rate": round((s1 - s0) / args.duration, 1),
        "delivered_rate": round((d1 - d0) / args.duration, 1),
        **summary,
        **usage,
    }


async def mode_idle(args: argparse.Namespace) -> dict[str, Any]:
    if not args.broker_pid:
        raise BenchError("idle needs --broker-pid")
    raise_fd_limit(args.connections + 256)
    run_id = secrets.token_hex(4)
    await asyncio.sleep(args.settle)
    rss_before = tree_rss_bytes(args.broker_pid)
    gate = asyncio.Semaphore(args.concurrency)
    deadline = time.monotonic() + args.timeout
    counter = itertools.count()

    async def one(i: int) -> BenchClient | None:
        async with gate:
            for _ in range(3):
                if time.monotonic() > deadline:
                    return None
                try:
                    return await connect(args.host, args.port, f"idle-{run_id}-{i}", keepalive=600)
                except (OSError, TimeoutError, BenchError):
                    next(counter)
                    await asyncio.sleep(0.1)
            return None

    t0 = time.monotonic()
    results = await asyncio.gather(*(one(i) for i in range(args.connections)))
    clients = [c for c in results if c is not None]
    connect_s = time.monotonic() - t0
    try:
        # prove every connection is alive: PINGREQ each, await every PINGRESP (§3.12, §3.13)
        for c in clients:
            c.write(PINGREQ)
        ping_deadline = time.monotonic() + 30
        while time.monotonic() < ping_deadline and any(c.pongs == 0 for c in clients):
            await asyncio.sleep(0.05)
        alive = sum(1 for c in clients if c.pongs > 0)
        await asyncio.sleep(args.settle)
        rss_after = tree_rss_bytes(args.broker_pid)
    finally:
        for c in clients:
            if c.transport is not None:
                c.transport.abort()
    return {
        "mode": "idle",
        "requested": args.connections,
        "connected": len(clients),
        "alive": alive,
        "retries": next(counter),
        "connect_s": round(connect_s, 2),
        "rss_before": rss_before,
        "rss_after": rss_after,
        "bytes_per_connection": round((rss_after - rss_before) / max(len(clients), 1)),
    }


def run_loop(coro: Coroutine[Any, Any, Any]) -> Any:
    """Run a coroutine on uvloop when it is installed, else on the default loop."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    return uvloop.run(coro)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="mode", required=True)

    def common(p: argparse.ArgumentParser) -> None:
        p.add_argument("--host", default="127.0.0.1")
        p.add_argument("--port", type=int, default=1883)
        p.add_argument("--broker-pid", type=int, help="read the broker's CPU and RSS in /proc")
        p.add_argument("--sub-host", default="",
                       help="subscribers connect here (default --host): another cluster node")
        p.add_argument("--sub-port", type=int, default=0, help="subscribers' port (default --port)")

    def flow(p: argparse.ArgumentParser) -> None:
        p.add_argument("--qos", type=int, choices=(0, 1), default=0)
        p.add_argument("--payload", type=int, default=64, help="payload bytes")
        p.add_argument("--duration", type=float, default=5.0, help="measured seconds")
        p.add_argument("--warmup", type=float, default=1.0, help="seconds before measuring")
        p.add_argument("--window", type=int, default=100, help="QoS 1 in-flight per publisher")
        p.add_argument("--max-lag", type=int, default=0,
                       help="max undelivered messages before publishers wait "
                            "(default 10000 at QoS 0, 500 at QoS 1)")
        p.add_argument("--split", action="store_true",
                       help="run the subscribers in a separate process")

    tp = sub.add_parser("throughput", help="P publishers -> one topic -> S subscribers")
    common(tp)
    flow(tp)
    tp.add_argument("--publishers", type=int, default=1)
    tp.add_argument("--subscribers", type=int, default=1)
    tp.add_argument("--batch", type=int, default=128, help="packets per write")

    lat = sub.add_parser("latency", help="fixed-rate publisher, latency at the subscriber")
    common(lat)
    flow(lat)
    lat.add_argument("--rate", type=float, default=5000.0, help="messages per second")
    lat.set_defaults(qos=1)

    idle = sub.add_parser("idle", help="N idle connections, broker RSS per connection")
    common(idle)
    idle.add_argument("--connections", type=int, default=5000)
    idle.add_argument("--concurrency", type=int, default=64, help="connects in flight")
    idle.add_argument("--settle", type=float, default=1.0, help="seconds before each RSS read")
    idle.add_argument("--timeout", type=float, default=120.0, help="give up connecting after")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    mode = {"throughput": mode_throughput, "latency": mode_latency, "idle": mode_idle}[args.mode]
    try:
        result = run_loop(mode(args))
    except (BenchError, OSError, TimeoutError) as exc:
        print(json.dumps({"mode": args.mode, "error": f"{type(exc).__name__}: {exc}"}))
        return 1
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
