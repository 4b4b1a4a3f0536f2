"""The AMQP service: virtual hosts, connections, authentication and the timers they share.

One `AmqpService` per broker. It batches output (connections ask for a flush and every dirty
connection is written once per event-loop turn), ticks heartbeats and handshake timeouts, sweeps
expired messages (`x-message-ttl`, per-message expiration) and unused queues (`x-expires`), and
deletes exclusive queues with their connection and auto-delete queues with their last consumer.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from ...core.edge import KICK_REASON, Action, ClientInfo, Edge, Principal, SecurityPort
from ...core.message import now_ms
from ...core.scheduling import Scheduler, Timer
from ..output import OutputBatcher
from ..read_budget import ReadBudget
from .queues import Queue
from .settings import AmqpSettings
from .vhost import VirtualHost

if TYPE_CHECKING:
    from .base import ConnectionBase
    from .channel import AmqpChannel
    from .remote import ExchangeDirectory, QueueDirectory

log = logging.getLogger(__name__)

SWEEP_S = 0.05
# The unacknowledged bytes (one pass over every channel's deliveries) are summed every this
# many sweeps (once a second), the ready bytes every sweep.
UNACKED_SWEEPS = 20
REFUSED = (
    "Login was refused using authentication mechanism PLAIN or AMQPLAIN. "
    "For details see the broker logfile."
)
ANONYMOUS_REFUSED = "anonymous login refused"

# authenticator(username, password) -> None to accept, or the refusal text.
Authenticator = Callable[[str, str], str | None]
TICK_S = 1.0


class AmqpService:
    def __init__(
        self, edge: Edge, settings: AmqpSettings | None = None, scheduler: Scheduler | None = None,
        read_budget: ReadBudget | None = None, *, queue_directory: QueueDirectory | None = None,
        exchange_directory: ExchangeDirectory | None = None,
    ) -> None:
        """`queue_directory` and `exchange_directory`: a cluster's shared queues and exchanges
        (`remote.py`) for every virtual host, used once the node has joined; None on a single
        node."""
        self.edge = edge
        # The broker's security policy, asked at each login (the Edge's port: a policy
        # installed later, or again, is the one the next login asks).
        self.security: SecurityPort = edge.security
        # Time and timers, from the I/O adapter (an asyncio loop is one) or a test's clock.
        self._scheduler = scheduler
        self.settings = settings or AmqpSettings()
        self.vhosts: dict[str, VirtualHost] = {}
        for name in self.settings.vhosts:
            vhost = VirtualHost(name, edge, queue_directory=queue_directory,
                                exchange_directory=exchange_directory)
            vhost.on_queue_deleted.append(self._queue_deleted)
            vhost.on_exchange_bound.append(self.reauthorize)
            self.vhosts[name] = vhost
        self.authenticator: Authenticator | None = None
        # Other checks `reauthorize` runs (the consumers of other nodes on this node's queues,
        # `remote.QueueHost`); each returns how many consumers it ended.
        self.on_reauthorize: list[Callable[[], int]] = []
        # Memory alarm raised: publishers are held (connection.blocked) until it clears.
        self.blocked = False
        # the alarms raised: "queues" (ready bytes of this service's queues), "memory" (the
        # process's resident memory, `shardgate.resources`)
        self._alarms: set[str] = set()
        self._sweeps = 0
        self._unacked_bytes = 0
        self.connections: set[ConnectionBase] = set()
        # Direct reply-to: token -> the channel whose reply consumer it names.
        self.reply_channels: dict[str, AmqpChannel] = {}
        self._all: set[ConnectionBase] = set()
        self.output: OutputBatcher[ConnectionBase] = OutputBatcher(
            lambda flush: self.scheduler.call_soon(flush))
        # The reads one loop turn handles, shared with the broker's other listeners.
        self.read_budget = read_budget or ReadBudget(
            call_soon=lambda handle: self.scheduler.call_soon(handle),
            clock=lambda: self.scheduler.time())
        self._tick_handle: Timer | None = None
        self._sweep_handle: Timer | None = None
        edge.clients.register("amqp", self)

    # ------------------------------------------------------------------ lifecycle
    @property
    def scheduler(self) -> Scheduler:
        if self._scheduler is None:
            raise RuntimeError("AmqpService needs a scheduler: the asyncio adapter passes its event loop")
        return self._scheduler

    def start(self) -> None:
        for vhost in self.vhosts.values():
            restored = vhost.restore()
            if restored:
                log.info("restored %d durable AMQP queues in vhost %r", restored, vhost.name)
        self._tick_handle = self.scheduler.call_later(TICK_S, self._tick)
        self._sweep_handle = self.scheduler.call_later(SWEEP_S, self._sweep)

    def stop(self) -> None:
        for handle in (self._tick_handle, self._sweep_handle):
            if handle is not None:
                handle.cancel()
        for connection in list(self._all):
            connection.shutdown()
        self._flush()

    # ------------------------------------------------------------------ output batching
    def request_flush(self, connection: ConnectionBase) -> None:
        self.output.request(connection)

    def _flush(self) -> None:
        self.output.flush()

    # ------------------------------------------------------------------ policy
    def authenticate(self, user: str | None, password: str | None, loopback: bool,
                     remote: str = "") -> str | None | asyncio.Future[str | None]:
        """None to accept, else the refusal text for connection.close 403, or a future of
        either while a password is hashed off the event loop (`remote`, the client's address,
        throttles those). The broker's security policy decides once it checks credentials;
        on an open broker (or with no policy) the built-in logins do, as RabbitMQ out of the
        box: `settings.users` (guest/guest) or the `authenticator` hook, and
        `settings.loopback_users` only from loopback."""
        policy = self.security.policy
        if policy is not None and policy.checks_credentials():
            verdict = policy.authenticate_principal(Principal("amqp", user, "", remote), password)
            if not isinstance(verdict, asyncio.Future):
                return _refusal_text(verdict)
            text: asyncio.Future[str | None] = asyncio.get_running_loop().create_future()
            verdict.add_done_callback(lambda done: text.set_result(_refusal_text(done.result())))
            return text
        refusal = self._builtin_login(user, password, loopback)
        if refusal is not None and policy is not None:
            policy.count_denial(Principal("amqp", user, "", remote), Action.CONNECT)
        return refusal

    def _builtin_login(self, user: str | None, password: str | None, loopback: bool) -> str | None:
        settings = self.settings
        if user is None or password is None:
            return REFUSED
        if self.authenticator is not None:
            refusal = self.authenticator(user, password)
            if refusal is not None:
                return refusal
        else:
            expected = settings.users.get(user)
            if expected is None or not hmac.compare_digest(expected.encode(), password.encode()):
                return REFUSED
        if user in settings.loopback_users and not loopback:
            return f"user '{user}' can only connect via localhost"
        return None

    # ------------------------------------------------------------------ client registry
    def clients(self) -> list[ClientInfo]:
        opened_offset = time.time() - self.scheduler.time()
        out = []
        for connection in list(self.connections):
            name = (connection.client_properties or {}).get("connection_name")
            out.append(ClientInfo(
                "amqp", connection.id, connection.username or None, connection.remote, "tcp",
                connection.opened_at + opened_offset, connection.messages_in,
                connection.messages_out,
                f"AMQP 0-9-1 {name}" if name else "AMQP 0-9-1",
            ))
        return out

    def reauthorize(self) -> int:
        """The users or the ACL rules changed: end the consumers whose user may no longer
        read their queue (`reauthorize_consumers`). Returns how many ended."""
        if not self.edge.secured:
            return 0
        ended = sum(connection.reauthorize_consumers() for connection in list(self.connections))
        return ended + sum(check() for check in self.on_reauthorize)

    def kick(self, client_id: str, reason: str = KICK_REASON) -> int:
        """Close `client_id` (a connection id) with connection.close 320 CONNECTION_FORCED."""
        for connection in list(self.connections):
            if connection.id == client_id:
                connection.shutdown(reason)
                return 1
        return 0

    def vhost(self, name: str) -> VirtualHost | None:
        return self.vhosts.get(name)

    # ------------------------------------------------------------------ connections
    def connection_made(self, connection: ConnectionBase) -> None:
        self._all.add(connection)

    def connection_opened(self, connection: ConnectionBase) -> None:
        self.connections.add(connection)
        log.info("%s: AMQP connection %s opened (user %r, vhost %r)", connection.remote, connection.id,
                 connection.username, connection.vhost.name if connection.vhost else None,
                 extra={"event": "client_connected", "protocol": "amqp", "client_id": connection.id,
                        "peer": connection.remote})

    def connection_closed(self, connection: ConnectionBase, touched: Iterable[Queue]) -> None:
        """The connection released its channels: drop what it owned."""
        self.queues_released(connection, touched)
        vhost = connection.vhost
        if vhost is not None:
            for queue in [q for q in vhost.queues.values() if q.exclusive_owner is connection]:
                vhost.delete_queue(queue)
        if connection in self.connections:
            self.connections.discard(connection)
            reason = connection.close_reason or "closed"
            log.info("%s: AMQP connection %s closed: %s", connection.remote, connection.id, reason,
                     extra={"event": "client_disconnected", "protocol": "amqp",
                            "client_id": connection.id, "peer": connection.remote, "reason": reason})

    def connection_gone(self, connection: ConnectionBase) -> None:
        connection.connection_lost()
        self._all.discard(connection)

    def queues_released(self, connection: ConnectionBase, queues: Iterable[Queue]) -> None:
        """Consumers left `queues`: delete the auto-delete ones now unused."""
        vhost = connection.vhost
        if vhost is None:
            return
        for queue in set(queues):
            if queue.unused_and_disposable and not queue.deleted:
                vhost.delete_queue(queue)
            elif not queue.deleted:
                queue.dispatch()

    def _queue_deleted(self, queue: Queue) -> None:
        for connection in list(self.connections):
            connection.queue_deleted(queue)

    # ------------------------------------------------------------------ memory alarm
    def ready_bytes(self) -> int:
        return sum(q.ready_bytes for vhost in self.vhosts.values() for q in vhost.queues.values())

    def unacked_bytes(self) -> int:
        """Payload bytes delivered and not acknowledged yet: they stay in memory until settled
        (700 deliveries of 1 MB with prefetch 0 held 700 MB the watermark did not count)."""
        return sum(len(delivery.entry.message.payload)
                   for connection in self.connections
                   for channel in connection.channels.values()
                   for delivery in channel.unacked.values())

    def _check_memory(self) -> None:
        high = self.settings.memory_high_watermark
        self._sweeps += 1
        if self._sweeps % UNACKED_SWEEPS == 0:
            self._unacked_bytes = self.unacked_bytes()
        held = self.ready_bytes() + self._unacked_bytes
        if "queues" not in self._alarms and held > high:
            log.warning("AMQP memory alarm: %d bytes of ready and unacknowledged messages; "
                        "blocking publishers", held)
            self.resource_alarm("queues", True)
        elif "queues" in self._alarms and held <= high // 2:
            log.info("AMQP memory alarm cleared (%d bytes); unblocking publishers", held)
            self.resource_alarm("queues", False)

    def resource_alarm(self, name: str, raised: bool) -> None:
        """Raise or clear one memory alarm; publishers are held while any is raised."""
        was = bool(self._alarms)
        if raised:
            self._alarms.add(name)
        else:
            self._alarms.discard(name)
        if bool(self._alarms) == was:
            return
        self.blocked = bool(self._alarms)
        for connection in list(self.connections):
            if self.blocked:
                connection.block("low on memory")
            else:
                connection.unblock()

    # ------------------------------------------------------------------ timers
    def _tick(self) -> None:
        self._tick_handle = self.scheduler.call_later(TICK_S, self._tick)
        now = self.scheduler.time()
        for connection in list(self._all):
            try:
                connection.tick(now)
            except Exception:
                log.exception("AMQP tick failed for %s", connection.remote)

    def _sweep(self) -> None:
        self._sweep_handle = self.scheduler.call_later(SWEEP_S, self._sweep)
        now = now_ms()
        self._check_memory()
        for vhost in self.vhosts.values():
            for queue in list(vhost.timed_queues):
                if queue.deleted:
                    continue
                queue.expire(now)
                if (
                    queue.expires is not None and not queue.consumers
                    and now - queue.last_used_ms >= queue.expires
                ):
                    vhost.delete_queue(queue)


def _refusal_text(verdict: str | None) -> str | None:
    """The connection.close text of the security policy's verdict."""
    if verdict is None:
        return None
    return ANONYMOUS_REFUSED if verdict == "not-authorized" else REFUSED
