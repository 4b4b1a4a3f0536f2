"""AMQP basic properties ⇄ core `Message` fields.

Core fields: content-type, headers (as text, see `header_text`), correlation-id (as `correlation_data` bytes),
reply-to, expiration (relative ms ⇄ absolute `expires_at_ms`). Properties without a core field
ride in headers with an `amqp-` prefix (`amqp-delivery-mode`, `amqp-priority`,
`amqp-message-id`, `amqp-timestamp`, `amqp-type`, `amqp-user-id`, `amqp-app-id`,
`amqp-content-encoding`) and are restored on the way out. A persistent message (delivery-mode 2)
is QoS 1 for MQTT subscribers and an MQTT QoS>0 message is persistent for AMQP consumers.

Messages published over AMQP also keep the exact property bytes they came with (the content
header's property flags and list, §4.2.6.1, as pamqp parsed them) as the message's native
properties in format `amqp-0-9-1`. The journal and the archive keep those bytes, so AMQP
consumers get typed headers (void, booleans, integers of each width, floats, decimals,
timestamps, byte arrays, nested tables and arrays) and every basic property back unchanged, also
after a restart or from the archive, and the properties are encoded once for every consumer.
"""

from __future__ import annotations

import base64
import datetime
import json
import struct
from typing import TYPE_CHECKING, Any

from pamqp import commands
from pamqp import header as pamqp_header

from ...core.message import Message, now_ms
from .routing import header_value

if TYPE_CHECKING:
    from .hotpath import BasicProperties

PROPERTIES_KEY = "amqp-properties"
"""Key of the properties encoded for a message from another protocol in `Message.encoded`."""
NATIVE_FORMAT = "amqp-0-9-1"
"""The name of AMQP's exact property encoding in `Message.native_properties`."""
_PREFIX = "amqp-"
_EXTRA = {
    "delivery_mode": "amqp-delivery-mode",
    "priority": "amqp-priority",
    "message_id": "amqp-message-id",
    "message_type": "amqp-type",
    "user_id": "amqp-user-id",
    "app_id": "amqp-app-id",
    "content_encoding": "amqp-content-encoding",
}
_INT_PROPS = {"delivery_mode", "priority"}


def _text(value: object) -> str | None:
    """A shortstr property as text (pamqp hands back bytes when it is not valid UTF-8)."""
    if value is None or value == "":
        return None
    if isinstance(value, bytes | bytearray):
        return bytes(value).decode("utf-8", "replace")
    return str(value)


