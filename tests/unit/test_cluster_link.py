"""The dialing end of a cluster link on a real loopback connection, on the event loop the node
runs (uvloop): a frame sent after the peer ended the connection, but before the link's task has
seen the end, is not written (and raises nothing: it stays unanswered and goes again on the next
connection). Found by the randomized fault run: a node logged a traceback from
`PeerLink._flush` writing to a transport its peer's SIGTERM had just closed."""

from __future__ import annotations

import asyncio

import uvloop
from shardgate.proto import cluster_pb2 as pb

from shardgate.cluster.link import LinkClient


async def dial_a_peer_that_answers_then_ends() -> LinkClient:
    async def peer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read(1)
        writer.write(b"\0")
        await writer.drain()
        writer.close()  # the peer leaves: EOF reaches the link

    server = await asyncio.start_server(peer, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    loop = asyncio.get_running_loop()
    _transport, link = await loop.create_connection(
        lambda: LinkClient(lambda reply: None, lambda: None), "127.0.0.1", port)
    await asyncio.wait_for(link.closed, 10)
    server.close()
    return link


def test_a_frame_sent_after_the_peer_ended_the_connection_is_not_written() -> None:
    async def scenario() -> None:
        link = await dial_a_peer_that_answers_then_ends()
        assert link.transport is not None and link.transport.is_closing()
        link.send(pb.PeerFrame(sequence=1))  # raised RuntimeError ("the handler is closed")

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        runner.run(scenario())
