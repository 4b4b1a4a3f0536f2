"""Shared fixtures: a real broker on ephemeral loopback ports, in a thread or a subprocess."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from shardgate.app import Shardgate
from shardgate.config import Config, load_config

# Re-exported: tests import these from here. Their state lives in those modules, which pytest's
# own copy of this conftest and the tests' `tests.conftest` import share.
from tests.child_processes import end_process, track_process, tracked_processes
from tests.local_ports import free_port
from tests.parallel import (  # noqa: F401  (hooks: marks, groups and orders the tests for xdist)
    pytest_addoption,
    pytest_collection_modifyitems,
    pytest_configure,
    pytest_xdist_auto_num_workers,
)

__all__ = ["end_process", "free_port", "track_process", "wait_for"]


def wait_for(condition: Callable[[], Any], timeout: float = 10.0, interval: float = 0.01) -> Any:
    """Poll `condition` until it returns a truthy value; fail the test after `timeout`."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout}s")
        time.sleep(interval)


class ThreadedBroker:
    """A Shardgate running on its own event loop in a background thread."""

    def __init__(self, config: Config) -> None:
        self.config = config
        self.app = Shardgate(config)
        try:
            import uvloop

            self.loop = uvloop.new_event_loop()
        except ImportError:
            self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)

    def start(self) -> ThreadedBroker:
        self._thread.start()
        self.call(self.app.start())
        return self

    def call(self, coro_or_fn: Any, timeout: float = 15.0) -> Any:
        """Run a coroutine, or a plain function, on the broker's loop and return its result."""
        if asyncio.iscoroutine(coro_or_fn):
            return asyncio.run_coroutine_threadsafe(coro_or_fn, self.loop).result(timeout)

        async def run() -> Any:
            return coro_or_fn()

        return asyncio.run_coroutine_threadsafe(run(), self.loop).result(timeout)

    def stop(self) -> None:
        try:
            self.call(self.app.stop())
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(10)
            self.loop.close()

    @property
    def mqtt_port(self) -> int:
        return self.app.port("mqtt")

    @property
    def ws_port(self) -> int:
        return self.app.port("mqtt-ws")


def serve_admin(broker: ThreadedBroker) -> Iterator[str]:
    """The node's admin URL (`for url in serve_admin(broker):`): its own HTTP listener when
    configured, else one started here for the loop's body."""
    if "http" in broker.app.listeners:
        yield f"http://127.0.0.1:{broker.app.port('http')}"
        return
    from shardgate.admin.admin_http import start_http_server

    server = broker.call(start_http_server(broker.app, "127.0.0.1", 0))
    try:
        yield f"http://127.0.0.1:{server.port}"
    finally:
        broker.call(server.wait_closed())


def make_config(data_dir: Path, **sections: dict[str, Any]) -> Config:
    config = load_config(environ={})
    config.data_dir = data_dir
    config.listeners.mqtt_port = free_port()
    config.listeners.mqtt_ws_port = free_port()
    config.listeners.grpc_port = 0
    config.listeners.amqp_port = 0
    config.listeners.http_port = 0
    config.mqtt.sys_interval = 0.5
    for section, values in sections.items():
        if not isinstance(values, dict):
            setattr(config, section, values)  # a top-level setting
            continue
        target = getattr(config, section)
        for key, value in values.items():
            setattr(target, key, value)
    return config


@pytest.fixture
def broker_factory(tmp_path: Path) -> Iterator[Callable[..., ThreadedBroker]]:
    started: list[ThreadedBroker] = []

    def start(**sections: dict[str, Any]) -> ThreadedBroker:
        config = make_config(tmp_path / f"data{len(started)}", **sections)
        broker = ThreadedBroker(config).start()
        started.append(broker)
        return broker

    yield start
    errors: list[BaseException] = []
    for broker in started:  # every one is stopped, even if stopping an earlier one failed
        try:
            broker.stop()
        except Exception as exc:  # noqa: BLE001  (raised below, after the others stopped)
            errors.append(exc)
    if errors:
        raise errors[0]


@pytest.fixture
def broker(broker_factory: Callable[..., ThreadedBroker]) -> ThreadedBroker:
    return broker_factory()


@pytest.fixture(autouse=True)
def _end_processes_left_running() -> Iterator[None]:
    """After each test, end the server processes it started and left running (a test that
    failed half-way, a node that failed to start beside a running peer). Processes of wider-
    scoped fixtures were started before this fixture and are left alone."""
    first = len(tracked_processes)
    yield
    for proc in tracked_processes[first:]:
        end_process(proc)
    del tracked_processes[first:]


class PortInUse(AssertionError):
    """`shardgate serve` exited because a port it was given is in use."""


