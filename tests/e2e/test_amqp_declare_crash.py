"""A durable queue declared and filled with confirmed messages survives a SIGKILL that comes
right after the last confirm: the queue's definition and its starting position are saved
before declare-ok, not with the next periodic flush (RabbitMQ: a durable queue's declare-ok
means the queue is on disk)."""

from __future__ import annotations

from pathlib import Path

import pika

from tests.conftest import free_port


def test_durable_queue_and_confirmed_messages_survive_an_immediate_sigkill(
    broker_process, tmp_path: Path
) -> None:
    port = free_port()
    node = broker_process(tmp_path / "data", extra_args=["--amqp-port", str(port)]).start()
    params = pika.ConnectionParameters("127.0.0.1", port, heartbeat=0)
    connection = pika.BlockingConnection(params)
    channel = connection.channel()
    channel.confirm_delivery()
    channel.queue_declare("jobs", durable=True)
    for i in range(20):
        channel.basic_publish(
            "", "jobs", f"job-{i}".encode(),
            pika.BasicProperties(delivery_mode=2), mandatory=True,
        )
    node.kill()  # right after the last confirm: no periodic save had a chance to run
    node.start()
    with pika.BlockingConnection(params) as connection:
        channel = connection.channel()
        assert channel.queue_declare("jobs", passive=True).method.message_count == 20
        bodies = []
        for _ in range(20):
            method, _props, body = channel.basic_get("jobs", auto_ack=True)
            assert method is not None
            bodies.append(body.decode())
        assert bodies == [f"job-{i}" for i in range(20)]
