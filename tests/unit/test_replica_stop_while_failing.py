"""A follower is stopped when its role changes (its leader died and the placement names
another), and the role change waits for it to end. Its requests to a dead leader fail at once
(the link is down), and a cancellation that came in the loop turn between that failure and
the request's waiter seeing it was swallowed by Python 3.11's `asyncio.wait_for`: the
follower went on asking the dead leader forever, the role change never ended, and the new
leader's high watermark never moved (the rare failover that never acknowledged again in
`bench/bench_replication.py`). Stopped at every loop turn of that window in turn, here it
always ends. Three in-process nodes on real loopback links (`test_replica_link.py`)."""

from __future__ import annotations

import asyncio

from shardgate.cluster.replica_epochs import EpochEndRequest, EpochHistory
from shardgate.cluster.replica_follow import FollowerLog, follow
from shardgate.cluster.replica_follower import FollowerReplica
from tests.unit import test_replica_link as replica_link
from tests.unit.test_replica_link import KEY, Node, wait_for

nodes = replica_link.nodes  # the fixture: nodes a, b and c, a leading

# loop turns to try: the window is a few turns after the request is made
TURNS = 12


async def leader_gone(started: dict[str, Node]) -> None:
    """a's process is gone: b's link to it is down (every dial refused)."""
    await started["a"].manager.close()
    await started["a"].plane.stop()
    link = started["b"].plane.links["a"]
    await wait_for(lambda: not link.connected)


async def test_a_request_to_a_dead_leader_cancelled_at_any_turn_ends_cancelled(nodes) -> None:
    await leader_gone(nodes)
    transport = nodes["b"].service.transport(*KEY)
    for turns in range(TURNS):
        task = asyncio.ensure_future(transport.epoch_end("a", EpochEndRequest("b", 2, 1)))
        for _ in range(turns):
            await asyncio.sleep(0)
        if not task.cancel():
            assert isinstance(task.exception(), ConnectionError)  # it had failed already
            continue
        await asyncio.wait((task,), timeout=5)
        assert task.cancelled(), f"cancelled after {turns} turns, it ended with {task.exception()!r}"


async def test_a_follower_of_a_dead_leader_stopped_at_any_turn_stops(nodes) -> None:
    await leader_gone(nodes)
    b = nodes["b"]
    journal_log = b.journal.open_shard("other", 0)
    transport = b.service.transport("other", 0)
    for turns in range(TURNS):
        history = EpochHistory()
        history.assign(1, 0)  # an epoch to ask about: the follower starts by truncating
        follower = FollowerReplica("b", "a", 2, history=history, log_end=0, durable_end=0,
                                   high_watermark=0)
        task = asyncio.ensure_future(follow(FollowerLog(journal_log, follower), transport, retry_s=0.01))
        for _ in range(turns):
            await asyncio.sleep(0)
        task.cancel()
        await asyncio.wait((task,), timeout=5)
        assert task.done(), f"stopped after {turns} loop turns, the follower went on"
