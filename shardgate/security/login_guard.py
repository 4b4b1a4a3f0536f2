"""Password checks off the event loop, and a growing delay for sources that keep failing.

scrypt costs tens of milliseconds of CPU by design. Run on the event loop, every wrong password
stalls every other client of the broker; so the checks run in a small thread pool
(`hashlib.scrypt` releases the GIL), at most `workers` at a time, and the loop only waits for
the answer.

A flood of wrong passwords must cost its sender, not the other clients: the checks of one
source address (an IP address, without the port) run one at a time, in order; an address that
fails is remembered with its count of failures, and its next check starts
`base_delay_s * 2 ** (failures - 1)` (at most `max_delay_s`) after the failure, so that more
parallel attempts get a flooder no more answers. When an address already has `max_waiting`
checks waiting, a new one is refused without hashing (answered after the longest delay all the
same). A success does not clear an address (a flooder holding one valid account could otherwise
reset its own delay); an idle address with no failure for `forget_after_s` is forgotten, and at
most `max_addresses` are remembered (the least recently failing idle ones go first), so the
memory it takes is bounded whatever the number of sources.

This module knows no protocol and no user: it is handed a verification to run.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import time
from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass(slots=True)
class _Source:
    failures: int = 0
    last_failure: float = 0.0
    # When this source's next check may start.
    next_at: float = 0.0
    # A check of this source is being hashed, and the checks waiting for it, in order.
    running: bool = False
    waiting: collections.deque[Callable[[], None]] = field(default_factory=collections.deque)

    @property
    def idle(self) -> bool:
        return not self.running and not self.waiting


def _settle(future: asyncio.Future[bool | None], value: bool | None) -> None:
    if not future.done():
        future.set_result(value)


def source_address(remote: str) -> str:
    """The address part of a peer name as the protocols write it: `1.2.3.4:5678`,
    `[::1]:5678`, gRPC's `ipv4:1.2.3.4:5678` / `ipv6:[::1]:5678`; anything else as it is."""
    text = remote
    for prefix in ("ipv4:", "ipv6:"):
        if text.startswith(prefix):
            text = text[len(prefix):]
            break
    if text.startswith("["):
        end = text.find("]")
        return text[1:end] if end > 0 else text
    if text.count(":") == 1:
        return text.rsplit(":", 1)[0]
    return text


class LoginGuard:
    """Runs password verifications in a thread pool, throttled per source address."""

    def __init__(
        self, *, workers: int = 2, base_delay_s: float = 0.25, max_delay_s: float = 5.0,
        max_waiting: int = 4, forget_after_s: float = 600.0, max_addresses: int = 4096,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.workers = workers
        self.base_delay_s = base_delay_s
        self.max_delay_s = max_delay_s
        self.max_waiting = max_waiting
        self.forget_after_s = forget_after_s
        self.max_addresses = max_addresses
        self._clock = clock
        self._sources: collections.OrderedDict[str, _Source] = collections.OrderedDict()
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        # Checks refused unhashed because their address had too much queued already.
        self.shed = 0

    def _executor(self) -> concurrent.futures.ThreadPoolExecutor:
        if self._pool is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(
                max_workers=self.workers, thread_name_prefix="shardgate-password")
        return self._pool

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None

    def delay_for(self, failures: int) -> float:
        if failures <= 0:
            return 0.0
        return min(self.max_delay_s, self.base_delay_s * 2 ** min(failures - 1, 32))

    def _source(self, address: str, now: float) -> _Source | None:
        source = self._sources.get(address)
        if (source is not None and source.idle and now >= source.next_at
                and now - source.last_failure > self.forget_after_s):
            del self._sources[address]
            return None
        return source

    def failures(self, address: str) -> int:
        source = self._source(source_address(address), self._clock())
        return source.failures if source is not None else 0

    def check(self, remote: str, verify: Callable[[], bool]) -> asyncio.Future[bool | None]:
        """A future of `verify()`, run in the pool once this address's earlier checks are
        done and its delay has passed; None instead (refuse without hashing) when the
        address has `max_waiting` checks waiting already."""
        loop = asyncio.get_running_loop()
        address = source_address(remote)
        now = self._clock()
        source = self._source(address, now)
        if source is None:
            source = self._sources[address] = _Source()
            self._evict()
        result: asyncio.Future[bool | None] = loop.create_future()
        if source.running and len(source.waiting) >= self.max_waiting:
            # Refused without hashing, answered after the longest delay all the same:
            # opening more connections does not get a flooder more or faster answers.
            self.shed += 1
            loop.call_later(self.max_delay_s, _settle, result, None)
            return result

        def finished(work: asyncio.Future[bool]) -> None:
            ok = False if work.cancelled() or work.exception() is not None else bool(work.result())
            self._record(address, source, ok)
            if not result.done():
                if work.cancelled() or work.exception() is not None:
                    result.set_exception(work.exception() or asyncio.CancelledError())
                else:
                    result.set_result(ok)
            self._next(loop, source)

        def run() -> None:
            source.running = True
            loop.run_in_executor(self._executor(), verify).add_done_callback(finished)

        source.waiting.append(run)
        if not source.running and len(source.waiting) == 1:
            self._next(loop, source)
        return result

    def _next(self, loop: asyncio.AbstractEventLoop, source: _Source) -> None:
        """Start the next waiting check of `source`, after its delay."""
        source.running = False
        if not source.waiting:
            return
        job = source.waiting.popleft()
        source.running = True  # reserved while its delay runs
        wait = source.next_at - self._clock()
        if wait > 0:
            loop.call_later(wait, job)
        else:
            job()

    def _evict(self) -> None:
        if len(self._sources) <= self.max_addresses:
            return
        for address, source in list(self._sources.items()):
            if source.idle:
                del self._sources[address]
                if len(self._sources) <= self.max_addresses:
                    return

    def _record(self, address: str, source: _Source, ok: bool) -> None:
        if ok:
            return
        now = self._clock()
        if self._sources.get(address) is source:
            self._sources.move_to_end(address)
        source.failures += 1
        source.last_failure = now
        source.next_at = max(source.next_at, now + self.delay_for(source.failures))
