"""`ViewChanges` (shardgate/cluster/view_changes.py): a retry waiting for the cluster view wakes
at its next change, at once when it changed since the retry's attempt, and after its timeout
at the latest."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from shardgate.cluster.view_changes import ViewChanges


class View:
    def __init__(self) -> None:
        self.callbacks: list[Callable[[], None]] = []

    def on_change(self, callback: Callable[[], None]) -> None:
        self.callbacks.append(callback)

    def changed(self) -> None:
        for callback in self.callbacks:
            callback()


async def test_a_waiter_wakes_at_the_next_change_not_at_its_timeout() -> None:
    view = View()
    changes = ViewChanges(view)
    seen = changes.count
    waiting = asyncio.ensure_future(changes.since(seen, 60))
    await asyncio.sleep(0)
    assert not waiting.done()
    view.changed()
    await asyncio.wait_for(waiting, 5)  # long before the 60 s timeout


async def test_a_change_between_the_attempt_and_the_wait_is_not_missed() -> None:
    view = View()
    changes = ViewChanges(view)
    seen = changes.count
    view.changed()  # while the attempt ran
    await asyncio.wait_for(changes.since(seen, 60), 1)


async def test_without_a_change_the_wait_ends_at_its_timeout() -> None:
    changes = ViewChanges(View())
    loop = asyncio.get_running_loop()
    started = loop.time()
    await changes.since(changes.count, 0.05)
    assert loop.time() - started >= 0.04
