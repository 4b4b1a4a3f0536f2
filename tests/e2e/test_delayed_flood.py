"""A flood of delayed messages costs the broker disk, not memory, and they survive a restart
(issue 26, item 10): `shardgate serve` keeps `$delayed/...` messages in its metadata store and
reads each only when it is due."""

from __future__ import annotations

import psutil
import pytest

from tests.conftest import wait_for
from tests.mqtt_clients import V5, Paho

MIB = 1024 * 1024


def resident(pid: int) -> int:
    return psutil.Process(pid).memory_info().rss


@pytest.mark.timeout(300)
def test_a_flood_of_delayed_messages_holds_no_memory_and_survives_a_restart(broker_process) -> None:
    broker = broker_process().start()
    assert broker.proc is not None
    # a persistent session that gets the released messages, across the restart
    subscriber = Paho(broker.mqtt_port, "late-reader", V5, clean=False, session_expiry=3600)
    subscriber.subscribe("jobs/#", qos=1)
    publisher = Paho(broker.mqtt_port, "scheduler", V5)
    publisher.publish("warm/up", bytes(MIB - 1024), qos=1)
    before = resident(broker.proc.pid)
    for number in range(64):
        publisher.publish(f"$delayed/3600/jobs/later/{number}", bytes(MIB - 1024), qos=1)
    # what was acknowledged is on disk: 64 MiB held must not be 64 MiB resident
    grown = resident(broker.proc.pid) - before
    assert grown < 24 * MIB, f"resident memory grew by {grown / MIB:.0f} MiB"
    for number in range(3):
        publisher.publish(f"$delayed/8/jobs/soon/{number}", f"soon {number}".encode(), qos=1)
    publisher.disconnect()
    subscriber.disconnect()

    assert broker.terminate() == 0
    broker.start()
    assert "restored 67 delayed messages" in broker.log_path.read_text()
    subscriber = Paho(broker.mqtt_port, "late-reader", V5, clean=False, session_expiry=3600)
    got = sorted(message.payload for message in subscriber.expect_n(3, timeout=60))
    assert got == [b"soon 0", b"soon 1", b"soon 2"]
    wait_for(lambda: "Traceback" not in broker.log_path.read_text(), timeout=1)
    subscriber.disconnect()
