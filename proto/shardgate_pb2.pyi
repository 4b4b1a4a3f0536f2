from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DispatchMode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DISPATCH_MODE_UNSPECIFIED: _ClassVar[DispatchMode]
    DISPATCH_MODE_NON_RELIABLE: _ClassVar[DispatchMode]
    DISPATCH_MODE_RELIABLE: _ClassVar[DispatchMode]

class Schema(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SCHEMA_UNSPECIFIED: _ClassVar[Schema]
    SCHEMA_BYTES: _ClassVar[Schema]
    SCHEMA_STRING: _ClassVar[Schema]
    SCHEMA_INT64: _ClassVar[Schema]
    SCHEMA_JSON: _ClassVar[Schema]

class SubscriptionType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SUBSCRIPTION_TYPE_UNSPECIFIED: _ClassVar[SubscriptionType]
    SUBSCRIPTION_TYPE_EXCLUSIVE: _ClassVar[SubscriptionType]
    SUBSCRIPTION_TYPE_SHARED: _ClassVar[SubscriptionType]
    SUBSCRIPTION_TYPE_FAILOVER: _ClassVar[SubscriptionType]
DISPATCH_MODE_UNSPECIFIED: DispatchMode
DISPATCH_MODE_NON_RELIABLE: DispatchMode
DISPATCH_MODE_RELIABLE: DispatchMode
SCHEMA_UNSPECIFIED: Schema
SCHEMA_BYTES: Schema
SCHEMA_STRING: Schema
SCHEMA_INT64: Schema
SCHEMA_JSON: Schema
SUBSCRIPTION_TYPE_UNSPECIFIED: SubscriptionType
SUBSCRIPTION_TYPE_EXCLUSIVE: SubscriptionType
SUBSCRIPTION_TYPE_SHARED: SubscriptionType
SUBSCRIPTION_TYPE_FAILOVER: SubscriptionType

class Header(_message.Message):
    __slots__ = ("key", "value")
    KEY_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    key: str
    value: str
    def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...

class PublishRequest(_message.Message):
    __slots__ = ("topic", "payload", "key", "headers", "content_type", "correlation_data", "reply_to", "ttl_ms", "retain", "stream", "producer_name", "identity")
    TOPIC_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    HEADERS_FIELD_NUMBER: _ClassVar[int]
    CONTENT_TYPE_FIELD_NUMBER: _ClassVar[int]
    CORRELATION_DATA_FIELD_NUMBER: _ClassVar[int]
    REPLY_TO_FIELD_NUMBER: _ClassVar[int]
    TTL_MS_FIELD_NUMBER: _ClassVar[int]
    RETAIN_FIELD_NUMBER: _ClassVar[int]
    STREAM_FIELD_NUMBER: _ClassVar[int]
    PRODUCER_NAME_FIELD_NUMBER: _ClassVar[int]
    IDENTITY_FIELD_NUMBER: _ClassVar[int]
    topic: str
    payload: bytes
    key: bytes
    headers: _containers.RepeatedCompositeFieldContainer[Header]
    content_type: str
    correlation_data: bytes
    reply_to: str
    ttl_ms: int
    retain: bool
    stream: str
    producer_name: str
    identity: ProducerIdentity
    def __init__(self, topic: _Optional[str] = ..., payload: _Optional[bytes] = ..., key: _Optional[bytes] = ..., headers: _Optional[_Iterable[_Union[Header, _Mapping]]] = ..., content_type: _Optional[str] = ..., correlation_data: _Optional[bytes] = ..., reply_to: _Optional[str] = ..., ttl_ms: _Optional[int] = ..., retain: _Optional[bool] = ..., stream: _Optional[str] = ..., producer_name: _Optional[str] = ..., identity: _Optional[_Union[ProducerIdentity, _Mapping]] = ...) -> None: ...

class ProducerIdentity(_message.Message):
    __slots__ = ("producer_id", "sequence", "resent", "first_sent_ms_ago")
    PRODUCER_ID_FIELD_NUMBER: _ClassVar[int]
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    RESENT_FIELD_NUMBER: _ClassVar[int]
    FIRST_SENT_MS_AGO_FIELD_NUMBER: _ClassVar[int]
    producer_id: bytes
    sequence: int
    resent: bool
    first_sent_ms_ago: int
    def __init__(self, producer_id: _Optional[bytes] = ..., sequence: _Optional[int] = ..., resent: _Optional[bool] = ..., first_sent_ms_ago: _Optional[int] = ...) -> None: ...

class PublishResponse(_message.Message):
    __slots__ = ("stream", "shard", "offset")
    STREAM_FIELD_NUMBER: _ClassVar[int]
    SHARD_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    stream: str
    shard: int
    offset: int
    def __init__(self, stream: _Optional[str] = ..., shard: _Optional[int] = ..., offset: _Optional[int] = ...) -> None: ...

class PublishBatch(_message.Message):
    __slots__ = ("sequence", "messages", "identity")
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    IDENTITY_FIELD_NUMBER: _ClassVar[int]
    sequence: int
    messages: _containers.RepeatedCompositeFieldContainer[PublishRequest]
    identity: ProducerIdentity
    def __init__(self, sequence: _Optional[int] = ..., messages: _Optional[_Iterable[_Union[PublishRequest, _Mapping]]] = ..., identity: _Optional[_Union[ProducerIdentity, _Mapping]] = ...) -> None: ...

class PublishResult(_message.Message):
    __slots__ = ("stream", "shard", "offset", "code", "error")
    STREAM_FIELD_NUMBER: _ClassVar[int]
    SHARD_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    stream: str
    shard: int
    offset: int
    code: int
    error: str
    def __init__(self, stream: _Optional[str] = ..., shard: _Optional[int] = ..., offset: _Optional[int] = ..., code: _Optional[int] = ..., error: _Optional[str] = ...) -> None: ...

class PublishAck(_message.Message):
    __slots__ = ("sequence", "results")
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    sequence: int
    results: _containers.RepeatedCompositeFieldContainer[PublishResult]
    def __init__(self, sequence: _Optional[int] = ..., results: _Optional[_Iterable[_Union[PublishResult, _Mapping]]] = ...) -> None: ...

class StartPosition(_message.Message):
    __slots__ = ("latest", "earliest", "offset", "timestamp_ms")
    LATEST_FIELD_NUMBER: _ClassVar[int]
    EARLIEST_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    TIMESTAMP_MS_FIELD_NUMBER: _ClassVar[int]
    latest: bool
    earliest: bool
    offset: int
    timestamp_ms: int
    def __init__(self, latest: _Optional[bool] = ..., earliest: _Optional[bool] = ..., offset: _Optional[int] = ..., timestamp_ms: _Optional[int] = ...) -> None: ...

class Subscribe(_message.Message):
    __slots__ = ("subscription", "type", "topic_filters", "stream", "position", "credit", "consumer_name", "durable", "max_deliveries")
    SUBSCRIPTION_FIELD_NUMBER: _ClassVar[int]
    TYPE_FIELD_NUMBER: _ClassVar[int]
    TOPIC_FILTERS_FIELD_NUMBER: _ClassVar[int]
    STREAM_FIELD_NUMBER: _ClassVar[int]
    POSITION_FIELD_NUMBER: _ClassVar[int]
    CREDIT_FIELD_NUMBER: _ClassVar[int]
    CONSUMER_NAME_FIELD_NUMBER: _ClassVar[int]
    DURABLE_FIELD_NUMBER: _ClassVar[int]
    MAX_DELIVERIES_FIELD_NUMBER: _ClassVar[int]
    subscription: str
    type: SubscriptionType
    topic_filters: _containers.RepeatedScalarFieldContainer[str]
    stream: str
    position: StartPosition
    credit: int
    consumer_name: str
    durable: bool
    max_deliveries: int
    def __init__(self, subscription: _Optional[str] = ..., type: _Optional[_Union[SubscriptionType, str]] = ..., topic_filters: _Optional[_Iterable[str]] = ..., stream: _Optional[str] = ..., position: _Optional[_Union[StartPosition, _Mapping]] = ..., credit: _Optional[int] = ..., consumer_name: _Optional[str] = ..., durable: _Optional[bool] = ..., max_deliveries: _Optional[int] = ...) -> None: ...

class Ack(_message.Message):
    __slots__ = ("delivery_ids",)
    DELIVERY_IDS_FIELD_NUMBER: _ClassVar[int]
    delivery_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, delivery_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class Nack(_message.Message):
    __slots__ = ("delivery_ids", "delay_ms")
    DELIVERY_IDS_FIELD_NUMBER: _ClassVar[int]
    DELAY_MS_FIELD_NUMBER: _ClassVar[int]
    delivery_ids: _containers.RepeatedScalarFieldContainer[int]
    delay_ms: int
    def __init__(self, delivery_ids: _Optional[_Iterable[int]] = ..., delay_ms: _Optional[int] = ...) -> None: ...

class Credit(_message.Message):
    __slots__ = ("credit",)
    CREDIT_FIELD_NUMBER: _ClassVar[int]
    credit: int
    def __init__(self, credit: _Optional[int] = ...) -> None: ...

class ConsumeRequest(_message.Message):
    __slots__ = ("subscribe", "ack", "nack", "credit")
    SUBSCRIBE_FIELD_NUMBER: _ClassVar[int]
    ACK_FIELD_NUMBER: _ClassVar[int]
    NACK_FIELD_NUMBER: _ClassVar[int]
    CREDIT_FIELD_NUMBER: _ClassVar[int]
    subscribe: Subscribe
    ack: Ack
    nack: Nack
    credit: Credit
    def __init__(self, subscribe: _Optional[_Union[Subscribe, _Mapping]] = ..., ack: _Optional[_Union[Ack, _Mapping]] = ..., nack: _Optional[_Union[Nack, _Mapping]] = ..., credit: _Optional[_Union[Credit, _Mapping]] = ...) -> None: ...

class ConsumedMessage(_message.Message):
    __slots__ = ("delivery_id", "topic", "payload", "key", "headers", "content_type", "correlation_data", "reply_to", "publish_time_ms", "expires_at_ms", "stream", "shard", "offset", "producer_protocol", "producer_id", "redelivery_count")
    DELIVERY_ID_FIELD_NUMBER: _ClassVar[int]
    TOPIC_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    HEADERS_FIELD_NUMBER: _ClassVar[int]
    CONTENT_TYPE_FIELD_NUMBER: _ClassVar[int]
    CORRELATION_DATA_FIELD_NUMBER: _ClassVar[int]
    REPLY_TO_FIELD_NUMBER: _ClassVar[int]
    PUBLISH_TIME_MS_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_AT_MS_FIELD_NUMBER: _ClassVar[int]
    STREAM_FIELD_NUMBER: _ClassVar[int]
    SHARD_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    PRODUCER_PROTOCOL_FIELD_NUMBER: _ClassVar[int]
    PRODUCER_ID_FIELD_NUMBER: _ClassVar[int]
    REDELIVERY_COUNT_FIELD_NUMBER: _ClassVar[int]
    delivery_id: int
    topic: str
    payload: bytes
    key: bytes
    headers: _containers.RepeatedCompositeFieldContainer[Header]
    content_type: str
    correlation_data: bytes
    reply_to: str
    publish_time_ms: int
    expires_at_ms: int
    stream: str
    shard: int
    offset: int
    producer_protocol: str
    producer_id: str
    redelivery_count: int
    def __init__(self, delivery_id: _Optional[int] = ..., topic: _Optional[str] = ..., payload: _Optional[bytes] = ..., key: _Optional[bytes] = ..., headers: _Optional[_Iterable[_Union[Header, _Mapping]]] = ..., content_type: _Optional[str] = ..., correlation_data: _Optional[bytes] = ..., reply_to: _Optional[str] = ..., publish_time_ms: _Optional[int] = ..., expires_at_ms: _Optional[int] = ..., stream: _Optional[str] = ..., shard: _Optional[int] = ..., offset: _Optional[int] = ..., producer_protocol: _Optional[str] = ..., producer_id: _Optional[str] = ..., redelivery_count: _Optional[int] = ...) -> None: ...

class Subscribed(_message.Message):
    __slots__ = ("subscription", "consumer_id", "active")
    SUBSCRIPTION_FIELD_NUMBER: _ClassVar[int]
    CONSUMER_ID_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_FIELD_NUMBER: _ClassVar[int]
    subscription: str
    consumer_id: str
    active: bool
    def __init__(self, subscription: _Optional[str] = ..., consumer_id: _Optional[str] = ..., active: _Optional[bool] = ...) -> None: ...

class ConsumerStatus(_message.Message):
    __slots__ = ("active",)
    ACTIVE_FIELD_NUMBER: _ClassVar[int]
    active: bool
    def __init__(self, active: _Optional[bool] = ...) -> None: ...

class ConsumeError(_message.Message):
    __slots__ = ("code", "error", "delivery_ids")
    CODE_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    DELIVERY_IDS_FIELD_NUMBER: _ClassVar[int]
    code: int
    error: str
    delivery_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, code: _Optional[int] = ..., error: _Optional[str] = ..., delivery_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class MessageBatch(_message.Message):
    __slots__ = ("messages",)
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    messages: _containers.RepeatedCompositeFieldContainer[ConsumedMessage]
    def __init__(self, messages: _Optional[_Iterable[_Union[ConsumedMessage, _Mapping]]] = ...) -> None: ...

class ConsumeResponse(_message.Message):
    __slots__ = ("subscribed", "messages", "status", "error")
    SUBSCRIBED_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    subscribed: Subscribed
    messages: MessageBatch
    status: ConsumerStatus
    error: ConsumeError
    def __init__(self, subscribed: _Optional[_Union[Subscribed, _Mapping]] = ..., messages: _Optional[_Union[MessageBatch, _Mapping]] = ..., status: _Optional[_Union[ConsumerStatus, _Mapping]] = ..., error: _Optional[_Union[ConsumeError, _Mapping]] = ...) -> None: ...

class Empty(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StreamSpec(_message.Message):
    __slots__ = ("name", "mode", "partitions", "schema", "retention_ms", "retention_bytes", "routes", "replicas", "min_insync_replicas")
    NAME_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    PARTITIONS_FIELD_NUMBER: _ClassVar[int]
    SCHEMA_FIELD_NUMBER: _ClassVar[int]
    RETENTION_MS_FIELD_NUMBER: _ClassVar[int]
    RETENTION_BYTES_FIELD_NUMBER: _ClassVar[int]
    ROUTES_FIELD_NUMBER: _ClassVar[int]
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    MIN_INSYNC_REPLICAS_FIELD_NUMBER: _ClassVar[int]
    name: str
    mode: DispatchMode
    partitions: int
    schema: Schema
    retention_ms: int
    retention_bytes: int
    routes: _containers.RepeatedScalarFieldContainer[str]
    replicas: int
    min_insync_replicas: int
    def __init__(self, name: _Optional[str] = ..., mode: _Optional[_Union[DispatchMode, str]] = ..., partitions: _Optional[int] = ..., schema: _Optional[_Union[Schema, str]] = ..., retention_ms: _Optional[int] = ..., retention_bytes: _Optional[int] = ..., routes: _Optional[_Iterable[str]] = ..., replicas: _Optional[int] = ..., min_insync_replicas: _Optional[int] = ...) -> None: ...

class ShardInfo(_message.Message):
    __slots__ = ("index", "next_offset", "owner", "unavailable")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    NEXT_OFFSET_FIELD_NUMBER: _ClassVar[int]
    OWNER_FIELD_NUMBER: _ClassVar[int]
    UNAVAILABLE_FIELD_NUMBER: _ClassVar[int]
    index: int
    next_offset: int
    owner: str
    unavailable: bool
    def __init__(self, index: _Optional[int] = ..., next_offset: _Optional[int] = ..., owner: _Optional[str] = ..., unavailable: _Optional[bool] = ...) -> None: ...

class UnansweredNode(_message.Message):
    __slots__ = ("node", "reason")
    NODE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    node: str
    reason: str
    def __init__(self, node: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class StreamSubscriptionInfo(_message.Message):
    __slots__ = ("name", "lag")
    NAME_FIELD_NUMBER: _ClassVar[int]
    LAG_FIELD_NUMBER: _ClassVar[int]
    name: str
    lag: int
    def __init__(self, name: _Optional[str] = ..., lag: _Optional[int] = ...) -> None: ...

class StreamInfo(_message.Message):
    __slots__ = ("name", "mode", "partitions", "schema", "retention_ms", "retention_bytes", "routes", "shards", "subscriptions", "is_default", "replicas", "min_insync_replicas", "unanswered")
    NAME_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    PARTITIONS_FIELD_NUMBER: _ClassVar[int]
    SCHEMA_FIELD_NUMBER: _ClassVar[int]
    RETENTION_MS_FIELD_NUMBER: _ClassVar[int]
    RETENTION_BYTES_FIELD_NUMBER: _ClassVar[int]
    ROUTES_FIELD_NUMBER: _ClassVar[int]
    SHARDS_FIELD_NUMBER: _ClassVar[int]
    SUBSCRIPTIONS_FIELD_NUMBER: _ClassVar[int]
    IS_DEFAULT_FIELD_NUMBER: _ClassVar[int]
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    MIN_INSYNC_REPLICAS_FIELD_NUMBER: _ClassVar[int]
    UNANSWERED_FIELD_NUMBER: _ClassVar[int]
    name: str
    mode: DispatchMode
    partitions: int
    schema: Schema
    retention_ms: int
    retention_bytes: int
    routes: _containers.RepeatedScalarFieldContainer[str]
    shards: _containers.RepeatedCompositeFieldContainer[ShardInfo]
    subscriptions: _containers.RepeatedCompositeFieldContainer[StreamSubscriptionInfo]
    is_default: bool
    replicas: int
    min_insync_replicas: int
    unanswered: _containers.RepeatedCompositeFieldContainer[UnansweredNode]
    def __init__(self, name: _Optional[str] = ..., mode: _Optional[_Union[DispatchMode, str]] = ..., partitions: _Optional[int] = ..., schema: _Optional[_Union[Schema, str]] = ..., retention_ms: _Optional[int] = ..., retention_bytes: _Optional[int] = ..., routes: _Optional[_Iterable[str]] = ..., shards: _Optional[_Iterable[_Union[ShardInfo, _Mapping]]] = ..., subscriptions: _Optional[_Iterable[_Union[StreamSubscriptionInfo, _Mapping]]] = ..., is_default: _Optional[bool] = ..., replicas: _Optional[int] = ..., min_insync_replicas: _Optional[int] = ..., unanswered: _Optional[_Iterable[_Union[UnansweredNode, _Mapping]]] = ...) -> None: ...

class StreamName(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class ListStreamsResponse(_message.Message):
    __slots__ = ("streams", "unanswered")
    STREAMS_FIELD_NUMBER: _ClassVar[int]
    UNANSWERED_FIELD_NUMBER: _ClassVar[int]
    streams: _containers.RepeatedCompositeFieldContainer[StreamInfo]
    unanswered: _containers.RepeatedCompositeFieldContainer[UnansweredNode]
    def __init__(self, streams: _Optional[_Iterable[_Union[StreamInfo, _Mapping]]] = ..., unanswered: _Optional[_Iterable[_Union[UnansweredNode, _Mapping]]] = ...) -> None: ...

class UpdateStreamRequest(_message.Message):
    __slots__ = ("name", "retention_ms", "retention_bytes", "add_routes")
    NAME_FIELD_NUMBER: _ClassVar[int]
    RETENTION_MS_FIELD_NUMBER: _ClassVar[int]
    RETENTION_BYTES_FIELD_NUMBER: _ClassVar[int]
    ADD_ROUTES_FIELD_NUMBER: _ClassVar[int]
    name: str
    retention_ms: int
    retention_bytes: int
    add_routes: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, name: _Optional[str] = ..., retention_ms: _Optional[int] = ..., retention_bytes: _Optional[int] = ..., add_routes: _Optional[_Iterable[str]] = ...) -> None: ...

class Route(_message.Message):
    __slots__ = ("topic_filter", "stream")
    TOPIC_FILTER_FIELD_NUMBER: _ClassVar[int]
    STREAM_FIELD_NUMBER: _ClassVar[int]
    topic_filter: str
    stream: str
    def __init__(self, topic_filter: _Optional[str] = ..., stream: _Optional[str] = ...) -> None: ...

class ListRoutesResponse(_message.Message):
    __slots__ = ("routes",)
    ROUTES_FIELD_NUMBER: _ClassVar[int]
    routes: _containers.RepeatedCompositeFieldContainer[Route]
    def __init__(self, routes: _Optional[_Iterable[_Union[Route, _Mapping]]] = ...) -> None: ...

class ConsumerInfo(_message.Message):
    __slots__ = ("consumer_id", "protocol", "active", "unacked", "credit", "delivered")
    CONSUMER_ID_FIELD_NUMBER: _ClassVar[int]
    PROTOCOL_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_FIELD_NUMBER: _ClassVar[int]
    UNACKED_FIELD_NUMBER: _ClassVar[int]
    CREDIT_FIELD_NUMBER: _ClassVar[int]
    DELIVERED_FIELD_NUMBER: _ClassVar[int]
    consumer_id: str
    protocol: str
    active: bool
    unacked: int
    credit: int
    delivered: int
    def __init__(self, consumer_id: _Optional[str] = ..., protocol: _Optional[str] = ..., active: _Optional[bool] = ..., unacked: _Optional[int] = ..., credit: _Optional[int] = ..., delivered: _Optional[int] = ...) -> None: ...

class SubscriptionInfo(_message.Message):
    __slots__ = ("name", "type", "durable", "topic_filters", "consumers", "protocol", "lag", "max_deliveries", "node")
    NAME_FIELD_NUMBER: _ClassVar[int]
    TYPE_FIELD_NUMBER: _ClassVar[int]
    DURABLE_FIELD_NUMBER: _ClassVar[int]
    TOPIC_FILTERS_FIELD_NUMBER: _ClassVar[int]
    CONSUMERS_FIELD_NUMBER: _ClassVar[int]
    PROTOCOL_FIELD_NUMBER: _ClassVar[int]
    LAG_FIELD_NUMBER: _ClassVar[int]
    MAX_DELIVERIES_FIELD_NUMBER: _ClassVar[int]
    NODE_FIELD_NUMBER: _ClassVar[int]
    name: str
    type: SubscriptionType
    durable: bool
    topic_filters: _containers.RepeatedScalarFieldContainer[str]
    consumers: _containers.RepeatedCompositeFieldContainer[ConsumerInfo]
    protocol: str
    lag: int
    max_deliveries: int
    node: str
    def __init__(self, name: _Optional[str] = ..., type: _Optional[_Union[SubscriptionType, str]] = ..., durable: _Optional[bool] = ..., topic_filters: _Optional[_Iterable[str]] = ..., consumers: _Optional[_Iterable[_Union[ConsumerInfo, _Mapping]]] = ..., protocol: _Optional[str] = ..., lag: _Optional[int] = ..., max_deliveries: _Optional[int] = ..., node: _Optional[str] = ...) -> None: ...

class SubscriptionName(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class ListSubscriptionsResponse(_message.Message):
    __slots__ = ("subscriptions", "unanswered")
    SUBSCRIPTIONS_FIELD_NUMBER: _ClassVar[int]
    UNANSWERED_FIELD_NUMBER: _ClassVar[int]
    subscriptions: _containers.RepeatedCompositeFieldContainer[SubscriptionInfo]
    unanswered: _containers.RepeatedCompositeFieldContainer[UnansweredNode]
    def __init__(self, subscriptions: _Optional[_Iterable[_Union[SubscriptionInfo, _Mapping]]] = ..., unanswered: _Optional[_Iterable[_Union[UnansweredNode, _Mapping]]] = ...) -> None: ...

class ResetCursorRequest(_message.Message):
    __slots__ = ("subscription", "position")
    SUBSCRIPTION_FIELD_NUMBER: _ClassVar[int]
    POSITION_FIELD_NUMBER: _ClassVar[int]
    subscription: str
    position: StartPosition
    def __init__(self, subscription: _Optional[str] = ..., position: _Optional[_Union[StartPosition, _Mapping]] = ...) -> None: ...

class ClientInfo(_message.Message):
    __slots__ = ("protocol", "client_id", "username", "remote", "connected_at", "messages_in", "messages_out", "detail", "node")
    PROTOCOL_FIELD_NUMBER: _ClassVar[int]
    CLIENT_ID_FIELD_NUMBER: _ClassVar[int]
    USERNAME_FIELD_NUMBER: _ClassVar[int]
    REMOTE_FIELD_NUMBER: _ClassVar[int]
    CONNECTED_AT_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_IN_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_OUT_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    NODE_FIELD_NUMBER: _ClassVar[int]
    protocol: str
    client_id: str
    username: str
    remote: str
    connected_at: float
    messages_in: int
    messages_out: int
    detail: str
    node: str
    def __init__(self, protocol: _Optional[str] = ..., client_id: _Optional[str] = ..., username: _Optional[str] = ..., remote: _Optional[str] = ..., connected_at: _Optional[float] = ..., messages_in: _Optional[int] = ..., messages_out: _Optional[int] = ..., detail: _Optional[str] = ..., node: _Optional[str] = ...) -> None: ...

class ListClientsResponse(_message.Message):
    __slots__ = ("clients", "unanswered")
    CLIENTS_FIELD_NUMBER: _ClassVar[int]
    UNANSWERED_FIELD_NUMBER: _ClassVar[int]
    clients: _containers.RepeatedCompositeFieldContainer[ClientInfo]
    unanswered: _containers.RepeatedCompositeFieldContainer[UnansweredNode]
    def __init__(self, clients: _Optional[_Iterable[_Union[ClientInfo, _Mapping]]] = ..., unanswered: _Optional[_Iterable[_Union[UnansweredNode, _Mapping]]] = ...) -> None: ...

class Listener(_message.Message):
    __slots__ = ("name", "host", "port")
    NAME_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    PORT_FIELD_NUMBER: _ClassVar[int]
    name: str
    host: str
    port: int
    def __init__(self, name: _Optional[str] = ..., host: _Optional[str] = ..., port: _Optional[int] = ...) -> None: ...

class BrokerInfo(_message.Message):
    __slots__ = ("version", "started_at", "uptime_s", "listeners", "messages_in", "bytes_in", "messages_out", "bytes_out", "messages_dropped", "streams", "subscriptions", "clients")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    STARTED_AT_FIELD_NUMBER: _ClassVar[int]
    UPTIME_S_FIELD_NUMBER: _ClassVar[int]
    LISTENERS_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_IN_FIELD_NUMBER: _ClassVar[int]
    BYTES_IN_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_OUT_FIELD_NUMBER: _ClassVar[int]
    BYTES_OUT_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_DROPPED_FIELD_NUMBER: _ClassVar[int]
    STREAMS_FIELD_NUMBER: _ClassVar[int]
    SUBSCRIPTIONS_FIELD_NUMBER: _ClassVar[int]
    CLIENTS_FIELD_NUMBER: _ClassVar[int]
    version: str
    started_at: float
    uptime_s: float
    listeners: _containers.RepeatedCompositeFieldContainer[Listener]
    messages_in: int
    bytes_in: int
    messages_out: int
    bytes_out: int
    messages_dropped: int
    streams: int
    subscriptions: int
    clients: int
    def __init__(self, version: _Optional[str] = ..., started_at: _Optional[float] = ..., uptime_s: _Optional[float] = ..., listeners: _Optional[_Iterable[_Union[Listener, _Mapping]]] = ..., messages_in: _Optional[int] = ..., bytes_in: _Optional[int] = ..., messages_out: _Optional[int] = ..., bytes_out: _Optional[int] = ..., messages_dropped: _Optional[int] = ..., streams: _Optional[int] = ..., subscriptions: _Optional[int] = ..., clients: _Optional[int] = ...) -> None: ...

class ClusterStatus(_message.Message):
    __slots__ = ("json",)
    JSON_FIELD_NUMBER: _ClassVar[int]
    json: str
    def __init__(self, json: _Optional[str] = ...) -> None: ...

class SchemaInfo(_message.Message):
    __slots__ = ("stream", "version", "type", "definition", "compatibility", "registered_ms", "rejected")
    STREAM_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    TYPE_FIELD_NUMBER: _ClassVar[int]
    DEFINITION_FIELD_NUMBER: _ClassVar[int]
    COMPATIBILITY_FIELD_NUMBER: _ClassVar[int]
    REGISTERED_MS_FIELD_NUMBER: _ClassVar[int]
    REJECTED_FIELD_NUMBER: _ClassVar[int]
    stream: str
    version: int
    type: str
    definition: str
    compatibility: str
    registered_ms: int
    rejected: int
    def __init__(self, stream: _Optional[str] = ..., version: _Optional[int] = ..., type: _Optional[str] = ..., definition: _Optional[str] = ..., compatibility: _Optional[str] = ..., registered_ms: _Optional[int] = ..., rejected: _Optional[int] = ...) -> None: ...

class RegisterSchemaRequest(_message.Message):
    __slots__ = ("stream", "type", "definition", "compatibility")
    STREAM_FIELD_NUMBER: _ClassVar[int]
    TYPE_FIELD_NUMBER: _ClassVar[int]
    DEFINITION_FIELD_NUMBER: _ClassVar[int]
    COMPATIBILITY_FIELD_NUMBER: _ClassVar[int]
    stream: str
    type: str
    definition: str
    compatibility: str
    def __init__(self, stream: _Optional[str] = ..., type: _Optional[str] = ..., definition: _Optional[str] = ..., compatibility: _Optional[str] = ...) -> None: ...

class ListSchemasResponse(_message.Message):
    __slots__ = ("schemas",)
    SCHEMAS_FIELD_NUMBER: _ClassVar[int]
    schemas: _containers.RepeatedCompositeFieldContainer[SchemaInfo]
    def __init__(self, schemas: _Optional[_Iterable[_Union[SchemaInfo, _Mapping]]] = ...) -> None: ...

class SchemaVersions(_message.Message):
    __slots__ = ("versions",)
    VERSIONS_FIELD_NUMBER: _ClassVar[int]
    versions: _containers.RepeatedCompositeFieldContainer[SchemaInfo]
    def __init__(self, versions: _Optional[_Iterable[_Union[SchemaInfo, _Mapping]]] = ...) -> None: ...