def _json_ready(value: object) -> object:
    if isinstance(value, dict):
        return {str(k): _json_ready(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_json_ready(v) for v in value]
    if value is None or isinstance(value, bool | int | float | str):
        return value
    return header_text(value)


def header_text(value: object) -> str:
    """An AMQP field value as the text of a core header, which MQTT 5 user properties and gRPC
    metadata carry: strings, integers, booleans (`true`/`false`) and void (empty) as the
    headers exchange compares them; nested tables and arrays as JSON; timestamps in ISO 8601;
    byte arrays as UTF-8 where they are, else `base64:` and their Base64. U+0000, which an
    MQTT string must not hold [MQTT-1.5.4-2], becomes U+FFFD. The exact typed value stays in
    the native properties for AMQP consumers."""
    if isinstance(value, dict | list | tuple):
        text = json.dumps(_json_ready(value), ensure_ascii=False, separators=(",", ":"))
    elif isinstance(value, datetime.datetime):
        stamp = value if value.tzinfo is not None else value.replace(tzinfo=datetime.UTC)
        text = stamp.isoformat()
    elif isinstance(value, bytes | bytearray):
        try:
            text = bytes(value).decode("utf-8")
        except UnicodeDecodeError:
            text = "base64:" + base64.b64encode(bytes(value)).decode("ascii")
    else:
        text = header_value(value)
    return text.replace("\x00", "\ufffd") if "\x00" in text else text


def message_from_properties(
    topic: str, body: bytes, props: BasicProperties, producer_id: str,
    raw_properties: bytes | None,
) -> Message:
    headers: list[tuple[str, str]] = []
    if props.headers:
        for name, value in props.headers.items():
            headers.append((str(name).replace("\x00", "\ufffd"), header_text(value)))
    for attr, header in _EXTRA.items():
        value = _text(getattr(props, attr))
        if value is not None:
            headers.append((header, value))
    if isinstance(props.timestamp, datetime.datetime):
        stamp = props.timestamp
        if stamp.tzinfo is None:
            stamp = stamp.replace(tzinfo=datetime.UTC)
        headers.append(("amqp-timestamp", str(int(stamp.timestamp()))))
    publish_time = now_ms()
    expires_at = None
    expiration = _text(props.expiration)
    if expiration:
        try:
            expires_at = publish_time + max(0, int(expiration))
        except ValueError:
            expires_at = None
    correlation_id: object = props.correlation_id
    correlation = (
        correlation_id.encode() if isinstance(correlation_id, str)
        else bytes(correlation_id) if isinstance(correlation_id, bytes | bytearray) else None
    )
    persistent = props.delivery_mode == 2
    message = Message(
        topic,
        body,
        qos=1 if persistent else 0,
        headers=headers or None,
        content_type=_text(props.content_type),
        correlation_data=correlation or None,
        reply_to=_text(props.reply_to),
        expires_at_ms=expires_at,
        publish_time_ms=publish_time,
        producer_protocol="amqp",
        producer_id=producer_id,
        transient=not persistent,
    )
    if raw_properties is not None:
        message.native_properties = {NATIVE_FORMAT: raw_properties}
    return message


def decode_properties(raw: bytes) -> commands.Basic.Properties:
    """Basic properties from their encoding (property flags and values, §4.2.6.1)."""
    content = pamqp_header.ContentHeader()
    content.unmarshal(content_header_payload(raw, 0))
    return content.properties


def typed_properties(message: Message) -> commands.Basic.Properties | None:
    """The basic properties `message` was published with over AMQP, typed headers included;
    None if it came from another protocol."""
    raw = native_properties(message)
    return decode_properties(raw) if raw is not None else None


def native_properties(message: Message) -> bytes | None:
    """The exact AMQP property bytes `message` was published with, None if it came otherwise."""
    native = message.native_properties
    return native.get(NATIVE_FORMAT) if native else None


def properties_from_message(message: Message, at_ms: int | None = None) -> commands.Basic.Properties:
    """Basic properties for a message that did not come in over AMQP (or lost its encoding)."""
    props = commands.Basic.Properties()
    table: dict[str, Any] = {}
    for name, value in message.headers or ():
        if name.startswith(_PREFIX):
            attr = _ATTR_OF.get(name)
            if attr is not None:
                if attr in _INT_PROPS:
                    try:
                        setattr(props, attr, int(value))
                    except ValueError:
                        pass
                else:
                    setattr(props, attr, value)
                continue
            if name == "amqp-timestamp":
                try:
                    props.timestamp = datetime.datetime.fromtimestamp(int(value), datetime.UTC)
                except (ValueError, OverflowError, OSError):
                    pass
                continue
        table[name] = value
    if table:
        props.headers = table
    if message.content_type:
        props.content_type = message.content_type[:255]
    if message.correlation_data is not None:
        props.correlation_id = message.correlation_data.decode("utf-8", "replace")[:255]
    if message.reply_to:
        props.reply_to = message.reply_to[:255]
    if message.expires_at_ms is not None:
        left = message.expires_at_ms - (at_ms if at_ms is not None else now_ms())
        props.expiration = str(max(0, left))
    if props.delivery_mode is None and message.qos > 0:
        props.delivery_mode = 2
    return props


_ATTR_OF = {header: attr for attr, header in _EXTRA.items()}


def encoded_properties(message: Message) -> bytes:
    """The property-flags-and-values part of a content header for `message`, cached."""
    native = message.native_properties
    if native:
        raw = native.get(NATIVE_FORMAT)
        if raw is not None:
            return raw
    encoded = message.encoded
    if encoded is not None:
        raw = encoded.get(PROPERTIES_KEY)
        if raw is not None:
            return raw
    else:
        encoded = message.encoded = {}
    raw = properties_from_message(message).marshal()
    if message.expires_at_ms is None:
        encoded[PROPERTIES_KEY] = raw
    return raw


_CONTENT_HEADER = struct.Struct(">HHQ")


def content_header_payload(properties: bytes, body_size: int) -> bytes:
    """Payload of a content header frame (§4.2.6.1): class 60, weight 0, body size, properties."""
    return _CONTENT_HEADER.pack(60, 0, body_size) + properties
