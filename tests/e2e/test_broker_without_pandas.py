"""`shardgate serve` never imports pandas, even where it is installed (it is a test extra here).

pyarrow would import it at the archive's first conversion (the archive's module constants, the
archiver's warm-up at start): about a third of a start's CPU, for a library the broker never
uses (`storage/arrow_pandas.py`). Seen from outside: no pandas extension module is mapped in
the broker's process, after a start with the archive on and messages archived.
"""

from __future__ import annotations

import sys
from pathlib import Path

import paho.mqtt.client as mqtt
import pytest

from tests.conftest import wait_for


def mapped_files(pid: int) -> set[str]:
    with open(f"/proc/{pid}/maps", encoding="utf-8") as maps:
        return {line.split(None, 5)[5].strip() for line in maps if len(line.split(None, 5)) == 6}


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/<pid>/maps")
def test_a_broker_with_pandas_installed_archives_without_importing_it(broker_process, tmp_path: Path) -> None:
    pandas = pytest.importorskip("pandas")
    pandas_dir = str(Path(pandas.__file__).parent)
    config = tmp_path / "shardgate.toml"
    config.write_text("[archive]\nmax_delay_s = 0.2\n")
    broker = broker_process(config_file=config).start()
    assert broker.proc is not None
    # the archive's warm-up ran before the port file was written; now archive a file too
    client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id="archived")
    client.connect("127.0.0.1", broker.mqtt_port)
    client.loop_start()
    try:
        client.publish("archived/a", b"kept", qos=1).wait_for_publish(10)
    finally:
        client.loop_stop()
        client.disconnect()
    archive = broker.data_dir / "archive"
    wait_for(lambda: any(archive.rglob("*.parquet")), timeout=30)
    assert mapped_files(broker.proc.pid), "nothing read from /proc"
    assert not [path for path in mapped_files(broker.proc.pid) if path.startswith(pandas_dir)]
    assert broker.terminate() == 0
