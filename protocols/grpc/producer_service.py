"""The `Producer` servicer: unary `Publish` and the batched `PublishStream`, whose acks are sent
once the batch's reliable messages are durable.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Any

import grpc

from ...core.edge import KICK_REASON
from ...core.message import Message
from ...proto import shardgate_pb2 as pb
from ...proto import shardgate_pb2_grpc as pb_grpc
from .auth import peer_of, user_of
from .convert import Refusal, abort
from .identity import Identity

if TYPE_CHECKING:
    from .server import GrpcServer


log = logging.getLogger(__name__)


PUBLISH_QUEUE_BATCHES = 256
_producer_ids = itertools.count(1)


@dataclass(slots=True, eq=False)
class ProducerStreamInfo:
    """A live `PublishStream`, listed by `Admin.ListClients`."""

    peer: str
    name: str
    connected_at: float = field(default_factory=time.time)
    messages_in: int = 0
    id: str = field(default_factory=lambda: f"grpc-producer-{next(_producer_ids)}")
    username: str | None = None
    # Set by `kick`: the stream ends with UNAVAILABLE and this reason once the batches already
    # read are acknowledged.
    kicked: str | None = None
    _reader: asyncio.Future[None] | None = field(default=None, repr=False)

    def kick(self, reason: str = KICK_REASON) -> None:
        """Disconnect this producer stream (the admin API's kick): batches it sent and the
        server has not read yet are not published, and the SDK resends them on reconnect."""
        if self.kicked is None:
            self.kicked = reason
        if self._reader is not None:
            self._reader.cancel()


def offset_landed(result: Any, message: Message, _: object) -> None:
    """A forwarded publish landed: its result carries the offset the shard's owner gave."""
    result.offset = max(message.offset, 0)


class ProducerService(pb_grpc.ProducerServicer):
    def __init__(self, server: GrpcServer) -> None:
        self.server = server

    async def Publish(self, request: pb.PublishRequest, context: grpc.aio.ServicerContext) -> pb.PublishResponse:
        server = self.server
        if not server.publishing.is_set():  # the memory alarm: wait (the deadline bounds it)
            await server.publishing.wait()
        try:
            message = server.message_from(request, peer_of(context), user_of(context))
            waiter = server.publish(message)
            if waiter is not None:
                try:
                    # shielded: a client gone meanwhile must not cancel the commit future, which
                    # the other messages of its commit group share
                    await asyncio.shield(waiter)
                except Exception as exc:
                    raise Refusal(grpc.StatusCode.UNAVAILABLE,
                                  f"the message could not be stored: {exc}") from exc
        except Refusal as refusal:
            await abort(context, refusal)
            raise  # unreachable: abort raises
        response = pb.PublishResponse(stream=message.stream, shard=message.shard)
        if message.offset >= 0:  # (a delayed message is held: it has no offset yet)
            response.offset = message.offset
        return response

    async def PublishStream(
        self, request_iterator: AsyncIterator[pb.PublishBatch], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.PublishAck]:
        server = self.server
        info = ProducerStreamInfo(peer=peer_of(context), name="", username=user_of(context))
        server.producers.add(info)
        log.info("%s: gRPC producer connected", info.peer,
                 extra={"event": "client_connected", "protocol": "grpc", "client_id": info.peer,
                        "peer": info.peer})
        reason = "stream ended"
        queue: asyncio.Queue[
            tuple[pb.PublishAck, list[tuple[pb.PublishResult, asyncio.Future[None]]]] | None
        ] = (
            asyncio.Queue(PUBLISH_QUEUE_BATCHES)
        )

        async def read() -> None:
            try:
                async for batch in request_iterator:
                    if not server.publishing.is_set():  # the memory alarm: read no more meanwhile
                        await server.publishing.wait()
                    await queue.put(self._publish_batch(batch, info))
            finally:
                await queue.put(None)

        reader = info._reader = asyncio.ensure_future(read())
        try:
            while True:
                item = await queue.get()
                if item is None:
                    break
                ack, waiters = item
                if waiters:
                    await self._await_durable(ack, waiters)
                yield ack
            if info.kicked is not None:
                await context.abort(grpc.StatusCode.UNAVAILABLE, info.kicked)
            if reader.done() and not reader.cancelled() and reader.exception() is not None:
                exc = reader.exception()
                if not isinstance(exc, asyncio.CancelledError | grpc.aio.AbortError):
                    log.debug("publish stream from %s ended: %r", info.peer, exc)
        except asyncio.CancelledError:
            reason = "stream cancelled"
            raise
        finally:
            reader.cancel()
            server.producers.discard(info)
            if info.kicked is not None:
                reason = f"kicked: {info.kicked}"
            client_id = info.name or info.peer
            log.info("%s: gRPC producer %s disconnected: %s", info.peer, client_id, reason,
                     extra={"event": "client_disconnected", "protocol": "grpc",
                            "client_id": client_id, "peer": info.peer, "reason": reason})

    def _publish_batch(
        self, batch: pb.PublishBatch, info: ProducerStreamInfo
    ) -> tuple[pb.PublishAck, list[tuple[pb.PublishResult, asyncio.Future[None]]]]:
        """Validate and authorize each message of `batch`, publish the accepted ones in one
        core call (one journal append per shard), and build the ack: one result per message,
        in order (its offset, or the status that refused it alone). Returns the ack and, per
        message to wait for, its result and the commit future it waits on."""
        server = self.server
        ack = pb.PublishAck(sequence=batch.sequence)
        producer_id = info.name or info.peer
        user = info.username
        message_from = server.message_from
        # Per request, in order: the message to publish, or the refusal of its validation.
        checked: list[Message | Refusal] = []
        accepted: list[Message] = []
        # (the n-th message's identity counts on from the batch's: `ProducerIdentity`)
        identity: Identity | None = None
        refused: Refusal | None = None  # a malformed identity refuses every message
        if batch.HasField("identity"):
            try:
                identity = Identity(batch.identity, len(batch.messages))
            except Refusal as refusal:
                refused = refusal
        for index, request in enumerate(batch.messages):
            if not info.name and request.producer_name:
                info.name = request.producer_name
            if refused is not None:
                checked.append(refused)
                continue
            try:
                message = message_from(request, producer_id, user, identity, index)
            except Refusal as refusal:
                checked.append(refusal)
                continue
            checked.append(message)
            accepted.append(message)
        outcomes = iter(server.publish_many(accepted) if accepted else ())
        results = ack.results
        waiters: list[tuple[pb.PublishResult, asyncio.Future[None]]] = []
        for item in checked:
            outcome = item if isinstance(item, Refusal) else next(outcomes)
            if isinstance(outcome, Refusal):
                results.add(code=outcome.code.value[0], error=outcome.reason)
                continue
            assert isinstance(item, Message)
            message = item
            result = results.add(stream=message.stream, shard=message.shard)
            if message.offset >= 0:
                result.offset = message.offset
            if outcome is not None:
                waiters.append((result, outcome))
                if message.offset < 0:  # forwarded to the shard's owner: the offset comes back
                    outcome.add_done_callback(partial(offset_landed, result, message))
        info.messages_in += len(batch.messages)
        return ack, waiters

    @staticmethod
    async def _await_durable(
        ack: pb.PublishAck, waiters: list[tuple[pb.PublishResult, asyncio.Future[None]]]
    ) -> None:
        """Wait until every waited-for message is durable; a message whose commit failed gets
        UNAVAILABLE in its own result (the others keep theirs)."""
        # (shielded: a stream cancelled meanwhile must not cancel the shared commit futures)
        await asyncio.gather(*{asyncio.shield(waiter) for waiter in {w for _, w in waiters}},
                             return_exceptions=True)
        for result, waiter in waiters:
            failure = "cancelled" if waiter.cancelled() else waiter.exception()
            if failure is not None:
                result.code = grpc.StatusCode.UNAVAILABLE.value[0]
                result.error = f"the message could not be stored: {failure}"
