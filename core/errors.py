"""The core's exception hierarchy; protocol adapters translate these into their own replies."""


class CoreError(Exception):
    """Base of every error the core raises."""


class StreamNotFound(CoreError):
    pass


class StreamExists(CoreError):
    pass


class InvalidStreamConfig(CoreError):
    pass


class SubscriptionNotFound(CoreError):
    pass


class SubscriptionBusy(CoreError):
    """An Exclusive subscription already has a consumer, or the type does not match."""


class PublishRejected(CoreError):
    """The message cannot be accepted (schema mismatch, storage failure, too large)."""


class InvalidMessage(PublishRejected):
    """The message itself is malformed (a delay header or a time to live out of range): the
    client's error, not to be retried as it is."""


class SchemaMismatch(PublishRejected):
    """The payload does not fit the stream's schema."""


class StoreFull(PublishRejected):
    """The stream's store cannot take more now (its disk is full or too far behind): a quota
    the publisher may retry against later."""


class ShardUnavailable(PublishRejected):
    """The shard is served by another node that cannot take the message now (no owner while
    the shard map changes, owner unreachable, ownership moved): the client may retry."""
