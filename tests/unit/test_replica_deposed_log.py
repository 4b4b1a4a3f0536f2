"""A leader that loses its epoch after appending, with two real journals in one process (node a
led shard s/0 in epoch 1 under the core's `Broker`; node b holds what it fetched, then leads
epoch 2): what a's publishers wait for is kept while a follows b. A publish whose record b
kept is acknowledged once a fetch answer of b says b's high watermark passed it; one whose
record a's log had to cut is refused (retryable: a resend is right); nothing is acknowledged
that b does not hold, nor without b's answer, nor after the deadline; and a's core never
dispatches those messages (b, the new leader, dispatches what it holds)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from shardgate.core.errors import ShardUnavailable
from shardgate.core.message import Message
from shardgate.core.records import decode_to_message
from shardgate.storage.journal import JournalShardLog

from shardgate.cluster.replica_epochs import FetchRequest, Refused, ReplicaError
from shardgate.cluster.replica_follow import FollowerLog, follow
from shardgate.cluster.replica_follower import FollowerReplica
from shardgate.cluster.replica_leader import LeaderReplica
from shardgate.cluster.replica_log import ReplicatedShardLog
from tests.unit.test_replica_log import Pair, wait_for


def payloads(journal_log: JournalShardLog) -> list[bytes]:
    return [decode_to_message(bytes(record.data), "s", 0, record.offset).payload
            for record in journal_log.read(0, 10)]


class Deposed(Pair):
    """a appended "kept" (fetched by b) and "lost" (never fetched), acknowledged neither."""

    def __init__(self, tmp_path: Path) -> None:
        super().__init__(tmp_path)
        self.replicated.hand_off = self.broker.dispatched_elsewhere
        self.kept = self.broker.publish(Message("t/1", b"kept"))
        self.lost: asyncio.Future[None] | None = None
        self.b_log = ReplicatedShardLog(self.logs["b"], time.monotonic, "b:s/0")
        self.a_task: asyncio.Task[None] | None = None

    async def fetched_by_b_then_one_more(self) -> None:
        await self.logs["a"].flush()
        request = self.follower.next_request()
        assert isinstance(request, FetchRequest)
        answer = self.replicated.serve_fetch(request)
        assert not isinstance(answer, Refused)
        self.follower_log.take(*answer)  # b holds "kept"; a has not heard b say so
        await self.logs["b"].flush()
        assert self.logs["b"].committed_offset == 1
        self.lost = self.broker.publish(Message("t/1", b"lost"))
        await self.logs["a"].flush()
        assert self.replicated.high_watermark == 0

    def b_leads(self, isr: tuple[str, ...] = ("b",), replicas: tuple[str, ...] = ("a", "b")) -> None:
        b_leader: LeaderReplica[asyncio.Future[None]] = LeaderReplica(
            "b", 2, replicas, isr, min_insync=1, lag_time_max_s=30.0,
            history=self.logs["b"].leader_epochs, log_end=self.logs["b"].next_offset,
            durable_end=self.logs["b"].committed_offset, high_watermark=0, now=time.monotonic())
        self.b_log.lead(b_leader)
        self.transport.leaders["b"] = self.b_log

    def a_follows_b(self) -> None:
        a_log = self.logs["a"]
        a_follower = FollowerReplica("a", "b", 2, history=a_log.leader_epochs,
                                     log_end=a_log.next_offset, durable_end=a_log.committed_offset,
                                     high_watermark=self.replicated.high_watermark)
        self.a_task = asyncio.get_running_loop().create_task(
            follow(FollowerLog(a_log, a_follower, self.replicated), self.transport, retry_s=0.01))

    async def stop(self) -> None:
        if self.a_task is not None:
            self.a_task.cancel()
            await asyncio.gather(self.a_task, return_exceptions=True)
        await super().stop()


@pytest.fixture
async def deposed(tmp_path: Path) -> AsyncIterator[Deposed]:
    made = Deposed(tmp_path)
    await made.fetched_by_b_then_one_more()
    yield made
    await made.stop()


async def test_what_the_new_leader_kept_is_acknowledged_and_what_it_lacks_is_refused(
        deposed: Deposed) -> None:
    kept, lost = deposed.kept, deposed.lost
    assert kept is not None and lost is not None
    deposed.replicated.depose()  # the placement names b the leader of epoch 2
    assert deposed.replicated.serve_fetch(FetchRequest("b", 1, 1, 1)) == Refused(ReplicaError.NOT_LEADER)
    deposed.b_leads()
    await asyncio.sleep(0.05)
    # b's high watermark passed "kept" already, but a has not heard it from b: nothing yet
    assert deposed.b_log.high_watermark == 1
    assert not kept.done() and not lost.done()
    assert deposed.replicated.deposed_waiting == 2
    deposed.a_follows_b()  # a cuts its log where epoch 1 ends on b (1), then fetches
    with pytest.raises(ShardUnavailable, match="no longer leads"):
        await asyncio.wait_for(lost, 10)  # its record is gone: the client sends it again
    await asyncio.wait_for(kept, 10)  # in the shard for good: acknowledged, not refused
    assert deposed.replicated.deposed_waiting == 0
    assert payloads(deposed.logs["a"]) == [b"kept"]
    assert deposed.logs["a"].read(0, 10) == deposed.logs["b"].read(0, 10)
    # a's core dispatched neither: b dispatches what it holds, as a new leader does
    await asyncio.sleep(0.05)
    assert deposed.recorder.got == []


async def test_nothing_is_acknowledged_before_the_new_leaders_mark_passes_it_and_the_wait_ends(
        deposed: Deposed) -> None:
    kept, lost = deposed.kept, deposed.lost
    assert kept is not None and lost is not None
    deposed.replicated.deposed_wait_s = 0.5
    deposed.replicated.depose()
    # b leads with c in its in-sync set, and c never fetches: b's mark stays where it was
    deposed.b_leads(isr=("b", "c"), replicas=("a", "b", "c"))
    deposed.a_follows_b()
    with pytest.raises(ShardUnavailable):
        await asyncio.wait_for(lost, 10)  # cut at once
    await wait_for(lambda: deposed.logs["a"].committed_offset == 1 and deposed.b_log.leader
                   is not None and deposed.b_log.leader.follower("a").durable_end == 1)
    assert deposed.b_log.high_watermark == 0
    assert not kept.done()
    await asyncio.sleep(0.5)
    deposed.replicated.tick()  # (the replica manager's tick)
    with pytest.raises(ShardUnavailable, match="no longer leads"):
        await asyncio.wait_for(kept, 10)
    assert deposed.recorder.got == []


async def test_a_node_that_leads_again_acknowledges_what_it_kept_at_its_new_high_watermark(
        deposed: Deposed) -> None:
    kept, lost = deposed.kept, deposed.lost
    assert kept is not None and lost is not None
    deposed.replicated.depose()
    a_log = deposed.logs["a"]
    again: LeaderReplica[asyncio.Future[None]] = LeaderReplica(
        "a", 3, ("a", "b"), ("a", "b"), min_insync=2, lag_time_max_s=30.0,
        history=a_log.leader_epochs, log_end=a_log.next_offset, durable_end=a_log.committed_offset,
        high_watermark=deposed.replicated.high_watermark, now=time.monotonic())
    deposed.replicated.lead(again)  # its log was never cut: both records are in it
    await asyncio.sleep(0.05)
    assert not kept.done() and not lost.done()  # b has not fetched in epoch 3 yet
    deposed.follower = FollowerReplica("b", "a", 3, history=deposed.history["b"],
                                       log_end=deposed.logs["b"].next_offset,
                                       durable_end=deposed.logs["b"].committed_offset,
                                       high_watermark=0)
    deposed.follower_log = FollowerLog(deposed.logs["b"], deposed.follower)
    deposed.start_following()
    await asyncio.wait_for(asyncio.gather(kept, lost), 10)
    assert payloads(deposed.logs["b"]) == [b"kept", b"lost"]
    # committed by this node's leadership: dispatched here, as its own
    await wait_for(lambda: deposed.recorder.got == [(0, b"kept"), (1, b"lost")])


async def test_a_node_that_stops_holding_the_shard_refuses_what_it_kept(deposed: Deposed) -> None:
    kept = deposed.kept
    assert kept is not None
    deposed.replicated.depose()
    deposed.replicated.resign()  # no longer a replica, or shutting down
    with pytest.raises(ShardUnavailable, match="no longer leads"):
        await asyncio.wait_for(kept, 10)
    assert deposed.replicated.deposed_waiting == 0
