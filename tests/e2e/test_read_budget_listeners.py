"""One read budget per event-loop turn for every client listener (`listeners.read_budget_s`,
`protocols/read_budget.py`): busy publishers over MQTT, MQTT over WebSocket and AMQP on one
broker all progress, nothing they were acknowledged for is lost, and a new MQTT client's
CONNECT and a new AMQP client's connection.open are answered while they run. A negative
budget leaves every read after a turn's first for a later turn, so that every publisher's
reads go through the deferred path again and again."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable

import aio_pika
import pytest
from shardgate.protocols.mqtt import packets as p

from tests.conftest import ThreadedBroker, free_port
from tests.mqtt_clients import V5, Paho, RawClient

PAYLOAD = bytes(512)
# Each publisher's acknowledgements seen while the others run, before a new client connects.
PROGRESS = 300
TIMEOUT = 60.0


class Progress:
    """What a publisher thread has had acknowledged, waited on by the test."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.acknowledged = 0
        self.error: BaseException | None = None
        self._changed = threading.Condition()

    def add(self, count: int) -> None:
        with self._changed:
            self.acknowledged += count
            self._changed.notify_all()

    def failed(self, error: BaseException) -> None:
        with self._changed:
            self.error = error
            self._changed.notify_all()

    def wait_beyond(self, count: int, timeout: float = TIMEOUT) -> None:
        with self._changed:
            self._changed.wait_for(lambda: self.error is not None or self.acknowledged >= count,
                                   timeout)
        assert self.error is None, f"{self.name} publisher failed: {self.error!r}"
        assert self.acknowledged >= count, f"{self.name}: {self.acknowledged} of {count} acknowledged"


def mqtt_publisher(port: int, transport: str, progress: Progress, stop: threading.Event) -> None:
    """QoS 1 in windows of 100 until told to stop."""
    try:
        client = Paho(port, f"busy-{transport}", V5, transport=transport)
        n = 0
        while not stop.is_set():
            infos = [client.publish(f"busy/{transport}", PAYLOAD, 1, wait=False) for _ in range(100)]
            for info in infos:
                info.wait_for_publish(TIMEOUT)
                assert info.is_published(), "PUBACK missing"
            n += len(infos)
            progress.add(len(infos))
        client.disconnect()
    except BaseException as exc:  # noqa: BLE001  (reported to the test thread)
        progress.failed(exc)


def amqp_publisher(url: str, progress: Progress, stop: threading.Event) -> None:
    """Persistent messages with publisher confirms, 100 outstanding at a time, until told to stop."""

    async def run() -> None:
        connection = await aio_pika.connect(url)
        async with connection:
            channel = await connection.channel(publisher_confirms=True)
            exchange = await channel.get_exchange("amq.topic")
            while not stop.is_set():
                await asyncio.gather(*(
                    exchange.publish(aio_pika.Message(PAYLOAD, delivery_mode=2), "busy.amqp")
                    for _ in range(100)))
                progress.add(100)

    try:
        asyncio.run(run())
    except BaseException as exc:  # noqa: BLE001
        progress.failed(exc)


async def open_amqp(url: str) -> None:
    connection = await asyncio.wait_for(aio_pika.connect(url), TIMEOUT)
    await connection.close()


@pytest.mark.parametrize("budget_s", [0.002, -1.0], ids=["default", "every-read-deferred"])
def test_busy_publishers_of_every_listener_progress_and_new_clients_are_answered(
    broker_factory: Callable[..., ThreadedBroker], budget_s: float,
) -> None:
    broker = broker_factory(listeners={"amqp_port": free_port(), "read_budget_s": budget_s})
    url = f"amqp://guest:guest@127.0.0.1:{broker.app.port('amqp')}/"
    # the three listeners' services share the broker's one budget
    assert broker.app.mqtt.read_budget is broker.app.amqp.read_budget is broker.app.read_budget
    subscriber = Paho(broker.mqtt_port, "busy-sub", V5)
    subscriber.subscribe("busy/#", 0)
    stop = threading.Event()
    progress = {name: Progress(name) for name in ("tcp", "websockets", "amqp")}
    threads = [
        threading.Thread(target=mqtt_publisher, args=(broker.mqtt_port, "tcp", progress["tcp"], stop)),
        threading.Thread(target=mqtt_publisher,
                         args=(broker.ws_port, "websockets", progress["websockets"], stop)),
        threading.Thread(target=amqp_publisher, args=(url, progress["amqp"], stop)),
    ]
    for thread in threads:
        thread.start()
    try:
        for each in progress.values():
            each.wait_beyond(PROGRESS)
        # New clients are answered while all three publish.
        late = RawClient(broker.mqtt_port, version=5)
        late.send(p.Connect("MQTT", 5, True, 60, "late"))
        assert isinstance(late.receive(TIMEOUT), p.Connack)
        late.close()
        asyncio.run(open_amqp(url))
        # ... and every publisher still progresses after that.
        for each in progress.values():
            each.wait_beyond(each.acknowledged + PROGRESS)
    finally:
        stop.set()
        for thread in threads:
            thread.join(TIMEOUT)
    assert not any(thread.is_alive() for thread in threads)
    for each in progress.values():
        assert each.error is None, f"{each.name} publisher failed: {each.error!r}"
    subscriber.disconnect()
