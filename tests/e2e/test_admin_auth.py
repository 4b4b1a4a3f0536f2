"""The admin HTTP API, `/metrics` and the dashboard need an admin's credentials as soon as the
broker has users; an open broker's admin API never binds a non-loopback address."""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path

import pytest

from shardgate.security.auth import User, hash_password, save_users
from tests.conftest import ThreadedBroker, free_port, make_config


def get(url: str, user: str | None = None, password: str = "", method: str = "GET") -> tuple[int, dict, bytes]:
    request = urllib.request.Request(url, method=method)
    if method not in ("GET", "HEAD"):
        request.add_header("X-Requested-With", "test")  # what the API wants of a change
    if user is not None:
        token = base64.b64encode(f"{user}:{password}".encode()).decode()
        request.add_header("Authorization", f"Basic {token}")
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, dict(response.headers), response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers), exc.read()


@pytest.fixture
def secured(tmp_path: Path) -> tuple[ThreadedBroker, str]:
    data = tmp_path / "secured"
    data.mkdir()
    save_users(data / "users.json", {
        "root": User("root", hash_password("root-pw"), ["admin"]),
        "alice": User("alice", hash_password("alice-pw")),
    })
    (data / "acl.toml").write_text(
        '[[allow]]\nuser = "alice"\nactions = ["publish", "subscribe"]\ntopics = ["#"]\n'
        '[[allow]]\nuser = "scraper"\nactions = ["admin"]\ntopics = ["metrics"]\n')
    save_users(data / "users.json", {
        "root": User("root", hash_password("root-pw"), ["admin"]),
        "alice": User("alice", hash_password("alice-pw")),
        "scraper": User("scraper", hash_password("scraper-pw")),
    })
    broker = ThreadedBroker(make_config(data, listeners={"http_port": free_port()},
                                        archive={"enabled": False})).start()
    yield broker, f"http://127.0.0.1:{broker.app.port('http')}"
    broker.stop()


@pytest.mark.parametrize("path", ["/api/info", "/api/retained", "/api/clients", "/metrics", "/",
                                  "/api/archive"])
def test_every_path_needs_credentials_once_users_exist(secured, path: str) -> None:
    _, url = secured
    status, headers, _ = get(url + path)
    assert status == 401
    assert headers["WWW-Authenticate"].startswith("Basic")
    assert get(url + path, "root", "wrong")[0] == 401
    assert get(url + path, "nobody", "x")[0] == 401
    assert get(url + path, "alice", "alice-pw")[0] == 403  # publish/subscribe, not admin
    assert get(url + path, "root", "root-pw")[0] == 200


def test_writes_are_refused_without_credentials(secured) -> None:
    _, url = secured
    assert get(url + "/api/archive/flush", method="POST")[0] == 401
    assert get(url + "/api/clients/mqtt/someone", method="DELETE")[0] == 401
    status, _, body = get(url + "/api/clients/mqtt/someone", "root", "root-pw", method="DELETE")
    assert status == 404 and "error" in json.loads(body)


def test_acl_grants_the_admin_action_per_path(secured) -> None:
    _, url = secured
    assert get(url + "/metrics", "scraper", "scraper-pw")[0] == 200
    assert get(url + "/api/info", "scraper", "scraper-pw")[0] == 403


def test_open_broker_on_loopback_needs_no_credentials(broker_factory: Callable[..., ThreadedBroker]) -> None:
    broker = broker_factory(listeners={"http_port": free_port()}, archive={"enabled": False})
    assert get(f"http://127.0.0.1:{broker.app.port('http')}/api/info")[0] == 200


def serve(data_dir: Path, *extra: str) -> subprocess.Popen[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SHARDGATE_")}
    env["SHARDGATE_HTTP_HOST"] = "0.0.0.0"
    return subprocess.Popen(
        [sys.executable, "-m", "shardgate", "serve", "--data-dir", str(data_dir), "--mqtt-port", "0",
         "--mqtt-ws-port", "0", "--grpc-port", "0", "--amqp-port", "0", "--http-port",
         str(free_port()), *extra], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def test_admin_api_on_a_public_address_is_refused_without_users(tmp_path: Path) -> None:
    process = serve(tmp_path / "open")
    _, err = process.communicate(timeout=60)
    assert process.returncode == 2
    assert "admin API would serve 0.0.0.0" in err and "shardgate users add" in err


def test_archive_cli_passes_credentials(secured) -> None:
    broker, url = secured
    env = {k: v for k, v in os.environ.items() if not k.startswith("SHARDGATE_")}
    command = [sys.executable, "-m", "shardgate", "archive", "status", "--http-url", url]
    refused = subprocess.run(command, capture_output=True, text=True, timeout=60, env=env)
    assert refused.returncode == 1 and "--username" in refused.stderr
    allowed = subprocess.run([*command, "--username", "root", "--password", "root-pw"],
                             capture_output=True, text=True, timeout=60, env=env)
    assert allowed.returncode == 0, allowed.stderr


def test_grpc_acl_and_admin_action_apply_under_serve(tmp_path: Path) -> None:
    from shardgate.client import PermissionDenied, SyncClient

    data = tmp_path / "grpc"
    data.mkdir()
    save_users(data / "users.json", {
        "root": User("root", hash_password("root-pw"), ["admin"]),
        "alice": User("alice", hash_password("alice-pw")),
    })
    (data / "acl.toml").write_text(
        '[[allow]]\nuser = "alice"\nactions = ["publish", "subscribe"]\ntopics = ["ok/#"]\n')
    broker = ThreadedBroker(make_config(data, listeners={"grpc_port": free_port()},
                                        archive={"enabled": False})).start()
    url = f"127.0.0.1:{broker.app.port('grpc')}"
    try:
        with SyncClient(url, username="alice", password="alice-pw") as alice:
            assert alice.producer().send("ok/1", b"1").stream == "default"
            with pytest.raises(PermissionDenied):
                alice.producer().send("secret/1", b"1")
            with pytest.raises(PermissionDenied, match="admin"):
                alice.admin.create_stream("evil")
            with pytest.raises(PermissionDenied):
                alice.admin.list_clients()
        with SyncClient(url, username="root", password="root-pw") as root:
            assert root.admin.create_stream("fine").name == "fine"
    finally:
        broker.stop()
