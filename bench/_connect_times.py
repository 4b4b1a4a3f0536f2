"""Where a client's CONNECT → CONNACK went, from the client's socket to the broker and back.

The soak's clients (`bench/soak.py`) read the CONNACK's arrival time from the kernel
(``SO_TIMESTAMPNS``: when the segment reached the client's socket), beside when their own
process read it, so that a client process that was busy elsewhere (the generator's event loop,
or any process waiting for a CPU on a loaded machine) is not counted as the broker's time. With
``--trace`` the broker started by the soak records, per connection, when it accepted the
socket, made its transport, first read it and wrote the CONNACK
(`bench/connect_trace/sitecustomize.py`); every timestamp on both sides is
``CLOCK_MONOTONIC``, so `breakdown` joins them by the client's address and splits each
client's span into consecutive parts that add up to it.

Imports nothing from shardgate.
"""

from __future__ import annotations

import asyncio
import json
import socket
import struct
import time
from collections.abc import Iterable
from pathlib import Path

# SO_TIMESTAMPNS (and its control message SCM_TIMESTAMPNS) on Linux; Python does not name it.
SO_TIMESTAMPNS = getattr(socket, "SO_TIMESTAMPNS", 35)
STAMP_SPACE = socket.CMSG_SPACE(16)


def stamp_arrivals(sock: socket.socket, on: bool = True) -> None:
    """Have the kernel stamp every segment `sock` receives (read with `recvmsg`)."""
    sock.setsockopt(socket.SOL_SOCKET, SO_TIMESTAMPNS, int(on))


def arrival_monotonic(ancdata: Iterable[tuple[int, int, bytes]]) -> float | None:
    """The kernel's arrival stamp of a `recvmsg` (CLOCK_REALTIME) on the CLOCK_MONOTONIC scale."""
    for level, kind, data in ancdata:
        if level == socket.SOL_SOCKET and kind == SO_TIMESTAMPNS and len(data) >= 16:
            seconds, nanoseconds = struct.unpack_from("@qq", data)
            offset = time.clock_gettime_ns(time.CLOCK_REALTIME) - time.monotonic_ns()
            return (seconds * 1_000_000_000 + nanoseconds - offset) / 1e9
    return None


def packet_length(buffer: bytes | bytearray) -> int:
    """Length of the whole MQTT packet at the start of `buffer`, 0 while its header is incomplete."""
    multiplier, length = 1, 0
    for pos in range(1, min(len(buffer), 5)):
        byte = buffer[pos]
        length += (byte & 0x7F) * multiplier
        if not byte & 0x80:
            return 1 + pos + length
        multiplier *= 128
    return 0


def recv_packet_blocking(sock: socket.socket) -> tuple[bytes, float | None]:
    """Read (blocking) until a whole packet is in; returns what was read and the kernel's arrival
    time of its first segment."""
    buffer = bytearray()
    arrived: float | None = None
    while True:
        data, ancdata, _flags, _address = sock.recvmsg(1 << 16, STAMP_SPACE)
        if not data:
            raise ConnectionError("closed before a whole packet")
        if arrived is None:
            arrived = arrival_monotonic(ancdata)
        buffer += data
        need = packet_length(buffer)
        if need and len(buffer) >= need:
            return bytes(buffer), arrived


async def recv_packet(sock: socket.socket) -> tuple[bytes, float | None]:
    """As `recv_packet_blocking`, on the running loop (a non-blocking socket)."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future[tuple[bytes, float | None]] = loop.create_future()
    buffer = bytearray()
    arrived: list[float | None] = []

    def readable() -> None:
        try:
            data, ancdata, _flags, _address = sock.recvmsg(1 << 18, STAMP_SPACE)
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:
            done.set_exception(exc)
            return
        if not data:
            done.set_exception(ConnectionError("closed before a whole packet"))
            return
        if not arrived:
            arrived.append(arrival_monotonic(ancdata))
        buffer.extend(data)
        need = packet_length(buffer)
        if need and len(buffer) >= need:
            done.set_result((bytes(buffer), arrived[0]))

    loop.add_reader(sock.fileno(), readable)
    try:
        return await done
    finally:
        loop.remove_reader(sock.fileno())


# ----------------------------------------------------------------------------- joining
PARTS = (
    ("accept", "CONNECT sent → accepted by the broker"),
    ("transport", "accepted → transport made"),
    ("first_read", "transport made → CONNECT read"),
    ("broker", "CONNECT read → CONNACK written (in the broker)"),
    ("of_which_commit", "  of which the metadata commit wait"),
    ("wire", "CONNACK written → at the client's socket"),
    ("client", "at the client's socket → read by the client process"),
)


def load_trace(path: Path) -> dict[str, list[dict[str, float]]]:
    """The broker's records by client address (`bench/connect_trace/sitecustomize.py`)."""
    by_remote: dict[str, list[dict[str, float]]] = {}
    if not path.exists():
        return by_remote
    for line in path.read_text().splitlines():
        record = json.loads(line)
        by_remote.setdefault(record["remote"], []).append(record)
    return by_remote


def split(client: dict[str, float], broker: dict[str, float]) -> dict[str, float]:
    """Consecutive parts (seconds) of one client's CONNECT → CONNACK; they add up to
    `read - sent` (a part that the client's order of events makes empty is 0)."""
    sent, arrived, read = client["sent"], client["arrived"], client["read"]
    t_accept = max(broker["accepted"] or sent, sent)
    t_made = max(broker["made"] or t_accept, t_accept)
    t_read = max(broker["read"], t_made)
    t_written = max(broker["written"], t_read)
    t_arrived = max(arrived, t_written)
    opened, durable = broker["opened"], broker["durable"]
    return {
        "accept": t_accept - sent, "transport": t_made - t_accept, "first_read": t_read - t_made,
        "broker": t_written - t_read, "of_which_commit": (durable - opened) if durable else 0.0,
        "wire": t_arrived - t_written, "client": max(read, t_arrived) - t_arrived,
        "total": read - sent,
    }


def join(clients: list[dict[str, float]], trace: dict[str, list[dict[str, float]]]) -> list[dict[str, float]]:
    """The split of every client record that has its broker record (same address, read
    within the client's span)."""
    out = []
    for client in clients:
        for broker in trace.get(client["local"], ()):  # type: ignore[call-overload]
            if client["sent"] - 0.5 <= broker["read"] <= client["read"] + 0.5:
                parts = split(client, broker)
                parts["persistent"] = float(bool(client.get("persistent")))
                out.append(parts)
                break
    return out


def quantile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def breakdown_rows(label: str, joined: list[dict[str, float]]) -> list[str]:
    """Markdown rows: each part's p50 / p99, and its mean over the slowest 1 % of clients (what
    the tail is made of)."""
    if not joined:
        return []
    totals = sorted(joined, key=lambda parts: parts["total"])
    tail = totals[int(0.99 * len(totals)):] or totals[-1:]
    rows = [
        f"| {label} ({len(joined):,} joined): CONNECT sent → CONNACK read by the client | "
        f"{quantile([j['total'] for j in joined], 0.5) * 1e3:.1f} / "
        f"{quantile([j['total'] for j in joined], 0.99) * 1e3:.1f} | "
        f"{sum(j['total'] for j in tail) / len(tail) * 1e3:.1f} |"
    ]
    for key, name in PARTS:
        values = [j[key] for j in joined]
        rows.append(f"| {label}: {name} | {quantile(values, 0.5) * 1e3:.1f} / "
                    f"{quantile(values, 0.99) * 1e3:.1f} | "
                    f"{sum(j[key] for j in tail) / len(tail) * 1e3:.1f} |")
    return rows
