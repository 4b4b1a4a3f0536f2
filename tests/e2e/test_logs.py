"""What `shardgate serve` logs with bridges to remotes that are down at first: each bridge says
once, in Shardgate's words, that its remote is unreachable and later that it connected; the
libraries under the bridges (amqtt and its `transitions`, aiormq, aio-pika) stay quiet."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

from tests.conftest import BrokerProcess, ThreadedBroker, free_port, wait_for


def test_bridges_to_a_remote_that_is_down_log_once_and_third_parties_stay_quiet(
    broker_process: Callable[..., BrokerProcess], broker_factory: Callable[..., ThreadedBroker],
    tmp_path: Path,
) -> None:
    mqtt_port, amqp_port = free_port(), free_port()
    config = tmp_path / "edge.toml"
    config.write_text(
        f'[[bridges]]\nname = "cloud"\nremote = "mqtt://127.0.0.1:{mqtt_port}"\nout = ["a/#"]\n'
        'inbound = ["b/#"]\nreconnect_min_s = 0.05\nreconnect_max_s = 0.2\n\n'
        f'[[amqp_bridges]]\nname = "rabbit"\nremote = "amqp://guest:guest@127.0.0.1:{amqp_port}/"\n'
        'out = ["c/#"]\nreconnect_min_s = 0.05\nreconnect_max_s = 0.2\n'
    )
    edge = broker_process(config_file=config).start()
    log = edge.log_path

    def said(text: str) -> bool:
        return text in log.read_text()

    wait_for(lambda: said("bridge cloud: cannot reach the remote")
             and said("amqp bridge rabbit: cannot reach the remote"), timeout=30)
    broker_factory(listeners={"mqtt_port": mqtt_port, "amqp_port": amqp_port})
    wait_for(lambda: said("bridge cloud: connected to") and said("amqp bridge rabbit: connected to"),
             timeout=30)
    assert edge.terminate() == 0
    text = log.read_text()
    assert text.count("bridge cloud: cannot reach the remote") == 1
    assert text.count("amqp bridge rabbit: cannot reach the remote") == 1
    attempts = [int(n) for n in re.findall(r"connected to \S+ after (\d+) failed attempts", text)]
    assert len(attempts) == 2 and min(attempts) >= 1  # failed attempts counted, said once
    noisy = [line for line in text.splitlines()
             if re.search(r" (INFO|WARNING|ERROR) (transitions|amqtt|aiormq|aio_pika)", line)]
    assert noisy == []


def test_serve_says_once_in_its_own_words_that_it_listens_on_a_websocket_port(
    broker_process: Callable[..., BrokerProcess],
) -> None:
    node = broker_process(extra_args=["--mqtt-ws-port", str(free_port())]).start()
    assert node.terminate() == 0
    text = node.log_path.read_text()
    assert text.count("listening for mqtt-ws on 127.0.0.1:") == 1
    assert "websockets.server" not in text  # its "server listening on" / "server closing"
