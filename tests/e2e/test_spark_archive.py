"""Spark reads what the archiver wrote: messages published over MQTT to a real broker are
archived from its journal, then one local SparkSession checks the row count against the
acknowledged publishes, every column and type, odd topic names, the decoded JSON column,
partition pruning in the physical plan, a stream named `007`, and a streaming query that
picks up new files. Skipped only when pyspark or Java is missing."""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import os
import shutil
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from pamqp import commands

pyspark = pytest.importorskip("pyspark")
# A local JVM's first jobs: minutes on a loaded 2-core machine (still bounded, to catch a hang)
pytestmark = pytest.mark.timeout(360)
if shutil.which("java") is None and not os.environ.get("JAVA_HOME"):
    pytest.skip("Java is not installed", allow_module_level=True)

from paho.mqtt.packettypes import PacketTypes  # noqa: E402
from paho.mqtt.properties import Properties  # noqa: E402
from pyspark.sql import functions as F  # noqa: E402
from pyspark.sql import types as T  # noqa: E402
from shardgate.core.records import MessageRecord, encode_message  # noqa: E402
from shardgate.storage.archive import Archiver, ArchiveSettings  # noqa: E402
from shardgate.storage.journal import JournalStorage  # noqa: E402
from shardgate.storage.spark import read_archive, read_archive_stream  # noqa: E402

from shardgate.config import StreamEntry  # noqa: E402
from tests.conftest import ThreadedBroker, make_config  # noqa: E402
from tests.mqtt_clients import V5, Paho  # noqa: E402

HOUR = 3_600_000
T0 = 1_700_000_000_000 - 1_700_000_000_000 % HOUR  # 2023-11-14 22:00 UTC
AMQP_PROPERTIES = commands.Basic.Properties(
    headers={"eta": None, "retries": 0}, content_type="application/json").marshal()
"""An AMQP message's exact properties, as the record's native properties carry them."""
EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
ODD_TOPICS = ["plant 7/línea/温度", "a//b/", "ünïcödé/🚀/x y", "/leading"]
LOG4J2 = """\
rootLogger.level = error
rootLogger.appenderRef.stderr.ref = stderr
appender.stderr.type = Console
appender.stderr.name = stderr
appender.stderr.target = SYSTEM_ERR
appender.stderr.layout.type = PatternLayout
appender.stderr.layout.pattern = %d{HH:mm:ss} %p %c{1}: %m%n
"""


@dataclass
class Published:
    url: str
    root: Path
    acked: int
    sensors: list[tuple[str, bytes]]
    odd: list[str]
    client_id: str
    window: tuple[int, int]
    history: int


