"""MQTT wills that outlive the node holding their client's connection.

A will lives in the memory of the node its client is connected to; when that node dies
(SIGKILL, power) nothing there publishes it. So every node also keeps the wills it holds in
etcd, under `/shardgate/<cluster>.state/wills/<client id>` (outside the watched prefix: a
CONNECT with a will is one etcd write no other node is woken for), naming the node and its
lease. The key follows the will's life on its node:

- a client with a will opens its session here: the will is put (as its connection's);
- the connection ends with DISCONNECT 0x00, its will is published here, or its session goes
  to another node: the key is deleted (if it still names this node);
- the connection drops with a will delay (MQTT 5): the key stays, marked with when the
  connection went, until the delayed will is published or cancelled here.

When a node's lease expires (it leaves the live nodes), the controller publishes every will
that node held, once its will delay has run from when the connection dropped (or from when
the controller saw the node go), with its retain flag and properties, through the normal
publish path. Publication is at least once across a controller's death, and once while no
controller dies:

1. claim: an etcd transaction at the revision read rewrites the key, marked as claimed by the
   controller under its lease (`"claim": {"node", "lease"}`); of two controllers, one wins;
2. publish;
3. delete the key at the claim's revision.

A claim whose claimer is gone (no longer a live node, or a node restarted under the same id
with a newer lease) is a will not known to be published: the controller claims it again and,
its delay having run, publishes it at once, unless it finds it published already. So a
controller that dies between claim and publish loses no will. One that dies between publish
and delete left the will in its shard: the claim records when it was made (`"at"`, the
claimer's clock, the same clock that stamped the will's publish time), and before publishing
again the next controller reads the will topic's shard from its owner's journal for a message
of that client, on that topic, with that payload, published at or after the claim; if there is
one, it only deletes the claim. That check needs a reliable shard (a journal): a will on a
non-reliable stream, or one whose shard's owner cannot be read within `PUBLISH_RETRY_S`, is
published again, so there a will is published at least once (twice if its controller died
between publishing it and deleting its claim). A will
whose client is back on a live node by then (the session registry says so) is dropped, as a
reconnect within the delay cancels it on one node. A node that restarts under the same id
publishes the wills its previous life left, held or claimed (they name an older lease).

Test hooks (tests only, never set in production): when the environment variable
`SG_TEST_PAUSE_AFTER_WILL_CLAIM` names a file, a node that has just claimed a will waits while
that file exists before publishing it, so that a test can kill it between claim and publish;
`SG_TEST_PAUSE_AFTER_WILL_PUBLISH` likewise between publish and delete.
"""

from __future__ import annotations

import asyncio
import base64
import logging
import os
from typing import TYPE_CHECKING, Any

from ..core.message import Message, now_ms
from ..protocols.mqtt import packets as p
from ..protocols.mqtt.service import will_message
from . import keys
from .etcd import KeyValue
from .journal_search import ShardUnreadable, shard_holds
from .set_aside import UNREADABLE, SetAside, decode_record
from .view_changes import ViewChanges

if TYPE_CHECKING:
    from ..core.broker import Broker
    from ..protocols.mqtt.service import MqttService
    from .control import ClusterNode
    from .state_writer import StateWriter

log = logging.getLogger(__name__)


def _node_in(raw: bytes) -> Any:
    """The node a will's record names; None when it cannot be read."""
    try:
        return decode_record(raw).get("node")
    except ValueError:
        return None

# How often the controller looks for wills of nodes that are gone.
SCAN_INTERVAL_S = 1.0
# How long a departed node's will is retried while its shard has no live owner (a reliable
# shard of the departed node itself waits for that node to come back).
PUBLISH_RETRY_S = 300.0
# How long a will waiting for its shard waits at most before trying again (the view's next
# change wakes it sooner).
RETRY_S = 0.5
# Names a file: while it exists, a node that claimed a will waits before publishing it (tests).
CLAIM_PAUSE_ENV = "SG_TEST_PAUSE_AFTER_WILL_CLAIM"
# Names a file: while it exists, a node that published a will waits before deleting its claim.
PUBLISH_PAUSE_ENV = "SG_TEST_PAUSE_AFTER_WILL_PUBLISH"
# Where the journal search for an already published will starts, before its claim's time (the
# journal is found by time; the match itself is exact on the publish time).
SEARCH_BEFORE_CLAIM_MS = 60_000


