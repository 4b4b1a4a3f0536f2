"""The state every part of the MQTT service shares (`ServiceState`: its attributes and their
first values) and who is told of sessions opening and ending (`SessionEvents`).

`MqttService` (`service.py`) is assembled from parts, one concern each, over this state:
`service_writes.py` (session state saved to the store, in one group commit per read),
`service_lifetimes.py` (the end of a connection: wills and session expiry),
`service_restore.py` (persistent sessions brought back at start) and `service_cluster.py`
(sessions held on other nodes). The parts are base classes, not objects the service calls
through: what a connection calls per packet costs no extra call. Nothing here touches a socket.
"""

from __future__ import annotations

import asyncio
import itertools
import os
from collections.abc import Callable
from concurrent.futures import Future
from typing import TYPE_CHECKING

from ...core.edge import Edge
from ...core.scheduling import Scheduler, Timer
from ..output import OutputBatcher
from ..read_budget import ReadBudget
from . import packets as p
from .remote import NO_REMOTE_SESSIONS, RemoteSessions
from .session import MqttSession
from .settings import MqttSettings
from .timing import ConnectTiming

if TYPE_CHECKING:
    from ...core.ports import MqttSessionPorts
    from .connection import MqttConnection


def _no_clock() -> float:
    raise RuntimeError("MqttService needs a scheduler: the asyncio adapter passes its event loop")


class SessionEvents:
    """Who is told, by client id, of a session opening here (`opened`: new, resumed or taken
    over), of a session ending here (`ended`: not merely disconnected) and of a client's will
    being published, dropped or scheduled here (`will_changed`). Cluster mode adds its
    listeners; on a single node the lists stay empty."""

    __slots__ = ("opened", "ended", "will_changed")

    def __init__(self) -> None:
        self.opened: list[Callable[[str], None]] = []
        self.ended: list[Callable[[str], None]] = []
        self.will_changed: list[Callable[[str], None]] = []


