"""Two cancellations in the cluster's data plane, on real loopback connections:

- a durable cursor's read of a shard another node owns (`shard_reader.OwnerLog`) whose call is
  cancelled (grpc.aio raises CancelledError in the caller when the channel is closed under the
  call, as `StateRpc.close` does) still resolves the waiter the cursor's subscription waits on:
  it used to be resolved only on an `Exception`, so the subscription never pumped again;
- `PeerLink.close()` lets its caller's own cancellation through (after failing what the link
  held), as asyncio asks of every coroutine; it used to swallow it, so the caller ran on."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest
from shardgate.core.broker import Broker
from shardgate.core.message import Message
from shardgate.core.streams import RoutingRule, StreamConfig
from shardgate.storage.interfaces import StoredRecord
from shardgate.storage.journal import JournalStorage

from shardgate.cluster.data_plane import DataPlane
from shardgate.cluster.membership import NodeInfo, ShardAssignment, StaticClusterView
from shardgate.cluster.shard_reader import OwnerLog
from shardgate.cluster.state_rpc import StateRpc


async def until(condition: Callable[[], object], timeout: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not condition():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(0.005)


@pytest.fixture
async def planes(tmp_path: Path) -> AsyncIterator[dict[str, DataPlane]]:
    """Nodes a and b on loopback; b owns the reliable stream `ledger`'s one shard."""
    assignments = {("ledger", 0): ShardAssignment("ledger", 0, "b", 1)}
    planes: dict[str, DataPlane] = {}
    for node_id in ("a", "b"):
        storage = JournalStorage(tmp_path / node_id)
        broker = Broker(storage=storage)
        broker.create_stream(StreamConfig("ledger", mode="reliable"))
        broker.add_route(RoutingRule("ledger/#", "ledger"))
        plane = DataPlane(broker, StaticClusterView(node_id, {}, dict(assignments)))
        await plane.start()
        planes[node_id] = plane
    infos = {p.node_id: NodeInfo(p.node_id, f"127.0.0.1:{p.port}") for p in planes.values()}
    for plane in planes.values():
        view = plane.view
        assert isinstance(view, StaticClusterView)
        view.node_infos = dict(infos)
        view.changed()
    await until(lambda: all(link.connected for p in planes.values() for link in p.links.values()))
    yield planes
    for plane in planes.values():
        await plane.stop()
        assert plane.broker.storage is not None
        plane.broker.storage.close()


async def test_a_cancelled_read_of_the_owner_still_wakes_the_cursor(planes: dict[str, DataPlane]) -> None:
    a, b = planes["a"], planes["b"]
    asked = asyncio.Event()

    async def stalled(request: dict[str, Any]) -> tuple[dict[str, Any], list[StoredRecord]]:
        asked.set()
        await asyncio.Event().wait()  # an owner that never answers (the call is cancelled)
        raise AssertionError("unreachable")

    served = StateRpc(b.view)
    served.on_read = stalled
    b.add_service(served.handler())
    rpc = StateRpc(a.view)
    owner = OwnerLog(rpc, a, "ledger", 0, 0, lambda: ["ledger/#"])
    assert owner.read(0) == []  # starts the read from b
    waiter = owner.commit_waiter()
    assert waiter is not None
    await asyncio.wait_for(asked.wait(), 5)
    await rpc.close()  # the call in flight is cancelled under its caller
    # the subscription waiting on it pumps again (it would have waited forever)
    await asyncio.wait_for(asyncio.shield(waiter), 3)


async def test_closing_a_link_lets_the_closers_cancellation_through(planes: dict[str, DataPlane]) -> None:
    a = planes["a"]
    link = a.links["b"]
    future = a.broker.publish(Message("ledger/1", b"queued", qos=1))
    assert future is not None and link.holding
    closer = asyncio.get_running_loop().create_task(link.close())
    await asyncio.sleep(0)  # the closer now waits for the link's task to end
    assert not closer.done()
    closer.cancel()
    with pytest.raises(asyncio.CancelledError):
        await closer
    assert closer.cancelled()
    assert not link.holding  # what it held was given up on all the same
