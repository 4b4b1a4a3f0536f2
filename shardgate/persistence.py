"""Wiring the core's persistence hooks to the metadata store: cursors saved in batches,
retained messages, and streams declared at run time."""

from __future__ import annotations

import asyncio
import logging

from .core.broker import Broker
from .core.message import Message, message_from_record
from .storage.metadata import CursorRecord, MetadataStore
from .storage.records import decode_message, encode_message

log = logging.getLogger(__name__)

CURSOR_SAVE_INTERVAL_S = 0.2


class MetadataCursorSink:
    """Collects cursor changes from durable subscriptions and writes them in one transaction."""

    def __init__(self, store: MetadataStore) -> None:
        self.store = store
        self._pending: dict[tuple[str, str, int], CursorRecord] = {}

    def save_cursor(self, subscription: str, stream: str, shard: int, floor: int, state: bytes) -> None:
        self._pending[(subscription, stream, shard)] = CursorRecord(subscription, stream, shard, floor, state)

    def flush(self) -> None:
        self.write()

    def write(self) -> None:
        if not self._pending:
            return
        batch, self._pending = list(self._pending.values()), {}
        try:
            self.store.put_cursors(batch)
        except Exception:
            log.exception("could not save %d cursors", len(batch))


class Persistence:
    """Periodic saving of cursors, and retained messages kept in the metadata store."""

    def __init__(self, broker: Broker, store: MetadataStore) -> None:
        self.broker = broker
        self.store = store
        self.sink = MetadataCursorSink(store)
        broker.cursor_sink = self.sink
        self._task: asyncio.Task[None] | None = None

    def restore_retained(self) -> int:
        count = 0
        for topic, data in self.store.list_retained():
            try:
                record = decode_message(data)
            except ValueError:
                log.error("retained message for %r is unreadable; dropped", topic)
                continue
            message = message_from_record(record, "", 0, -1)
            self.broker.retained.set(topic, message)
            count += 1
        self.broker.on_retained_change = self._retained_changed
        return count

    def _retained_changed(self, topic: str, message: Message | None) -> None:
        if topic.startswith("$SYS/"):
            return
        try:
            if message is None:
                self.store.delete_retained(topic)
            else:
                self.store.put_retained(topic, encode_message(message))
        except Exception:
            log.exception("could not save the retained message of %r", topic)

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(CURSOR_SAVE_INTERVAL_S)
            self.flush()

    def flush(self) -> None:
        self.broker.save_cursors()
        self.sink.write()

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
        self.flush()
