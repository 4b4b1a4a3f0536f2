"""Password checks off the event loop, and a growing delay for sources that keep failing.

scrypt costs tens of milliseconds of CPU by design. Run on the event loop, every wrong password
stalls every other client of the broker; so the checks run in a small thread pool
(`hashlib.scrypt` releases the GIL), at most `workers` at a time, and the loop only waits for
the answer.

A flood of wrong passwords must cost its sender, not the other clients: each source address
(an IP address, without the port) that fails is remembered with its count of failures, and its
next check waits `base_delay_s * 2 ** (failures - 1)` (at most `max_delay_s`) after the one
before it, so parallel attempts from one address are spread out in time rather than hashed
at once. When an address already has `max_wait_s` of attempts queued, a new attempt is refused
without hashing (after the longest delay). A success does not clear an address (a flooder holding one valid
account could otherwise reset its own delay); an address with no failure for `forget_after_s`
is forgotten, and at most `max_addresses` are remembered (the least recently
failing go first), so the memory it takes is bounded whatever the number of sources.

This module knows no protocol and no user: it is handed a verification to run.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import time
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(slots=True)
class _Source:
    failures: int = 0
    last_failure: float = 0.0
    # When this source's next check may start (its queued attempts end here).
    next_at: float = 0.0


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
        self, *, workers: int = 2, base_delay_s: float = 0.1, max_delay_s: float = 5.0,
        max_wait_s: float = 10.0, forget_after_s: float = 600.0, max_addresses: int = 4096,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.workers = workers
        self.base_delay_s = base_delay_s
        self.max_delay_s = max_delay_s
        self.max_wait_s = max_wait_s
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
        if source is not None and now - source.last_failure > self.forget_after_s and now >= source.next_at:
            del self._sources[address]
            return None
        return source

    def failures(self, address: str) -> int:
        source = self._source(source_address(address), self._clock())
        return source.failures if source is not None else 0

    def check(self, remote: str, verify: Callable[[], bool]) -> asyncio.Future[bool | None]:
        """A future of `verify()` run in the pool once this address's delay has passed;
        None instead when the address has too much queued already (refuse without hashing)."""
        loop = asyncio.get_running_loop()
        address = source_address(remote)
        now = self._clock()
        source = self._source(address, now)
        start = now
        if source is not None and source.failures:
            start = max(now, source.next_at)
            if start - now > self.max_wait_s:
                # Refused without hashing, answered after the longest delay all the same:
                # opening more connections does not get a flooder faster answers.
                self.shed += 1
                shed: asyncio.Future[bool | None] = loop.create_future()
                loop.call_later(self.max_delay_s, lambda: shed.done() or shed.set_result(None))
                return shed
            source.next_at = start + self.delay_for(source.failures)
        result: asyncio.Future[bool | None] = loop.create_future()

        def run() -> None:
            work = loop.run_in_executor(self._executor(), verify)
            work.add_done_callback(finished)

        def finished(work: asyncio.Future[bool]) -> None:
            if result.done():
                return
            exception = None if work.cancelled() else work.exception()
            if work.cancelled() or exception is not None:
                result.set_exception(exception or asyncio.CancelledError())
                return
            ok = work.result()
            self._record(address, ok)
            result.set_result(ok)

        if start > now:
            loop.call_later(start - now, run)
        else:
            run()
        return result

    def _record(self, address: str, ok: bool) -> None:
        if ok:
            return
        now = self._clock()
        source = self._source(address, now)
        if source is None:
            source = self._sources[address] = _Source()
            while len(self._sources) > self.max_addresses:
                self._sources.popitem(last=False)
        else:
            self._sources.move_to_end(address)
        source.failures += 1
        source.last_failure = now
        source.next_at = max(source.next_at, now + self.delay_for(source.failures))
