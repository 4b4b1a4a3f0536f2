"""Delayed delivery in the core (core/delayed.py): what a publish asks for, the delay headers
removed from what is held, and a cluster's shared hold acknowledging the publish (its receipt
is what `Broker.publish` and `publish_many` return)."""

from __future__ import annotations

import asyncio

import pytest
from shardgate.core.broker import Broker
from shardgate.core.delayed import deliver_at
from shardgate.core.errors import PublishRejected
from shardgate.core.message import Message, now_ms


class Kept:
    """A SharedHold that keeps what it is given, its receipts resolved by the test."""

    def __init__(self) -> None:
        self.held: list[tuple[Message, int, asyncio.Future[None]]] = []

    def hold(self, message: Message, at_ms: int) -> asyncio.Future[None]:
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.held.append((message, at_ms, done))
        return done

    def __len__(self) -> int:
        return len(self.held)

    async def finish(self) -> None:
        pass

    def close(self) -> None:
        pass


def test_deliver_at_reads_the_topic_prefix_and_the_headers() -> None:
    message = Message("$delayed/5/jobs/a", b"x", publish_time_ms=1_000)
    assert deliver_at(message) == 6_000 and message.topic == "jobs/a"
    assert deliver_at(Message("t", b"", headers=[("x-delay", "250")], publish_time_ms=1_000)) == 1_250
    assert deliver_at(Message("t", b"", headers=[("x-deliver-at", "9000")])) == 9_000
    assert deliver_at(Message("t", b"")) is None
    with pytest.raises(PublishRejected, match="integer"):
        deliver_at(Message("t", b"", headers=[("x-delay", "soon")]))
    with pytest.raises(PublishRejected, match=r"\$delayed/<seconds>/<topic>"):
        deliver_at(Message("$delayed/x/t", b""))


async def test_a_held_message_loses_its_delay_headers_and_its_publish_waits_for_the_shared_hold() -> None:
    broker = Broker()
    kept = Kept()
    broker.delayed.shared = kept
    due = now_ms() + 60_000
    held = Message("jobs/a", b"later", headers=[("x-deliver-at", str(due)), ("keep", "me")])
    receipt = broker.publish(held)
    assert receipt is kept.held[0][2] and not receipt.done()  # acknowledged once kept
    assert kept.held[0][0].headers == [("keep", "me")] and kept.held[0][1] == due
    outcomes = broker.publish_many([Message("jobs/b", b"now"),
                                    Message("$delayed/30/jobs/c", b"later too")])
    assert outcomes[0] is None and outcomes[1] is kept.held[1][2]
    stream = broker.stream_for_topic("jobs/a")
    # only the one not held was taken into its shard
    assert sum(shard.next_offset for shard in stream.shards) == 1
    assert len(broker.delayed) == 2
