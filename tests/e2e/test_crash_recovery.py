"""Crash safety: SIGKILL the broker while publishers send QoS 1 and QoS 2, restart it on the
same data directory, and check that every acknowledged message reaches the persistent session,
QoS 2 exactly once; retained messages and sessions come back."""

from __future__ import annotations

import threading
import time

from tests.conftest import wait_for
from tests.mqtt_clients import V5, V311, Paho


def _publisher(port: int, name: str, qos: int, acked: list[str], stop: threading.Event) -> None:
    import paho.mqtt.client as mqtt

    client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=name, protocol=mqtt.MQTTv311)
    try:
        client.connect("127.0.0.1", port)
    except OSError:
        return
    client.loop_start()
    index = 0
    try:
        while not stop.is_set():
            payload = f"{name}-{index}"
            info = client.publish(f"crash/{name}", payload, qos)
            try:
                info.wait_for_publish(2)
            except (RuntimeError, ValueError):
                break
            if not info.is_published():
                break
            acked.append(payload)  # acknowledged by the broker: must survive the crash
            index += 1
    finally:
        client.loop_stop()


def test_sigkill_loses_no_acknowledged_message(broker_process):
    broker = broker_process().start()
    port = broker.mqtt_port
    subscriber = Paho(port, "survivor", V5, clean=False, session_expiry=3600)
    subscriber.subscribe("crash/#", 2)
    subscriber.disconnect()
    retained = Paho(port, "retainer", V311)
    retained.publish("crash-status", "kept", 1, retain=True)
    retained.disconnect()

    stop = threading.Event()
    acked: dict[str, list[str]] = {"q1a": [], "q1b": [], "q2a": [], "q2b": []}
    threads = [
        threading.Thread(target=_publisher, args=(port, name, 1 if name.startswith("q1") else 2, acked[name], stop))
        for name in acked
    ]
    for thread in threads:
        thread.start()
    wait_for(lambda: all(len(v) >= 50 for v in acked.values()), timeout=30)
    broker.kill()
    stop.set()
    for thread in threads:
        thread.join(10)

    broker.start(mqtt_port=port)
    back = Paho(port, "survivor", V5, clean=False, session_expiry=3600, connect=False)
    flags, rc, _ = back.connect()
    assert flags.session_present
    expected = {payload for values in acked.values() for payload in values}
    got: list[str] = []
    deadline = time.monotonic() + 60
    while not expected.issubset(got) and time.monotonic() < deadline:
        try:
            got.append(back.expect(timeout=20).payload.decode())
        except Exception:
            break
    missing = expected - set(got)
    assert not missing, f"{len(missing)} acknowledged messages lost, e.g. {sorted(missing)[:5]}"
    qos2 = [x for x in got if x.startswith("q2")]
    assert len(qos2) == len(set(qos2)), "a QoS 2 message was delivered twice"
    # Per publisher, order is kept.
    for name in acked:
        mine = [x for x in got if x.startswith(name + "-")]
        numbers = [int(x.rsplit("-", 1)[1]) for x in dict.fromkeys(mine)]
        assert numbers == sorted(numbers)

    reader = Paho(port, "reader", V311)
    reader.subscribe("crash-status", 1)
    assert reader.expect().payload == b"kept"


def test_sigterm_stops_cleanly_and_keeps_sessions(broker_process):
    broker = broker_process().start()
    port = broker.mqtt_port
    subscriber = Paho(port, "keeper", V311, clean=False)
    subscriber.subscribe("term/#", 1)
    subscriber.disconnect()
    publisher = Paho(port, "pub", V311)
    for index in range(20):
        publisher.publish(f"term/{index}", str(index), 1)
    publisher.disconnect()
    assert broker.terminate() == 0
    broker.start(mqtt_port=port)
    back = Paho(port, "keeper", V311, clean=False)
    assert [m.payload for m in back.expect_n(20)] == [str(i).encode() for i in range(20)]
    back.expect_none()


def test_v5_clients_get_server_shutting_down(broker_process):
    broker = broker_process().start()
    client = Paho(broker.mqtt_port, "told", V5)
    broker.terminate()
    rc, _ = client.disconnects.get(timeout=10)
    assert rc.value == 0x8B
