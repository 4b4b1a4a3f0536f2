"""Dead-lettering of AMQP queues: a message rejected, expired or dropped by a length limit
is republished to its queue's dead-letter exchange with RabbitMQ's `x-death` and
`x-first-death-*` headers (in RabbitMQ's field order), unless it would go round a cycle of
queues with no rejection on the way, and only if the queue's declaring user may publish there.

A part of `VirtualHost` (`vhost.py`); `dead_lettered_properties` is the pure header rewrite.
"""

from __future__ import annotations

import datetime
import logging
from typing import TYPE_CHECKING, Any

from pamqp import encode, header
from pamqp.common import FieldArray, FieldTable

from ...core.edge import Action, Principal
from ...core.errors import PublishRejected
from ...core.message import Message
from .properties import (
    NATIVE_FORMAT,
    content_header_payload,
    native_properties,
    properties_from_message,
)
from .queues import Queue, QueueEntry
from .routing import exchange_and_key, publish_topic, queue_topic

if TYPE_CHECKING:
    from ...core.edge import Edge
    from .exchanges import Exchange

log = logging.getLogger("shardgate.protocols.amqp.vhost")


class DeadLettering:
    """The dead-lettering part of `VirtualHost` (no state of its own)."""

    name: str
    edge: Edge
    exchanges: dict[str, Exchange]

    def _dead_letter_cycle(self, message: Message, raw: bytes, queue: str) -> bool:
        """True if every queue `message` would reach has dead-lettered it before, with no
        rejection on the way: RabbitMQ drops such a message ("Messages in such cycles (i.e.
        messages that reach the same queue twice) will be dropped if there was no rejections
        in the entire cycle", https://www.rabbitmq.com/docs/dlx#routing)."""
        targets = [
            sub.owner.name for sub, filters in self.edge.match(message.topic)
            if isinstance(sub.owner, Queue)
            and (not sub.owner.checked_filters or sub.owner.accepts(message, filters))
        ]
        if not targets:
            return False
        died_in, rejected = _deaths(raw)
        died_in.add(queue)
        return not rejected and all(name in died_in for name in targets)

    def dead_letter(self, queue: Queue, entry: QueueEntry, reason: str) -> None:
        """Republish a dropped message to the queue's dead-letter exchange, if it has one."""
        queue.settle(entry)
        dlx = queue.dead_letter_exchange
        if dlx is None:
            return
        exchange = self.exchanges.get(dlx)
        if exchange is None:
            return
        original = entry.message
        old_exchange, old_key = exchange_and_key(original.topic)
        key = queue.dead_letter_routing_key
        if key is None:
            key = old_key
        headers = [(k, v) for k, v in original.headers or () if not k.startswith("x-first-death-")]
        first = {k: v for k, v in original.headers or () if k.startswith("x-first-death-")}
        if not first:
            first = {
                "x-first-death-reason": reason, "x-first-death-queue": queue.name,
                "x-first-death-exchange": old_exchange,
            }
        headers.extend(first.items())
        message = Message(
            publish_topic(exchange.name, exchange.type, key),
            original.payload,
            qos=original.qos,
            key=original.key,
            headers=headers,
            content_type=original.content_type,
            correlation_data=original.correlation_data,
            reply_to=original.reply_to,
            payload_format=original.payload_format,
            expires_at_ms=None,
            producer_protocol=original.producer_protocol,
            producer_id=original.producer_id,
            transient=original.transient,
        )
        raw = native_properties(original)
        if raw is None:
            raw = properties_from_message(original).marshal()
        if reason != "rejected" and self._dead_letter_cycle(message, raw, queue.name):
            return
        message.native_properties = {NATIVE_FORMAT: dead_lettered_properties(
            raw, reason, queue.name, old_exchange, old_key, first
        )}
        writer = Principal("amqp", queue.writer, "", "dead-lettering")
        if original.topic != queue_topic(queue.name) and not self.edge.authorize(
                writer, Action.SUBSCRIBE, original.topic):
            # Dead-lettering reads the message out of the queue as its declaring user: what
            # that user may not (or no longer) read does not leave through it.
            log.info("queue %r in vhost %r: dead-lettering refused, user %r may not read %r; "
                     "message dropped", queue.name, self.name, queue.writer, original.topic)
            return
        if not self.edge.authorize(writer, Action.PUBLISH, message.topic):
            # As if the dead-letter exchange routed it nowhere: dropped, and said so.
            log.info("queue %r in vhost %r: dead-lettering to exchange %r refused, user %r may "
                     "not publish to %r; message dropped", queue.name, self.name, exchange.name,
                     queue.writer, message.topic)
            return
        try:
            self.edge.publish(message)
        except PublishRejected:
            pass


