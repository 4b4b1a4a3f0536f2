"""What a broker holds once clients are gone: closed MQTT connections and ended sessions are
freed by reference counting as they go, not left in cycles for the garbage collector (under
load thousands of them piled up between collections, and the heap kept what their peak
needed). An idle broker keeps no string of the load that went (a cache entry made under load
pins a page of Python's small-object heap, and its 1 MiB arena, for good). And a stopped broker
is freed whole, even after serving its admin API."""

from __future__ import annotations

import gc
import json
import subprocess
import sys
import textwrap
import types
import urllib.request
import uuid
import weakref
from collections import deque
from collections.abc import Iterator, Mapping
from pathlib import Path

import pytest
from shardgate.protocols.mqtt import packets as p
from shardgate.protocols.mqtt.connection import MqttConnection
from shardgate.protocols.mqtt.session import MqttSession

from shardgate import persistence
from tests.conftest import ThreadedBroker, free_port, make_config, wait_for
from tests.mqtt_clients import V5, V311, Paho, RawClient


@pytest.fixture
def no_cycle_collection(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """No garbage collection: neither the automatic one nor the idle broker's own."""
    monkeypatch.setattr(persistence, "release_idle_memory", lambda broker: None)
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def _alive(kind: type, earlier: set[int]) -> int:
    """How many objects of `kind` exist that are not among `earlier` (ids of objects an
    earlier test in this process left alive, held by the caller so that no id is reused)."""
    return sum(1 for thing in gc.get_objects() if type(thing) is kind and id(thing) not in earlier)


def test_closed_connections_and_ended_sessions_are_freed_without_the_collector(
    broker: ThreadedBroker, no_cycle_collection: None
) -> None:
    port = broker.mqtt_port
    left_by_earlier_tests = [thing for thing in gc.get_objects()
                             if type(thing) in (MqttConnection, MqttSession)]
    earlier = {id(thing) for thing in left_by_earlier_tests}
    for index in range(5):
        persistent = Paho(port, f"p{index}", V311, clean=False)
        persistent.subscribe("load/#", 1)
        persistent.publish("load/x", "m", 1)
        assert persistent.expect().payload == b"m"
        persistent.drop()  # gone without DISCONNECT, the session stays
        ender = Paho(port, f"p{index}", V5, clean=True)  # ends the persistent session
        ender.disconnect()
        clean = Paho(port, f"c{index}", V5)
        clean.subscribe("load/#", 0)
        clean.disconnect()
    wait_for(lambda: not broker.app.mqtt.connections and not broker.app.mqtt.sessions)
    wait_for(lambda: _alive(MqttConnection, earlier) == 0 and _alive(MqttSession, earlier) == 0)


def test_an_ended_session_with_unacknowledged_messages_is_freed_without_the_collector(
    broker: ThreadedBroker, no_cycle_collection: None
) -> None:
    """A persistent session ended while messages it was sent are unacknowledged: its durable
    subscription's record of them must not keep the session (and the messages, whose payloads
    pin the heap) in a cycle until the next full collection."""
    port = broker.mqtt_port
    earlier = {id(thing) for thing in gc.get_objects() if type(thing) is MqttSession}
    publisher = Paho(port, "publisher", V5)
    for index in range(3):
        reader = RawClient(port, version=4)
        assert reader.connect(f"unacked{index}", clean=False).reason_code == 0
        reader.send(p.Subscribe(1, [p.SubscriptionRequest("held/#", 1)]))
        assert isinstance(reader.receive(), p.Suback)
        publisher.publish("held/x", b"x" * 2048, 1)
        delivered = reader.receive()
        assert isinstance(delivered, p.Publish) and delivered.qos == 1  # never acknowledged
        reader.close()
        ender = Paho(port, f"unacked{index}", V311, clean=True)  # ends the persistent session
        ender.disconnect()
    publisher.disconnect()
    wait_for(lambda: not broker.app.mqtt.connections and not broker.app.mqtt.sessions)
    wait_for(lambda: _alive(MqttSession, earlier) == 0)


def _strings_held(roots: list[object], marker: str, kept: list[object]) -> list[str]:
    """Every str or bytes containing `marker` reachable from `roots`, without entering other
    modules (what a module holds is reached through its own dictionary among the roots) nor
    the objects in `kept`."""
    raw = marker.encode()
    seen = {id(root) for root in roots} | {id(thing) for thing in kept}
    queue = deque(roots)
    held: list[str] = []
    while queue:
        thing = queue.popleft()
        if isinstance(thing, (str, bytes)):
            if (marker in thing) if isinstance(thing, str) else (raw in thing):
                held.append(repr(thing))
            continue
        for inner in gc.get_referents(thing):
            if id(inner) not in seen and not isinstance(inner, (types.ModuleType, types.FrameType)):
                seen.add(id(inner))
                queue.append(inner)
    return held


def test_an_idle_broker_keeps_nothing_of_the_topics_and_clients_of_the_load(broker: ThreadedBroker) -> None:
    """Topics and client ids of a load (publishers, persistent and clean subscribers, wills,
    QoS 2, retained set and cleared) are all forgotten once the broker is idle and releases
    memory: no per-topic or per-producer cache keeps them."""
    port = broker.mqtt_port
    marker = f"gone{uuid.uuid4().hex[:12]}"
    subscribers = [Paho(port, f"{marker}s{index}", V5 if index % 2 else V311, clean=index == 0)
                   for index in range(3)]
    for subscriber in subscribers:
        subscriber.subscribe(f"{marker}/#", 1)
    for index in range(8):
        will = {"topic": f"{marker}/will/{index}", "payload": b"w", "qos": 1} if index % 4 == 0 else None
        publisher = Paho(port, f"{marker}p{index}", V5 if index % 2 else V311, will=will)
        for qos in (0, 1, 2):
            publisher.publish(f"{marker}/t/{index}/{qos}", f"{marker}{index}".encode(), qos,
                              retain=index == 1 and qos == 1)
        publisher.drop() if will is not None else publisher.disconnect()
    for subscriber in subscribers:
        subscriber.expect_n(8 * 3 + 2)  # every publish and both wills
    subscribers[0].publish(f"{marker}/t/1/1", b"", 1, retain=True)  # clears the retained one
    for index, subscriber in enumerate(subscribers):
        subscriber.disconnect()
        if index:
            Paho(port, f"{marker}s{index}", V5, clean=True).disconnect()  # ends the session
    wait_for(lambda: not broker.app.mqtt.connections and not broker.app.mqtt.sessions)
    broker.call(lambda: persistence.release_idle_memory(broker.app.broker))
    modules = [vars(module) for name, module in list(sys.modules.items())
               if name == "shardgate" or name.startswith("shardgate.")]
    # The journal keeps the load's records (and any index of them) until retention: stored
    # data, not something held for nothing.
    assert _strings_held([broker.app, *modules], marker, kept=[broker.app.journal]) == []


def test_an_idle_broker_keeps_no_abstract_class_cache_entry_made_under_load(broker: ThreadedBroker) -> None:
    """A type first checked against an abstract base class under load (as every log record
    checks its argument against `Mapping`) leaves weak references in the ABCs' caches; the idle
    release empties those caches (the registrations stay)."""

    class SeenUnderLoad:
        pass

    unchecked = weakref.getweakrefcount(SeenUnderLoad)  # its base class's list of subclasses
    assert not isinstance(SeenUnderLoad(), Mapping)
    assert weakref.getweakrefcount(SeenUnderLoad) > unchecked  # the caches of Mapping and below
    broker.call(lambda: persistence.release_idle_memory(broker.app.broker))
    assert weakref.getweakrefcount(SeenUnderLoad) == unchecked
    assert isinstance({}, Mapping) and not isinstance(SeenUnderLoad(), Mapping)


def test_a_stopped_broker_is_freed_after_serving_its_admin_api(tmp_path: Path) -> None:
    """aiohttp keeps recent applications in a module-level cache; a stopped broker's admin
    application must not keep the broker (its sessions, its journal) alive through it."""
    broker = ThreadedBroker(make_config(tmp_path / "data", listeners={"http_port": free_port()}))
    broker.start()
    try:
        sleepy = Paho(broker.mqtt_port, "sleepy", V5, clean=False, session_expiry=3600)
        sleepy.subscribe("t/#", 1)
        sleepy.drop()  # the session stays, offline
        url = f"http://127.0.0.1:{broker.app.port('http')}/api/sessions"
        with urllib.request.urlopen(url, timeout=10) as response:
            assert [s["client_id"] for s in json.loads(response.read())] == ["sleepy"]
    finally:
        broker.stop()
    app = weakref.ref(broker.app)
    del broker
    gc.collect()
    assert app() is None


ARCHIVE_FIRST_FILE = textwrap.dedent("""
    import asyncio, json, sys, tempfile, time
    from pathlib import Path
    from shardgate.core.records import MessageRecord, encode_message
    from shardgate.storage.archive import Archiver
    from shardgate.storage.journal import JournalStorage

    async def main():
        root = Path(tempfile.mkdtemp())
        journal = JournalStorage(root / "journal")
        now = int(time.time() * 1000)
        journal.open_shard("default", 0).append([
            (now, encode_message(MessageRecord(f"t/{i}", b"x" * i, 1, False, now, headers=[("h", "v")])))
            for i in range(50)
        ])
        journal.flush_sync()
        archiver = Archiver(journal, f"file://{root}/archive", lambda: [("default", 1, "bytes")])
        await archiver.start()
        before = set(sys.modules)
        await archiver.flush()
        print(json.dumps(sorted(set(sys.modules) - before)))
        await archiver.stop(flush=False)

    asyncio.run(main())
""")


def test_the_first_archive_file_under_load_imports_nothing() -> None:
    """pyarrow and numpy import modules the first time a table is built (numpy.ma, dateutil):
    the archiver does that when it starts, so the first file written under load allocates no
    long-lived module objects among the load's short-lived ones (each would keep a page of the
    heap once the load is gone). A fresh process: no earlier test has imported them."""
    done = subprocess.run([sys.executable, "-c", ARCHIVE_FIRST_FILE], capture_output=True,
                          text=True, timeout=120, check=True)
    assert json.loads(done.stdout.strip().splitlines()[-1]) == []
