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
from pathlib import Path

from celery import Celery

app = Celery("tasks", broker="amqp://guest:guest@127.0.0.1:{port}//")
app.conf.broker_transport_options = {{"confirm_publish": True}}
app.conf.broker_connection_retry_on_startup = True
app.conf.worker_hijack_root_logger = False
DONE = Path({done!r})


@app.task(name="tasks.record")
def record(name):
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


def queued(port: int, queue: str) -> int:
    import pika

    with pika.BlockingConnection(pika.ConnectionParameters("127.0.0.1", port, heartbeat=0)) as conn:
        return conn.channel().queue_declare(queue, passive=True).method.message_count


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

    log = (tmp_path / "worker.log").open("wb")
    worker = subprocess.Popen(
        [sys.executable, "-m", "celery", "-A", "tasks", "worker", "--pool=solo", "-l", "info",
         "--without-gossip", "--without-mingle", "--without-heartbeat"],
        cwd=tmp_path, stdout=log, stderr=subprocess.STDOUT,
    )
    log.close()
    try:
        before = {f"before-{i}" for i in range(20)}

        def ran(names: set[str]) -> bool:
            assert worker.poll() is None, (tmp_path / "worker.log").read_text()
            return names <= {p.name for p in done.iterdir()}

        wait_for(lambda: ran(before), timeout=60)
        # the worker is still alive and takes new work
        send(port, ["after"])
        wait_for(lambda: ran({"after"}), timeout=60)
        text = (tmp_path / "worker.log").read_text()
        assert "Unrecoverable error" not in text, text
    finally:
        worker.terminate()
        worker.wait(30)
