"""Redeclaring queues and exchanges differently, and invalid arguments, get RabbitMQ's exact
reply codes and texts (rabbit_amqqueue:assert_equivalence/5, rabbit_misc:
assert_args_equivalence/4, rabbit_exchange:assert_equivalence/6). Runs against Shardgate and a
real RabbitMQ node; argument types are as aiormq encodes them (100 is a 'byte').
"""

from __future__ import annotations

import uuid

import aiormq
import pytest
from pamqp.commands import Basic

LOCKED = (
    "RESOURCE_LOCKED - cannot obtain exclusive access to locked queue '{q}' in vhost '/'. It "
    "could be originally declared on another connection or the exclusive property value does "
    "not match that of the original declaration."
)
CASES = [
    ("durable", lambda c, q: c.queue_declare(q, durable=True, auto_delete=True, arguments={"x-message-ttl": 100}),
     "PRECONDITION_FAILED - inequivalent arg 'durable' for queue '{q}' in vhost '/': received 'true' but current is 'false'"),
    ("auto_delete", lambda c, q: c.queue_declare(q, auto_delete=False, arguments={"x-message-ttl": 100}),
     "PRECONDITION_FAILED - inequivalent arg 'auto_delete' for queue '{q}' in vhost '/': received 'false' but current is 'true'"),
    ("exclusive", lambda c, q: c.queue_declare(q, exclusive=True, auto_delete=True, arguments={"x-message-ttl": 100}),
     LOCKED),
    ("ttl changed", lambda c, q: c.queue_declare(q, auto_delete=True, arguments={"x-message-ttl": 200}),
     "PRECONDITION_FAILED - inequivalent arg 'x-message-ttl' for queue '{q}' in vhost '/': received '200' but current is '100'"),
    ("ttl left out", lambda c, q: c.queue_declare(q, auto_delete=True),
     "PRECONDITION_FAILED - inequivalent arg 'x-message-ttl' for queue '{q}' in vhost '/': received none but current is the value '100' of type 'byte'"),
    ("max-length added", lambda c, q: c.queue_declare(q, auto_delete=True, arguments={"x-message-ttl": 100, "x-max-length": 5}),
     "PRECONDITION_FAILED - inequivalent arg 'x-max-length' for queue '{q}' in vhost '/': received the value '5' of type 'byte' but current is none"),
    ("negative ttl", lambda c, q: c.queue_declare("new-" + q, auto_delete=True, arguments={"x-message-ttl": -1}),
     "PRECONDITION_FAILED - invalid arg 'x-message-ttl' for queue 'new-{q}' in vhost '/': {{value_negative,-1}}"),
    ("ttl as text", lambda c, q: c.queue_declare("new-" + q, auto_delete=True, arguments={"x-message-ttl": "x"}),
     "PRECONDITION_FAILED - invalid arg 'x-message-ttl' for queue 'new-{q}' in vhost '/': \"expected integer, got longstr\""),
    ("exchange type", lambda c, q: c.exchange_declare("x-" + q, exchange_type="fanout", auto_delete=True),
     "PRECONDITION_FAILED - inequivalent arg 'type' for exchange 'x-{q}' in vhost '/': received 'fanout' but current is 'direct'"),
    ("exchange durable", lambda c, q: c.exchange_declare("x-" + q, exchange_type="direct", durable=True, auto_delete=True),
     "PRECONDITION_FAILED - inequivalent arg 'durable' for exchange 'x-{q}' in vhost '/': received 'true' but current is 'false'"),
    ("exchange auto_delete", lambda c, q: c.exchange_declare("x-" + q, exchange_type="direct"),
     "PRECONDITION_FAILED - inequivalent arg 'auto_delete' for exchange 'x-{q}' in vhost '/': received 'false' but current is 'true'"),
    ("bind to a missing queue", lambda c, q: c.queue_bind("missing-" + q, "x-" + q, "k"),
     "NOT_FOUND - no queue 'missing-{q}' in vhost '/'"),
    ("publish to a missing exchange", lambda c, q: c.basic_publish(b"x", exchange="missing-" + q, routing_key="k"),
     "NOT_FOUND - no exchange 'missing-{q}' in vhost '/'"),
    ("publish to an internal exchange", lambda c, q: c.basic_publish(b"x", exchange="internal-" + q, routing_key="k"),
     "ACCESS_REFUSED - cannot publish to internal exchange 'internal-{q}' in vhost '/'"),
    ("user-id of someone else", lambda c, q: c.basic_publish(b"x", routing_key=q, properties=Basic.Properties(user_id="bob")),
     "PRECONDITION_FAILED - user_id property set to 'bob' but authenticated user was 'guest'"),
    ("bind to the default exchange", lambda c, q: c.queue_bind(q, "", "k"),
     "ACCESS_REFUSED - operation not permitted on the default exchange"),
    ("ack of an unknown delivery tag", lambda c, q: _ack_then_round_trip(c, 7),
     "PRECONDITION_FAILED - unknown delivery tag 7"),
]


async def _ack_then_round_trip(channel: aiormq.abc.AbstractChannel, tag: int) -> None:
    await channel.basic_ack(tag)
    await channel.basic_qos(prefetch_count=1)  # the channel.close arrives before qos-ok


async def test_redeclare_and_argument_errors(amqp_broker_url):
    conn = await aiormq.connect(amqp_broker_url)
    try:
        queue = f"q-{uuid.uuid4().hex[:10]}"
        channel = await conn.channel()
        await channel.queue_declare(queue, auto_delete=True, arguments={"x-message-ttl": 100})
        await channel.exchange_declare("x-" + queue, exchange_type="direct", auto_delete=True)
        await channel.queue_bind(queue, "x-" + queue, "k")  # keeps the exchange alive
        await channel.exchange_declare("internal-" + queue, exchange_type="fanout",
                                       auto_delete=True, internal=True)
        for label, attempt, text in CASES:
            channel = await conn.channel()
            with pytest.raises(aiormq.exceptions.AMQPChannelError) as raised:
                await attempt(channel, queue)
            assert raised.value.args[0] == text.format(q=queue), label
    finally:
        await conn.close()
