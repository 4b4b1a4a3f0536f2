"""A real RabbitMQ node for the AMQP conformance tests, started once per test session.

AMQP tests that assert RabbitMQ's behaviour run against Shardgate *and* against Debian's
`rabbitmq-server`, so that every expectation is proven to be RabbitMQ's. The node runs as the
test user on loopback ephemeral ports, with its node name, Erlang distribution port, epmd port,
database and logs in a temporary directory. When RabbitMQ is not installed or does not come up
within `RABBITMQ_START_TIMEOUT` seconds, the RabbitMQ half of those tests is skipped; Shardgate's
half always runs.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.conftest import free_port
from tests.e2e.cluster_fixtures import (  # noqa: F401  (a real etcd, cluster nodes)
    cluster,
    etcd,
    module_etcd,
)

RABBITMQ_SCRIPT = "/usr/lib/rabbitmq/bin/rabbitmq-server"
RABBITMQ_START_TIMEOUT = 60.0


class RabbitNode:
    """A running RabbitMQ node (or the reason it could not be started)."""

    def __init__(self) -> None:
        self.port = 0
        self.error = ""
        self._proc: subprocess.Popen[bytes] | None = None
        self._home: Path | None = None
        self._epmd_port = 0

    def start(self) -> RabbitNode:
        # The real script, not Debian's /usr/sbin wrapper (which switches to the rabbitmq user
        # and its /var/lib/rabbitmq): the node must run as us, in a throw-away directory.
        server = RABBITMQ_SCRIPT
        if not Path(server).exists():
            self.error = "rabbitmq-server is not installed"
            return self
        home = self._home = Path(tempfile.mkdtemp(prefix="rabbit-"))
        for sub in ("mnesia", "log"):
            (home / sub).mkdir()
        (home / "enabled_plugins").write_text("[].\n")
        (home / "rabbitmq.conf").write_text("loopback_users = none\n")
        self.port = free_port()
        self._epmd_port = free_port()
        env = dict(os.environ)
        env.update({
            "HOME": str(home),
            "RABBITMQ_NODE_PORT": str(self.port),
            "RABBITMQ_NODE_IP_ADDRESS": "127.0.0.1",
            "RABBITMQ_DIST_PORT": str(free_port()),
            "ERL_EPMD_PORT": str(self._epmd_port),
            "RABBITMQ_NODENAME": f"shardgate-test-{os.getpid()}@localhost",
            "RABBITMQ_MNESIA_BASE": str(home / "mnesia"),
            "RABBITMQ_LOG_BASE": str(home / "log"),
            "RABBITMQ_ENABLED_PLUGINS_FILE": str(home / "enabled_plugins"),
            "RABBITMQ_CONFIG_FILE": str(home / "rabbitmq"),
            "RABBITMQ_FEATURE_FLAGS_FILE": str(home / "feature_flags"),
            "RABBITMQ_QUORUM_DIR": str(home / "quorum"),
            "RABBITMQ_PID_FILE": str(home / "rabbit.pid"),
            "ERL_CRASH_DUMP": str(home / "erl_crash.dump"),
        })
        log = open(home / "stdout.log", "wb")  # noqa: SIM115
        self._proc = subprocess.Popen(
            [server], stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True,
            cwd=home,
        )
        log.close()
        deadline = time.monotonic() + RABBITMQ_START_TIMEOUT
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                self.error = f"rabbitmq-server exited with {self._proc.returncode}"
                self.stop()
                return self
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", self.port), 0.2):
                return self
            time.sleep(0.2)
        self.error = f"rabbitmq-server did not listen within {RABBITMQ_START_TIMEOUT}s"
        self.stop()
        return self

    @property
    def url(self) -> str:
        return f"amqp://guest:guest@127.0.0.1:{self.port}/"

    def stop(self) -> None:
        proc = self._proc
        if proc is not None and proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(5)
        if self._epmd_port:
            # The node started an epmd for its private port: end that one by its own id.
            with contextlib.suppress(Exception):
                out = subprocess.run(
                    ["ss", "-Hltnp", f"sport = :{self._epmd_port}"], capture_output=True,
                    text=True, timeout=5,
                ).stdout
                for part in out.split("pid=")[1:]:
                    os.kill(int(part.split(",")[0]), signal.SIGTERM)
            self._epmd_port = 0
        if self._home is not None:
            shutil.rmtree(self._home, ignore_errors=True)
            self._home = None


@pytest.fixture(scope="session")
def rabbitmq_node() -> Iterator[RabbitNode]:
    """The session's RabbitMQ node, started on first use; `.error` says why it is not there."""
    node = RabbitNode().start()
    try:
        yield node
    finally:
        node.stop()


@pytest.fixture(params=["shardgate", "rabbitmq"])
def amqp_broker_url(request: pytest.FixtureRequest, broker_factory: Callable[..., object]) -> str:
    """The URL of the broker under test: a fresh Shardgate, or the session's RabbitMQ node
    (skipped when it could not be started). Tests name their queues and exchanges uniquely,
    since the RabbitMQ node is shared."""
    if request.param == "rabbitmq":
        node = request.getfixturevalue("rabbitmq_node")
        if node.error:
            pytest.skip(node.error)
        return node.url
    app = broker_factory(listeners={"amqp_port": free_port()}).app  # type: ignore[attr-defined]
    return f"amqp://guest:guest@127.0.0.1:{app.port('amqp')}/"