def _b64(data: bytes | None) -> str | None:
    return None if data is None else base64.b64encode(data).decode()


def _unb64(data: str | None) -> bytes | None:
    return None if data is None else base64.b64decode(data)


def will_state(client_id: str, will: p.Will, *, node: str, lease: int, delay: int, expiry: int,
               disconnected_ms: int | None) -> dict[str, Any]:
    """What etcd keeps of a will: enough to publish it as its node would have."""
    props = will.properties
    return {
        "client_id": client_id, "node": node, "lease": lease,
        "topic": will.topic, "payload": _b64(will.payload), "qos": will.qos, "retain": will.retain,
        "delay": delay, "expiry": expiry, "disconnected_ms": disconnected_ms,
        "message_expiry_interval": props.message_expiry_interval,
        "content_type": props.content_type, "correlation_data": _b64(props.correlation_data),
        "response_topic": props.response_topic,
        "payload_format_indicator": props.payload_format_indicator,
        "user_properties": [list(pair) for pair in props.user_properties or []],
    }


def will_of(state: dict[str, Any]) -> p.Will:
    props = p.Properties(
        message_expiry_interval=state.get("message_expiry_interval"),
        content_type=state.get("content_type"),
        correlation_data=_unb64(state.get("correlation_data")),
        response_topic=state.get("response_topic"),
        payload_format_indicator=state.get("payload_format_indicator"),
        user_properties=[(str(k), str(v)) for k, v in state.get("user_properties") or []],
    )
    return p.Will(str(state["topic"]), _unb64(state.get("payload")) or b"", int(state.get("qos", 0)),
                  bool(state.get("retain", False)), props)


def responsible(state: dict[str, Any]) -> tuple[Any, Any]:
    """The node and lease answering for a will in etcd: its claimer once claimed, else the node
    holding its client's connection."""
    claim = state.get("claim")
    if isinstance(claim, dict):
        return claim.get("node"), claim.get("lease")
    return state.get("node"), state.get("lease")


def publish_at_ms(state: dict[str, Any], noticed_ms: int) -> int:
    """When a dead node's will is due: its delay (bounded by the session expiry, as on the
    node) from when the connection dropped, or from when its node was seen gone; at once
    when a departed controller had claimed it (its delay had run)."""
    if state.get("claim") is not None:
        return noticed_ms
    delay = int(state.get("delay") or 0)
    expiry = int(state.get("expiry") or 0)
    if delay <= 0 or expiry == 0:
        return noticed_ms
    dropped = state.get("disconnected_ms")
    start = int(dropped) if dropped is not None else noticed_ms
    return start + min(delay, expiry) * 1000


