"""A plain TCP connect-and-close on the MQTT WebSocket port (a load balancer's or Kubernetes'
TCP probe) is logged at debug level in one line: no ERROR, no traceback. A real MQTT client
over WebSocket still works beside it."""

from __future__ import annotations

import logging
import socket

from tests.conftest import wait_for
from tests.mqtt_clients import V311


def test_tcp_probe_on_websocket_port_logs_one_debug_line(broker, caplog):
    caplog.set_level(logging.DEBUG)
    for _ in range(3):
        with socket.create_connection(("127.0.0.1", broker.ws_port)):
            pass

    def probe_lines() -> list[logging.LogRecord]:
        return [r for r in caplog.records if "opening handshake failed" in r.getMessage()]

    wait_for(lambda: len(probe_lines()) == 3)
    for record in probe_lines():
        assert record.levelno == logging.DEBUG
        assert record.exc_info is None and "\n" not in record.getMessage()
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text

    import paho.mqtt.client as mqtt

    client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id="ws-after-probe",
                         protocol=V311, transport="websockets")
    client.connect("127.0.0.1", broker.ws_port)
    client.loop_start()
    try:
        wait_for(client.is_connected)
    finally:
        client.loop_stop()
        client.disconnect()