class ServiceState:
    """What every part of `MqttService` reads and changes; the parts' methods that the other
    parts call are declared here for the type checker (`service.py` assembles them)."""

    # The memory alarm (`shardgate.resources`): connections that publish are not read
    # meanwhile (each looks again every `BLOCKED_RECHECK_S`).
    publishers_blocked = False
    def __init__(
        self, edge: Edge, settings: MqttSettings | None = None,
        store: MqttSessionPorts | None = None, scheduler: Scheduler | None = None,
        read_budget: ReadBudget | None = None, *, use_identity_as_username: bool = False,
    ) -> None:
        self.edge = edge
        # Time and timers, from the I/O adapter (an asyncio loop is one) or a test's clock.
        self._scheduler = scheduler
        # Monotonic seconds of that scheduler: one bound method for every connection to call.
        self.clock: Callable[[], float] = scheduler.time if scheduler is not None else _no_clock
        # Where persistent sessions are saved; None keeps them in memory only.
        self.store = store
        self.settings = settings or MqttSettings()
        self.sessions: dict[str, MqttSession] = {}
        self.connections: set[MqttConnection] = set()
        # Set by a graceful stop: no new PUBLISH goes out (see `finish_in_flight`).
        self.draining = False
        # Cluster mode: who is told of sessions opening and ending here and of wills changing
        # (the session registry, wills kept in etcd), in the order they were added.
        self.session_events = SessionEvents()
        # Sessions held on other nodes (`remote.py`): a cluster's, given once at its join
        # (`join_cluster`); on a single node, nothing is elsewhere.
        self._remote: RemoteSessions = NO_REMOTE_SESSIONS
        # Cluster mode, while the node starts: done once it has joined its cluster (see
        # `hold_sessions_until`); until then every CONNECT waits before its session opens.
        self._joined: asyncio.Future[None] | None = None
        # TLS listeners: a verified client certificate's subject CN is the user name.
        self.use_identity_as_username = use_identity_as_username
        # Output of a loop turn leaves after the session state it acknowledges is committed.
        self.output: OutputBatcher[MqttConnection] = OutputBatcher(
            lambda flush: self.scheduler.call_soon(flush), before_flush=self.commit_writes)
        # Sessions saved while a read's writes are grouped: written once each as the group
        # closes (by client id, so that forgetting a session drops its pending save).
        self._grouping = False
        self._unsaved: dict[str, MqttSession] = {}
        # A new persistent session was saved in the read being handled: its group commits at
        # the end of that read, not of the turn, so that the session is committed before its
        # CONNACK is written and the fsync that every later acknowledgement to it waits for
        # starts at once (and the commit is small: one read's writes).
        self._commit_at_read_end = False
        self.store_writes_deferred = 0
        # Of those, the ones no output waits for (`save_session(acknowledged=False)`), and how
        # many such writes were made: `store_writes` leaves them out.
        self._quiet: set[str] = set()
        self._quiet_writes = 0
        # Connections whose output waits for a metadata commit to be durable, by its future.
        self._held_for_durable: dict[Future[None] | asyncio.Future[None], list[MqttConnection]] = {}
        # Cluster mode: persistent sessions whose QoS 2 state the read being handled changed
        # (`exactly_once_changed`), told to `_remote.exactly_once` as the read ends.
        self._exactly_once: dict[str, MqttSession] = {}
        # QoS 2 inbound state changes of durable sessions, written in one batch per loop turn.
        self._will_timers: dict[str, tuple[Timer, p.Will]] = {}
        self._expiry_timers: dict[str, Timer] = {}
        self._client_ids = itertools.count(1)
        self._id_prefix = os.urandom(4).hex()
        self._tick_handle: Timer | None = None
        self._sys_handle: Timer | None = None
        self.total_connections = 0
        # Connections not yet past CONNECT -> when they were accepted: the CONNECT timeout
        # runs from accept, whatever the client trickles in meanwhile.
        self._handshaking: dict[MqttConnection, float] = {}
        # Cluster mode: connections whose CONNECT waits for its session to come from (or end
        # on) another node, by client id, each with the node whose later CONNECT overtook it
        # meanwhile (None until one does): `service_cluster.py`.
        self._awaiting_session: dict[str, dict[MqttConnection, str | None]] = {}
        # The connection whose packets are being handled (its writes are grouped).
        self.publishing: MqttConnection | None = None
        # Back-pressure (`core/backpressure.py`, shared with every publisher of the broker: a
        # cluster peer's link too): the online sessions whose queue is over half full hold
        # the current publisher until they catch up.
        self.back_pressure = edge.back_pressure
        self._congested: set[MqttSession] = set()
        # ... of which those whose queue (not only their socket's output) is over half full.
        self._queue_congested: set[MqttSession] = set()
        # Drops of a full session queue, by reason -> (when the last line was logged, drops
        # since): logged at most once per DROP_LOG_INTERVAL_S per reason.
        self._drop_log: dict[str, tuple[float, int]] = {}
        # Where CONNECTs wait (read → session open → CONNACK written) and the loop's lateness.
        self.connect_timing = ConnectTiming()
        # The reads one loop turn handles, shared with the broker's other listeners.
        self.read_budget = read_budget or ReadBudget(
            call_soon=lambda handle: self.scheduler.call_soon(handle),
            clock=lambda: self.scheduler.time())

    @property
    def scheduler(self) -> Scheduler:
        if self._scheduler is None:
            raise RuntimeError("MqttService needs a scheduler: the asyncio adapter passes its event loop")
        return self._scheduler

    if TYPE_CHECKING:  # the parts' methods the other parts call (`service.py` assembles them)
        def group_writes(self, on: bool) -> None: ...

        def commit_writes(self) -> None: ...

        def save_session(self, session: MqttSession, *, acknowledged: bool = True) -> None: ...

        def relieved(self, session: MqttSession) -> None: ...

        def stop_timers(self, client_id: str, *, publish_will: bool) -> None: ...

        def _expire_session(self, client_id: str) -> None: ...

        def forget_session(self, client_id: str) -> None: ...
