"""Per-device aggregates of JSON sensor readings from the Shardgate archive, with PySpark.

Devices publish readings over MQTT to `sensors/<device>/reading` with a JSON payload such as
`{"temperature": 21.5, "humidity": 40.2}`; a reliable stream `sensors` with schema `json`
keeps them, and the archiver turns them into Parquet. This job reads that archive (only the
stream's partitions, only the requested time range) and prints, per device: readings, mean,
min and max temperature, mean humidity, first and last reading.

    python examples/sensor_aggregates.py --archive file:///var/lib/shardgate/archive
    python examples/sensor_aggregates.py --demo            # synthetic readings, no broker

`--publish N --mqtt HOST:PORT` first publishes N readings to a running broker (paho-mqtt),
then asks its admin API (`--http-url`, default http://127.0.0.1:8080) to flush the archive, so
the job reads what was just published.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import tempfile
import time
from typing import Any

READING_SCHEMA = "temperature DOUBLE, humidity DOUBLE"


def per_device_aggregates(frame: Any) -> Any:
    """Readings (an archive DataFrame of a json stream) grouped by device (topic level 2)."""
    from pyspark.sql import functions as F

    readings = frame.select(
        F.element_at(F.split("topic", "/"), 2).alias("device"),
        "publish_time",
        F.from_json("payload_json", READING_SCHEMA).alias("reading"),
    )
    return (
        readings.groupBy("device")
        .agg(
            F.count("*").alias("readings"),
            F.round(F.avg("reading.temperature"), 3).alias("avg_temperature"),
            F.min("reading.temperature").alias("min_temperature"),
            F.max("reading.temperature").alias("max_temperature"),
            F.round(F.avg("reading.humidity"), 3).alias("avg_humidity"),
            F.min("publish_time").alias("first_seen"),
            F.max("publish_time").alias("last_seen"),
        )
        .orderBy("device")
    )


def local_spark(app_name: str = "shardgate-example", master: str = "local[*]") -> Any:
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    from pyspark.sql import SparkSession

    spark = (
        SparkSession.builder.master(master)
        .appName(app_name)
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.sql.session.timeZone", "UTC")
        .config("spark.sql.shuffle.partitions", "4")
        .getOrCreate()
    )
    spark.sparkContext.setLogLevel("ERROR")
    return spark


def reading(device: str) -> bytes:
    return json.dumps({
        "temperature": round(random.gauss(21, 2), 2),
        "humidity": round(random.uniform(30, 60), 1),
    }).encode()


def publish_over_mqtt(address: str, count: int, devices: int) -> None:
    import paho.mqtt.client as mqtt

    host, _, port = address.rpartition(":")
    client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id="sensor-example",
                         protocol=mqtt.MQTTv5)
    client.connect(host or "127.0.0.1", int(port))
    client.loop_start()
    try:
        for i in range(count):
            device = f"dev-{i % devices:03d}"
            info = client.publish(f"sensors/{device}/reading", reading(device), qos=1)
            info.wait_for_publish(10)
    finally:
        client.disconnect()
        client.loop_stop()


def flush_archive(http_url: str, username: str | None, password: str | None) -> bool:
    """`POST /api/archive/flush` on the broker's admin API: seal and write what the journal
    holds. False (with a note) when the admin API cannot be reached or refuses."""
    import base64
    import urllib.error
    import urllib.request

    request = urllib.request.Request(http_url.rstrip("/") + "/api/archive/flush", method="POST",
                                     data=b"{}", headers={"Content-Type": "application/json"})
    if username:
        token = base64.b64encode(f"{username}:{password or ''}".encode()).decode()
        request.add_header("Authorization", f"Basic {token}")
    try:
        with urllib.request.urlopen(request, timeout=150):
            return True
    except (urllib.error.URLError, OSError) as exc:
        print(f"could not flush the archive through {http_url} ({exc}); the newest readings "
              "appear once the archiver's max delay has passed", file=sys.stderr)
        return False


def write_demo_archive(url: str, count: int, devices: int) -> None:
    """Synthetic readings through a real journal and the archiver (no broker needed)."""
    from shardgate.core.records import MessageRecord, encode_message
    from shardgate.storage.archive import Archiver
    from shardgate.storage.journal import JournalStorage

    async def run() -> None:
        with tempfile.TemporaryDirectory() as directory:
            journal = JournalStorage(directory, fsync="os")
            log = journal.open_shard("sensors", 0)
            now = int(time.time() * 1000)
            batch = []
            for i in range(count):
                device = f"dev-{i % devices:03d}"
                ts = now - (count - i) * 1000
                batch.append((ts, encode_message(MessageRecord(
                    f"sensors/{device}/reading", reading(device), 1, False, ts,
                    content_type="application/json", producer_protocol="mqtt",
                    producer_id=device))))
            log.append(batch)
            archiver = Archiver(journal, url, lambda: [("sensors", 1, "json")])
            await archiver.flush()
            journal.close()

    asyncio.run(run())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--archive", help="archive URL (file:///..., s3://bucket/prefix)")
    parser.add_argument("--stream", default="sensors")
    parser.add_argument("--start", help="ISO time, UTC unless it has an offset")
    parser.add_argument("--end", help="ISO time (exclusive)")
    parser.add_argument("--demo", action="store_true", help="archive synthetic readings first")
    parser.add_argument("--publish", type=int, default=0, help="publish N readings over MQTT first")
    parser.add_argument("--mqtt", default="127.0.0.1:1883")
    parser.add_argument("--http-url", default="http://127.0.0.1:8080",
                        help="the broker's admin API, to flush the archive after --publish")
    parser.add_argument("--username", help="an admin user, when the broker has users")
    parser.add_argument("--password")
    parser.add_argument("--devices", type=int, default=10)
    parser.add_argument("--master", default="local[*]")
    args = parser.parse_args(argv)
    url = args.archive
    if args.demo:
        url = url or "file://" + tempfile.mkdtemp(prefix="shardgate-archive-")
        write_demo_archive(url, 5000, args.devices)
        print(f"demo archive at {url}")
    if not url:
        parser.error("--archive is required (or --demo)")
    if args.publish:
        publish_over_mqtt(args.mqtt, args.publish, args.devices)
        flushed = flush_archive(args.http_url, args.username, args.password)
        print(f"published {args.publish} readings" + ("; archive flushed" if flushed else ""))

    from shardgate.storage.spark import read_archive

    spark = local_spark("sensor-aggregates", args.master)
    try:
        frame = read_archive(spark, url, stream=args.stream, start=args.start, end=args.end)
        if not frame.limit(1).count():
            print(f"no readings of stream {args.stream!r} in {url}: create it first "
                  f"(shardgate streams create {args.stream} --schema json --route "
                  f"'sensors/+/reading'), publish readings to it (--publish N), or name the "
                  "stream that has them with --stream", file=sys.stderr)
            return 1
        per_device_aggregates(frame).show(100, truncate=False)
    finally:
        spark.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
