from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class OutcomeCode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    STORED: _ClassVar[OutcomeCode]
    NOT_OWNER: _ClassVar[OutcomeCode]
    REJECTED: _ClassVar[OutcomeCode]
    FAILED: _ClassVar[OutcomeCode]
STORED: OutcomeCode
NOT_OWNER: OutcomeCode
REJECTED: OutcomeCode
FAILED: OutcomeCode

class PeerFrame(_message.Message):
    __slots__ = ("sequence", "from_node", "forwards", "pushes", "routes", "retained", "session", "answered_below", "batches", "heartbeat_ms", "push_batches", "pushes_lost", "routes_applied", "replica")
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    FROM_NODE_FIELD_NUMBER: _ClassVar[int]
    FORWARDS_FIELD_NUMBER: _ClassVar[int]
    PUSHES_FIELD_NUMBER: _ClassVar[int]
    ROUTES_FIELD_NUMBER: _ClassVar[int]
    RETAINED_FIELD_NUMBER: _ClassVar[int]
    SESSION_FIELD_NUMBER: _ClassVar[int]
    ANSWERED_BELOW_FIELD_NUMBER: _ClassVar[int]
    BATCHES_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_MS_FIELD_NUMBER: _ClassVar[int]
    PUSH_BATCHES_FIELD_NUMBER: _ClassVar[int]
    PUSHES_LOST_FIELD_NUMBER: _ClassVar[int]
    ROUTES_APPLIED_FIELD_NUMBER: _ClassVar[int]
    REPLICA_FIELD_NUMBER: _ClassVar[int]
    sequence: int
    from_node: str
    forwards: _containers.RepeatedCompositeFieldContainer[Forward]
    pushes: _containers.RepeatedCompositeFieldContainer[Push]
    routes: RouteUpdate
    retained: _containers.RepeatedCompositeFieldContainer[Retained]
    session: int
    answered_below: int
    batches: _containers.RepeatedCompositeFieldContainer[ForwardBatch]
    heartbeat_ms: int
    push_batches: _containers.RepeatedCompositeFieldContainer[PushBatch]
    pushes_lost: bool
    routes_applied: int
    replica: _containers.RepeatedCompositeFieldContainer[ReplicaRequest]
    def __init__(self, sequence: _Optional[int] = ..., from_node: _Optional[str] = ..., forwards: _Optional[_Iterable[_Union[Forward, _Mapping]]] = ..., pushes: _Optional[_Iterable[_Union[Push, _Mapping]]] = ..., routes: _Optional[_Union[RouteUpdate, _Mapping]] = ..., retained: _Optional[_Iterable[_Union[Retained, _Mapping]]] = ..., session: _Optional[int] = ..., answered_below: _Optional[int] = ..., batches: _Optional[_Iterable[_Union[ForwardBatch, _Mapping]]] = ..., heartbeat_ms: _Optional[int] = ..., push_batches: _Optional[_Iterable[_Union[PushBatch, _Mapping]]] = ..., pushes_lost: _Optional[bool] = ..., routes_applied: _Optional[int] = ..., replica: _Optional[_Iterable[_Union[ReplicaRequest, _Mapping]]] = ...) -> None: ...

class PushBatch(_message.Message):
    __slots__ = ("stream", "shard", "records", "offsets", "share_groups")
    STREAM_FIELD_NUMBER: _ClassVar[int]
    SHARD_FIELD_NUMBER: _ClassVar[int]
    RECORDS_FIELD_NUMBER: _ClassVar[int]
    OFFSETS_FIELD_NUMBER: _ClassVar[int]
    SHARE_GROUPS_FIELD_NUMBER: _ClassVar[int]
    stream: str
    shard: int
    records: bytes
    offsets: _containers.RepeatedScalarFieldContainer[int]
    share_groups: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, stream: _Optional[str] = ..., shard: _Optional[int] = ..., records: _Optional[bytes] = ..., offsets: _Optional[_Iterable[int]] = ..., share_groups: _Optional[_Iterable[str]] = ...) -> None: ...

class ForwardBatch(_message.Message):
    __slots__ = ("stream", "shard", "epoch", "records", "unacknowledged", "transient")
    STREAM_FIELD_NUMBER: _ClassVar[int]
    SHARD_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    RECORDS_FIELD_NUMBER: _ClassVar[int]
    UNACKNOWLEDGED_FIELD_NUMBER: _ClassVar[int]
    TRANSIENT_FIELD_NUMBER: _ClassVar[int]
    stream: str
    shard: int
    epoch: int
    records: bytes
    unacknowledged: bool
    transient: bool
    def __init__(self, stream: _Optional[str] = ..., shard: _Optional[int] = ..., epoch: _Optional[int] = ..., records: _Optional[bytes] = ..., unacknowledged: _Optional[bool] = ..., transient: _Optional[bool] = ...) -> None: ...

