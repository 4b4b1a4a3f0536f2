"""Durable AMQP queues across a SIGKILL and restart of a `shardgate serve` process: the durable
exchange, the queue with its arguments and bindings, and every confirmed but unacknowledged
message come back (acknowledged ones may come back once more: at-least-once, never lost)."""

from __future__ import annotations

import pika
import pytest
from pika.exceptions import ChannelClosedByBroker

from tests.conftest import free_port, wait_for


def persisted(data_dir, subscription: str) -> bool:
    """The composition root saved the queue's durable subscription and its cursor (it does so
    every 0.2 s); read the metadata store from outside, read-only."""
    import sqlite3

    with sqlite3.connect(f"file:{data_dir / 'metadata.db'}?mode=ro", uri=True) as db:
        subs = db.execute("select count(*) from subscriptions where name = ?", (subscription,))
        cursors = db.execute("select count(*) from cursors where subscription = ?", (subscription,))
        return subs.fetchone()[0] > 0 and cursors.fetchone()[0] > 0


def topology_record(data_dir) -> bytes:
    """The saved AMQP topology of vhost "/" (a retained message), read-only; b"" if none."""
    import sqlite3

    with sqlite3.connect(f"file:{data_dir / 'metadata.db'}?mode=ro", uri=True) as db:
        row = db.execute(
            "select data from retained where topic like '%topology/%2F'"
        ).fetchone()
    return bytes(row[0]) if row else b""


def connect(port: int) -> pika.BlockingConnection:
    return pika.BlockingConnection(pika.ConnectionParameters("127.0.0.1", port, heartbeat=0))


def drain(channel, queue: str) -> list[bytes]:
    bodies = []
    while True:
        method, _, body = channel.basic_get(queue)
        if method is None:
            return bodies
        bodies.append(body)
        channel.basic_ack(method.delivery_tag)


def test_durable_queue_keeps_confirmed_messages_across_sigkill(broker_process, tmp_path):
    port = free_port()
    node = broker_process(tmp_path / "data", extra_args=["--amqp-port", str(port)]).start()
    with connect(port) as conn:
        channel = conn.channel()
        channel.confirm_delivery()
        channel.exchange_declare("orders", "direct", durable=True)
        channel.queue_declare("billing", durable=True, arguments={"x-max-length": 1000})
        channel.queue_bind("billing", "orders", "new")
        channel.queue_declare("scratch", durable=False)
        for i in range(10):
            channel.basic_publish("orders", "new", b"order-%d" % i,
                                  pika.BasicProperties(delivery_mode=2), mandatory=True)
        acked = []
        for _ in range(3):
            method, _, body = channel.basic_get("billing")
            channel.basic_ack(method.delivery_tag)
            acked.append(body)
    wait_for(lambda: persisted(tmp_path / "data", "amqp:/:billing"))
    node.kill()
    node.start()
    with connect(port) as conn:
        channel = conn.channel()
        channel.confirm_delivery()
        # the queue, its arguments and its binding to the durable exchange are back
        declared = channel.queue_declare("billing", durable=True, arguments={"x-max-length": 1000})
        assert declared.method.message_count >= 7
        channel.basic_publish("orders", "new", b"after-restart",
                              pika.BasicProperties(delivery_mode=2), mandatory=True)
        bodies = drain(channel, "billing")
        unacked = {b"order-%d" % i for i in range(3, 10)}
        assert unacked <= set(bodies)
        assert set(bodies) <= unacked | set(acked) | {b"after-restart"}
        assert bodies[-1] == b"after-restart"
        with pytest.raises(ChannelClosedByBroker) as info:
            channel.queue_declare("scratch", passive=True)
        assert info.value.reply_code == 404
    node.terminate()


def test_committed_transaction_survives_sigkill_right_after_commit_ok(broker_process, tmp_path):
    """tx.commit-ok comes only once the transaction's publishes to a reliable stream are
    journaled: a SIGKILL right after it loses none of them; a rolled-back publish never
    appears."""
    port = free_port()
    node = broker_process(tmp_path / "data", extra_args=["--amqp-port", str(port)]).start()
    conn = connect(port)
    channel = conn.channel()
    channel.queue_declare("ledger", durable=True)
    wait_for(lambda: persisted(tmp_path / "data", "amqp:/:ledger"))
    channel.tx_select()
    channel.basic_publish("", "ledger", b"rolled-back", pika.BasicProperties(delivery_mode=2))
    channel.tx_rollback()
    for i in range(20):
        channel.basic_publish("", "ledger", b"entry-%d" % i, pika.BasicProperties(delivery_mode=2))
    channel.tx_commit()
    node.kill()
    node.start()
    with connect(port) as conn:
        channel = conn.channel()
        assert drain(channel, "ledger") == [b"entry-%d" % i for i in range(20)]
    node.terminate()