class WillKeeper:
    """Keeps this node's wills in etcd and publishes those of dead nodes (module docstring)."""

    def __init__(self, node: ClusterNode, service: MqttService, writer: StateWriter,
                 broker: Broker) -> None:
        self.node = node
        self.service = service
        self.broker = broker
        self.writer = writer
        self.prefix = node.settings.prefix.rstrip("/") + ".state/wills/"
        # wills in etcd that cannot be restored: logged once each, left where they are
        self.set_aside = SetAside(log)
        self.view_changes = ViewChanges(node.view)
        # client ids whose will this node has put in etcd
        self._kept: set[str] = set()
        # wills of dead nodes waiting for their delay: key -> mod revision being waited on
        self._due: dict[str, int] = {}
        self._scanner: asyncio.Task[None] | None = None
        self._own_leftovers_checked = False
        self._claims: set[asyncio.Task[None]] = set()
        # keys this node is claiming, publishing or deleting now
        self._claiming: set[str] = set()
        self.published = 0

    def key(self, client_id: str) -> str:
        return self.prefix + client_id

    # ------------------------------------------------------------ wiring
    def install(self) -> None:
        events = self.service.session_events
        events.opened.append(self.opened)  # after the session registry's (attach.py)
        events.will_changed.append(self.changed)

    def start(self) -> None:
        if self._scanner is None:
            self._scanner = asyncio.get_running_loop().create_task(self._scan_loop())

    def stop(self) -> None:
        if self._scanner is not None:
            self._scanner.cancel()
            self._scanner = None

    # ------------------------------------------------------------ this node's wills
    def opened(self, client_id: str) -> None:
        session = self.service.sessions.get(client_id)
        connection = session.connection if session is not None else None
        if (connection is not None and connection.will is not None) or client_id in self._kept:
            self._sync(client_id, opened=True)

    def changed(self, client_id: str) -> None:
        """The MQTT service published, dropped or scheduled `client_id`'s will."""
        if client_id in self._kept:
            self._sync(client_id, opened=False)

    def _current(self, client_id: str) -> dict[str, Any] | None:
        """The will this node holds for `client_id` now, as etcd keeps it (None: none)."""
        service = self.service
        session = service.sessions.get(client_id)
        node_id, lease = self.node.node_id, self.node.lease_id
        if session is not None and session.connection is not None:
            connection = session.connection
            if connection.will is None:
                return None
            return will_state(client_id, connection.will, node=node_id, lease=lease,
                              delay=service.will_delay(connection, connection.will),
                              expiry=connection.session_expiry_at_connect, disconnected_ms=None)
        pending = service.pending_will(client_id)
        if pending is None or session is None:
            return None
        delay = pending.properties.will_delay_interval or 0
        return will_state(client_id, pending, node=node_id, lease=lease, delay=delay,
                          expiry=session.expiry_interval, disconnected_ms=session.disconnected_at_ms)

    def _sync(self, client_id: str, *, opened: bool) -> None:
        """Make etcd agree with the will held here, in the background (what is written is the
        state when it is written). A session opening here replaces whatever etcd had; any
        other change deletes only a key that still names this node."""
        key = self.key(client_id)

        async def write() -> None:
            client = self.node.state_store
            state = self._current(client_id)
            if state is not None:
                self._kept.add(client_id)
                await client.put(key, keys.encode(state))
                return
            self._kept.discard(client_id)
            if opened:
                await client.delete(key)
                return
            kv = await client.get(key)
            if kv is not None and _node_in(kv.value) == self.node.node_id:
                await client.delete_unchanged(key, kv.mod_revision)

        self.writer.run(key, write)

    # ------------------------------------------------------------ wills of dead nodes
    async def _scan_loop(self) -> None:
        while True:
            try:
                if self.node.is_controller or not self._own_leftovers_checked:
                    await self.scan()
                    self._own_leftovers_checked = True
            except Exception as exc:  # noqa: BLE001 - the next round tries again
                log.warning("cluster: looking for wills of departed nodes failed: %s", exc)
            await asyncio.sleep(SCAN_INTERVAL_S)

    def _orphaned(self, state: dict[str, Any]) -> bool:
        holder, lease = responsible(state)
        if holder == self.node.node_id:
            return bool(lease != self.node.lease_id)  # left by this node's previous life
        return self.node.is_controller and holder not in self.node.view.nodes()

    def _claimed_here(self, state: dict[str, Any]) -> bool:
        claim = state.get("claim")
        return (isinstance(claim, dict) and claim.get("node") == self.node.node_id
                and claim.get("lease") == self.node.lease_id)

    async def scan(self) -> int:
        """Schedule every will whose holder (or claimer) is gone; returns how many were found."""
        kvs, _revision = await self.node.state_store.get_prefix(self.prefix)
        found = 0
        now = now_ms()
        for kv in kvs:
            try:
                state = decode_record(kv.value)
                claimed_here = self._claimed_here(state)
                orphaned = self._orphaned(state)
                publish_at = publish_at_ms(state, now)
            except UNREADABLE as exc:
                self.set_aside("an MQTT will", kv, exc)
                continue
            if claimed_here:
                if kv.key not in self._claiming:  # published, but its delete failed: again
                    await self._delete_claim(kv.key, kv.mod_revision)
                continue
            if not orphaned or self._due.get(kv.key) == kv.mod_revision:
                continue
            found += 1
            self._due[kv.key] = kv.mod_revision
            wait_s = max(0.0, (publish_at - now) / 1000)
            asyncio.get_running_loop().call_later(wait_s, self._claim_later, kv, state)
        return found

    def _claim_later(self, kv: KeyValue, state: dict[str, Any]) -> None:
        task = asyncio.get_running_loop().create_task(self._claim(kv, state))
        self._claims.add(task)
        task.add_done_callback(self._claims.discard)

    async def _claim(self, kv: KeyValue, state: dict[str, Any]) -> None:
        """Publish a departed node's will if this node wins the etcd claim on it (module
        docstring: claim, publish, delete)."""
        if self._due.get(kv.key) == kv.mod_revision:
            del self._due[kv.key]
        if kv.key in self._claiming:
            return
        client_id = str(state.get("client_id", ""))
        previous = state.get("claim")
        claimed = dict(state, claim={"node": self.node.node_id, "lease": self.node.lease_id, "at": now_ms()})
        self._claiming.add(kv.key)
        try:
            try:
                taken = await self.node.state_store.write([(kv.key, keys.encode(claimed))],
                                                     if_at=(kv.key, kv.mod_revision))
            except Exception as exc:  # noqa: BLE001 - the next scan finds it again
                log.warning("cluster: cannot claim the will of %r yet: %s", client_id, exc)
                return
            if taken is None:
                return  # claimed, replaced or cancelled elsewhere
            await pause_for_tests(CLAIM_PAUSE_ENV)
            holder = self.node.view.sessions.get(client_id)
            will = will_of(state)
            if holder is not None and holder != state.get("node") and holder in self.node.view.nodes():
                log.info("cluster: the will of %r is cancelled: its client is back on %s", client_id, holder)
            elif (isinstance(previous, dict) and isinstance(previous.get("at"), int)
                  and await self.published_since(client_id, will, previous["at"])):
                log.info("cluster: the will of %r was published by departed controller %s already",
                         client_id, previous.get("node"))
            else:
                log.info("cluster: publishing the will of %r held by departed node %s",
                         client_id, state.get("node"))
                await self._publish(client_id, will)
                await pause_for_tests(PUBLISH_PAUSE_ENV)
            await self._delete_claim(kv.key, taken)
        finally:
            self._claiming.discard(kv.key)

    async def _delete_claim(self, key: str, revision: int) -> None:
        """Delete a will this node claimed and published (or cancelled), unless it changed."""
        try:
            await self.node.state_store.delete_unchanged(key, revision)
        except Exception as exc:  # noqa: BLE001 - the next scan deletes it
            log.warning("cluster: cannot delete a published will's claim yet: %s", exc)

    async def published_since(self, client_id: str, will: p.Will, since_ms: int) -> bool:
        """Whether the will's shard holds it already: a message of `client_id` on the will's
        topic with its payload, published at or after `since_ms` (a departed controller's
        claim). False when that cannot be known: a non-reliable shard, or its owner not read
        within PUBLISH_RETRY_S (then the will is published again: at least once)."""

        def published(message: Message) -> bool:
            return (message.producer_id == client_id and message.payload == will.payload
                    and message.publish_time_ms >= since_ms)

        loop = asyncio.get_running_loop()
        give_up = loop.time() + PUBLISH_RETRY_S
        while True:
            seen = self.view_changes.count
            try:
                held = await shard_holds(self.node, self.broker, will.topic,
                                         since_ms - SEARCH_BEFORE_CLAIM_MS, published)
                return bool(held)
            except ShardUnreadable as exc:
                if loop.time() >= give_up:
                    log.warning("cluster: cannot tell whether the will of %r was published (%s); "
                                "publishing it", client_id, exc)
                    return False
                log.info("cluster: the will of %r waits for its shard to be read (%s)", client_id, exc)
            await self.view_changes.since(seen, RETRY_S)  # its owner back changes the view

    async def _publish(self, client_id: str, will: p.Will) -> None:
        """Publish through the normal path, retried while its shard has no live owner (a
        reliable shard of the departed node is unavailable until that node is back)."""
        message = will_message(client_id, will)
        loop = asyncio.get_running_loop()
        give_up = loop.time() + PUBLISH_RETRY_S
        while True:
            seen = self.view_changes.count
            try:
                receipt = self.service.edge.publish(message)
                if receipt is not None:
                    await receipt
                self.published += 1
                return
            except Exception as exc:  # noqa: BLE001 - a shard without owner yet: retried
                if loop.time() >= give_up:
                    log.error("cluster: the will of %r could not be published: %s", client_id, exc)
                    return
                log.info("cluster: the will of %r waits for its shard (%s)", client_id, exc)
            await self.view_changes.since(seen, RETRY_S)  # its owner back changes the view


async def pause_for_tests(variable: str) -> None:
    """The test hooks of the module docstring: wait while the file named by `variable`
    exists (never set outside tests)."""
    path = os.environ.get(variable)
    while path and os.path.exists(path):
        await asyncio.sleep(0.05)
