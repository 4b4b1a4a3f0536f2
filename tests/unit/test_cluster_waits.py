"""`wait_within` (shardgate/cluster/waits.py): a wait with a timeout that never swallows a
cancellation. Python 3.11's `asyncio.wait_for` returns the awaited outcome when the waiter is
cancelled in the loop turn that outcome came; cancelled at every loop turn of that window in
turn, `wait_within` always ends cancelled (and `asyncio.wait_for` does not, on 3.11: the
technique finds the window). Otherwise it keeps `wait_for`'s contract: TimeoutError after
the timeout, the awaited task cancelled and ended before the waiter goes on."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from shardgate.cluster.waits import wait_within

# loop turns to try: the window is a few turns after the wait starts
TURNS = 12

Wait = Callable[[Awaitable[Any], float], Awaitable[Any]]


async def answer_after(turns: int, fail: bool) -> str:
    for _ in range(turns):
        await asyncio.sleep(0)
    if fail:
        raise ConnectionError("the leader is gone")  # as a request on a link that is down
    return "answer"


async def swallowed_turns(wait: Wait, answer_turns: int, fail: bool) -> list[int]:
    """The loop turns at which a cancellation of a task waiting with `wait` was accepted
    (`cancel()` said True) and yet the task ended otherwise than cancelled."""
    swallowed = []
    for turns in range(TURNS):
        inner = asyncio.ensure_future(answer_after(answer_turns, fail))
        task = asyncio.ensure_future(wait(inner, 5))
        for _ in range(turns):
            await asyncio.sleep(0)
        if task.cancel():
            await asyncio.wait((task,), timeout=5)
            assert task.done()
            if not task.cancelled():
                swallowed.append(turns)
        # (else it had ended already: nothing to lose)
        inner.cancel()
        await asyncio.wait((inner, task), timeout=5)
        for ended in (inner, task):
            if not ended.cancelled():
                ended.exception()  # retrieved
    return swallowed


@pytest.mark.parametrize("fail", [False, True], ids=["answered", "failed"])
@pytest.mark.parametrize("answer_turns", [0, 1, 3])
async def test_a_cancellation_at_any_loop_turn_is_never_swallowed(answer_turns: int, fail: bool) -> None:
    assert await swallowed_turns(wait_within, answer_turns, fail) == []


@pytest.mark.skipif(sys.version_info >= (3, 12), reason="wait_for lets cancellations through since 3.12")
async def test_asyncio_wait_for_swallows_one_here_which_is_why_the_helper_exists() -> None:
    assert await swallowed_turns(asyncio.wait_for, 0, True) != []


async def test_the_outcome_comes_back_as_it_is() -> None:
    assert await wait_within(answer_after(1, False), 5) == "answer"
    with pytest.raises(ConnectionError):
        await wait_within(answer_after(1, True), 5)
    assert await wait_within(answer_after(1, False), None) == "answer"


async def test_the_timeout_raises_timeout_error_once_the_awaited_task_has_ended() -> None:
    ended = asyncio.Event()

    async def slow() -> None:
        try:
            await asyncio.sleep(60)
        finally:
            ended.set()

    with pytest.raises(TimeoutError):
        await wait_within(slow(), 0.01)
    assert ended.is_set()


async def test_a_cancelled_waiter_cancels_and_ends_the_awaited_task_first() -> None:
    ended = asyncio.Event()
    started = asyncio.Event()

    async def slow() -> None:
        started.set()
        try:
            await asyncio.sleep(60)
        finally:
            ended.set()

    inner = asyncio.ensure_future(slow())
    waiter = asyncio.ensure_future(wait_within(inner, 60))
    await started.wait()
    waiter.cancel()
    await asyncio.wait((waiter,), timeout=5)
    assert waiter.cancelled() and inner.cancelled() and ended.is_set()


async def test_a_shielded_future_goes_on_after_the_timeout() -> None:
    future: asyncio.Future[str] = asyncio.get_running_loop().create_future()
    with pytest.raises(TimeoutError):
        await wait_within(asyncio.shield(future), 0.01)
    assert not future.done()
    future.set_result("later")
    assert await wait_within(asyncio.shield(future), 5) == "later"
