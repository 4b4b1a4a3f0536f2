"""The replica protocol between nodes: a follower's fetches and epoch-end questions to its
shard's leader, and their answers.

They travel on the peer links (`peer_link.PeerLink.replica_call`), the node-to-node TCP
connections already authenticated by the cluster port's handshake: a request leaves at the end
of the loop turn that made it, with the others of that turn, and the leader's event loop reads
it and answers it on the same connection (`ReplicaService.serve_link`), with no thread
hand-off on either side. (They were first gRPC calls through the cluster port, passed through
to the node's gRPC server: several thread hand-offs each way, a few milliseconds each under
load, for every fetch; an acknowledgement waits for two of them. `handler()` still answers
such calls, from nodes of that version, and a `ReplicaService` made without links calls so.)

Both ends live here: the leader's side answers for the shards this node leads
(`ReplicaManager.leading`), and `ReplicaService` itself is the followers' `ReplicaTransport`.
A request and its answer are `ReplicaRequest` / `ReplicaAnswer` of `proto/cluster.proto`
(`replica_frames.py`): a follower has one request in flight per shard, and a fetch is a long
poll (the leader holds it up to `FETCH_WAIT_S` while it has nothing new). An answer carries at
most `FETCH_MAX_RECORDS` records and about `FETCH_MAX_BYTES` (always at least one record). A
request naming another replica than the node whose link it came by is refused
(`unknown_replica`).

A shard this node does not lead is answered `not_leader`; a leader whose journal no longer
holds the asked offset answers `behind_log_start` with its first offset, and the follower
then starts there (the offsets before become empty records: what retention removed from the
leader is not fetched from the archive yet). A request whose link is down or breaks before
its answer, or that is not answered in time, raises `ConnectionError` (the follower retries).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING

import grpc

from ..proto import cluster_pb2 as pb
from ..storage.interfaces import StoredRecord
from .link_auth import NodeCredentials, cluster_channel
from .membership import ClusterView
from .replica_epochs import (
    EpochEndAnswer,
    EpochEndRequest,
    FetchRequest,
    FetchResponse,
    Refused,
    ReplicaError,
)
from .replica_frames import (
    ReplicaFrameError,
    epoch_end_answer,
    epoch_end_answer_from,
    fetch_answer,
    fetch_answer_from,
    request_from,
    request_message,
)
from .replica_log import ReplicatedShardLog
from .waits import wait_within

if TYPE_CHECKING:
    from .peer_link import PeerLink

log = logging.getLogger(__name__)

SERVICE = "shardgate.cluster.v1.Replica"
FETCH = "Fetch"
EPOCH_END = "EpochEnd"
FETCH_WAIT_S = 0.5
FETCH_MAX_RECORDS = 2_000
FETCH_MAX_BYTES = 8 << 20
# A call is given up on (and retried) after the leader's wait and this much more.
CALL_MARGIN_S = 5.0
MAX_MESSAGE = 64 << 20
CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE),
    ("grpc.max_receive_message_length", MAX_MESSAGE),
]

Leading = Callable[[str, int], ReplicatedShardLog | None]


class ReplicaService:
    """Both ends of the replica protocol on this node (see the module docstring)."""

    def __init__(self, view: ClusterView, leading: Leading,
                 credentials: NodeCredentials | None = None, *,
                 fetch_wait_s: float = FETCH_WAIT_S,
                 links: Mapping[str, PeerLink] | None = None,
                 replicated: Callable[[str, int], bool] | None = None) -> None:
        self.view = view
        self.leading = leading
        # whether the placement makes this node one of a shard's several replicas (None: never)
        self.replicated = replicated
        self.credentials = credentials or NodeCredentials(view.node_id)
        self.fetch_wait_s = fetch_wait_s
        # this node's links to its peers (the data plane's): requests go there; None: gRPC
        self.links = links
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._next_id = 0
        # the fetches answered after a long poll, until they are
        self._parked: set[asyncio.Task[None]] = set()

    def settling(self, stream: str, shard: int) -> bool:
        """True while the view names this node the leader of replicated shard `stream`/`shard`
        and its log does not take publishes: it does not lead yet (its role is changing: the
        follower's fetch stopping, what it never wrote cut; or it waits for an epoch an
        earlier run of it did not lead), or it is quiesced for a leave or a drain and its
        leadership is about to move. Publishes are held meanwhile, for whichever node leads
        next (`plane_ports.ReplicaRequests.settling`)."""
        replicated = self.replicated
        if replicated is None or not replicated(stream, shard):
            return False
        leading = self.leading(stream, shard)
        return leading is None or leading.leader is None or leading.leader.closed

    # ------------------------------------------------------------ the leader's side, on a link
    def serve_link(self, peer: str, requests: Sequence[pb.ReplicaRequest],
                   reply: Callable[[pb.PeerReply], None]) -> None:
        """Answer the replica requests `peer` sent on one of its links, through `reply` (that
        link's stream): at once together, but a fetch with nothing to send yet after its
        long poll."""
        answers: list[pb.ReplicaAnswer] = []
        for message in requests:
            answer = self._link_answer(peer, message, reply)
            if answer is not None:
                answers.append(answer)
        if answers:
            reply(pb.PeerReply(replica=answers))

    def _link_answer(self, peer: str, message: pb.ReplicaRequest,
                     reply: Callable[[pb.PeerReply], None]) -> pb.ReplicaAnswer | None:
        try:
            asked = request_from(message)
        except ReplicaFrameError as exc:
            log.warning("a malformed replica request from node %s: %s", peer, exc)
            return pb.ReplicaAnswer(id=message.id, error=f"malformed: {exc}")
        if asked.replica != peer:
            log.warning("node %s sent a replica request as node %s: refused", peer, asked.replica)
            return pb.ReplicaAnswer(id=message.id, error=ReplicaError.UNKNOWN_REPLICA.value)
        shard_log = self.leading(message.stream, message.shard)
        if isinstance(asked, EpochEndRequest):
            return epoch_end_answer(message.id, Refused(ReplicaError.NOT_LEADER) if shard_log is None
                                    else shard_log.serve_epoch_end(asked))
        if shard_log is None:
            return fetch_answer(message.id, Refused(ReplicaError.NOT_LEADER))
        answer = shard_log.serve_fetch(asked, FETCH_MAX_RECORDS)
        if isinstance(answer, Refused) or answer[1] or self.fetch_wait_s <= 0:
            return fetch_answer(message.id, _bounded_answer(answer))
        task = asyncio.get_running_loop().create_task(
            self._parked_fetch(shard_log, message, asked, reply))
        self._parked.add(task)
        task.add_done_callback(self._parked.discard)
        return None

    async def _parked_fetch(self, shard_log: ReplicatedShardLog, message: pb.ReplicaRequest,
                            asked: FetchRequest, reply: Callable[[pb.PeerReply], None]) -> None:
        await shard_log.wait_for_news(self.fetch_wait_s)
        answer = shard_log.serve_fetch(asked, FETCH_MAX_RECORDS)
        reply(pb.PeerReply(replica=[fetch_answer(message.id, _bounded_answer(answer))]))

    # ------------------------------------------------------------ the leader's side
    def handler(self) -> grpc.GenericRpcHandler:
        async def fetch(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
            message = self._parse(request)
            if message is None:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "a malformed replica request")
            assert message is not None
            try:
                asked = request_from(message)
            except ReplicaFrameError as exc:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
                raise
            if not isinstance(asked, FetchRequest):
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "an epoch-end request sent as a fetch")
            assert isinstance(asked, FetchRequest)
            shard_log = self.leading(message.stream, message.shard)
            answer: tuple[FetchResponse, Sequence[StoredRecord]] | Refused
            if shard_log is None:
                answer = Refused(ReplicaError.NOT_LEADER)
            else:
                answer = await shard_log.fetch(asked, FETCH_MAX_RECORDS, self.fetch_wait_s)
                if not isinstance(answer, Refused):
                    answer = _bounded(*answer)
            return bytes(fetch_answer(message.id, answer).SerializeToString())

        async def epoch_end(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
            message = self._parse(request)
            if message is None:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "a malformed replica request")
            assert message is not None
            try:
                asked = request_from(message)
            except ReplicaFrameError as exc:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
                raise
            if not isinstance(asked, EpochEndRequest):
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "a fetch sent as an epoch-end request")
            assert isinstance(asked, EpochEndRequest)
            shard_log = self.leading(message.stream, message.shard)
            answer = (Refused(ReplicaError.NOT_LEADER) if shard_log is None
                      else shard_log.serve_epoch_end(asked))
            return bytes(epoch_end_answer(message.id, answer).SerializeToString())

        return grpc.method_handlers_generic_handler(SERVICE, {
            FETCH: grpc.unary_unary_rpc_method_handler(fetch),
            EPOCH_END: grpc.unary_unary_rpc_method_handler(epoch_end),
        })

    @staticmethod
    def _parse(request: bytes) -> pb.ReplicaRequest | None:
        message = pb.ReplicaRequest()
        try:
            message.ParseFromString(request)
        except Exception:  # protobuf's DecodeError
            return None
        return message

    # ------------------------------------------------------------ the follower's side
    def transport(self, stream: str, shard: int) -> ShardTransport:
        """The `ReplicaTransport` of one shard (its requests name the shard)."""
        return ShardTransport(self, stream, shard)

    async def call(self, leader: str, method: str, message: pb.ReplicaRequest,
                   timeout: float) -> pb.ReplicaAnswer:
        info = self.view.nodes().get(leader)
        if info is None:
            raise ConnectionError(f"leader {leader} is not live")
        if self.links is not None:
            link = self.links.get(leader)
            if link is None:
                raise ConnectionError(f"no link to the leader {leader}")
            # wait_within, not asyncio.wait_for (waits.py): a request to a leader whose link is
            # down fails at once, and a follower stopped then (its leader died and the
            # placement names another: its role changes) went on following the dead leader
            # forever when wait_for swallowed that cancellation; the role change awaiting its
            # end never ended (the rare failover that never acknowledged again).
            try:
                return await wait_within(link.replica_call(message), timeout)
            except TimeoutError:
                raise ConnectionError(f"{method} on {leader}: no answer in {timeout:g} s") from None
        channel = self._channels.get(info.cluster_address)
        if channel is None:
            channel = cluster_channel(info.cluster_address, self.credentials, CHANNEL_OPTIONS)
            self._channels[info.cluster_address] = channel
        call = channel.unary_unary(f"/{SERVICE}/{method}")
        try:
            data = await call(message.SerializeToString(), timeout=timeout)
        except grpc.aio.AioRpcError as exc:
            raise ConnectionError(f"{method} on {leader}: {exc.code().name} {exc.details()}") from None
        answer = pb.ReplicaAnswer()
        try:
            answer.ParseFromString(data)
        except Exception:  # protobuf's DecodeError
            raise ConnectionError(f"{method} on {leader}: an answer that does not decode") from None
        return answer

    def request_id(self) -> int:
        self._next_id += 1
        return self._next_id

    async def close(self) -> None:
        for task in list(self._parked):
            task.cancel()
        channels, self._channels = list(self._channels.values()), {}
        for channel in channels:
            await channel.close(grace=None)


class ShardTransport:
    """`ReplicaTransport` for one shard over `ReplicaService`'s channels."""

    def __init__(self, service: ReplicaService, stream: str, shard: int) -> None:
        self.service = service
        self.stream = stream
        self.shard = shard

    async def epoch_end(self, leader: str, request: EpochEndRequest) -> EpochEndAnswer | Refused:
        service = self.service
        message = request_message(service.request_id(), self.stream, self.shard, request)
        answer = await service.call(leader, EPOCH_END, message, CALL_MARGIN_S)
        try:
            return epoch_end_answer_from(answer)
        except ReplicaFrameError as exc:
            raise ConnectionError(f"epoch end from {leader}: {exc}") from None

    async def fetch(self, leader: str, request: FetchRequest
                    ) -> tuple[FetchResponse, Sequence[StoredRecord]] | Refused:
        service = self.service
        message = request_message(service.request_id(), self.stream, self.shard, request)
        answer = await service.call(leader, FETCH, message, service.fetch_wait_s + CALL_MARGIN_S)
        try:
            return fetch_answer_from(answer)
        except ReplicaFrameError as exc:
            raise ConnectionError(f"fetch from {leader}: {exc}") from None


def _bounded_answer(answer: tuple[FetchResponse, Sequence[StoredRecord]] | Refused
                    ) -> tuple[FetchResponse, Sequence[StoredRecord]] | Refused:
    return answer if isinstance(answer, Refused) else _bounded(*answer)


def _bounded(response: FetchResponse, records: Sequence[StoredRecord]
             ) -> tuple[FetchResponse, Sequence[StoredRecord]]:
    """At most about `FETCH_MAX_BYTES` of records (at least one): the rest comes next fetch."""
    size = 0
    for count, record in enumerate(records):
        size += len(record.data) + 12
        if size > FETCH_MAX_BYTES and count > 0:
            end = response.start + count
            epochs = tuple(entry for entry in response.epochs if entry.start_offset < end)
            return (FetchResponse(response.leader_epoch, response.start, end,
                                  response.high_watermark, epochs, response.dispatched_end),
                    records[:count])
    return response, records
