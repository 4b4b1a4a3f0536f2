"""AMQP queues that live on another node of a cluster, used as RabbitMQ's nodes use a classic
queue on its home node.

A shared queue (neither exclusive nor auto-delete) lives on one node, its *home*: the
node where it was declared (the cluster records it; see `shardgate/cluster/amqp_queues.py`).
A client of any other node uses it through its home node:

- queue.declare (passive or not), queue.bind, queue.unbind, queue.purge, queue.delete and
  basic.get become one call to the home node (`QueueDirectory.call`). The home node runs them on
  the real queue (`QueueHost.handle`) and answers with the reply's fields, or with the channel
  exception to raise.
- basic.consume opens a consumer link to the home node (`QueueDirectory.consume`). There the
  consumer is registered on the queue like a local one, with the same prefetch
  (`HostedConsumer`). Each delivery goes over the link, and the acks, nacks, rejects and
  requeues come back over it. When the link ends (cancel, channel or connection closed, a node
  gone) the home node requeues what was not settled, as for a local consumer.
- On the client's node a `RemoteQueue` stands for the queue in the channel's consumers and
  unacknowledged deliveries, so that an ack or a requeue goes to where the message came from.

When the home node is down, these operations fail as in RabbitMQ (rabbit_amqqueue:absent/2):
404 "home node 'n1' of durable queue 'q' in vhost '/' is down or inaccessible".

Sans-IO: the transport (gRPC on the cluster port) belongs to the cluster; the frames of a
consumer link are defined here.

    to the home node:   request (JSON), then  A|R|J + ids (ack, requeue, reject),  X (cancel)
                        and, for a no-ack consumer,  W + count (handed to a writable client)
    from the home node: O + JSON (consuming) | E + JSON (refused), then  D + delivery  and
                        C (the queue was deleted: the consumer is cancelled)

Several frames travel in one transport message (`pack_frames`).

This module holds the ports the cluster implements (`QueueDirectory`, `ExchangeDirectory`,
`ConsumerLink`) and what both sides share; its parts are `remote_frames.py` (the frames and
encodings), `remote_queue.py` (the client's node) and `queue_host.py` (the home node). Every
name is importable from here as before.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

from pamqp import commands

from .errors import ChannelException, ConnectionException, ReplyCode
from .frames import method_ids
from .queue_host import HostedConsumer, QueueHost
from .queues import Queue
from .remote_frames import (
    ACK,
    CANCEL,
    CONSUMING,
    DELETED,
    DELIVERY,
    HANDED,
    MAX_IN_FLIGHT,
    REFUSED,
    REJECT,
    REQUEUE,
    decode_delivery,
    decode_table,
    encode_delivery,
    encode_table,
    pack_frames,
    unpack_frames,
)
from .remote_queue import ConsumerProxy, GetOrigin, RemoteEntry, RemoteOrigin, RemoteQueue

if TYPE_CHECKING:
    from .vhost import VirtualHost

__all__ = [
    "ACK", "CANCEL", "CONSUMING", "DELETED", "DELIVERY", "HANDED", "MAX_IN_FLIGHT", "REFUSED",
    "REJECT", "REQUEUE", "AmqpFailure", "ConsumerLink", "ConsumerProxy", "ExchangeDirectory",
    "GetOrigin", "HostedConsumer", "QueueDirectory", "QueueHost", "RemoteEntry", "RemoteOrigin",
    "RemoteQueue", "decode_delivery", "decode_table", "encode_delivery", "encode_table",
    "home_down", "is_shared", "pack_frames", "refusal", "unpack_frames",
]


class ConsumerLink(Protocol):
    """One consumer's link to a queue's home node (the cluster's transport)."""

    def send(self, frame: bytes) -> None: ...

    def close(self) -> None: ...


class QueueDirectory(Protocol):
    """What the cluster tells a virtual host about queues on other nodes."""

    def home(self, vhost: str, queue: str) -> str | None:
        """The node a shared queue lives on when it is not this one, else None."""

    def live(self, node: str) -> bool: ...

    def lookup(self, vhost: str, queue: str) -> asyncio.Future[str | None]:
        """`home`, asked of the cluster's store itself (this node's view may lag behind)."""

    def claim(self, vhost: str, queue: str, durable: bool) -> asyncio.Future[str | None]:
        """Record this node as the home of a queue just declared here; the answer is the
        node that recorded it first when that is another one (this declare then gives way)."""

    def replicated(self, vhost: str, queue: str) -> asyncio.Future[None] | None:
        """For a durable queue homed here: done once the cluster holds its state as it is now
        (its definition, cursors and acknowledgements: what a node taking it over reads); it
        never fails (bounded: a state the cluster cannot take now is written later). None
        when there is nothing to wait for."""

    def call(self, node: str, request: dict[str, Any]) -> asyncio.Future[dict[str, Any]]:
        """Run `request` (a `QueueHost.handle` request) on `node`."""

    def consume(self, node: str, request: dict[str, Any],
                receive: Callable[[bytes], None]) -> ConsumerLink:
        """Open a consumer link; `receive` gets each frame from the home node, and b"" when
        the link is gone."""


class ExchangeDirectory(Protocol):
    """What the cluster does for a virtual host's exchanges, which every node shares."""

    def create(self, vhost: VirtualHost, name: str, definition: dict[str, Any]) -> asyncio.Future[None]:
        """Record the exchange `name` in the cluster unless it is there already; when done,
        the virtual host has the cluster's exchange of that name (this one or an earlier)."""

    def lookup(self, vhost: VirtualHost, names: list[str]) -> asyncio.Future[None]:
        """Bring those of `names` the cluster knows (and this node's view does not yet) into
        the virtual host."""

    def in_use_elsewhere(self, vhost: VirtualHost, name: str) -> asyncio.Future[bool]:
        """Whether a queue of another node is bound to the exchange `name`."""

    def auto_delete(self, vhost: VirtualHost, name: str) -> None:
        """The auto-delete exchange `name` is unused here: delete it (`vhost.auto_delete`)
        once no other node's queue is bound to it."""

    def deleted(self, vhost: VirtualHost, name: str) -> asyncio.Future[None]:
        """Done once the deletion of the exchange `name`, just made here, is committed in the
        cluster and every other live node has applied it (bounded), so that a client told
        delete-ok finds it gone on any node."""


def is_shared(queue: Queue) -> bool:
    """A queue every node of a cluster may use: neither exclusive nor auto-delete (those
    belong to one connection, and stay on its node)."""
    return queue.exclusive_owner is None and not queue.auto_delete and not isinstance(queue, RemoteQueue)


def home_down(node: str, vhost: str, queue: str, method: type[commands.base.Frame]) -> ChannelException:
    return ChannelException(
        ReplyCode.NOT_FOUND,
        f"home node '{node}' of durable queue '{queue}' in vhost '{vhost}' is down or inaccessible",
        *method_ids(method),
    )


def refusal(reply: dict[str, Any], method: type[commands.base.Frame]) -> AmqpFailure | None:
    """The exception a home node's answer carries, if any."""
    error = reply.get("error")
    if error is None:
        return None
    code, text, hard = int(error[0]), str(error[1]), bool(error[2]) if len(error) > 2 else False
    kind = ConnectionException if hard else ChannelException
    return kind(ReplyCode(code), text, *method_ids(method))


AmqpFailure = ChannelException | ConnectionException

