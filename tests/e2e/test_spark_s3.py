"""Spark reads the archive from object storage: a broker archives MQTT publishes to an S3 API
on loopback (`moto_server`), a stream with a registered JSON Schema as typed columns, and a
local Spark job of its own (its own JVM, with Hadoop's S3A connector) reads `s3a://` through
`shardgate.storage.spark.read_archive`: every acknowledged message once, the typed column
filtered with Parquet pushdown.

Spark needs Hadoop's S3A connector (hadoop-aws) and the AWS SDK, which pyspark does not ship.
A user adds them with `spark.jars.packages` from Maven Central; CI cannot reach Maven, so
`.ci/run` unpacks both jars from PyPI's sagemaker-pyspark into `S3A_JARS` (hadoop-aws 3.3.1:
it reads the numeric forms of the S3A options that Hadoop 3.4 writes as `60s`, so the job
sets those). Skipped where the jars, Java, pyspark or moto_server are missing."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import free_port
from tests.e2e.test_shutdown_timeout import start_moto
from tests.mqtt_clients import V5, Paho

boto3 = pytest.importorskip("boto3")
pytest.importorskip("s3fs")
pytest.importorskip("pyspark")
pytestmark = pytest.mark.timeout(420)

S3A_JARS = Path(os.environ.get("SHARDGATE_S3A_JARS", Path.home() / ".cache" / "shardgate-s3a-jars"))
JARS = ("hadoop-aws-3.3.1.jar", "aws-java-sdk-bundle-1.11.901.jar")
SCHEMA = {
    "type": "object",
    "properties": {"device": {"type": "string"}, "temp": {"type": "number"}},
    "required": ["device", "temp"],
}
SPARK_JOB = r'''
import json, re, sys
from pyspark.sql import SparkSession, functions as F
from shardgate.storage.spark import read_archive

jars, endpoint, url = sys.argv[1:4]
numeric = {  # Hadoop 3.4+ defaults written as "60s", which hadoop-aws 3.3.1 cannot parse
    "connection.establish.timeout": "30000", "connection.timeout": "200000",
    "threads.keepalivetime": "60", "multipart.purge.age": "86400", "connection.ttl": "300000",
    "retry.interval": "500", "retry.throttle.interval": "100",
    "assumed.role.session.duration": "1800", "multipart.size": "67108864",
    "multipart.threshold": "134217728", "block.size": "33554432", "readahead.range": "65536",
}
builder = (SparkSession.builder.master("local[1]").appName("shardgate-s3-test")
           .config("spark.ui.enabled", "false").config("spark.ui.showConsoleProgress", "false")
           .config("spark.driver.bindAddress", "127.0.0.1").config("spark.jars", jars)
           .config("spark.sql.session.timeZone", "UTC")
           .config("spark.hadoop.fs.s3a.endpoint", endpoint)
           .config("spark.hadoop.fs.s3a.access.key", "k").config("spark.hadoop.fs.s3a.secret.key", "s")
           .config("spark.hadoop.fs.s3a.path.style.access", "true")
           .config("spark.hadoop.fs.s3a.connection.ssl.enabled", "false")
           .config("spark.hadoop.fs.s3a.aws.credentials.provider",
                   "org.apache.hadoop.fs.s3a.SimpleAWSCredentialsProvider"))
for key, value in numeric.items():
    builder = builder.config(f"spark.hadoop.fs.s3a.{key}", value)
spark = builder.getOrCreate()
spark.sparkContext.setLogLevel("ERROR")
try:
    readings = read_archive(spark, url, stream="readings")
    hot = readings.where(F.col("temp") > 30)
    print(json.dumps({
        "root_rows": spark.read.parquet(url.replace("s3://", "s3a://")).count(),
        "rows": readings.count(),
        "devices": sorted(r.device for r in readings.select("device").collect()),
        "temp_type": dict(readings.dtypes)["temp"],
        "hot": hot.count(),
        "pushed": re.findall(r"PushedFilters: \[([^\]]*)\]",
                             hot._jdf.queryExecution().executedPlan().toString()),
    }))
finally:
    spark.stop()
'''


def test_spark_reads_a_typed_archive_on_s3_with_every_acknowledged_message_once(
        broker_process, tmp_path: Path) -> None:
    missing = [name for name in JARS if not (S3A_JARS / name).is_file()]
    if missing:
        pytest.skip(f"Spark's S3A connector is not in {S3A_JARS} ({', '.join(missing)}); "
                    ".ci/run puts it there")
    if shutil.which("moto_server") is None:
        pytest.skip("moto_server (moto[server]) is not installed")
    if shutil.which("java") is None and not os.environ.get("JAVA_HOME"):
        pytest.skip("Java is not installed")
    port = free_port()
    moto = start_moto(port)
    try:
        endpoint = f"http://127.0.0.1:{port}"
        boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1", aws_access_key_id="k",
                     aws_secret_access_key="s").create_bucket(Bucket="lake")
        schema_file = tmp_path / "readings.schema.json"
        schema_file.write_text(json.dumps(SCHEMA))
        config = tmp_path / "shardgate.toml"
        config.write_text(
            "[archive]\n"
            f'url = "s3://lake/shardgate"\nendpoint_url = "{endpoint}"\nregion = "us-east-1"\n'
            'access_key_id = "k"\nsecret_access_key = "s"\n'
            "[[streams]]\n"
            'name = "readings"\nmode = "reliable"\npartitions = 2\nschema = "json"\n'
            f'routes = ["readings/#"]\nschema_file = "{schema_file}"\nschema_type = "json"\n'
        )
        broker = broker_process(config_file=config).start()
        publisher = Paho(broker.mqtt_port, "s3-publisher", V5)
        sent = [{"device": f"dev-{index:03d}", "temp": float(index % 60)} for index in range(120)]
        for reading in sent:
            publisher.publish(f"readings/{reading['device']}", json.dumps(reading),
                              1).wait_for_publish(10)
        publisher.disconnect()
        # SIGTERM archives everything the journal holds before the broker exits
        assert broker.terminate(timeout=60) == 0

        job = tmp_path / "spark_job.py"
        job.write_text(SPARK_JOB)
        jars = ",".join(str(S3A_JARS / name) for name in JARS)
        result = subprocess.run(
            [sys.executable, str(job), jars, endpoint, "s3://lake/shardgate"],
            capture_output=True, text=True, timeout=360,
            env={**os.environ, "SPARK_LOCAL_IP": "127.0.0.1", "PYSPARK_PYTHON": sys.executable},
        )
        assert result.returncode == 0, result.stderr[-4000:]
        answer = json.loads(result.stdout.strip().splitlines()[-1])
    finally:
        moto.kill()
        moto.wait(10)
    assert answer["rows"] == len(sent)
    assert answer["root_rows"] == len(sent)
    assert answer["devices"] == sorted(reading["device"] for reading in sent)
    assert answer["temp_type"] == "double"
    assert answer["hot"] == sum(1 for reading in sent if reading["temp"] > 30)
    assert any("GreaterThan(temp,30" in pushed for pushed in answer["pushed"]), answer["pushed"]
