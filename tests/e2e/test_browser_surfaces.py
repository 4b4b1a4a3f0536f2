"""Browser-facing surfaces: a page of another origin cannot open MQTT over WebSocket, a rebound
DNS name cannot reach the admin API, and no cross-site request can change anything there."""

from __future__ import annotations

import http.client
from collections.abc import Callable

import pytest
from websockets.exceptions import InvalidStatus
from websockets.sync.client import connect

from tests.conftest import ThreadedBroker, free_port, serve_admin


def open_websocket(port: int, origin: str | None) -> bool:
    """Whether the MQTT WebSocket handshake with this Origin succeeds (False: refused 403)."""
    try:
        with connect(f"ws://127.0.0.1:{port}/mqtt", origin=origin, subprotocols=["mqtt"],  # type: ignore[arg-type]
                     open_timeout=20):
            return True
    except InvalidStatus as exc:
        assert exc.response.status_code == 403
        return False


def test_websocket_origin_defaults_to_the_same_host(broker_factory: Callable[..., ThreadedBroker]) -> None:
    broker = broker_factory()
    assert open_websocket(broker.ws_port, None)  # not a browser
    assert open_websocket(broker.ws_port, "http://127.0.0.1:8080")  # a page of the same host
    assert not open_websocket(broker.ws_port, "http://evil.example")
    assert not open_websocket(broker.ws_port, "null")


def test_websocket_origin_allow_list(broker_factory: Callable[..., ThreadedBroker]) -> None:
    broker = broker_factory(mqtt={"ws_allowed_origins": ["https://app.example"]})
    assert open_websocket(broker.ws_port, "https://app.example")
    assert not open_websocket(broker.ws_port, "http://127.0.0.1:8080")
    assert open_websocket(broker.ws_port, None)


def request(port: int, method: str, path: str, headers: dict[str, str]) -> int:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=20)
    try:
        connection.request(method, path, body=b"{}" if method == "POST" else None, headers=headers)
        return connection.getresponse().status
    finally:
        connection.close()


@pytest.fixture
def admin_port(broker_factory: Callable[..., ThreadedBroker]) -> int:
    broker = broker_factory(listeners={"http_port": free_port(), "http_allowed_hosts": ["broker.internal"]})
    for url in serve_admin(broker):
        return int(url.rsplit(":", 1)[1])
    raise AssertionError("no admin listener")


def test_admin_api_refuses_foreign_host_names(admin_port: int) -> None:
    assert request(admin_port, "GET", "/api/info", {"Host": "evil.example"}) == 421
    assert request(admin_port, "GET", "/api/info", {"Host": f"evil.example:{admin_port}"}) == 421
    for host in (f"127.0.0.1:{admin_port}", f"localhost:{admin_port}", "broker.internal"):
        assert request(admin_port, "GET", "/api/info", {"Host": host}) == 200, host


def test_admin_api_changes_need_a_non_simple_same_origin_request(admin_port: int) -> None:
    flush = "/api/archive/flush"
    # What a form or a simple cross-site fetch can send: refused.
    assert request(admin_port, "POST", flush, {"Content-Type": "text/plain"}) == 403
    assert request(admin_port, "POST", flush, {"Content-Type": "application/x-www-form-urlencoded",
                                               "Origin": "http://evil.example"}) == 403
    assert request(admin_port, "DELETE", "/api/clients/mqtt/nobody", {}) == 403
    # Cross-origin, even non-simple: refused.
    assert request(admin_port, "POST", flush, {"Content-Type": "application/json",
                                               "Origin": "http://evil.example"}) == 403
    # A non-simple request of the same origin (the dashboard, the CLI): done.
    assert request(admin_port, "POST", flush, {"Content-Type": "application/json"}) == 200
    assert request(admin_port, "DELETE", "/api/clients/mqtt/nobody",
                   {"X-Requested-With": "shardgate-dashboard",
                    "Origin": f"http://127.0.0.1:{admin_port}"}) == 404
