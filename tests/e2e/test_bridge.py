"""The MQTT bridge against a second Shardgate on loopback, with a restart of the remote."""

from __future__ import annotations

from collections.abc import Callable

from shardgate.app import Shardgate
from shardgate.bridges.bridge import Bridge, BridgeSettings
from tests.conftest import ThreadedBroker, wait_for
from tests.mqtt_clients import V5, V311, Paho


def start_bridge(local: ThreadedBroker, remote: ThreadedBroker, **kwargs: object) -> Bridge:
    settings = BridgeSettings(name="edge", remote=f"mqtt://127.0.0.1:{remote.mqtt_port}", **kwargs)  # type: ignore[arg-type]

    def start() -> Bridge:
        bridge = Bridge(local.app.edge, settings)
        bridge.start()
        return bridge

    bridge = local.call(start)
    wait_for(lambda: bridge.connected)
    return bridge


def stop_node(broker: ThreadedBroker) -> None:
    broker.call(broker.app.stop())


def start_node(broker: ThreadedBroker) -> None:
    """A new node on the stopped one's loop, ports and data directory."""
    broker.app = Shardgate(broker.config)
    broker.call(broker.app.start())


def test_bridge_mirrors_both_ways_and_stores_while_the_remote_restarts(
    broker_factory: Callable[..., ThreadedBroker],
) -> None:
    remote = broker_factory()
    local = broker_factory()
    bridge = start_bridge(local, remote, out=["sensors/#"], inbound=["commands/#"])
    try:
        # A persistent watcher on the remote: its session survives the remote's restart.
        watcher = Paho(remote.mqtt_port, "watcher", V311, clean=False)
        watcher.subscribe("sensors/#", qos=1)
        device = Paho(local.mqtt_port, "device", V5)
        device.subscribe("commands/#", qos=1)

        device.publish("sensors/1", b"before", qos=1)
        assert (watcher.expect().topic, watcher.expect_none()) == ("sensors/1", None)

        controller = Paho(remote.mqtt_port, "controller", V5)
        controller.publish("commands/light", b"on", qos=1)
        command = device.expect()
        assert (command.topic, command.payload) == ("commands/light", b"on")
        controller.disconnect()

        watcher.disconnect()
        stop_node(remote)
        wait_for(lambda: not bridge.connected)
        # While the remote is down, what is published locally waits (in the journal, behind
        # the bridge's durable cursor).
        for number in range(50):
            device.publish(f"sensors/{number % 5}", f"m{number}".encode(), qos=1)
        assert local.call(lambda: bridge.backlog) >= 50 and not bridge.connected
        start_node(remote)
        wait_for(lambda: bridge.connected and bridge.forwarded_out == 51, timeout=30)
        assert bridge.connects >= 2 and bridge.dropped == 0

        watcher = Paho(remote.mqtt_port, "watcher", V311, clean=False, connect=False)
        _, rc, _ = watcher.connect()
        assert rc == 0
        payloads = [m.payload for m in watcher.expect_n(50)]
        assert payloads == [f"m{n}".encode() for n in range(50)]
        watcher.expect_none()

        controller = Paho(remote.mqtt_port, "controller-2", V5)
        controller.publish("commands/door", b"open", qos=1)
        assert device.expect().payload == b"open"
        # Nothing the bridge brought in goes back out, nothing local leaks the other way.
        device.publish("other/topic", b"local only", qos=1)
        watcher.expect_none()
        assert bridge.forwarded_in == 2 and bridge.forwarded_out == 51
        device.disconnect()
        watcher.disconnect()
        controller.disconnect()
    finally:
        local.call(bridge.stop())


def test_bridge_rewrites_topics_with_prefixes(broker_factory: Callable[..., ThreadedBroker]) -> None:
    remote = broker_factory()
    local = broker_factory()
    bridge = start_bridge(local, remote, out=["site/#"], local_prefix="site/",
                          remote_prefix="plants/berlin/")
    try:
        watcher = Paho(remote.mqtt_port, "hq", V5)
        watcher.subscribe("plants/#", qos=1)
        device = Paho(local.mqtt_port, "plc", V5)
        device.publish("site/line1/temp", b"72", qos=1)
        message = watcher.expect()
        assert (message.topic, message.payload) == ("plants/berlin/line1/temp", b"72")
        device.disconnect()
        watcher.disconnect()
    finally:
        local.call(bridge.stop())