def test_durable_exchange_binding_survives_a_restart(broker_process, tmp_path):
    """An exchange-to-exchange binding between durable exchanges is durable (RabbitMQ keeps a
    binding whose both ends are durable) and routes again after SIGKILL and restart."""
    port = free_port()
    node = broker_process(tmp_path / "data", extra_args=["--amqp-port", str(port)]).start()
    conn = connect(port)
    channel = conn.channel()
    channel.exchange_declare("ingress", "topic", durable=True)
    channel.exchange_declare("audit", "fanout", durable=True)
    channel.exchange_bind("audit", "ingress", "orders.#")
    channel.queue_declare("audit-log", durable=True)
    channel.queue_bind("audit-log", "audit")
    wait_for(lambda: persisted(tmp_path / "data", "amqp:/:audit-log"))
    wait_for(lambda: b"exchange_bindings" in topology_record(tmp_path / "data")
             and b'"audit-log"' in topology_record(tmp_path / "data"))
    node.kill()
    node.start()
    with connect(port) as conn:
        channel = conn.channel()
        channel.confirm_delivery()
        channel.basic_publish("ingress", "orders.eu.new", b"o-1", mandatory=True)
        channel.basic_publish("ingress", "payments.eu", b"p-1")
        assert drain(channel, "audit-log") == [b"o-1"]
    node.terminate()


def saved_unacked(data_dir, subscription: str) -> int:
    """How many unacknowledged offsets the saved cursors of `subscription` hold (read-only)."""
    import sqlite3

    from shardgate.core.durable import decode_cursor_state

    with sqlite3.connect(f"file:{data_dir / 'metadata.db'}?mode=ro", uri=True) as db:
        rows = db.execute("select acked from cursors where subscription = ?", (subscription,))
        return sum(len(decode_cursor_state(bytes(row[0]))[1]) for row in rows if row[0])


@pytest.mark.parametrize("stop", ["terminate", "kill"])
async def test_a_message_held_unacknowledged_across_a_restart_comes_back_redelivered(
        broker_process, tmp_path, stop):
    """As in RabbitMQ: a message an aio-pika consumer held unacknowledged when the broker
    stopped (SIGTERM or SIGKILL) is delivered again with `redelivered` set; one published
    after the restart is a first delivery, without it."""
    import asyncio

    import aio_pika

    port = free_port()
    data_dir = tmp_path / "data"
    node = broker_process(data_dir, extra_args=["--amqp-port", str(port)]).start()
    url = f"amqp://guest:guest@127.0.0.1:{port}/"
    conn = await aio_pika.connect(url)
    try:
        channel = await conn.channel()
        await channel.set_qos(prefetch_count=1)
        queue = await channel.declare_queue("held", durable=True)
        await channel.default_exchange.publish(
            aio_pika.Message(b"held-1", delivery_mode=aio_pika.DeliveryMode.PERSISTENT), "held")
        held: asyncio.Queue[aio_pika.abc.AbstractIncomingMessage] = asyncio.Queue()
        await queue.consume(held.put)
        first = await asyncio.wait_for(held.get(), 10)
        assert (first.body, first.redelivered) == (b"held-1", False)
        await asyncio.to_thread(wait_for, lambda: saved_unacked(data_dir, "amqp:/:held") == 1)
        if stop == "kill":
            node.kill()
        else:
            assert node.terminate() == 0
    finally:
        await conn.close()
    node.start()
    async with await aio_pika.connect(url) as conn:
        channel = await conn.channel()
        queue = await channel.declare_queue("held", durable=True)
        await channel.default_exchange.publish(
            aio_pika.Message(b"fresh-1", delivery_mode=aio_pika.DeliveryMode.PERSISTENT), "held")
        got = []
        async with queue.iterator() as messages:
            async for message in messages:
                await message.ack()
                got.append((message.body, message.redelivered))
                if len(got) == 2:
                    break
        assert got == [(b"held-1", True), (b"fresh-1", False)]
    node.terminate()
