"""What the broker counts: messages and bytes in and out (per protocol and per stream), drops
and refusals by reason, and the commit latency of reliable streams. Plain counters, read by the
metrics at scrape time; no logic of its own.
"""

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass, field

from ..storage.interfaces import LatencyHistogram
from .message import Message


@dataclass(slots=True)
class BrokerStats:
    started_at: float = field(default_factory=time.time)
    messages_in: int = 0
    bytes_in: int = 0
    messages_out: int = 0
    bytes_out: int = 0
    messages_dropped: int = 0
    messages_without_subscriber: int = 0
    # Plain dict counters for metrics, read at scrape time: per producer or client protocol
    # ("mqtt", "amqp", "grpc", ...; "" for the broker's own messages) and per stream.
    in_by_protocol: defaultdict[str, int] = field(default_factory=lambda: defaultdict(int))
    bytes_in_by_protocol: defaultdict[str, int] = field(default_factory=lambda: defaultdict(int))
    in_by_stream: defaultdict[str, int] = field(default_factory=lambda: defaultdict(int))
    bytes_in_by_stream: defaultdict[str, int] = field(default_factory=lambda: defaultdict(int))
    out_by_protocol: defaultdict[str, int] = field(default_factory=lambda: defaultdict(int))
    bytes_out_by_protocol: defaultdict[str, int] = field(default_factory=lambda: defaultdict(int))
    out_by_stream: defaultdict[str, int] = field(default_factory=lambda: defaultdict(int))
    bytes_out_by_stream: defaultdict[str, int] = field(default_factory=lambda: defaultdict(int))
    # Drops counted through `drop` (messages_dropped also holds those counted directly).
    dropped_by_reason: defaultdict[str, int] = field(default_factory=lambda: defaultdict(int))
    # Publishes refused before they were stored, by reason ("schema": the payload does not fit
    # its stream's schema).
    rejected_by_reason: defaultdict[str, int] = field(default_factory=lambda: defaultdict(int))
    # Append to durable, once per commit group, from the group's first append (reliable streams).
    commit_latency: LatencyHistogram = field(default_factory=LatencyHistogram)

    def sent(self, protocol: str, message: Message) -> None:
        """Count `message` as delivered to a client over `protocol` (the broker's own `$SYS`
        statistics are not messages: they count neither in nor out)."""
        if message.producer_protocol == "sys":
            return
        size = len(message.payload)
        self.messages_out += 1
        self.bytes_out += size
        self.out_by_protocol[protocol] += 1
        self.bytes_out_by_protocol[protocol] += size
        self.out_by_stream[message.stream] += 1
        self.bytes_out_by_stream[message.stream] += size

    def sent_many(self, protocol: str, stream: str, count: int, size: int) -> None:
        """Count `count` messages of `stream`, `size` bytes in all, as delivered over
        `protocol` (what `sent` counts for each; the caller leaves out `$SYS` statistics)."""
        self.messages_out += count
        self.bytes_out += size
        self.out_by_protocol[protocol] += count
        self.bytes_out_by_protocol[protocol] += size
        self.out_by_stream[stream] += count
        self.bytes_out_by_stream[stream] += size

    def received(self, protocol: str, stream: str, count: int, size: int) -> None:
        """Count `count` messages of `size` bytes in all, taken from `protocol` into `stream`."""
        self.messages_in += count
        self.bytes_in += size
        self.in_by_protocol[protocol] += count
        self.bytes_in_by_protocol[protocol] += size
        self.in_by_stream[stream] += count
        self.bytes_in_by_stream[stream] += size

    def drop(self, reason: str, count: int = 1) -> None:
        """Count `count` messages dropped for `reason` (e.g. "slow_subscriber", "queue_full")."""
        self.messages_dropped += count
        self.dropped_by_reason[reason] += count
