"""The shared TCP listener makes an accepted connection's transport in the accepting callback, so
that the protocol hears of it (and reads what the client already sent) one event-loop iteration
after the accept, not two: under load an iteration is tens of milliseconds of a new client's
CONNECT → CONNACK."""

from __future__ import annotations

import asyncio
import socket

import uvloop
from shardgate.protocols.listener import TcpListener, _listening_socket, start_eagerly


def _iterations_from_accept_to_read() -> tuple[int, int]:
    """(iterations from the accept to `connection_made`, ... to the first `data_received`) of a
    connection whose client wrote before the broker accepted it."""

    async def scenario() -> tuple[int, int]:
        loop = asyncio.get_running_loop()
        iterations = [0]

        def tick() -> None:  # runs once per loop iteration
            iterations[0] += 1
            loop.call_soon(tick)

        loop.call_soon(tick)
        seen: dict[str, int] = {}
        read: asyncio.Future[None] = loop.create_future()

        class Recorder(asyncio.Protocol):
            def connection_made(self, transport: asyncio.BaseTransport) -> None:
                seen["made"] = iterations[0]

            def data_received(self, data: bytes) -> None:
                seen["read"] = iterations[0]
                if not read.done():
                    read.set_result(None)

        class RecordingListener(TcpListener):
            def _accept(self, sock: socket.socket) -> None:
                seen.setdefault("accepted", iterations[0])
                super()._accept(sock)

        listening = _listening_socket(socket.AF_INET, socket.SOCK_STREAM, 0, ("127.0.0.1", 0))
        port = listening.getsockname()[1]
        listener = RecordingListener(loop, [listening], Recorder, None)
        client = socket.create_connection(("127.0.0.1", port))
        try:
            client.sendall(b"CONNECT")  # before the accept: the kernel queued both
            await asyncio.wait_for(read, 10)
        finally:
            client.close()
            listener.close()
            await listener.wait_closed()
        return seen["made"] - seen["accepted"], seen["read"] - seen["accepted"]

    return uvloop.run(scenario())


def test_an_accepted_connection_is_made_and_read_one_iteration_after_its_accept() -> None:
    made, read = _iterations_from_accept_to_read()
    assert made == 1
    assert read == 1


def test_start_eagerly_runs_the_first_step_at_once_and_the_rest_in_a_task() -> None:
    async def scenario() -> list[str]:
        steps: list[str] = []
        waited: asyncio.Future[str] = asyncio.get_running_loop().create_future()

        async def work() -> str:
            steps.append("first")
            value = await waited
            steps.append("rest")
            return value

        outcome = start_eagerly(asyncio.get_running_loop(), work())
        assert steps == ["first"]
        waited.set_result("done")
        assert await outcome == "done"
        failing = start_eagerly(asyncio.get_running_loop(), _fails())
        try:
            await failing
        except ValueError:
            steps.append("failed")
        return steps

    async def _fails() -> None:
        raise ValueError("at once")

    assert uvloop.run(scenario()) == ["first", "rest", "failed"]
