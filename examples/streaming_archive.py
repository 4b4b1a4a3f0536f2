"""Spark Structured Streaming over the Shardgate archive: new Parquet files are picked up as
the archiver uploads them (each file appears whole, so none is read half-written).

Prints, per micro-batch, the readings per device and minute of the `sensors` stream:

    python examples/streaming_archive.py --archive file:///var/lib/shardgate/archive \
        --checkpoint /tmp/sensor-stream-checkpoint

`--once` processes the files present now and exits (trigger availableNow); run it again later
and, with the same checkpoint, it reads only the files that arrived since.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from sensor_aggregates import READING_SCHEMA, local_spark  # noqa: E402


def readings_per_minute(stream_frame: Any) -> Any:
    """Per device and one-minute window: readings and mean temperature (late data: 10 min)."""
    from pyspark.sql import functions as F

    readings = stream_frame.select(
        F.element_at(F.split("topic", "/"), 2).alias("device"),
        "publish_time",
        F.from_json("payload_json", READING_SCHEMA).alias("reading"),
    )
    return (
        readings.withWatermark("publish_time", "10 minutes")
        .groupBy(F.window("publish_time", "1 minute"), "device")
        .agg(F.count("*").alias("readings"),
             F.round(F.avg("reading.temperature"), 3).alias("avg_temperature"))
    )


def start_query(spark: Any, url: str, stream: str, checkpoint: str, once: bool) -> Any:
    from shardgate.storage.spark import read_archive_stream

    source = read_archive_stream(spark, url, stream=stream, max_files_per_trigger=100)
    writer = (
        readings_per_minute(source).writeStream.outputMode("update").format("console")
        .option("truncate", "false").option("checkpointLocation", checkpoint)
    )
    writer = writer.trigger(availableNow=True) if once else writer.trigger(processingTime="10 seconds")
    return writer.start()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--archive", required=True)
    parser.add_argument("--stream", default="sensors")
    parser.add_argument("--checkpoint", default=os.path.join(tempfile.gettempdir(),
                                                             "shardgate-stream-checkpoint"))
    parser.add_argument("--once", action="store_true")
    args = parser.parse_args(argv)
    spark = local_spark("streaming-archive")
    try:
        query = start_query(spark, args.archive, args.stream, args.checkpoint, args.once)
        query.awaitTermination()
    except KeyboardInterrupt:
        pass
    finally:
        spark.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
