"""What the core asks of a cluster, when it runs in one: where a shard is served, which
other nodes want a stored message, and where a durable subscription not held here lives.

A single node has none of them (`Broker.placement` and `Broker.fanout` stay None, the `Edge`
gets no `RemoteDurables`, and the core behaves as it always did). In a cluster the
composition root hands the cluster layer's `RemoteDurables` to the `Edge` when it builds it,
and the data plane joins the broker as its placement and fan-out while it runs
(`Broker.join_cluster`, `leave_cluster`): the core only calls them, and knows nothing of
peers, links or etcd.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Container, Sequence
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from ..storage.interfaces import ShardLog
    from .durable import DurableSubscription
    from .message import Message
    from .subscriptions import Subscription


class ShardPlacement(Protocol):
    """Decides whether a publish is stored here or forwarded to the shard's owner."""

    def serves(self, stream: str, shard: int) -> bool:
        """True when this node owns `stream`/`shard` now and stores its messages itself."""
        ...

    def stores(self, stream: str, shard: int) -> bool:
        """True when a publish to `stream`/`shard` is stored here now: this node serves it and
        its log takes messages. False also while the shard's leadership is coming to this node
        (its replicated log not leading yet): `forward` holds the message for it then, as for
        a leader elsewhere, instead of the publish being refused."""
        ...

    def forward(self, message: Message) -> asyncio.Future[None]:
        """Send `message` (stream and shard set) to the shard's owner. The future resolves once
        the owner holds it under the stream's durability policy (`message.offset` is set
        then), or fails with `PublishRejected` (`ShardUnavailable` when the client may retry).
        Must not block or await."""
        ...

    def received_log(self, stream: str, shard: int) -> ShardLog:
        """What this node received of a shard another node owns (the messages pushed here, in
        offset order, a bounded window): durable subscriptions here replay from it."""
        ...

    def owner_log(self, stream: str, shard: int, start: int, filters: Callable[[], Sequence[str]],
                  since_ms: int | None = None) -> ShardLog | None:
        """A log reading a shard another node owns from its owner's journal, from `start` (or
        the owner's first record at or after `since_ms`), only the records matching
        `filters()`: a subscription opened at an earlier position replays from it. None when
        this node cannot read other nodes' journals (it replays `received_log` then)."""
        ...


class Fanout(Protocol):
    """Pushes a message stored on this node to the other nodes whose clients want it."""

    def push(
        self, message: Message, local: list[tuple[Subscription, tuple[str, ...]]]
    ) -> Container[str] | None:
        """Push `message` to every other interested node, once each; `local` is what matched
        here. Returns the names of the local shared subscriptions that should take it (the
        others were given to other nodes), or None when every local match takes it."""
        ...

    def wanted_elsewhere(self, topic: str) -> bool:
        """True when a subscription on another node matches `topic` (AMQP's mandatory flag)."""
        ...

    def wanted_durably_elsewhere(self, topic: str) -> bool:
        """True when a durable subscription on another node matches `topic`: it replays this
        node's journal, so a transient message it wants is journaled here too."""
        ...

    def routes_ready(self) -> asyncio.Future[None] | None:
        """None when the other nodes already know every subscription made here so far; else a
        future that resolves once they do (bounded: a slow or unreachable node is not waited
        for long). A SUBACK waits for it, so a publish on another node right after the
        SUBACK reaches the new subscription."""
        ...


class RemoteDurables(Protocol):
    """Durable subscriptions that live on other nodes (a cluster's handover of them)."""

    async def find(self, name: str) -> str | None:
        """Before a consumer attaches here to durable subscription `name`, which this node does
        not have: bring it over from the node that holds it (None: attach here), or name the
        node where it is consumed now (the consumer attaches there). Raises a `CoreError` (as
        `ShardUnavailable`) when it cannot look now."""
        ...


class DurableWatcher(Protocol):
    """Told of every durable subscription defined, changed or removed (`Broker.watch_durables`)."""

    def durable_defined(self, sub: DurableSubscription) -> None: ...

    def durable_removed(self, sub: Subscription) -> None: ...