class BrokerProcess:
    """`shardgate serve` as a real subprocess, for restart and SIGKILL tests."""

    def __init__(self, data_dir: Path, extra_args: list[str] | None = None,
                 config_file: Path | None = None) -> None:
        self.data_dir = data_dir
        self.extra_args = extra_args or []
        self.config_file = config_file
        self.proc: subprocess.Popen[bytes] | None = None
        self.ports: dict[str, int] = {}
        self.log_path = data_dir.parent / f"{data_dir.name}.log"

    # What the command is run with, e.g. `ip netns exec NS` (which execs it: the process is
    # the broker's own, as without one).
    command_prefix: tuple[str, ...] = ()
    # A port taken by another socket is waited for this long (same ports) before failing.
    PORT_IN_USE_TIMEOUT = 30.0
    # How long a start may take until the port file is written (the interpreter's and the
    # broker's imports: a few seconds alone, far more while the parallel workers start theirs).
    START_TIMEOUT = 60.0

    def start(self, mqtt_port: int | None = None) -> BrokerProcess:
        """Start `shardgate serve` and wait for its port file. A restart keeps the ports it
        had (clients come back to the same address). If a port is in use (a socket of the
        killed process not yet released, or another process), the start is retried with the
        same ports until PORT_IN_USE_TIMEOUT after the first refusal (a start itself can take
        long on a loaded machine)."""
        port = mqtt_port or self.ports.get("mqtt") or free_port()
        deadline: float | None = None
        while True:
            try:
                return self._start_once(port)  # any other failure is raised as it is
            except PortInUse:
                if deadline is None:
                    deadline = time.monotonic() + self.PORT_IN_USE_TIMEOUT
                elif time.monotonic() > deadline:
                    raise
            # start again as soon as every port can be bound (polled; then one last try)
            left = deadline - time.monotonic()
            with contextlib.suppress(AssertionError):
                wait_for(lambda: self._ports_bindable(port), timeout=max(0.1, left), interval=0.05)

    def _ports_bindable(self, mqtt_port: int) -> bool:
        """Whether every fixed port this broker is given can be bound now."""
        ports = [mqtt_port] + [int(value) for flag, value in zip(self.extra_args, self.extra_args[1:], strict=False)
                               if flag.endswith("-port") and value.isdigit() and value != "0"]
        for port in ports:
            with socket.socket() as sock:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                try:
                    sock.bind(("127.0.0.1", port))
                except OSError:
                    return False
        return True

    def _start_once(self, mqtt_port: int) -> BrokerProcess:
        port_file = self.data_dir.parent / f"{self.data_dir.name}.ports.json"
        if port_file.exists():
            port_file.unlink()
        args = [
            *self.command_prefix,
            sys.executable, "-m", "shardgate", "serve", "--data-dir", str(self.data_dir),
            "--host", "127.0.0.1", "--mqtt-port", str(mqtt_port),
            "--mqtt-ws-port", "0", "--grpc-port", "0", "--amqp-port", "0", "--http-port", "0",
            "--port-file", str(port_file), *self.extra_args,
        ]
        if self.config_file is not None:
            args += ["--config", str(self.config_file)]
        env = {k: v for k, v in os.environ.items() if not k.startswith("SHARDGATE_")}
        log_start = self.log_path.stat().st_size if self.log_path.exists() else 0
        log_file = open(self.log_path, "ab")  # noqa: SIM115
        self.proc = track_process(
            subprocess.Popen(args, stdout=log_file, stderr=subprocess.STDOUT, env=env))
        log_file.close()

        def ready() -> bool:
            assert self.proc is not None
            if self.proc.poll() is not None:
                with open(self.log_path, "rb") as log:
                    log.seek(log_start)
                    output = log.read().decode(errors="replace")
                if "cannot listen" in output and "already in use" in output:
                    raise PortInUse(output)
                raise AssertionError(f"broker exited early:\n{self.log_path.read_text()}")
            return port_file.exists()

        try:
            wait_for(ready, timeout=self.START_TIMEOUT)
        except AssertionError:
            end_process(self.proc)  # one that never came up is not left running
            raise
        self.ports = json.loads(port_file.read_text())
        return self

    @property
    def mqtt_port(self) -> int:
        return self.ports["mqtt"]

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)

    def terminate(self, timeout: float = 20) -> int:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout)


@pytest.fixture
def broker_process(tmp_path: Path) -> Iterator[Callable[..., BrokerProcess]]:
    processes: list[BrokerProcess] = []

    def make(data_dir: Path | None = None, **kwargs: Any) -> BrokerProcess:
        process = BrokerProcess(data_dir or tmp_path / "data", **kwargs)
        processes.append(process)
        return process

    yield make
    for process in processes:
        end_process(process.proc)
