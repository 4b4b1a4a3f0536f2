"""Time and deferred calls, as the I/O layer provides them to sans-IO code.

Protocol connections and services never ask an event loop for the time or for a timer: they
are handed a `Scheduler`. An asyncio event loop is one as it is (`loop.time`, `loop.call_soon`,
`loop.call_later`), which is what the asyncio adapters pass; tests pass a manual clock and
drive time themselves.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol


class Timer(Protocol):
    """A call scheduled for later; `cancel` drops it (a no-op once it ran)."""

    def cancel(self) -> None: ...


class Scheduler(Protocol):
    def time(self) -> float:
        """Monotonic seconds."""
        ...

    def call_soon(self, callback: Callable[..., Any], *args: Any) -> Any:
        """Run `callback(*args)` once the current work is done (the next loop turn)."""
        ...

    def call_later(self, delay: float, callback: Callable[..., Any], *args: Any) -> Timer:
        """Run `callback(*args)` after `delay` seconds."""
        ...
