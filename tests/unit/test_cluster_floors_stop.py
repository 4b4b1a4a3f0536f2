"""`CursorFloors.stop` (shardgate/cluster/floors.py) ends its report loop by cancelling it and
waits for it. The loop waits for a "report now" (cursors came here) with a timeout; with
Python 3.11's `asyncio.wait_for` a stop that came in the loop turn the wake-up did was lost,
and the loop (and the node's stop awaiting it) ran on forever. Stopped at every loop turn
after a wake-up in turn, here it always ends. The node is an in-process stand-in: a view of
one node and a state store kept in a dict."""

from __future__ import annotations

import asyncio
from typing import Any

from shardgate.cluster.floors import CursorFloors
from shardgate.cluster.settings import ClusterSettings

# loop turns to try: the window is a few turns after the wake-up
TURNS = 12


class Store:
    def __init__(self) -> None:
        self.values: dict[str, bytes] = {}

    async def put(self, key: str, value: bytes) -> None:
        self.values[key] = value

    async def get_prefix(self, prefix: str) -> tuple[list[Any], int]:
        return [], 0


class View:
    def nodes(self) -> dict[str, Any]:
        return {"a": None}

    def leader(self, stream: str, shard: int) -> None:
        return None


class Node:
    node_id = "a"
    is_controller = False

    def __init__(self) -> None:
        self.settings = ClusterSettings()
        self.view = View()
        self.state_store = Store()


class Broker:
    subscriptions: dict[str, Any] = {}
    streams: dict[str, Any] = {}

    def held_offsets(self) -> dict[tuple[str, int], int]:
        return {}


async def test_a_stop_at_any_loop_turn_after_a_wake_up_ends_the_report_loop() -> None:
    for turns in range(TURNS):
        floors = CursorFloors(Node(), Broker())  # type: ignore[arg-type]
        floors.start()
        await asyncio.sleep(0.01)  # both loops waiting
        floors.report_soon()
        for _ in range(turns):
            await asyncio.sleep(0)
        tasks = list(floors._tasks)
        stopping = asyncio.ensure_future(floors.stop())
        await asyncio.wait((stopping,), timeout=5)
        for task in tasks:
            if not task.done():
                task.cancel()  # (the test's own cleanup of a loop that ran on)
        assert stopping.done(), f"the report loop ran on after a stop {turns} turns after a wake-up"
        assert all(task.cancelled() for task in tasks)
