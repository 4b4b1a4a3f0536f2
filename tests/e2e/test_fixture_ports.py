"""The suite's own port handling: ports picked for servers can't be taken by the kernel for
another socket, and a broker restarted on its ports waits out a socket that holds one."""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable
from pathlib import Path

from tests.conftest import BrokerProcess, free_port, wait_for
from tests.local_ports import EPHEMERAL_LOW


def test_picked_ports_are_free_and_below_the_kernels_ephemeral_range() -> None:
    ports = [free_port() for _ in range(50)]
    assert len(set(ports)) == len(ports)
    if EPHEMERAL_LOW > 20000:
        assert all(port < EPHEMERAL_LOW for port in ports)
    for port in ports:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", port))


def test_a_restart_waits_for_its_port_held_by_another_socket(
    broker_process: Callable[..., BrokerProcess], tmp_path: Path,
) -> None:
    amqp_port = free_port()
    process = broker_process(tmp_path / "data", extra_args=["--amqp-port", str(amqp_port)]).start()
    mqtt_port = process.mqtt_port
    process.kill()
    holder = socket.socket()
    holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    holder.bind(("127.0.0.1", amqp_port))
    holder.listen()
    errors: list[BaseException] = []

    def restart() -> None:
        try:
            process.start()
        except BaseException as exc:  # noqa: BLE001  (asserted below)
            errors.append(exc)

    restarting = threading.Thread(target=restart)
    restarting.start()
    try:
        # the broker refuses to start while the port is held ...
        wait_for(lambda: "already in use" in process.log_path.read_text(), timeout=30)
    finally:
        holder.close()
    restarting.join(60)
    # ... and starts on the same ports once it is free
    assert not restarting.is_alive() and not errors, errors
    assert process.ports["amqp"] == amqp_port and process.mqtt_port == mqtt_port
    assert process.terminate() == 0