def test_store_and_forward_survives_a_restart_of_this_node_on_a_reliable_stream(
    broker_factory: Callable[..., ThreadedBroker], broker_process, tmp_path,
) -> None:
    from tests.conftest import free_port

    remote_port = free_port()  # nothing listens there yet: the remote is down
    config = tmp_path / "edge.toml"
    config.write_text(
        '[[streams]]\nname = "sensors"\nmode = "reliable"\n\n'
        f'[[bridges]]\nname = "cloud"\nremote = "mqtt://127.0.0.1:{remote_port}"\nout = ["sensors/#"]\n'
    )
    http_port = free_port()
    edge = broker_process(config_file=config, extra_args=["--http-port", str(http_port)]).start()

    def forwarded(count: int) -> bool:
        import urllib.request

        with urllib.request.urlopen(f"http://127.0.0.1:{http_port}/metrics", timeout=10) as response:
            text = response.read().decode()
        return f'shardgate_bridge_forwarded_total{{bridge="cloud",direction="out"}} {count}.0' in text

    device = Paho(edge.mqtt_port, "device", V311)
    for index in range(3):
        device.publish(f"sensors/t{index}", f"{index}".encode(), qos=1)
    device.disconnect()
    assert edge.terminate() == 0  # SIGTERM while the remote is still down

    remote = broker_factory(listeners={"mqtt_port": remote_port})
    watcher = Paho(remote.mqtt_port, "watcher", V311)
    watcher.subscribe("sensors/#", 1)
    edge.start()
    received = watcher.expect_n(3, timeout=30)
    assert [(m.topic, m.payload) for m in received] == [
        ("sensors/t0", b"0"), ("sensors/t1", b"1"), ("sensors/t2", b"2")]
    # once acknowledged by the remote (PUBACK), a further restart sends nothing again
    wait_for(lambda: forwarded(3))
    assert edge.terminate() == 0
    edge.start()
    device = Paho(edge.mqtt_port, "device", V311)
    device.publish("sensors/t3", b"3", qos=1)
    device.disconnect()
    assert [(m.topic, m.payload) for m in watcher.expect_n(1, timeout=30)] == [("sensors/t3", b"3")]
    watcher.expect_none(0.5)
    watcher.disconnect()
    assert edge.terminate() == 0


def test_inbound_filters_name_remote_topics_under_remote_prefix_and_drops_are_counted_and_logged(
    broker_factory: Callable[..., ThreadedBroker], caplog,
) -> None:
    """Both directions alike: a filter names topics of the side read from, prefix included.
    A filter outside its prefix is refused at once, naming the filter to write; a message a
    wildcard filter brings from outside the prefix is dropped, counted by reason and logged."""
    import logging

    import pytest

    remote = broker_factory()
    local = broker_factory()
    settings = BridgeSettings(name="edge", remote=f"mqtt://127.0.0.1:{remote.mqtt_port}",
                              inbound=["commands/#"], remote_prefix="edge1/")
    with pytest.raises(ValueError, match=r"inbound filter 'commands/#' is not under remote_prefix "
                                         r"'edge1/'.*write 'edge1/commands/#'"):
        local.call(lambda: Bridge(local.app.edge, settings))

    caplog.set_level(logging.WARNING, logger="shardgate.bridges")
    bridge = start_bridge(local, remote, inbound=["edge1/commands/#", "+/alarms/#"],
                          remote_prefix="edge1/", out=["status/#"])
    try:
        device = Paho(local.mqtt_port, "device", V5)
        device.subscribe("#", qos=1)
        controller = Paho(remote.mqtt_port, "controller", V5)
        controller.publish("edge1/commands/reboot", b"now", qos=1)
        command = device.expect()
        assert (command.topic, command.payload) == ("commands/reboot", b"now")
        controller.publish("edge2/alarms/fire", b"x", qos=1)  # matched by +/alarms/#, not edge1/
        wait_for(lambda: local.call(lambda: bridge.drops_in.get("outside_prefix")) == 1)
        device.expect_none()
        status = local.call(bridge.status)
        assert status["drops_in"] == {"outside_prefix": 1} and status["forwarded_in"] == 1
        # out: a local topic goes out with remote_prefix added, the same rule the other way
        watcher = Paho(remote.mqtt_port, "watcher", V5)
        watcher.subscribe("edge1/status/#", qos=1)
        device.publish("status/up", b"1", qos=1)
        assert watcher.expect().topic == "edge1/status/up"
        for client in (device, controller, watcher):
            client.disconnect()
    finally:
        local.call(bridge.stop())
    warnings = [r.getMessage() for r in caplog.records if "dropped a message" in r.getMessage()]
    assert warnings == ["bridge edge: dropped a message coming in on 'edge2/alarms/fire': outside "
                        "prefix (not under remote_prefix 'edge1/')"]
    assert any("'+/alarms/#' reaches beyond remote_prefix 'edge1/'" in r.getMessage()
               for r in caplog.records)


def test_config_check_refuses_a_bridge_filter_outside_its_prefix(tmp_path) -> None:
    import subprocess
    import sys

    config = tmp_path / "edge.toml"
    config.write_text('[[bridges]]\nname = "cloud"\nremote = "mqtt://127.0.0.1:1"\n'
                      'remote_prefix = "edge1/"\ninbound = ["commands/#"]\n')
    done = subprocess.run([sys.executable, "-m", "shardgate", "config", "check", str(config)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert "inbound filter 'commands/#' is not under remote_prefix 'edge1/'" in done.stderr
    assert "Traceback" not in done.stderr
