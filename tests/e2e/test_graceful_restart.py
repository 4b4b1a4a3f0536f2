"""A graceful stop (SIGTERM) of `shardgate serve` while messages flow to persistent MQTT
subscribers: the broker stops sending, lets in-flight deliveries be acknowledged, saves every
cursor and session, and after the restart no message a subscriber had acknowledged arrives
again (QoS 1 and QoS 2, MQTT 5.0 and 3.1.1), while none is lost."""

from __future__ import annotations

import queue
import threading

import pytest

from tests.conftest import wait_for
from tests.mqtt_clients import V5, V311, Paho

SUBSCRIBERS = [("g-q1-v5", 1, V5), ("g-q2-v5", 2, V5), ("g-q1-v311", 1, V311), ("g-q2-v311", 2, V311)]


def _subscriber(port: int, name: str, version: int) -> Paho:
    return Paho(port, name, version, clean=False, session_expiry=3600)


def _publisher(port: int, acked: list[str], stop: threading.Event) -> None:
    import paho.mqtt.client as mqtt

    client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id="g-publisher",
                         protocol=mqtt.MQTTv311)
    client.connect("127.0.0.1", port)
    client.loop_start()
    index = 0
    try:
        while not stop.is_set():
            payload = f"m-{index}"
            info = client.publish("graceful/data", payload, 1)
            try:
                info.wait_for_publish(2)
            except (RuntimeError, ValueError):
                break
            if not info.is_published():
                break
            acked.append(payload)
            index += 1
    finally:
        client.loop_stop()
        client.disconnect()


def _drain(client: Paho) -> list[str]:
    got = []
    while True:
        try:
            got.append(client.messages.get_nowait().payload.decode())
        except queue.Empty:
            return got


@pytest.mark.timeout(180)
def test_sigterm_resends_no_acknowledged_message(broker_process):
    broker = broker_process().start()
    port = broker.mqtt_port
    subscribers = {}
    for name, qos, version in SUBSCRIBERS:
        subscribers[name] = _subscriber(port, name, version)
        subscribers[name].subscribe("graceful/#", qos)
    received: dict[str, list[str]] = {name: [] for name in subscribers}

    stop = threading.Event()
    acked: list[str] = []
    publisher = threading.Thread(target=_publisher, args=(port, acked, stop))
    publisher.start()

    def flowing() -> bool:
        for name, client in subscribers.items():
            received[name] += _drain(client)
        return all(len(got) >= 300 for got in received.values())

    wait_for(flowing, timeout=60)
    assert broker.terminate() == 0  # SIGTERM while messages flow
    stop.set()
    publisher.join(15)
    for name, client in subscribers.items():
        client.client.loop_stop()  # no automatic reconnect: the test reconnects below
        received[name] += _drain(client)
        client.client.socket() and client.client.socket().close()

    broker.start(mqtt_port=port)
    marker = Paho(port, "g-marker", V311)
    marker.publish("graceful/end", "end", 1)
    marker.disconnect()
    for name, qos, version in SUBSCRIBERS:
        before = received[name]
        assert len(before) == len(set(before)), f"{name}: a duplicate before the restart"
        back = _subscriber(port, name, version) if version == V5 else Paho(
            port, name, version, clean=False, connect=False)
        if version != V5:
            flags, _, _ = back.connect()
            assert flags.session_present
        after: list[str] = []
        while not after or after[-1] != "end":
            after.append(back.expect(timeout=30).payload.decode())
        back.disconnect()
        again = set(before) & set(after)
        assert not again, (
            f"{name} (QoS {qos}): {len(again)} acknowledged messages came again after a "
            f"graceful restart, e.g. {sorted(again)[:5]}"
        )
        missing = set(acked) - set(before) - set(after)
        assert not missing, f"{name}: {len(missing)} acknowledged publishes lost"
