"""A real Celery worker against `shardgate serve`: tasks queued before the broker restarts (by
SIGTERM or SIGKILL) all run once it is back, and the worker keeps running. Celery sends typed
AMQP headers (`eta: None`, `timelimit: [None, None]`, ...) that must come back typed after the
restart, or the worker dies on the first task."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import free_port, wait_for

TASKS = """\
import time
from pathlib import Path

from celery import Celery

app = Celery("tasks", broker="amqp://guest:guest@127.0.0.1:{port}//")
app.conf.broker_transport_options = {{"confirm_publish": True}}
app.conf.broker_connection_retry_on_startup = True
app.conf.worker_hijack_root_logger = False
DONE = Path({done!r})


@app.task(name="tasks.record")
def record(name):
    if name.startswith("slow-"):
        time.sleep(0.1)
    (DONE / name).write_text("done")
"""


def send(port: int, names: list[str]) -> None:
    """Queue `tasks.record` for each name, as a Celery client does (confirmed publishes)."""
    from celery import Celery

    app = Celery("client", broker=f"amqp://guest:guest@127.0.0.1:{port}//")
    app.conf.broker_transport_options = {"confirm_publish": True}
    try:
        for name in names:
            app.send_task("tasks.record", args=[name])
    finally:
        app.close()


def start_worker(directory: Path) -> subprocess.Popen[bytes]:
    with (directory / "worker.log").open("ab") as log:
        return subprocess.Popen(
            [sys.executable, "-m", "celery", "-A", "tasks", "worker", "--pool=solo", "-l", "info",
             "--without-gossip", "--without-mingle", "--without-heartbeat"],
            cwd=directory, stdout=log, stderr=subprocess.STDOUT,
        )


def queued(port: int, queue: str) -> int:
    import pika

    with pika.BlockingConnection(pika.ConnectionParameters("127.0.0.1", port, heartbeat=0)) as conn:
        return conn.channel().queue_declare(queue, passive=True).method.message_count


@pytest.mark.timeout(300)
@pytest.mark.parametrize("stop", ["sigterm", "sigkill"])
def test_celery_backlog_queued_before_a_restart_runs_and_the_worker_keeps_running(
    broker_process, tmp_path: Path, stop: str
) -> None:
    port = free_port()
    node = broker_process(tmp_path / "data", extra_args=["--amqp-port", str(port)]).start()
    done = tmp_path / "done"
    done.mkdir()
    (tmp_path / "tasks.py").write_text(TASKS.format(port=port, done=str(done)))
    send(port, [f"before-{i}" for i in range(20)])
    assert queued(port, "celery") == 20

    if stop == "sigterm":
        assert node.terminate() == 0
    else:
        node.kill()
    node.start()

    worker = start_worker(tmp_path)
    try:
        before = {f"before-{i}" for i in range(20)}

        def ran(names: set[str]) -> bool:
            assert worker.poll() is None, (tmp_path / "worker.log").read_text()
            return names <= {p.name for p in done.iterdir()}

        wait_for(lambda: ran(before), timeout=120)
        # the worker is still alive and takes new work
        send(port, ["after"])
        wait_for(lambda: ran({"after"}), timeout=60)
        text = (tmp_path / "worker.log").read_text()
        assert "Unrecoverable error" not in text, text
    finally:
        worker.terminate()
        worker.wait(30)


@pytest.mark.timeout(300)
def test_celery_worker_running_through_a_restart_finishes_the_backlog(
    broker_process, tmp_path: Path
) -> None:
    """The worker is busy with a backlog when the broker restarts (SIGTERM): it reconnects,
    runs every task that was queued, and keeps running."""
    port = free_port()
    node = broker_process(tmp_path / "data", extra_args=["--amqp-port", str(port)]).start()
    done = tmp_path / "done"
    done.mkdir()
    (tmp_path / "tasks.py").write_text(TASKS.format(port=port, done=str(done)))
    names = {f"slow-{i}" for i in range(40)}
    send(port, sorted(names))
    worker = start_worker(tmp_path)
    try:
        def ran(wanted: set[str], at_least: int | None = None) -> bool:
            assert worker.poll() is None, (tmp_path / "worker.log").read_text()
            finished = {p.name for p in done.iterdir()}
            if at_least is not None:
                return len(finished & wanted) >= at_least
            return wanted <= finished

        wait_for(lambda: ran(names, at_least=3), timeout=120)
        assert node.terminate() == 0
        assert len({p.name for p in done.iterdir()}) < len(names)  # a backlog is left
        node.start()
        wait_for(lambda: ran(names), timeout=120)
        send(port, ["after"])
        wait_for(lambda: ran({"after"}), timeout=60)
        text = (tmp_path / "worker.log").read_text()
        assert "Unrecoverable error" not in text, text
    finally:
        worker.terminate()
        worker.wait(30)
