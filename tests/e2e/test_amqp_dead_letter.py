"""Dead-lettering headers exactly as RabbitMQ writes them (https://www.rabbitmq.com/docs/dlx,
"Dead-Lettered Messages"; rabbit_dead_letter:update_x_death_header/2), and per-message TTL
honoured only at the head of a queue (https://www.rabbitmq.com/docs/ttl, "Per-Message TTL
and Dead Lettering": "only when expired messages reach the head of a queue will they actually
be discarded (or dead-lettered)"). Each test runs against Shardgate and a real RabbitMQ node.
"""

from __future__ import annotations

import asyncio
import datetime
import uuid

import aiormq
from pamqp.commands import Basic


def unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:10]}"


async def wait_get(channel: aiormq.abc.AbstractChannel, queue: str, timeout: float = 5.0):
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        result = await channel.basic_get(queue, no_ack=True)
        if isinstance(result.delivery, Basic.GetOk):
            return result
        if loop.time() > deadline:
            raise AssertionError(f"nothing arrived in {queue}")
        await asyncio.sleep(0.02)


def check_time(death: dict) -> None:
    stamp = death["time"]
    assert isinstance(stamp, datetime.datetime)
    now = datetime.datetime.now(datetime.UTC)
    assert abs((now - stamp.replace(tzinfo=datetime.UTC)).total_seconds()) < 60


async def setup(channel: aiormq.abc.AbstractChannel, **arguments) -> tuple[str, str, str]:
    dlx = unique("dlx")
    await channel.exchange_declare(dlx, exchange_type="fanout", auto_delete=True)
    dead = (await channel.queue_declare(unique("dead"), exclusive=True)).queue
    await channel.queue_bind(dead, dlx, "")
    work = (await channel.queue_declare(unique("work"), exclusive=True, arguments={
        "x-dead-letter-exchange": dlx, **arguments,
    })).queue
    return dlx, dead, work


async def test_expired_then_expired_again_then_rejected(amqp_broker_url):
    conn = await aiormq.connect(amqp_broker_url)
    try:
        channel = await conn.channel()
        dlx, dead, work = await setup(channel)
        await channel.basic_publish(b"a", routing_key=work, properties=Basic.Properties(
            expiration="50", headers={"h": 1},
        ))
        first = await wait_get(channel, dead)
        props = first.header.properties
        assert (first.delivery.exchange, first.delivery.routing_key) == (dlx, work)
        assert props.expiration is None  # removed, kept as original-expiration
        death = props.headers["x-death"][0]
        check_time(death)
        assert list(death) == [
            "count", "reason", "queue", "time", "exchange", "routing-keys", "original-expiration",
        ]
        assert {k: v for k, v in death.items() if k != "time"} == {
            "count": 1, "reason": "expired", "queue": work, "exchange": "",
            "routing-keys": [work], "original-expiration": "50",
        }
        assert props.headers["h"] == 1
        assert {k: v for k, v in props.headers.items() if k.startswith("x-first-death-")} == {
            "x-first-death-reason": "expired", "x-first-death-queue": work,
            "x-first-death-exchange": "",
        }
        # The same message dies again in the same queue for the same reason: count 2.
        await channel.basic_publish(b"a", routing_key=work, properties=Basic.Properties(
            expiration="50", headers=props.headers,
        ))
        second = (await wait_get(channel, dead)).header.properties.headers
        assert len(second["x-death"]) == 1 and second["x-death"][0]["count"] == 2
        assert second["x-death"][0]["time"] == death["time"]  # the first death's time is kept
        # Rejected: a new table goes in front, the expired one stays with its count.
        await channel.basic_publish(b"b", routing_key=work, properties=Basic.Properties(
            headers=second,
        ))
        got = await channel.basic_get(work)
        await channel.basic_reject(got.delivery.delivery_tag, requeue=False)
        third = (await wait_get(channel, dead)).header.properties.headers
        assert [(d["reason"], d["count"]) for d in third["x-death"]] == [("rejected", 1), ("expired", 2)]
        assert list(third["x-death"][0]) == sorted(third["x-death"][0])
        assert "original-expiration" not in third["x-death"][0]
        assert third["x-first-death-reason"] == "expired"
    finally:
        await conn.close()


