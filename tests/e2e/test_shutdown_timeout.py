"""A graceful stop is bounded by `shutdown_timeout_s`: with the object store gone, SIGTERM still
ends the broker in time, and what could not be archived stays in the journal."""

from __future__ import annotations

import shutil
import socket
import subprocess
from pathlib import Path

import pytest

from tests.conftest import free_port, wait_for
from tests.mqtt_clients import V5, Paho

boto3 = pytest.importorskip("boto3")
pytest.importorskip("s3fs")


def start_moto(port: int) -> subprocess.Popen[bytes]:
    process = subprocess.Popen(["moto_server", "-H", "127.0.0.1", "-p", str(port)],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def listening() -> bool:
        assert process.poll() is None, "moto_server exited"
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            return True
        except OSError:
            return False

    wait_for(listening, timeout=30, interval=0.05)
    return process


def test_sigterm_with_object_store_down_exits_within_shutdown_timeout(broker_process, tmp_path: Path):
    if shutil.which("moto_server") is None:
        pytest.skip("moto_server (moto[server]) is not installed")
    port = free_port()
    moto = start_moto(port)
    try:
        endpoint = f"http://127.0.0.1:{port}"
        boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1", aws_access_key_id="k",
                     aws_secret_access_key="s").create_bucket(Bucket="lake")
        config = tmp_path / "shardgate.toml"
        config.write_text(
            "shutdown_timeout_s = 3.0\n[archive]\n"
            f'url = "s3://lake/shardgate"\nendpoint_url = "{endpoint}"\nregion = "us-east-1"\n'
            'access_key_id = "k"\nsecret_access_key = "s"\nmax_delay_s = 3600.0\n'
        )
        broker = broker_process(config_file=config).start()
        session = Paho(broker.mqtt_port, "keeper", V5, clean=False, session_expiry=3600)
        session.subscribe("plant/#", 1)
        session.disconnect()
        publisher = Paho(broker.mqtt_port, "publisher", V5)
        for index in range(50):
            publisher.publish(f"plant/line{index % 3}", f"reading-{index}", 1).wait_for_publish(10)
        publisher.disconnect()
    finally:
        moto.kill()
        moto.wait(10)
    # The archiver cannot upload; without the bound its stop would retry for 30 s.
    assert broker.terminate(timeout=15) in (0, 1)
    config.write_text("[archive]\nenabled = false\n")
    broker.start()
    session = Paho(broker.mqtt_port, "keeper", V5, clean=False, session_expiry=3600)
    received = sorted(m.payload.decode() for m in session.expect_n(50))
    assert received == sorted(f"reading-{index}" for index in range(50))
