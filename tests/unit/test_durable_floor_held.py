"""A live durable cursor's retention floor never moves it past a message the broker still
holds for its commit.

The floor of a live cursor with nothing in hand moves its position up to the log's
deliverable end (`ShardCursor.retention_floor`, called by the node's retention pass and by a
cluster node's floor reports). On a replicated shard the deliverable end is the high
watermark, which passes a commit group record by record, and a group is dispatched live only
once all of it is committed, in its commit callback a loop turn later. A floor taken in
between moved the cursor past the held messages, and their live offer then counted as
already delivered: every durable subscription of the leader's node (MQTT persistent
sessions, AMQP queues, gRPC durable subscriptions) lost acknowledged messages (the chaos
bench at 3 replicas, issue 28).

Real journals and the leader's `ReplicatedShardLog` under the core's `Broker`; the follower's
fetches are made by hand, so the high watermark moves exactly where each test needs it."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from shardgate.core.broker import Broker
from shardgate.core.durable import DurableSubscription
from shardgate.core.message import Message
from shardgate.core.streams import StreamConfig
from shardgate.storage.journal import JournalShardLog, JournalStorage
from shardgate.storage.metadata import SqliteMetadataStore

from shardgate.cluster.floors import CursorFloors
from shardgate.cluster.replica_epochs import FetchRequest
from shardgate.cluster.replica_leader import LeaderReplica
from shardgate.cluster.replica_log import ReplicatedShardLog
from shardgate.cluster.settings import ClusterSettings
from shardgate.persistence import Persistence


class OneShardStorage:
    """The broker's storage: the leader's replicated log for shard 0 of stream `s`."""

    def __init__(self, shard_log: ReplicatedShardLog) -> None:
        self.shard_log = shard_log

    def open_shard(self, stream: str, shard: int) -> ReplicatedShardLog:
        assert (stream, shard) == ("s", 0)
        return self.shard_log

    def list_shards(self) -> list[tuple[str, int]]:
        return [("s", 0)]

    def delete_shard(self, stream: str, shard: int) -> None:
        raise AssertionError("not in these tests")

    async def flush(self) -> None:
        await self.shard_log.log.flush()

    def close(self) -> None:
        pass


class AckingConsumer:
    """A consumer that acknowledges each message as it comes: its cursor stays live with
    nothing in hand."""

    consumer_id = "acking"
    available = True

    def __init__(self) -> None:
        self.got: list[int] = []

    def deliver(self, message: Message, subscription: Any, filters: tuple[str, ...]) -> None:
        self.got.append(message.offset)
        subscription.ack(message)


class Leader:
    """Node a leads shard s/0 (replicas a and b, both needed to acknowledge); b's fetches are
    made by hand (`fetched`)."""

    def __init__(self, tmp_path: Path) -> None:
        self.journal = JournalStorage(tmp_path / "a")
        self.log: JournalShardLog = self.journal.open_shard("s", 0)
        self.replicated = ReplicatedShardLog(self.log, time.monotonic, "a:s/0")
        self.leader: LeaderReplica[asyncio.Future[None]] = LeaderReplica(
            "a", 1, ("a", "b"), ("a", "b"), min_insync=2, lag_time_max_s=30.0,
            history=self.log.leader_epochs, log_end=0, durable_end=0, high_watermark=0,
            now=time.monotonic())
        self.replicated.lead(self.leader)
        self.broker = Broker(storage=OneShardStorage(self.replicated),  # type: ignore[arg-type]
                             default_stream=StreamConfig("s", mode="reliable"))
        self.sub = self.broker.durable_subscription("kept")
        assert isinstance(self.sub, DurableSubscription)
        self.broker.add_filter(self.sub, "t/#")
        self.consumer = AckingConsumer()
        self.broker.attach(self.sub, self.consumer)

    async def durable_here(self) -> None:
        """The leader's own journal holds everything appended."""
        await self.log.flush()
        deadline = time.monotonic() + 10
        while self.leader.durable_end < self.log.next_offset:
            assert time.monotonic() < deadline, "the leader's journal did not catch up"
            await asyncio.sleep(0.005)

    def fetched(self, end: int) -> None:
        """b holds every record below `end` (it fetched them before, and says so now)."""
        answer = self.replicated.serve_fetch(FetchRequest("b", 1, end, end))
        assert isinstance(answer, tuple), answer

    async def first_message_delivered(self) -> None:
        """One message committed and taken live: the cursor exists, live, nothing in hand."""
        future = self.broker.publish(Message("t/0", b"first"))
        assert future is not None
        await self.durable_here()
        self.fetched(1)
        await asyncio.wait_for(future, 10)
        cursor = self.sub.cursors[("s", 0)]
        assert self.consumer.got == [0] and cursor.live and not cursor.unacked

    def close(self) -> None:
        self.journal.close()


@pytest.fixture
async def leader(tmp_path: Path) -> AsyncIterator[Leader]:
    made = Leader(tmp_path)
    yield made
    made.close()


def retention_pass(broker: Broker, tmp_path: Path) -> None:
    """The node's retention pass computes what each cursor still needs (`needed_offsets`)."""
    store = SqliteMetadataStore(tmp_path / "meta.db")
    try:
        Persistence(broker, store).needed_offsets()
    finally:
        store.close()


async def test_a_retention_pass_while_the_high_watermark_is_inside_a_held_group(
    leader: Leader, tmp_path: Path,
) -> None:
    await leader.first_message_delivered()
    # two messages in one append: one commit group, held until all of it is committed
    outcomes = leader.broker.publish_many([Message("t/1", b"one"), Message("t/2", b"two")])
    future = outcomes[0]
    assert isinstance(future, asyncio.Future) and outcomes[1] is future
    await leader.durable_here()
    leader.fetched(2)  # b holds offset 1, not 2: the high watermark is inside the group
    assert leader.replicated.deliverable_end == 2 and not future.done()
    retention_pass(leader.broker, tmp_path)
    assert leader.sub.cursors[("s", 0)].position == 1  # not past the held message
    leader.fetched(3)
    await asyncio.wait_for(future, 10)
    assert leader.consumer.got == [0, 1, 2]


async def test_a_retention_pass_between_the_commit_and_its_dispatch(
    leader: Leader, tmp_path: Path,
) -> None:
    await leader.first_message_delivered()
    future = leader.broker.publish(Message("t/1", b"one"))
    assert future is not None
    await leader.durable_here()
    leader.fetched(2)  # committed: the group goes out when its callback runs, a turn later
    assert leader.replicated.deliverable_end == 2 and leader.consumer.got == [0]
    retention_pass(leader.broker, tmp_path)
    await asyncio.wait_for(future, 10)
    assert leader.consumer.got == [0, 1]


class View:
    def nodes(self) -> dict[str, Any]:
        return {"a": None, "b": None}

    def leader(self, stream: str, shard: int) -> Any:
        class Assignment:
            leader = "a"
            replicas = ("a", "b")
        return Assignment()


class Node:
    node_id = "a"
    is_controller = False

    def __init__(self) -> None:
        self.settings = ClusterSettings()
        self.view = View()


async def test_a_cluster_floor_report_between_the_commit_and_its_dispatch(leader: Leader) -> None:
    await leader.first_message_delivered()
    future = leader.broker.publish(Message("t/1", b"one"))
    assert future is not None
    await leader.durable_here()
    leader.fetched(2)
    floors = CursorFloors(Node(), leader.broker)  # type: ignore[arg-type]
    assert floors.local_floors() == {"s/0": 1}  # the held message is still needed
    await asyncio.wait_for(future, 10)
    assert leader.consumer.got == [0, 1]
