"""gRPC publishes whose header, content type or reply-to text no other protocol could carry
(U+0000, more than 65535 bytes) get INVALID_ARGUMENT; MQTT 5 subscribers of the same topic
are never sent a malformed packet, and good messages still flow."""

from __future__ import annotations

import pytest
from shardgate.client import InvalidArgument, SyncClient

from tests.conftest import free_port
from tests.mqtt_clients import V5, Paho


def test_text_other_protocols_cannot_carry_is_refused(broker_factory) -> None:
    broker = broker_factory(listeners={"grpc_port": free_port()})
    subscriber = Paho(broker.mqtt_port, "text-watcher", V5)
    subscriber.subscribe("text/#", 1)
    with SyncClient(f"127.0.0.1:{broker.app.port('grpc')}") as client:
        producer = client.producer()
        for fields in ({"headers": [("k", "a\x00b")]}, {"headers": [("k\x00", "v")]},
                       {"content_type": "text/\x00"}, {"reply_to": "r\x00"},
                       {"headers": [("big", "x" * 70_000)]}):
            with pytest.raises(InvalidArgument):
                producer.publish("text/bad", b"no", **fields)
        producer.publish("text/good", b"yes", headers=[("k", "v"), ("k", "w")])
    message = subscriber.expect()
    assert (message.topic, message.payload) == ("text/good", b"yes")
    assert message.properties.UserProperty == [("k", "v"), ("k", "w")]
    subscriber.expect_none()