class Retained(_message.Message):
    __slots__ = ("topic", "present", "message")
    TOPIC_FIELD_NUMBER: _ClassVar[int]
    PRESENT_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    topic: str
    present: bool
    message: Push
    def __init__(self, topic: _Optional[str] = ..., present: _Optional[bool] = ..., message: _Optional[_Union[Push, _Mapping]] = ...) -> None: ...

class Forward(_message.Message):
    __slots__ = ("stream", "shard", "epoch", "record", "topic", "payload", "qos", "retain", "publish_time_ms", "producer_protocol", "producer_id")
    STREAM_FIELD_NUMBER: _ClassVar[int]
    SHARD_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    RECORD_FIELD_NUMBER: _ClassVar[int]
    TOPIC_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    QOS_FIELD_NUMBER: _ClassVar[int]
    RETAIN_FIELD_NUMBER: _ClassVar[int]
    PUBLISH_TIME_MS_FIELD_NUMBER: _ClassVar[int]
    PRODUCER_PROTOCOL_FIELD_NUMBER: _ClassVar[int]
    PRODUCER_ID_FIELD_NUMBER: _ClassVar[int]
    stream: str
    shard: int
    epoch: int
    record: bytes
    topic: str
    payload: bytes
    qos: int
    retain: bool
    publish_time_ms: int
    producer_protocol: str
    producer_id: str
    def __init__(self, stream: _Optional[str] = ..., shard: _Optional[int] = ..., epoch: _Optional[int] = ..., record: _Optional[bytes] = ..., topic: _Optional[str] = ..., payload: _Optional[bytes] = ..., qos: _Optional[int] = ..., retain: _Optional[bool] = ..., publish_time_ms: _Optional[int] = ..., producer_protocol: _Optional[str] = ..., producer_id: _Optional[str] = ...) -> None: ...

class Push(_message.Message):
    __slots__ = ("stream", "shard", "offset", "record", "plain", "share_groups", "topic", "payload", "qos", "retain", "publish_time_ms", "producer_protocol", "producer_id")
    STREAM_FIELD_NUMBER: _ClassVar[int]
    SHARD_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    RECORD_FIELD_NUMBER: _ClassVar[int]
    PLAIN_FIELD_NUMBER: _ClassVar[int]
    SHARE_GROUPS_FIELD_NUMBER: _ClassVar[int]
    TOPIC_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    QOS_FIELD_NUMBER: _ClassVar[int]
    RETAIN_FIELD_NUMBER: _ClassVar[int]
    PUBLISH_TIME_MS_FIELD_NUMBER: _ClassVar[int]
    PRODUCER_PROTOCOL_FIELD_NUMBER: _ClassVar[int]
    PRODUCER_ID_FIELD_NUMBER: _ClassVar[int]
    stream: str
    shard: int
    offset: int
    record: bytes
    plain: bool
    share_groups: _containers.RepeatedScalarFieldContainer[str]
    topic: str
    payload: bytes
    qos: int
    retain: bool
    publish_time_ms: int
    producer_protocol: str
    producer_id: str
    def __init__(self, stream: _Optional[str] = ..., shard: _Optional[int] = ..., offset: _Optional[int] = ..., record: _Optional[bytes] = ..., plain: _Optional[bool] = ..., share_groups: _Optional[_Iterable[str]] = ..., topic: _Optional[str] = ..., payload: _Optional[bytes] = ..., qos: _Optional[int] = ..., retain: _Optional[bool] = ..., publish_time_ms: _Optional[int] = ..., producer_protocol: _Optional[str] = ..., producer_id: _Optional[str] = ...) -> None: ...

class RouteUpdate(_message.Message):
    __slots__ = ("reset", "added", "removed", "generation")
    RESET_FIELD_NUMBER: _ClassVar[int]
    ADDED_FIELD_NUMBER: _ClassVar[int]
    REMOVED_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    reset: bool
    added: _containers.RepeatedCompositeFieldContainer[Route]
    removed: _containers.RepeatedCompositeFieldContainer[Route]
    generation: int
    def __init__(self, reset: _Optional[bool] = ..., added: _Optional[_Iterable[_Union[Route, _Mapping]]] = ..., removed: _Optional[_Iterable[_Union[Route, _Mapping]]] = ..., generation: _Optional[int] = ...) -> None: ...

class Route(_message.Message):
    __slots__ = ("topic_filter", "share_group", "weight", "durable")
    TOPIC_FILTER_FIELD_NUMBER: _ClassVar[int]
    SHARE_GROUP_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_FIELD_NUMBER: _ClassVar[int]
    DURABLE_FIELD_NUMBER: _ClassVar[int]
    topic_filter: str
    share_group: str
    weight: int
    durable: bool
    def __init__(self, topic_filter: _Optional[str] = ..., share_group: _Optional[str] = ..., weight: _Optional[int] = ..., durable: _Optional[bool] = ...) -> None: ...

