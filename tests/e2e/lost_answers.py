"""A TCP proxy in front of a broker's gRPC port that loses the broker's answers on demand, as a
network or a dying node does: while `dropping`, what the broker sends is discarded (what the
client sends still arrives); `cut()` then breaks every connection (reset), so the client sees
its calls fail and retries them; `close()` stops listening too (a client given more addresses
moves on to the next one).
"""

from __future__ import annotations

import asyncio
import contextlib


class AnswerLosingProxy:
    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.dropping = False
        self.dropped_bytes = 0
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self._tasks: set[asyncio.Task[None]] = set()

    async def start(self) -> AnswerLosingProxy:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return self

    @property
    def port(self) -> int:
        assert self._server is not None
        return int(self._server.sockets[0].getsockname()[1])

    async def _serve(self, client_reader: asyncio.StreamReader,
                     client_writer: asyncio.StreamWriter) -> None:
        try:
            broker_reader, broker_writer = await asyncio.open_connection("127.0.0.1", self.target_port)
        except OSError:
            client_writer.transport.abort()
            return
        self._writers |= {client_writer, broker_writer}
        pipes = [asyncio.ensure_future(self._pipe(client_reader, broker_writer, False)),
                 asyncio.ensure_future(self._pipe(broker_reader, client_writer, True))]
        self._tasks.update(pipes)
        try:
            await asyncio.wait(pipes, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in pipes:
                task.cancel()
                self._tasks.discard(task)
            for writer in (client_writer, broker_writer):
                writer.transport.abort()
                self._writers.discard(writer)

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                    answers: bool) -> None:
        with contextlib.suppress(OSError, asyncio.IncompleteReadError):
            while data := await reader.read(65536):
                if answers and self.dropping:
                    self.dropped_bytes += len(data)
                    continue
                writer.write(data)
                await writer.drain()

    def cut(self) -> None:
        """Reset every connection made through the proxy."""
        for writer in list(self._writers):
            writer.transport.abort()
        self._writers.clear()

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None
        self.cut()
        for task in list(self._tasks):
            task.cancel()
