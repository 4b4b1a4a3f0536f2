"""The SDK's idempotent producer across a failover: three `shardgate serve` nodes and a real etcd
on loopback, a stream of three replicas, the SDK connected to the shard's leader first (its
target lists the other nodes after it, so that its channel moves on when the leader is gone).

Publishes (unary, and a batch over the SDK's publish stream) are made while the leader's
answers are lost (a TCP proxy between the SDK and the
leader drops them, `lost_answers.py`): the leader stores each one and its high watermark passes
them (they are on a quorum), but the SDK hears nothing. The leader is then SIGKILLed: the SDK's
calls (and its stream) fail, it retries them (resends the batch) on another node, which holds them until the new leader is named and
sends them there, marked as sent again. The new leader finds each in the log it took over and
answers with the first copy's offset: every acknowledged message is in the stream exactly once.
Before the producer identity, each retry was a second copy.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import pytest

from tests.conftest import wait_for
from tests.e2e.cluster_fixtures import ClusterNodeProcess, read_back
from tests.e2e.lost_answers import AnswerLosingProxy

STREAM = "idem"
CONFIG = (f'[[streams]]\nname = "{STREAM}"\nmode = "reliable"\npartitions = 1\n'
          f'routes = ["{STREAM}/#"]\nreplicas = 3\n')
LOST = 20  # unary publishes, and as many in one batch


def shard(node: ClusterNodeProcess) -> dict[str, Any] | None:
    try:
        return node.status()["replicated_shards"].get(f"{STREAM}/0")
    except OSError:
        return None


def fully_replicated(node: ClusterNodeProcess) -> dict[str, Any] | None:
    placed = shard(node)
    if placed is None or len(placed["replicas"]) != 3 or len(placed["isr"]) != 3:
        return None
    return placed


async def eventually(check: Callable[[], bool], timeout: float = 60) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not await asyncio.to_thread(check):
        assert asyncio.get_running_loop().time() < deadline, "condition not met in time"
        await asyncio.sleep(0.05)


@pytest.mark.timeout(300)
def test_publishes_whose_answers_the_killed_leader_never_sent_are_stored_once(
        cluster: Callable[..., list[ClusterNodeProcess]]) -> None:
    nodes = {node.node_id: node for node in cluster(3, extra_config=CONFIG)}
    placed = wait_for(lambda: fully_replicated(nodes["n1"]), timeout=60, interval=0.1)
    leader = nodes[placed["leader"]]
    others = [node for node in nodes.values() if node is not leader]
    receipts, first, after = asyncio.run(_publish_through_the_failover(leader, others))

    offsets = sorted(receipt.offset for receipt in receipts)
    assert offsets == list(range(first + 1, first + 1 + 2 * LOST)), offsets
    assert after == first + 1 + 2 * LOST
    expected = {"before", "after"} | {f"lost-{index}" for index in range(2 * LOST)}
    got = asyncio.run(read_back(others[0].grpc_url, [f"{STREAM}/#"], expected))
    assert set(got) == expected
    twice = {payload: count for payload, count in got.items() if count != 1}
    assert not twice, f"stored more than once: {twice}"


async def _publish_through_the_failover(
        leader: ClusterNodeProcess, others: list[ClusterNodeProcess]) -> tuple[list[Any], int, int]:
    from shardgate.client import Client

    proxy = await AnswerLosingProxy(leader.ports["grpc"]).start()
    addresses = [f"127.0.0.1:{proxy.port}"] + [f"127.0.0.1:{node.ports['grpc']}" for node in others]
    try:
        async with Client("ipv4:" + ",".join(addresses)) as client:
            producer = client.producer()
            first = await producer.publish(f"{STREAM}/a", b"before")
            proxy.dropping = True
            tasks: list[asyncio.Future[Any]] = [asyncio.ensure_future(producer.publish(f"{STREAM}/a", f"lost-{index}"))
                     for index in range(LOST)]
            tasks += [producer.send_nowait(f"{STREAM}/a", f"lost-{index}")
                      for index in range(LOST, 2 * LOST)]

            def committed() -> bool:  # on a quorum, and answered (the answers dropped)
                placed = shard(leader)
                return (placed is not None and placed.get("high_watermark", 0) > first.offset + 2 * LOST
                        and proxy.dropped_bytes > 0)

            await eventually(committed)
            assert not any(task.done() for task in tasks)
            leader.kill()
            await proxy.close()
            receipts = await asyncio.gather(*tasks)
            after = await producer.publish(f"{STREAM}/a", b"after")
            await producer.close()
    finally:
        await proxy.close()
    return list(receipts), first.offset, after.offset


HELD = (f'[[streams]]\nname = "{STREAM}"\nmode = "reliable"\npartitions = 1\n'
        f'routes = ["{STREAM}/#"]\nreplicas = 2\nmin_insync_replicas = 2\n')


@pytest.mark.timeout(300)
def test_a_publish_held_past_its_deadline_below_min_in_sync_is_stored_once(
        cluster: Callable[..., list[ClusterNodeProcess]]) -> None:
    """The SDK's deadline (2 s here) runs out while the leader holds its publish: appended,
    but its only follower is frozen, and the in-sync set falls below the minimum. The SDK
    retries on the same leader: each retry finds the first copy still waiting for a replica
    (UNAVAILABLE, retried again), until the follower is back and the first copy committed; then
    the retry is answered with its offset. Before the producer identity, the retry was stored
    again once the follower was back."""

    nodes = {node.node_id: node for node in cluster(3, extra_config=HELD)}

    def in_sync() -> dict[str, Any] | None:
        placed = shard(nodes["n1"])
        return placed if placed is not None and len(placed.get("isr", ())) == 2 else None

    placed = wait_for(in_sync, timeout=60, interval=0.1)
    leader = nodes[placed["leader"]]
    follower = nodes[next(name for name in placed["replicas"] if name != leader.node_id)]
    assert follower.proc is not None
    receipts = asyncio.run(_publish_held(leader, follower))
    before, once, after = (receipt.offset for receipt in receipts)
    assert (once, after) == (before + 1, before + 2)
    got = asyncio.run(read_back(leader.grpc_url, [f"{STREAM}/#"], {"before", "once", "after"}))
    assert dict(got) == {"before": 1, "once": 1, "after": 1}


async def _publish_held(leader: ClusterNodeProcess, follower: ClusterNodeProcess) -> list[Any]:
    import signal

    from shardgate.client import Client

    assert follower.proc is not None
    async with Client(leader.grpc_url, timeout=2.0) as client:
        producer = client.producer(retries=60)
        before = await producer.publish(f"{STREAM}/a", b"before")
        follower.proc.send_signal(signal.SIGSTOP)
        try:
            task = asyncio.ensure_future(producer.publish(f"{STREAM}/a", b"once"))
            # the controller takes the frozen follower out (its lease, 3 s, outlasts the SDK's
            # deadline): the first copy waits for the in-sync set to be whole again
            await eventually(lambda: (shard(leader) or {}).get("isr") == [leader.node_id])
            assert not task.done()
        finally:
            follower.proc.send_signal(signal.SIGCONT)
        once = await asyncio.wait_for(task, 120)
        after = await producer.publish(f"{STREAM}/a", b"after")
    return [before, once, after]
