"""Out-of-range values in a gRPC publish are the client's error: INVALID_ARGUMENT with a reason,
and the message is not delivered (a retry would otherwise duplicate it). A valid delay is
acknowledged (a held message has no offset yet) and delivered once due."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from shardgate.client import Client, InvalidArgument

from tests.conftest import ThreadedBroker, free_port

TIMEOUT = 10.0


@pytest.fixture
def url(broker_factory: Callable[..., ThreadedBroker]) -> str:
    broker = broker_factory(listeners={"grpc_port": free_port()})
    return f"127.0.0.1:{broker.app.port('grpc')}"


async def test_out_of_range_ttl_and_delay_are_invalid_and_not_delivered(url: str) -> None:
    async with Client(url) as client:
        consumer = await client.consumer("bad-values", ["bad/#"]).subscribe()
        producer = client.producer()
        with pytest.raises(InvalidArgument, match="ttl_ms"):
            await producer.publish("bad/ttl", b"1", ttl_ms=2**63 - 1)
        for name, value in (("x-delay", "-1"), ("x-delay", str(2**63)), ("x-deliver-at", str(2**70)),
                            ("x-delay", "soon")):
            with pytest.raises(InvalidArgument, match=name):
                await producer.publish("bad/delay", b"2", headers={name: value})
        await producer.publish("bad/ok", b"3")
        message = await consumer.receive(TIMEOUT)
        assert (message.topic, message.payload) == ("bad/ok", b"3")  # nothing refused came first
        message.ack()
        await consumer.close()


async def test_valid_delay_is_acknowledged_and_delivered(url: str) -> None:
    async with Client(url) as client:
        consumer = await client.consumer("delayed-ok", ["later/#"]).subscribe()
        await client.producer().publish("later/x", b"held", headers={"x-delay": "200"})
        message = await consumer.receive(TIMEOUT)
        assert (message.topic, message.payload) == ("later/x", b"held")
        message.ack()
        await consumer.close()
