"""The front door into the core: the one object every protocol, admin surface and bridge uses.

A protocol adapter turns its frames into core calls through an `Edge` and nothing else:

- `publish(message) -> Receipt`: accept a message; the receipt is None when the message is
  already stored and dispatched, or a future that resolves once it is durable under its
  stream's policy (and fails with `PublishRejected` if the store could not take it).
  `publish_many(messages)` accepts the messages of one read at once (one journal append per
  shard) and returns, per message, its receipt or the `PublishRejected` that refused it alone
  (`stop_at_refusal=True`: nothing after the first refused message is processed). Whether
  the shard is stored here or forwarded to its owner node is the broker's placement hook
  (`core.placement.ShardPlacement`, None on a single node); a `ShardRouter` given to the
  `Edge` puts another publish path in front of the broker for the whole node.
- `subscription` / `durable_subscription` / `add_filter` / `remove_filter` / `attach` /
  `detach` / `remove_subscription`: subscribe and unsubscribe (a cluster layer hooks filter
  changes here for its route table); acks and nacks go to the durable subscription the
  consumer was handed.
- `authenticate(principal, password)` and `authorize(principal, action, topic)`: one shape
  for every protocol; a `Principal` says who asks (protocol, user, client id, peer). Both ask
  the `SecurityPolicy` installed in the Edge's `SecurityPort` (`security`), which the Edge is
  built with; installing another policy on a running broker is one swap in that port, so
  every connected client's next check asks the new one.
- `clients`: the registry of connected clients of every protocol (list, kick), read by the
  admin HTTP API and by gRPC `ListClients` alike.

This module knows no protocol and no storage engine.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import TYPE_CHECKING, Protocol

from .delayed import DELAYED_PREFIX, release_topic
from .errors import PublishRejected
from .kept_state import INTERNAL_PREFIX
from .message import Message

if TYPE_CHECKING:
    from .backpressure import BackPressure
    from .broker import Broker, BrokerStats, Matches
    from .durable import DurableOptions, DurableSubscription
    from .placement import RemoteDurables
    from .schema_registry import SchemaRegistry
    from .streams import RoutingRule, Stream, StreamConfig
    from .subscriptions import Consumer, Subscription, SubscriptionType

# What `publish` returns: None when the message is stored and dispatched already, else a
# future resolving once it is durable (shared by every message of the same commit group).
Receipt = asyncio.Future[None] | None
# What `publish_many` returns per message: its receipt, or the error that refused it.
Outcome = asyncio.Future[None] | PublishRejected | None

KICK_REASON = "kicked by administrator"


class PublishMany(Protocol):
    """`publish_many(messages, stop_at_refusal=False)`: one outcome per message, in order;
    with `stop_at_refusal` the list ends at the first refused message and the messages after
    it are not processed at all."""

    def __call__(
        self, messages: Sequence[Message], /, *, stop_at_refusal: bool = False
    ) -> list[Outcome]: ...


class Action(StrEnum):
    """What a principal asks to do; `authorize` decides."""

    CONNECT = "connect"
    PUBLISH = "publish"
    SUBSCRIBE = "subscribe"
    ADMIN = "admin"


@dataclass(frozen=True, slots=True)
class Principal:
    """Who is asking: the protocol it came in by, the user it authenticated as (None for an
    anonymous client or a bare token), its client id (MQTT client id, AMQP connection id,
    gRPC producer or consumer id; may be empty) and its peer address."""

    protocol: str
    username: str | None = None
    client_id: str = ""
    remote: str = ""


# What authentication answers: None to accept, else the refusal ("bad-credentials" or
# "not-authorized"); or a future of that while a password is checked off the event loop.
Verdict = str | None | asyncio.Future[str | None]


class SecurityPolicy(Protocol):
    """Who may connect and what they may do: the one security model every protocol asks
    through the Edge (`shardgate.security.auth.Security` is the product's)."""

    @property
    def allow_anonymous(self) -> bool:
        """Clients without credentials are accepted (a protocol's own setting may narrow it)."""

    def checks_credentials(self) -> bool:
        """False while the policy checks no credentials at all (no user defined and anonymous
        access on): a protocol whose clients always send credentials (AMQP) then applies its
        own built-in logins. Asked once per login, with the policy's files re-read."""

    def authenticate_principal(self, principal: Principal, password: bytes | str | None, /) -> Verdict:
        """None to accept, else the refusal ("bad-credentials", "not-authorized"), or a future
        of either while a password is hashed off the event loop."""

    def authorize_principal(self, principal: Principal, action: Action, topic: str, /) -> bool:
        """May `principal` do `action` on `topic` (a topic name for publish, a filter for
        subscribe)? Asked once per message: keep it cheap."""

    def count_denial(self, principal: Principal, action: Action, /) -> None:
        """Count a refusal a protocol decided by itself (AMQP's built-in login)."""


class SecurityPort:
    """The Edge's security collaborator: the installed `SecurityPolicy`, or None (every client
    accepted, every action allowed but the core's own rules in `Edge.authorize`).

    The policy is one reference, replaced whole by `install`: a client never sees half of an
    old policy and half of a new one, and every check after the swap asks the new policy.
    Nothing else assigns it."""

    __slots__ = ("policy",)

    def __init__(self, policy: SecurityPolicy | None = None) -> None:
        self.policy: SecurityPolicy | None = policy

    def install(self, policy: SecurityPolicy | None) -> SecurityPolicy | None:
        """Make `policy` the one every later check asks; returns the one it replaces."""
        previous = self.policy
        self.policy = policy
        return previous


class ShardRouter(Protocol):
    """Where a publish goes: the local shard, or (in a cluster) the node owning the shard."""

    def publish(self, message: Message) -> Receipt: ...


# ---------------------------------------------------------------------------- clients
@dataclass(slots=True)
class ClientInfo:
    """One connected client as every admin surface lists it."""

    protocol: str
    client_id: str
    username: str | None
    remote: str
    transport: str
    connected_at: float  # epoch seconds
    messages_in: int | None
    messages_out: int | None
    detail: str
    kickable: bool = True


class ClientSource(Protocol):
    """A protocol layer's connected clients: listed, and disconnected by id."""

    def clients(self) -> Iterable[ClientInfo]: ...

    def kick(self, client_id: str, reason: str) -> int:
        """Disconnect the client(s) named `client_id`; returns how many connections ended."""


class ClientRegistry:
    """Connected clients of every protocol: each protocol layer registers its source."""

    def __init__(self) -> None:
        self._sources: dict[str, list[ClientSource]] = {}

    def register(self, protocol: str, source: ClientSource) -> None:
        sources = self._sources.setdefault(protocol, [])
        if not any(existing is source for existing in sources):
            sources.append(source)

    def unregister(self, protocol: str, source: ClientSource) -> None:
        sources = self._sources.get(protocol, [])
        self._sources[protocol] = [existing for existing in sources if existing is not source]

    @property
    def protocols(self) -> list[str]:
        return list(self._sources)

    def list(self, protocol: str | None = None) -> list[ClientInfo]:
        out: list[ClientInfo] = []
        for name, sources in list(self._sources.items()):
            if protocol is not None and name != protocol:
                continue
            for source in list(sources):
                out.extend(source.clients())
        return out

    def kick(self, protocol: str, client_id: str, reason: str = KICK_REASON) -> int:
        """Disconnect `client_id` of `protocol`; returns how many connections were ended."""
        return sum(source.kick(client_id, reason) for source in list(self._sources.get(protocol, ())))


class ListenerInfo(Protocol):
    """A bound listener as the admin surfaces show it."""

    name: str
    host: str
    port: int


# ---------------------------------------------------------------------------- the front door
class Edge:
    """The front door into one broker node (see the module docstring)."""

    def __init__(self, broker: Broker, router: ShardRouter | None = None, *,
                 remote_durables: RemoteDurables | None = None,
                 listeners: Mapping[str, ListenerInfo] | None = None,
                 security: SecurityPort | None = None,
                 owner_factories: Mapping[str, Callable[[Mapping[str, object]], object]] | None = None,
                 ) -> None:
        self.broker = broker
        self.clients = ClientRegistry()
        # The broker's statistics (one object for the broker's life): every protocol counts in it.
        self.stats: BrokerStats = broker.stats
        # Who may connect and do what: the port's policy is swapped whole when the security
        # model is installed again; this reference stays for the Edge's life.
        self.security: SecurityPort = SecurityPort() if security is None else security
        # Bound listeners by name (the composition root's, filled as they bind), for broker
        # info views.
        self.listeners: Mapping[str, ListenerInfo] = {} if listeners is None else listeners
        # Durable subscription owners by kind, so that subscriptions saved by a protocol come
        # back with the right owner after a restart (`"grpc"` -> its state factory).
        self.owner_factories: dict[str, Callable[[Mapping[str, object]], object]] = dict(
            owner_factories or {})
        # Cluster mode: awaited before a consumer attaches here to a durable subscription this
        # node does not have (`core.placement.RemoteDurables.find`). None on one node.
        self.find_durable_elsewhere: Callable[[str], Awaitable[str | None]] | None = (
            None if remote_durables is None else remote_durables.find
        )
        # Bound once: publishing costs one call, no attribute walk per message.
        self.publish: Callable[[Message], Receipt] = (
            router.publish if router is not None else broker.publish
        )
        self.publish_many: PublishMany = broker.publish_many if router is None else self._publish_each
        # The subscriptions a topic reaches here, each with the filters it matched (bound once).
        self.match: Callable[[str], Matches] = broker.match

    def _publish_each(
        self, messages: Sequence[Message], *, stop_at_refusal: bool = False
    ) -> list[Outcome]:
        """`publish_many` through a router: one `publish` per message."""
        outcomes: list[Outcome] = []
        publish = self.publish
        for message in messages:
            try:
                outcomes.append(publish(message))
            except PublishRejected as exc:
                outcomes.append(exc)
                if stop_at_refusal:
                    break
        return outcomes

    # ------------------------------------------------------------------ what the core holds
    # Read by protocols, bridges and admin surfaces (bind what a hot path needs once).
    @property
    def back_pressure(self) -> BackPressure:
        """The queues that hold publishers (`core/backpressure.py`), shared by every protocol."""
        return self.broker.back_pressure

    @property
    def stores_messages(self) -> bool:
        """True when the node has a journal: durable subscriptions and reliable streams keep
        their messages across a restart."""
        return self.broker.storage is not None

    @property
    def subscriptions(self) -> Mapping[str, Subscription]:
        """Every subscription by name (read only: change them through the calls below)."""
        return self.broker.subscriptions

    @property
    def subscription_count(self) -> int:
        return self.broker.subscription_count

    @property
    def retained_count(self) -> int:
        return len(self.broker.retained)

    def retained_message(self, topic: str) -> Message | None:
        return self.broker.retained.get(topic)

    def retained_messages(self) -> Iterator[tuple[str, Message]]:
        """Every retained (topic, message) pair, in the order the topics were first retained."""
        return self.broker.retained.items()

    def retained_matching(self, topic_filter: str) -> list[Message]:
        """Every retained message whose topic matches `topic_filter` (raises `TopicError`)."""
        return self.broker.retained.match(topic_filter)

    def forget_retained(self, topic: str) -> None:
        """Remove the retained message of `topic`, if any."""
        self.broker.forget_retained(topic)

    def wanted_elsewhere(self, topic: str) -> bool:
        """True when a subscription on another node of a cluster matches `topic`."""
        fanout = self.broker.fanout
        return fanout is not None and fanout.wanted_elsewhere(topic)

    def routes_ready(self) -> asyncio.Future[None] | None:
        """None when every node that may store a message for a subscription made here knows
        it; else a future resolving once they do (`Broker.routes_ready`)."""
        return self.broker.routes_ready()

    def flush_cursors(self) -> None:
        """Write every durable cursor saved so far now (before an acknowledgement that
        promises them)."""
        sink = self.broker.cursor_sink
        if sink is not None:
            sink.flush()

    def keep_internal(self, message: Message) -> None:
        """Keep a protocol's own state as `message` under `$internal/...` (`Broker.internal_state`)."""
        self.broker.keep_internal(message)

    def internal_state(self, topic: str) -> Message | None:
        return self.broker.internal_state.get(topic)

    # ------------------------------------------------------------------ streams and routes
    @property
    def streams(self) -> Mapping[str, Stream]:
        return self.broker.streams

    def stream(self, name: str) -> Stream:
        """The stream `name`; raises `StreamNotFound`."""
        return self.broker.stream(name)

    def stream_for_topic(self, topic: str) -> Stream:
        return self.broker.stream_for_topic(topic)

    @property
    def default_stream(self) -> str:
        return self.broker.router.default_stream

    @property
    def routes(self) -> list[RoutingRule]:
        """The routing rules, most specific first."""
        return self.broker.router.rules

    def create_stream(self, config: StreamConfig, routes: list[str] | None = None) -> Stream:
        return self.broker.create_stream(config, routes=routes)

    def update_stream(self, name: str, **changes: int | None) -> Stream:
        return self.broker.update_stream(name, **changes)

    def delete_stream(self, name: str) -> None:
        self.broker.delete_stream(name)

    def add_route(self, rule: RoutingRule) -> None:
        self.broker.add_route(rule)

    def remove_route(self, topic_filter: str) -> bool:
        return self.broker.remove_route(topic_filter)

    @property
    def schemas(self) -> SchemaRegistry:
        """Registered schemas per stream (`core/schema_registry.py`)."""
        return self.broker.schemas

    # ------------------------------------------------------------------ security
    @property
    def secured(self) -> bool:
        """A security policy is installed (without one every client is accepted and only the
        core's own rules of `authorize` refuse)."""
        return self.security.policy is not None

    def authenticate(self, principal: Principal, password: bytes | str | None) -> Verdict:
        """None to accept `principal`, else the refusal ("bad-credentials", "not-authorized"),
        or a future of either (a password hashed off the event loop): callers handle both."""
        policy = self.security.policy
        if policy is None:
            return None
        return policy.authenticate_principal(principal, password)

    def authorize(self, principal: Principal, action: Action, topic: str) -> bool:
        """May `principal` do `action` on `topic`. A publish to `$delayed/<s>/<topic>` needs
        the right to publish to `<topic>` as well: that is where the message goes. No client
        subscribes under `$internal/`, whatever the ACL says, even on an open broker: the
        broker's own state is kept there (in a cluster, persistent sessions' snapshots and
        queues' states, with the messages they hold)."""
        if action == Action.SUBSCRIBE and topic.startswith(INTERNAL_PREFIX):
            return False
        policy = self.security.policy  # read once: one policy decides the whole call
        if policy is None:
            return True
        if not policy.authorize_principal(principal, action, topic):
            return False
        if action == Action.PUBLISH and topic.startswith(DELAYED_PREFIX):
            release = release_topic(topic)
            return release is None or bool(policy.authorize_principal(principal, action, release))
        return True

    # ------------------------------------------------------------------ subscribing
    def subscription(
        self, name: str, type: SubscriptionType | None = None, *, durable: bool = False,
        create: bool = True, owner: object = None,
    ) -> Subscription:
        from .subscriptions import SubscriptionType

        return self.broker.subscription(
            name, type or SubscriptionType.EXCLUSIVE, durable=durable, create=create, owner=owner
        )

    def durable_subscription(
        self, name: str, type: SubscriptionType | None = None, *,
        options: DurableOptions | None = None, owner: object = None,
        initial_position: str | int = "latest",
    ) -> DurableSubscription:
        from .subscriptions import SubscriptionType

        return self.broker.durable_subscription(
            name, type or SubscriptionType.EXCLUSIVE, options=options, owner=owner,
            initial_position=initial_position,
        )

    def add_filter(self, sub: Subscription, topic_filter: str, options: object = None) -> bool:
        return self.broker.add_filter(sub, topic_filter, options)

    def remove_filter(self, sub: Subscription, topic_filter: str) -> bool:
        return self.broker.remove_filter(sub, topic_filter)

    def durable_changed(self, sub: DurableSubscription) -> None:
        """The owner changed what it saves with `sub`: it is saved again."""
        self.broker.durable_changed(sub)

    def remove_subscription(self, name: str, *, forget: bool = True) -> Subscription | None:
        """Remove subscription `name` (`forget` False: its stored record stays as it was)."""
        return self.broker.remove_subscription(name, forget=forget)

    def attach(self, sub: Subscription, consumer: Consumer) -> None:
        self.broker.attach(sub, consumer)

    def detach(self, sub: Subscription, consumer: Consumer) -> None:
        self.broker.detach(sub, consumer)
