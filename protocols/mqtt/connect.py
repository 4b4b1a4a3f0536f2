"""CONNECT of an MQTT connection: the checks of the spec, authentication (also off the event
loop), the session opened or taken over (in a cluster, fetched from another node) and the
CONNACK. A part of `MqttConnection`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ...core.edge import Principal
from ...core.topics import TopicError, validate_topic_name
from . import packets as p
from .codec import encode
from .connection_state import MQTT_V5, RC, ConnectionState, State, log
from .session import NEVER_EXPIRES, SessionOfAnotherUser
from .timing import clock as timing_clock

if TYPE_CHECKING:
    import asyncio


class ConnectHandling(ConnectionState):
    __slots__ = ()

    # ------------------------------------------------------------------ CONNECT
    def _refuse(self, v5_code: int, v3_code: int, reason: str) -> None:
        log.info("%s: connection refused: %s", self.remote, reason)
        if self.version == MQTT_V5:
            props = p.Properties(reason_string=reason)
            self._send(encode(p.Connack(False, v5_code, props), MQTT_V5))
        else:
            self._send(encode(p.Connack(False, v3_code), self.version))
        self.close()

    def _on_connect(self, connect: p.Connect) -> None:
        settings = self.service.settings
        self.version = connect.protocol_level
        v5 = self.version == MQTT_V5
        props = connect.properties
        client_id = connect.client_id
        assigned = None
        if not client_id:
            if not v5 and not connect.clean_start:
                # [MQTT-3.1.3-8] empty client id needs clean session on 3.1.1.
                self._refuse(RC.CLIENT_IDENTIFIER_NOT_VALID, p.ConnackCode311.IDENTIFIER_REJECTED,
                             "an empty client identifier needs clean session")
                return
            client_id = assigned = self.service.assign_client_id()
        elif len(client_id) > settings.max_client_id_length:
            self._refuse(RC.CLIENT_IDENTIFIER_NOT_VALID, p.ConnackCode311.IDENTIFIER_REJECTED,
                         "client identifier too long")
            return
        if v5 and props.authentication_method is not None:
            self._refuse(RC.BAD_AUTHENTICATION_METHOD, p.ConnackCode311.NOT_AUTHORIZED,
                         f"authentication method {props.authentication_method!r} is not supported")
            return
        if connect.will is not None:
            try:
                validate_topic_name(connect.will.topic)
            except TopicError as exc:
                self._refuse(RC.TOPIC_NAME_INVALID, p.ConnackCode311.SERVER_UNAVAILABLE, f"will topic: {exc}")
                return
            if connect.will.qos > settings.maximum_qos:
                self._refuse(RC.QOS_NOT_SUPPORTED, p.ConnackCode311.SERVER_UNAVAILABLE, "will QoS not supported")
                return
            if connect.will.retain and not settings.retain_available:
                self._refuse(RC.RETAIN_NOT_SUPPORTED, p.ConnackCode311.SERVER_UNAVAILABLE, "retain not supported")
                return
        if settings.max_connections and len(self.service.connections) >= settings.max_connections:
            self._refuse(RC.SERVER_BUSY, p.ConnackCode311.SERVER_UNAVAILABLE, "too many connections")
            return
        username = connect.username
        verdict: str | None
        if self.certificate_identity is not None:
            # The TLS layer verified a client certificate that names the user: no password.
            username, verdict = self.certificate_identity, None
        elif self._checked is not None:
            verdict, self._checked = self._checked[0], None  # checked off the loop (below)
        else:
            answer = self.service.authenticate(connect.username, connect.password, client_id, self.remote)
            if answer is not None and not isinstance(answer, str):  # a future of the verdict
                # A password is being hashed off the event loop: nothing else of this client
                # is handled until the verdict is in; then the CONNECT is handled again.
                self.state = State.OPENING
                answer.add_done_callback(lambda done: self._authenticated_later(connect, done))
                return
            verdict = answer
        if verdict is not None:
            bad_credentials = verdict == "bad-credentials"
            self._refuse(
                RC.BAD_USER_NAME_OR_PASSWORD if bad_credentials else RC.NOT_AUTHORIZED,
                p.ConnackCode311.BAD_USERNAME_OR_PASSWORD if bad_credentials else p.ConnackCode311.NOT_AUTHORIZED,
                "bad user name or password" if bad_credentials else "not authorized",
            )
            return
        principal = Principal("mqtt", username, client_id, self.remote)
        if connect.will is not None and not self.service.authorize_will(principal, connect.will.topic):
            # A will is a publish the client makes at CONNECT (retained or not): the publish
            # ACL decides, and a will on $SYS is refused as a PUBLISH there is (as mosquitto).
            self._refuse(RC.NOT_AUTHORIZED, p.ConnackCode311.NOT_AUTHORIZED,
                         f"will topic {connect.will.topic!r} not authorized")
            return
        clean_start = connect.clean_start
        if self.service.owned_by_other(client_id, username):
            if self._refuse_other_user(client_id):
                return
            clean_start = True  # a new session for the newcomer
        self.parser.max_packet_size = settings.max_packet_size  # logged in: the full limit
        self.client_id = client_id
        self.username = username
        self.principal = principal
        self.keep_alive = connect.keep_alive
        server_keep_alive = None
        if v5 and settings.max_keepalive and (self.keep_alive == 0 or self.keep_alive > settings.max_keepalive):
            # Server Keep Alive exists on 5.0 only [MQTT-3.2.2-21]; a 3.1.1 client's value stands.
            self.keep_alive = server_keep_alive = settings.max_keepalive
        if v5:
            expiry = props.session_expiry_interval or 0
            self.send_window = props.receive_maximum or 65535
            self.client_max_packet_size = props.maximum_packet_size or 0
            self.client_topic_alias_max = props.topic_alias_maximum or 0
            self.problem_info = props.request_problem_information != 0
        else:
            expiry = 0 if connect.clean_start else (settings.persistent_session_expiry or NEVER_EXPIRES)
        self.session_expiry_at_connect = expiry
        self.will = connect.will
        fetching = self.service.session_elsewhere(client_id, clean_start, username)
        if fetching is not None:
            # Cluster: the session lives on (or must be ended on) another node first; CONNACK
            # and every later packet wait until it is here.
            self.state = State.OPENING
            self.service.await_session(self)  # type: ignore[arg-type]
            fetching.add_done_callback(
                lambda done: self._opened_later(done, client_id, clean_start, expiry, assigned,
                                                server_keep_alive))
            return
        self._opened(client_id, clean_start, expiry, assigned, server_keep_alive)

    def _refuse_other_user(self, client_id: str) -> bool:
        """`client_id`'s session belongs to another user: True when the CONNECT is refused
        (`mqtt.session_takeover_by_other_user = "refuse"`), False when it gets a new session."""
        if self.service.settings.session_takeover_by_other_user != "refuse":
            log.info("%s: client %r has a session of another user; it starts anew", self.remote,
                     client_id)
            return False
        self._refuse(RC.NOT_AUTHORIZED, p.ConnackCode311.NOT_AUTHORIZED,
                     f"client identifier {client_id!r} has a session of another user")
        return True

    def _authenticated_later(self, connect: p.Connect, done: asyncio.Future[str | None]) -> None:
        """The password check of `connect` is done: handle the CONNECT with its verdict, then
        whatever the client sent meanwhile, as one read."""
        if self.state is not State.OPENING:
            return  # the client left meanwhile
        self.state = State.AWAIT_CONNECT
        verdict = "bad-credentials" if done.cancelled() or done.exception() is not None else done.result()
        self._checked = (verdict,)
        packets: list[p.Packet] = [connect, *self._backlog]
        self._backlog.clear()
        error, self._backlog_error = self._backlog_error, None
        self._process(packets, error)
        if self.state is State.CLOSED:
            self._checked = None

    def _opened_later(self, fetching: asyncio.Future[None], client_id: str, clean_start: bool, expiry: int,
                      assigned: str | None, server_keep_alive: int | None) -> None:
        """The session came from another node: open it as a read would, its store write in
        a group committed off the loop, and the CONNACK of a resumed session (and whatever
        follows a new one's CONNACK) held until that write is durable (a write outside a group
        would wait for its fsync on the event loop). A session that could not be brought here
        now (the future's error) refuses the CONNECT, retryably: a new session would drop the
        one held elsewhere."""
        failure = None if fetching.cancelled() else fetching.exception()
        overtaken_on = self.service.session_awaited(self)  # type: ignore[arg-type]
        if failure is None and overtaken_on is not None:
            # a later CONNECT on another node took the session while this one waited
            if self.state is not State.CLOSED:
                self._refuse(RC.SERVER_UNAVAILABLE, p.ConnackCode311.SERVER_UNAVAILABLE,
                             f"session taken over on {overtaken_on} while this CONNECT waited")
            return
        if isinstance(failure, SessionOfAnotherUser):
            # held on another node by another user: refused there, nothing ended anywhere
            if self.state is not State.CLOSED:
                self._refuse(RC.NOT_AUTHORIZED, p.ConnackCode311.NOT_AUTHORIZED,
                             f"client identifier {client_id!r} has a session of another user")
            return
        if failure is not None:
            if self.state is not State.CLOSED:
                self._refuse(RC.SERVER_UNAVAILABLE, p.ConnackCode311.SERVER_UNAVAILABLE, str(failure))
            return
        service = self.service
        if service.owned_by_other(client_id, self.username):
            # the session came from another node, made by another user
            if self._refuse_other_user(client_id):
                return
            clean_start = True
        grouping = service.publishing is None  # (a callback runs outside any read's group)
        start = len(self._out)
        writes = service.store_writes()
        if grouping:
            service.group_writes(True)
        try:
            self._opened(client_id, clean_start, expiry, assigned, server_keep_alive)
        finally:
            if grouping:
                service.group_writes(False)
            after_connack, self._after_connack = self._after_connack, None
            if service.store_writes() != writes:
                service.hold_output_until_durable(self, start if after_connack is None else after_connack)  # type: ignore[arg-type]
        if self.state is State.CONNECTED and self._out:
            self.flush()  # the CONNACK, unless it waits for a commit

    def _opened(self, client_id: str, clean_start: bool, expiry: int, assigned: str | None,
                server_keep_alive: int | None) -> None:
        if self.state is State.CLOSED:
            return  # the client left while its session was fetched
        settings = self.service.settings
        v5 = self.version == MQTT_V5
        resumed = self.state is State.OPENING
        self.state = State.CONNECTED
        session, present = self.service.open_session(self, client_id, clean_start, expiry)  # type: ignore[arg-type]
        self.session = session
        if self._connect_marks is not None:
            self._connect_marks[1] = timing_clock()
        connack_props = p.Properties()
        if v5:
            connack_props.receive_maximum = settings.receive_maximum
            connack_props.maximum_packet_size = settings.max_packet_size
            connack_props.topic_alias_maximum = settings.topic_alias_maximum
            if settings.maximum_qos < 2:
                connack_props.maximum_qos = settings.maximum_qos
            if not settings.retain_available:
                connack_props.retain_available = 0
            connack_props.assigned_client_identifier = assigned
            connack_props.server_keep_alive = server_keep_alive
        self._send(encode(p.Connack(present, RC.SUCCESS, connack_props), self.version))
        if not present and session.durable:
            # A new persistent session: its CONNACK reports no session (session present 0), so
            # it need not wait for the fsync of the session's commit (which is committed, into
            # the metadata WAL, before the CONNACK is written: a crash of the process keeps it).
            # Everything after the CONNACK (SUBACK, PUBACK, PUBREC, ...) waits for that fsync,
            # so no acknowledgement leaves before the session record is durable: after a
            # machine crash the client is told its session is gone, never half of it.
            self._after_connack = len(self._out)
        log.info("%s: client %r connected (MQTT %s, clean=%s, keepalive=%s)", self.remote, client_id,
                 {3: "3.1", 4: "3.1.1", 5: "5.0"}[self.version], clean_start, self.keep_alive,
                 extra={"event": "client_connected", "protocol": "mqtt", "client_id": client_id,
                        "peer": self.remote})
        session.resend_inflight()
        if resumed and (self._backlog or self._backlog_error is not None):
            self._resume_backlog()

