"""What the broker tells the stores that keep it across restarts, and where it reads what left
its journal: collaborators the broker is built with (`Broker(keeper=..., topology=...,
archive=...)`), each in a `PortSlot` that starts empty (a single node with nothing kept: the
default) and that the composition root fills once the collaborator exists.

| slot | holds | filled by |
|---|---|---|
| `Broker.keeper` | `StateKeeper`: retained messages, internal state, durable definitions | `shardgate/persistence.py` |
| `Broker.topology` | `streams.TopologySink`: streams and routes changed at run time | `shardgate/app.py` (metadata, then the cluster too) |
| `Broker.archive_source` | `storage.interfaces.ArchiveSource`: tiered replay | `shardgate/archiving.py` |

A slot is needed where the collaborator is made after the broker (the store's keeper reads
the broker to restore it), or only from a point of the start on (the topology sink, once the
configuration's streams exist). A slot's content is one reference, replaced whole by
`install`: nothing else assigns it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Generic, Protocol, TypeVar

if TYPE_CHECKING:
    from .durable import DurableSubscription
    from .message import Message
    from .subscriptions import Subscription

__all__ = ["PortSlot", "StateKeeper"]

T = TypeVar("T")


class StateKeeper(Protocol):
    """Keeps what the broker holds beyond its journal across a restart: retained messages and
    internal state (`$internal/` topics), and the definitions of durable subscriptions."""

    def retained_changed(self, topic: str, message: Message | None, /) -> None:
        """The retained message (or internal state) of `topic` is now `message` (None:
        cleared)."""
        ...

    def durable_defined(self, sub: DurableSubscription, /) -> None:
        """`sub` was created or its definition changed; saved before the protocol confirms it
        (declare-ok, SUBACK, ...)."""
        ...

    def subscription_removed(self, sub: Subscription, /) -> None:
        """`sub` is gone for good (its saved definition goes too)."""
        ...


class PortSlot(Generic[T]):
    """One collaborator of the broker, made after it or used from a point of the start on:
    `current` is the installed one, or None (nothing told, nothing read)."""

    __slots__ = ("current",)

    def __init__(self, current: T | None = None) -> None:
        self.current: T | None = current

    def install(self, collaborator: T | None) -> T | None:
        """Make `collaborator` the one the broker uses from now on; returns the one it replaces."""
        previous = self.current
        self.current = collaborator
        return previous