def _deaths(raw: bytes) -> tuple[set[str], bool]:
    """Queues named in the x-death header of properties `raw`, and whether any death there
    was a rejection."""
    content = header.ContentHeader()
    content.unmarshal(content_header_payload(raw, 0))
    tables = _death_tables(content.properties.headers or {})
    return {str(d.get("queue")) for d in tables}, any(d.get("reason") == "rejected" for d in tables)


def _death_tables(headers: FieldTable) -> list[FieldTable]:
    """The tables of the x-death array in `headers`; anything else there counts as none."""
    deaths = headers.get("x-death")
    return [d for d in deaths if isinstance(d, dict)] if isinstance(deaths, list) else []


def dead_lettered_properties(
    raw: bytes, reason: str, queue: str, exchange: str, routing_key: str, first: dict[str, str],
    now: datetime.datetime | None = None,
) -> bytes:
    """The original typed properties with RabbitMQ's dead-lettering headers, expiration removed.

    As rabbit_dead_letter:update_x_death_header/2 (RabbitMQ 3.x): `x-death` is an array of
    tables, most recent first, one per (queue, reason); dying again in the same queue for the
    same reason increments that table's `count` (a long) and moves it to the front, keeping its
    other fields. A new table holds count, reason, queue, time, exchange, routing-keys (the
    routing key and any CC keys) and `original-expiration` (when the message had a per-message
    TTL). `x-first-death-reason/queue/exchange` are set on the first death
    only. A first table comes in RabbitMQ's field order (count, reason, queue, time, exchange,
    routing-keys, original-expiration); tables written while an x-death exists are sorted by
    field name. See https://www.rabbitmq.com/docs/dlx#effects."""
    content = header.ContentHeader()
    content.unmarshal(content_header_payload(raw, 0))
    props = content.properties
    headers = dict(props.headers or {})
    deaths = _death_tables(headers)
    same = [d for d in deaths if d.get("queue") == queue and d.get("reason") == reason]
    if same:
        death = dict(sorted(same[0].items()))
        count = death.get("count", 0)
        death["count"] = (count if isinstance(count, int) else 0) + 1
        deaths = [death, *(d for d in deaths if d is not same[0])]
    else:
        routing_keys: FieldArray = [routing_key]
        cc = headers.get("CC")
        if isinstance(cc, list):
            routing_keys.extend(str(k) for k in cc)
        stamp = (now or datetime.datetime.now(datetime.UTC)).replace(microsecond=0, tzinfo=None)
        death = {
            "count": 1, "reason": reason, "queue": queue, "time": stamp, "exchange": exchange,
            "routing-keys": routing_keys,
        }
        expiration = props.expiration
        if expiration:
            death["original-expiration"] = (
                expiration.decode() if isinstance(expiration, bytes) else str(expiration)
            )
        if deaths:
            death = dict(sorted(death.items()))
        deaths.insert(0, death)
    headers["x-death"] = [*deaths]  # a FieldArray (a list of tables is not one to mypy)
    for name, value in first.items():
        headers.setdefault(name, value)
    props.headers = None
    props.expiration = None
    return _with_headers(props.marshal(), headers)


# Basic property flags (AMQP 0-9-1 §4.2.6.1, class basic): content-type, content-encoding,
# headers are the first three.
_CONTENT_TYPE_FLAG, _CONTENT_ENCODING_FLAG, _HEADERS_FLAG = 0x8000, 0x4000, 0x2000


def _with_headers(raw: bytes, headers: dict[str, Any]) -> bytes:
    """Property bytes `raw` (without headers) with `headers` spliced in. pamqp sorts every
    table's fields; RabbitMQ keeps the order it writes x-death tables in, so the table is
    encoded here: top-level names sorted (as RabbitMQ sends them), nested tables in order."""
    flags = int.from_bytes(raw[:2], "big")
    pos = 2
    for flag in (_CONTENT_TYPE_FLAG, _CONTENT_ENCODING_FLAG):
        if flags & flag:
            pos += 1 + raw[pos]
    table = _ordered_table(dict(sorted(headers.items())))
    return (flags | _HEADERS_FLAG).to_bytes(2, "big") + raw[2:pos] + table + raw[pos:]


def _ordered_table(table: dict[str, Any]) -> bytes:
    parts = []
    for name, value in table.items():
        parts.append(encode.short_string(name))
        parts.append(_ordered_value(name, value))
    body = b"".join(parts)
    return len(body).to_bytes(4, "big") + body


def _ordered_value(name: str, value: Any) -> bytes:
    if isinstance(value, dict):
        return b"F" + _ordered_table(value)
    if isinstance(value, list):
        body = b"".join(_ordered_value("", item) for item in value)
        return b"A" + len(body).to_bytes(4, "big") + body
    if name == "count" and isinstance(value, int) and not isinstance(value, bool):
        return b"l" + encode.long_long_int(value)  # x-death count is a long in RabbitMQ
    return encode.encode_table_value(value)