class PeerReply(_message.Message):
    __slots__ = ("sequence", "outcomes", "batches", "heartbeat", "replica")
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    OUTCOMES_FIELD_NUMBER: _ClassVar[int]
    BATCHES_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_FIELD_NUMBER: _ClassVar[int]
    REPLICA_FIELD_NUMBER: _ClassVar[int]
    sequence: int
    outcomes: _containers.RepeatedCompositeFieldContainer[Outcome]
    batches: _containers.RepeatedCompositeFieldContainer[BatchOutcome]
    heartbeat: bool
    replica: _containers.RepeatedCompositeFieldContainer[ReplicaAnswer]
    def __init__(self, sequence: _Optional[int] = ..., outcomes: _Optional[_Iterable[_Union[Outcome, _Mapping]]] = ..., batches: _Optional[_Iterable[_Union[BatchOutcome, _Mapping]]] = ..., heartbeat: _Optional[bool] = ..., replica: _Optional[_Iterable[_Union[ReplicaAnswer, _Mapping]]] = ...) -> None: ...

class BatchOutcome(_message.Message):
    __slots__ = ("offsets", "refused")
    OFFSETS_FIELD_NUMBER: _ClassVar[int]
    REFUSED_FIELD_NUMBER: _ClassVar[int]
    offsets: _containers.RepeatedScalarFieldContainer[int]
    refused: _containers.RepeatedCompositeFieldContainer[Outcome]
    def __init__(self, offsets: _Optional[_Iterable[int]] = ..., refused: _Optional[_Iterable[_Union[Outcome, _Mapping]]] = ...) -> None: ...

class Outcome(_message.Message):
    __slots__ = ("code", "offset", "reason", "epoch", "index")
    CODE_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    code: OutcomeCode
    offset: int
    reason: str
    epoch: int
    index: int
    def __init__(self, code: _Optional[_Union[OutcomeCode, str]] = ..., offset: _Optional[int] = ..., reason: _Optional[str] = ..., epoch: _Optional[int] = ..., index: _Optional[int] = ...) -> None: ...

class ReplicaRequest(_message.Message):
    __slots__ = ("id", "stream", "shard", "replica", "leader_epoch", "fetch_offset", "durable_end", "epoch_end", "epoch", "high_watermark")
    ID_FIELD_NUMBER: _ClassVar[int]
    STREAM_FIELD_NUMBER: _ClassVar[int]
    SHARD_FIELD_NUMBER: _ClassVar[int]
    REPLICA_FIELD_NUMBER: _ClassVar[int]
    LEADER_EPOCH_FIELD_NUMBER: _ClassVar[int]
    FETCH_OFFSET_FIELD_NUMBER: _ClassVar[int]
    DURABLE_END_FIELD_NUMBER: _ClassVar[int]
    EPOCH_END_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    HIGH_WATERMARK_FIELD_NUMBER: _ClassVar[int]
    id: int
    stream: str
    shard: int
    replica: str
    leader_epoch: int
    fetch_offset: int
    durable_end: int
    epoch_end: bool
    epoch: int
    high_watermark: int
    def __init__(self, id: _Optional[int] = ..., stream: _Optional[str] = ..., shard: _Optional[int] = ..., replica: _Optional[str] = ..., leader_epoch: _Optional[int] = ..., fetch_offset: _Optional[int] = ..., durable_end: _Optional[int] = ..., epoch_end: _Optional[bool] = ..., epoch: _Optional[int] = ..., high_watermark: _Optional[int] = ...) -> None: ...

class ReplicaAnswer(_message.Message):
    __slots__ = ("id", "error", "log_start", "leader_epoch", "start", "end", "high_watermark", "epochs", "records", "epoch", "end_offset", "dispatched_end")
    ID_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    LOG_START_FIELD_NUMBER: _ClassVar[int]
    LEADER_EPOCH_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    HIGH_WATERMARK_FIELD_NUMBER: _ClassVar[int]
    EPOCHS_FIELD_NUMBER: _ClassVar[int]
    RECORDS_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    END_OFFSET_FIELD_NUMBER: _ClassVar[int]
    DISPATCHED_END_FIELD_NUMBER: _ClassVar[int]
    id: int
    error: str
    log_start: int
    leader_epoch: int
    start: int
    end: int
    high_watermark: int
    epochs: _containers.RepeatedScalarFieldContainer[int]
    records: bytes
    epoch: int
    end_offset: int
    dispatched_end: int
    def __init__(self, id: _Optional[int] = ..., error: _Optional[str] = ..., log_start: _Optional[int] = ..., leader_epoch: _Optional[int] = ..., start: _Optional[int] = ..., end: _Optional[int] = ..., high_watermark: _Optional[int] = ..., epochs: _Optional[_Iterable[int]] = ..., records: _Optional[bytes] = ..., epoch: _Optional[int] = ..., end_offset: _Optional[int] = ..., dispatched_end: _Optional[int] = ...) -> None: ...