@pytest.fixture(scope="module")
def spark(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    with pytest.MonkeyPatch.context() as environment:  # for this module's tests only
        environment.setenv("SPARK_LOCAL_IP", "127.0.0.1")
        environment.setenv("PYSPARK_PYTHON", os.environ.get("PYSPARK_PYTHON", sys.executable))
        yield from spark_session(tmp_path_factory)


def spark_session(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """A local SparkSession; afterwards its JVM is ended too (`stop()` leaves the gateway
    process running, some 600 MiB, for the rest of the test run)."""
    from pyspark import SparkContext
    from pyspark.sql import SparkSession

    conf_file = tmp_path_factory.mktemp("spark") / "log4j2.properties"
    conf_file.write_text(LOG4J2)
    java_options = f"-Dlog4j2.configurationFile=file:{conf_file}"
    session = None
    try:
        session = (
            SparkSession.builder.master("local[1]")
            .appName("shardgate-archive-tests")
            .config("spark.ui.enabled", "false")
            .config("spark.ui.showConsoleProgress", "false")
            .config("spark.sql.shuffle.partitions", "2")
            .config("spark.sql.session.timeZone", "UTC")
            .config("spark.driver.extraJavaOptions", java_options)
            .config("spark.driver.bindAddress", "127.0.0.1")
            .config("spark.sql.maxMetadataStringLength", "2000")  # untruncated scan filters
            .getOrCreate()
        )
        session.sparkContext.setLogLevel("ERROR")
        yield session
    finally:
        try:
            if session is not None:
                session.stop()
        finally:  # also when the start or a test timed out mid-call (a broken gateway)
            gateway = SparkContext._gateway
            if gateway is not None:
                with contextlib.suppress(Exception):
                    gateway.shutdown()
                jvm = getattr(gateway, "proc", None)
                if jvm is not None:
                    jvm.terminate()  # the gateway server exits on its stdin's end anyway
                    jvm.wait(30)
                SparkContext._gateway = None
                SparkContext._jvm = None


def append_history(root: Path, journal_dir: Path) -> int:
    """A second journal (another node's history) archived into the same URL: a json stream
    over three hours, a `+` in a topic (legal outside MQTT), and a stream named `007`."""

    async def run() -> int:
        journal = JournalStorage(journal_dir, fsync="os")
        readings = journal.open_shard("history", 0)
        batch = [
            (T0 + i * 60_000, encode_message(MessageRecord(
                f"history/dev-{i % 3}/+", b'{"temperature": %d}' % i, 1, False,
                T0 + i * 60_000, producer_protocol="grpc", producer_id="loader")))
            for i in range(180)
        ]
        readings.append(batch)
        journal.open_shard("007", 0).append([(T0, encode_message(MessageRecord(
            "007/x", b"bond", 0, False, T0, native_properties={"amqp-0-9-1": AMQP_PROPERTIES})))])
        await journal.flush()
        archiver = Archiver(journal, f"file://{root}",
                            lambda: [("history", 1, "json"), ("007", 1, "string")],
                            ArchiveSettings(target_rows=50))
        await archiver.flush()
        journal.close()
        return len(batch)

    return asyncio.run(run())


@pytest.fixture(scope="module")
def published(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Published]:
    base = tmp_path_factory.mktemp("archive-e2e")
    root = base / "archive"
    config = make_config(base / "data", streams=[
        StreamEntry("sensors", schema="json", routes=["sensors/#"]),
    ])
    broker = ThreadedBroker(config).start()
    try:
        client_id = "sensor-gw"
        client = Paho(broker.mqtt_port, client_id, V5)
        start_ms = __import__("time").time() * 1000
        sensors = []
        for i in range(120):
            topic, payload = f"sensors/dev-{i % 4}/reading", b'{"temperature": %d.5}' % i
            properties = Properties(PacketTypes.PUBLISH)
            properties.UserProperty = [("unit", "C"), ("seq", str(i))]
            properties.ContentType = "application/json"
            client.publish(topic, payload, qos=1, properties=properties)
            sensors.append((topic, payload))
        for topic in ODD_TOPICS:
            client.publish(topic, b"\x00\xff binary \x80", qos=1)
        binary = bytes(range(256))
        client.publish("raw/bytes", binary, qos=1)
        client.disconnect()
        end_ms = __import__("time").time() * 1000 + 1
        acked = len(sensors) + len(ODD_TOPICS) + 1

        app = broker.app

        def reliable_streams() -> list[tuple[str, int, str]]:
            return [(s.name, len(s.shards), s.config.schema.value)
                    for s in app.broker.streams.values() if s.reliable]

        archiver = Archiver(app.journal, f"file://{root}", reliable_streams,
                            ArchiveSettings(target_rows=64))
        broker.call(archiver.start())
        broker.call(archiver.stop(flush=True))
    finally:
        broker.stop()
    history = append_history(root, base / "history-journal")
    yield Published(f"file://{root}", root, acked, sensors, ODD_TOPICS, client_id,
                    (int(start_ms), int(end_ms)), history)


def test_plain_read_parquet_counts_every_acknowledged_message(spark: Any, published: Published
                                                              ) -> None:
    frame = spark.read.parquet(published.url)
    live = frame.where(F.col("stream").isin("sensors", "default"))
    assert live.count() == published.acked
    assert live.select("stream", "shard", "offset").distinct().count() == published.acked


def test_every_reader_opens_the_root_with_no_options(spark: Any, published: Published) -> None:
    """Spark, pyarrow, pandas, DuckDB and polars on the same root: the `stream` column once
    (the partition), every acknowledged message once."""
    import warnings

    import pandas as pd
    import pyarrow.parquet as pq

    live = ("sensors", "default")
    frame = spark.read.parquet(published.url)
    names = [field.name for field in frame.schema.fields]
    assert len(names) == len(set(names)) and "stream" in names
    assert frame.where(F.col("stream").isin(*live)).count() == published.acked
    everything = published.acked + published.history + 1  # the history and `007` streams
    assert frame.count() == everything
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        table = pq.read_table(published.root)
        assert table.num_rows == everything
        pandas = pd.read_parquet(published.root)
        assert len(pandas[pandas["stream"].isin(live)]) == published.acked
        assert len(pd.read_parquet(published.root / "stream=sensors")) == len(published.sensors)
    duckdb = pytest.importorskip("duckdb")
    [(count, distinct)] = duckdb.sql(
        "select count(*), count(distinct (stream, shard, \"offset\")) from "
        f"read_parquet('{published.root}/**/*.parquet', hive_partitioning=true) "
        "where stream in ('sensors', 'default')").fetchall()
    assert count == distinct == published.acked
    polars = pytest.importorskip("polars")
    lazy = polars.scan_parquet(f"{published.root}/**/*.parquet", hive_partitioning=True)
    assert lazy.filter(polars.col("stream").is_in(live)).collect().height == published.acked


def test_every_column_keeps_its_type_and_value(spark: Any, published: Published) -> None:
    frame = spark.read.parquet(published.url)
    types = {field.name: field.dataType for field in frame.schema.fields}
    assert types["payload"] == T.BinaryType() and types["key"] == T.BinaryType()
    assert types["headers"] == T.MapType(T.StringType(), T.StringType(), True)
    assert types["publish_time"] == T.TimestampType() and types["offset"] == T.LongType()
    assert types["stream"] == T.StringType() and types["hour"] == T.IntegerType()

    rows = (read_archive(spark, published.url, stream="sensors")
            .select("offset", "topic", "payload", "headers", "content_type", "qos",
                    "producer_protocol", "producer_id", "payload_json",
                    F.unix_millis("publish_time").alias("ms"),
                    F.date_format("publish_time", "yyyy-MM-dd").alias("day"),
                    F.hour("publish_time").alias("hh"), "date", "hour")
            .orderBy("offset").collect())
    assert [(r.topic, bytes(r.payload)) for r in rows] == published.sensors
    assert [r.offset for r in rows] == list(range(len(published.sensors)))
    first = rows[0]
    assert first.headers == {"unit": "C", "seq": "0"}
    assert first.content_type == "application/json" and first.qos == 1
    assert (first.producer_protocol, first.producer_id) == ("mqtt", published.client_id)
    assert first.payload_json == '{"temperature": 0.5}'
    low, high = published.window
    assert all(low - 1000 <= r.ms <= high + 1000 for r in rows)
    assert all(r.day == str(r.date) and r.hh == r.hour for r in rows)  # UTC partitions

    [raw] = read_archive(spark, published.url, stream="default").where(
        F.col("topic") == "raw/bytes").collect()
    assert bytes(raw.payload) == bytes(range(256)) and raw.payload_json is None


def test_topic_names_with_slashes_plus_spaces_and_unicode_survive(spark: Any,
                                                                  published: Published) -> None:
    topics = {r.topic for r in read_archive(spark, published.url, stream="default")
              .select("topic").collect()}
    assert set(published.odd) <= topics
    plus = read_archive(spark, published.url, stream="history").where(
        F.col("topic") == "history/dev-1/+")
    assert plus.count() == 60


def test_partition_pruning_shows_in_the_physical_plan(spark: Any, published: Published) -> None:
    frame = read_archive(spark, published.url, stream="history",
                         start=T0 + HOUR + 30 * 60_000, end=T0 + 2 * HOUR)
    plan = frame._jdf.queryExecution().executedPlan().toString()
    filters = plan.split("PartitionFilters: [", 1)[1].split("], ", 1)[0]
    assert "stream" in filters and "date" in filters and "hour" in filters
    assert frame.count() == 30
    per_hour = read_archive(spark, published.url, stream="history").groupBy("hour").count()
    assert sorted((r.hour, r["count"]) for r in per_hour.collect()) == [(0, 60), (22, 60), (23, 60)]


def test_stream_named_007_stays_a_string(spark: Any, published: Published) -> None:
    [row] = read_archive(spark, published.url, stream="007").collect()
    assert row.stream == "007" and row.payload_string == "bond"
    names = {r.stream for r in read_archive(spark, published.url).select("stream").distinct()
             .collect()}
    assert names == {"007", "default", "history", "sensors"}
    assert read_archive(spark, published.url, stream="missing").count() == 0


def test_native_properties_read_as_a_binary_map_that_pamqp_decodes(spark: Any,
                                                                   published: Published) -> None:
    from pamqp import header

    frame = spark.read.parquet(published.url)
    types = {field.name: field.dataType for field in frame.schema.fields}
    assert types["native_properties"] == T.MapType(T.StringType(), T.BinaryType(), True)
    [row] = read_archive(spark, published.url, stream="007").collect()
    raw = bytes(row.native_properties["amqp-0-9-1"])
    assert raw == AMQP_PROPERTIES
    content = header.ContentHeader()
    content.unmarshal(b"\x00\x3c\x00\x00" + bytes(8) + raw)
    assert content.properties.headers == {"eta": None, "retries": 0}
    assert read_archive(spark, published.url, stream="default").where(
        F.col("native_properties").isNotNull()).count() == 0


def load_example(name: str) -> Any:
    sys.path.insert(0, str(EXAMPLES))
    try:
        spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(str(EXAMPLES))


def test_sensor_aggregates_example_on_mqtt_readings(spark: Any, published: Published) -> None:
    example = load_example("sensor_aggregates")
    rows = example.per_device_aggregates(
        read_archive(spark, published.url, stream="sensors")).collect()
    assert [(r.device, r.readings) for r in rows] == [(f"dev-{i}", 30) for i in range(4)]
    assert rows[0].min_temperature == 0.5 and rows[3].max_temperature == 119.5


def test_structured_streaming_picks_up_new_files_once(spark: Any, published: Published,
                                                      tmp_path: Path) -> None:
    output = tmp_path / "copy"
    # Its own copy of the stream: the module's archive stays as the other tests expect it,
    # whichever order they run in.
    archive = tmp_path / "archive"
    shutil.copytree(published.root / "stream=history", archive / "stream=history")
    url = archive.as_uri()

    def run_once() -> int:
        """Copy new archive rows into another Parquet table; returns the rows copied so far."""
        query = (read_archive_stream(spark, url, stream="history")
                 .select("offset", "shard", "topic").writeStream.format("parquet")
                 .option("path", str(output))
                 .option("checkpointLocation", str(tmp_path / "checkpoint"))
                 .trigger(availableNow=True).start())
        query.awaitTermination(60)
        return spark.read.parquet(str(output)).count()

    assert run_once() == published.history

    async def archive_more() -> None:
        journal = JournalStorage(tmp_path / "more", fsync="os")
        log = journal.open_shard("history", 0)
        # Another shard of the same stream, so the file names cannot collide.
        shard = journal.open_shard("history", 1)
        shard.append([(T0 + 5 * HOUR + i, encode_message(MessageRecord(
            "history/new", b"{}", 0, False, T0 + 5 * HOUR + i))) for i in range(7)])
        await journal.flush()
        archiver = Archiver(journal, url, lambda: [("history", 2, "json")])
        await archiver.flush()
        assert log.next_offset == 0
        journal.close()

    asyncio.run(archive_more())
    assert run_once() == published.history + 7  # only the new files were read again


def test_sigterm_archives_everything_for_spark_and_cli_reports_it(spark: Any, tmp_path: Path) -> None:
    """The whole pipeline through the real commands: `shardgate serve`, MQTT publishes,
    `shardgate archive flush|status`, SIGTERM, then Spark sees every acknowledged message."""
    import json
    import subprocess

    from tests.conftest import BrokerProcess, free_port

    http_port = free_port()
    broker = BrokerProcess(tmp_path / "data", extra_args=["--http-port", str(http_port)]).start()
    try:
        publisher = Paho(broker.mqtt_port, "meter", V5)
        for index in range(50):
            publisher.publish(f"meters/m{index % 5}", json.dumps({"kwh": index}), 1)
        cli = [sys.executable, "-m", "shardgate", "archive"]
        url = ["--http-url", f"http://127.0.0.1:{http_port}"]
        flushed = subprocess.run([*cli, "flush", *url, "--json"], capture_output=True, text=True, timeout=120)
        assert flushed.returncode == 0, flushed.stderr
        default = next(s for s in json.loads(flushed.stdout)["shards"] if s["stream"] == "default")
        assert default["archived_next"] == default["journal_next"] >= 50
        table = subprocess.run([*cli, "status", *url], capture_output=True, text=True, timeout=60)
        assert table.returncode == 0 and "default" in table.stdout
        for index in range(50, 80):
            publisher.publish(f"meters/m{index % 5}", json.dumps({"kwh": index}), 1)
        publisher.disconnect()
    finally:
        assert broker.terminate() == 0
    archive = f"file://{tmp_path / 'data' / 'archive'}"
    rows = read_archive(spark, archive, stream="default").filter(F.col("topic").startswith("meters/"))
    assert rows.count() == 80
    payloads = sorted(json.loads(bytes(r.payload))["kwh"] for r in rows.select("payload").collect())
    assert payloads == list(range(80))


TYPED_V1 = {"type": "object", "properties": {
    "device": {"type": "string"}, "temp": {"type": "number"},
    "pos": {"type": "object", "properties": {"lat": {"type": "number"}}},
    "tags": {"type": "array", "items": {"type": "string"}}}}
TYPED_V2 = {**TYPED_V1, "properties": {**TYPED_V1["properties"], "humidity": {"type": "number"}}}


@pytest.fixture(scope="module")
def typed_archive(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A stream with a registered JSON Schema, archived over two versions: 40 readings of
    version 1 (temp 0..39), then 40 of version 2 (temp 40..79, with humidity)."""
    import json

    base = tmp_path_factory.mktemp("typed")

    async def run() -> None:
        journal = JournalStorage(base / "journal", fsync="os")
        log = journal.open_shard("typed", 0)
        version = {"now": 1}
        archiver = Archiver(journal, (base / "archive").as_uri(), lambda: [("typed", 1, "json")],
                            ArchiveSettings(target_rows=20),
                            registered_schema=lambda s: (
                                "json", TYPED_V1 if version["now"] == 1 else TYPED_V2,
                                version["now"]))
        for batch in range(2):
            rows = []
            for i in range(batch * 40, batch * 40 + 40):
                document = {"device": f"d{i % 4}", "temp": float(i), "pos": {"lat": i / 2},
                            "tags": ["x"] * (i % 3)}
                if batch:
                    document["humidity"] = 50.0
                at = T0 + i * 1000
                rows.append((at, encode_message(MessageRecord(
                    "typed/r", json.dumps(document).encode(), 1, False, at))))
            log.append(rows)
            await journal.flush()
            await archiver.flush()
            version["now"] = 2
        journal.close()

    asyncio.run(run())
    return (base / "archive").as_uri()


def test_typed_columns_filter_with_parquet_pushdown(spark: Any, typed_archive: str) -> None:
    frame = read_archive(spark, typed_archive, stream="typed")
    types = {field.name: field.dataType for field in frame.schema.fields}
    assert types["temp"] == T.DoubleType() and types["device"] == T.StringType()
    assert types["pos"] == T.StructType([T.StructField("lat", T.DoubleType(), True)])
    assert types["tags"] == T.ArrayType(T.StringType(), True)
    hot = frame.where("temp > 30")
    plan = hot._jdf.queryExecution().executedPlan().toString()
    pushed = plan.split("PushedFilters: [", 1)[1].split("]", 1)[0]
    assert "GreaterThan(temp,30.0)" in pushed
    assert hot.count() == 49
    assert frame.where(F.col("payload").isNotNull()).count() == 0  # not stored twice
    # the version 2 column, null in version 1's files
    per_version = {(r.temp >= 40, r.humidity) for r in frame.select("temp", "humidity").collect()}
    assert per_version == {(False, None), (True, 50.0)}
    merged = spark.read.option("mergeSchema", "true").parquet(f"{typed_archive}/stream=typed")
    assert "humidity" in merged.columns and merged.count() == 80


def test_structured_streaming_reads_typed_columns(spark: Any, typed_archive: str,
                                                  tmp_path: Path) -> None:
    output = tmp_path / "out"
    query = (read_archive_stream(spark, typed_archive, stream="typed")
             .where("temp >= 10").select("offset", "temp", "humidity")
             .writeStream.format("parquet").option("path", str(output))
             .option("checkpointLocation", str(tmp_path / "checkpoint"))
             .trigger(availableNow=True).start())
    query.awaitTermination(120)
    copied = spark.read.parquet(str(output))
    assert copied.count() == 70 and copied.where("humidity = 50.0").count() == 40


def test_unknown_archive_scheme_is_a_clear_error_at_start(tmp_path: Path) -> None:
    import subprocess

    config = tmp_path / "shardgate.toml"
    config.write_text('[archive]\nurl = "nosuchfs://bucket/x"\n')
    result = subprocess.run(
        [sys.executable, "-m", "shardgate", "serve", "--config", str(config), "--data-dir", str(tmp_path / "d"),
         "--mqtt-port", "0", "--mqtt-ws-port", "0", "--grpc-port", "0", "--http-port", "0", "--amqp-port", "0"],
        capture_output=True, text=True, timeout=60,
    )
    assert result.returncode == 2
    assert "archive" in result.stderr and "nosuchfs" in result.stderr