async def test_maxlen_dead_letter_keeps_exchange_and_cc_routing_keys(amqp_broker_url):
    conn = await aiormq.connect(amqp_broker_url)
    try:
        channel = await conn.channel()
        _, dead, work = await setup(channel, **{"x-max-length": 1})
        key = unique("k")
        await channel.queue_bind(work, "amq.direct", key)
        await channel.basic_publish(b"c1", exchange="amq.direct", routing_key=key,
                                    properties=Basic.Properties(headers={"CC": ["cc1"]}))
        await channel.basic_publish(b"c2", exchange="amq.direct", routing_key=key)
        dropped = await wait_get(channel, dead)
        assert dropped.body == b"c1" and dropped.delivery.routing_key == key
        death = dropped.header.properties.headers["x-death"][0]
        assert (death["reason"], death["queue"], death["exchange"], death["routing-keys"]) == (
            "maxlen", work, "amq.direct", [key, "cc1"],
        )
        assert dropped.header.properties.headers["x-first-death-exchange"] == "amq.direct"
    finally:
        await conn.close()


async def test_per_message_ttl_expires_only_at_the_head(amqp_broker_url):
    conn = await aiormq.connect(amqp_broker_url)
    try:
        channel = await conn.channel()
        _, dead, work = await setup(channel)
        await channel.basic_publish(b"long", routing_key=work,
                                    properties=Basic.Properties(expiration="60000"))
        await channel.basic_publish(b"short", routing_key=work,
                                    properties=Basic.Properties(expiration="10"))
        marker = (await channel.queue_declare(unique("marker"), exclusive=True,
                                              arguments={"x-message-ttl": 300})).queue
        await channel.basic_publish(b"m", routing_key=marker)
        for _ in range(200):  # until a 300 ms TTL has surely passed (the marker is gone)
            if (await channel.queue_declare(marker, passive=True)).message_count == 0:
                break
            await asyncio.sleep(0.02)
        # "short" expired long ago but sits behind "long": neither is dead-lettered yet.
        assert (await channel.queue_declare(work, passive=True)).message_count == 2
        assert (await channel.queue_declare(dead, passive=True)).message_count == 0
        head = await channel.basic_get(work, no_ack=True)
        assert head.body == b"long"
        # Now "short" is at the head: it is dead-lettered, never delivered.
        late = await wait_get(channel, dead)
        assert late.body == b"short"
        assert late.header.properties.headers["x-death"][0]["original-expiration"] == "10"
    finally:
        await conn.close()


async def test_dead_letter_cycle_without_rejection_is_dropped(amqp_broker_url):
    """A queue that dead-letters expired messages back to itself (the default exchange, no
    dead-letter routing key): the message reaches the same queue twice with no rejection on the
    way, so RabbitMQ drops it (https://www.rabbitmq.com/docs/dlx#routing)."""
    conn = await aiormq.connect(amqp_broker_url)
    try:
        channel = await conn.channel()
        loop = (await channel.queue_declare(unique("loop"), exclusive=True, arguments={
            "x-message-ttl": 30, "x-dead-letter-exchange": "",
        })).queue
        marker = (await channel.queue_declare(unique("marker"), exclusive=True,
                                              arguments={"x-message-ttl": 400})).queue
        await channel.basic_publish(b"m", routing_key=marker)
        await channel.basic_publish(b"cycling?", routing_key=loop)
        for _ in range(300):  # until 400 ms have surely passed: many 30 ms TTLs
            if (await channel.queue_declare(marker, passive=True)).message_count == 0:
                break
            await asyncio.sleep(0.02)
        assert (await channel.queue_declare(loop, passive=True)).message_count == 0
        assert (await channel.basic_get(loop, no_ack=True)).delivery.__class__ is Basic.GetEmpty
    finally:
        await conn.close()
