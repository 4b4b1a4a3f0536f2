"""The archive as a typed table (issue 29), in one bounded run:

1. **typed rows/s**: N JSON readings (`{"device", "temp", "site"}`) on a stream with a
   registered JSON Schema (then the same readings as Avro datums of a registered Avro schema)
   are archived into typed columns (one column per field) by an archiver kept running, as a
   broker keeps it: each repeat appends readings to the journal (untimed) and times the
   `Archiver.flush()` that archives them, **one file** of N rows (a file's latency) or
   **sustained**, `--files` files of N rows (the archiver reads and builds a file while the
   one before it is encoded, as under a steady load). Against pyarrow writing the very table
   the archiver wrote (one file, read back) with the archiver's Parquet options
   (`PARQUET_OPTIONS`, its zstd level and its row group size, not pyarrow's defaults of level
   1 and 1 Mi rows): the ratio is the goal of issue 29 (>= 1x, the archiver may use both
   cores). Each repeat times an archiver flush and pyarrow's write back to back (the
   machine's drift weighs on both alike); wall clock and process CPU time (all threads),
   rows/s and ratios of the medians of `--repeat` (the best ones too).
2. **files per shard per day at 1 msg/s**: a day of one reading a second, archived as a live
   broker does (a file each `max_delay_s`, 60 s: one flush per simulated minute), then
   compacted (`compact_after_s = 0`): file count and sizes before and after. `--day-hours`
   shortens the day; the count is scaled to 24 h and says so.
3. **Spark** (when pyspark and a JVM are there): `count(*) where temp > 30` over the typed
   archive (`storage.spark.read_archive`: Parquet filter pushdown on the column) against the
   same rows archived untyped and filtered on `from_json(payload_json)`; best of `--repeat`,
   and whether the plan shows the pushed filter (each query runs once untimed first, for the
   JVM's warm-up).

The process runs with `shardgate serve`'s allocator settings (`tune_malloc`), as the archiver
does in a broker. The first phase also prints the load average at its start and end, and whether the archive's
compiled readers ran (`compiled`: "all" in a release build).

Every phase checks the `--max-seconds` deadline (default 900 s) and is skipped or cut short
past it (a phase's first measurement, and Spark's warm-up, always complete); the run always prints what it measured (markdown, and JSON with `--json`). Do not
take figures from a loaded machine.

    python bench/bench_archive_table.py [--rows 200000] [--files 3] [--day-hours 24] [--repeat 3]
                                        [--no-spark] [--max-seconds 900] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import io
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
from shardgate.core.records import MessageRecord, encode_message
from shardgate.storage.allocators import tune_malloc
from shardgate.storage.archive import Archiver, ArchiveSettings, list_stream_files
from shardgate.storage.archive.columns import PARQUET_OPTIONS
from shardgate.storage.journal import JournalStorage

HOUR_MS = 3_600_000
T0 = 1_700_000_000_000 - 1_700_000_000_000 % (24 * HOUR_MS)  # a UTC midnight
SCHEMA = {
    "type": "object",
    "properties": {"device": {"type": "string"}, "temp": {"type": "number"},
                   "site": {"type": "string"}},
    "required": ["device", "temp"],
}
AVRO_SCHEMA = {"type": "record", "name": "Reading", "fields": [
    {"name": "device", "type": "string"}, {"name": "temp", "type": "double"},
    {"name": "site", "type": ["null", "string"]}]}
SCHEMAS = {"json": SCHEMA, "avro": AVRO_SCHEMA}


class Deadline:
    def __init__(self, seconds: float) -> None:
        self.end = time.monotonic() + seconds

    def passed(self) -> bool:
        return time.monotonic() >= self.end


def reading(i: int, ts: int, kind: str = "json") -> bytes:
    value = {"device": f"dev-{i % 500:04d}", "temp": (i * 7919 % 600) / 10, "site": f"site-{i % 7}"}
    if kind == "avro":
        import fastavro

        out = io.BytesIO()
        fastavro.schemaless_writer(out, _parsed_avro(), value)
        payload = out.getvalue()
    else:
        payload = json.dumps(value).encode()
    return encode_message(MessageRecord(f"sensors/dev-{i % 500:04d}", payload, 1, False, ts,
                                        producer_protocol="mqtt", producer_id=f"dev-{i % 500:04d}"))


@functools.cache
def _parsed_avro() -> Any:
    import fastavro

    return fastavro.parse_schema(AVRO_SCHEMA)


def fill(journal: JournalStorage, stream: str, count: int, step_ms: int = 1, start: int = 0,
         kind: str = "json", per_ms: int = 1) -> None:
    """Readings `start`.. of `stream`, `per_ms` of them a millisecond (a step of `step_ms`)."""
    log = journal.open_shard(stream, 0)
    for first in range(start, start + count, 10_000):
        last = min(start + count, first + 10_000)
        log.append([(T0 + i // per_ms * step_ms, reading(i, T0 + i // per_ms * step_ms, kind))
                    for i in range(first, last)])
        journal.flush_sync()


def typed(kind: str = "json") -> Any:
    return lambda _stream: (kind, SCHEMAS[kind], 1)


def cpu() -> float:
    return time.process_time()


def load_average() -> str:
    """The 1, 5 and 15 minute load averages: the ratio is only comparable on a quiet machine."""
    return ", ".join(f"{value:.2f}" for value in os.getloadavg())


def compiled_build() -> str:
    """Which of the archive's compiled readers run (all of them in a release build): the C
    journal scan, record decoder and typed-column readers, and the mypyc footer stitching."""
    from shardgate.core.native import compiled_in_use

    wanted = {"journal scan": "shardgate.storage.journal.scan_native",
              "records": "shardgate.storage.archive.records_native",
              "typed columns": "shardgate.storage.archive.typed_native",
              "footer": "shardgate.storage.archive.footer_native"}
    used = compiled_in_use()
    missing = [name for name, group in wanted.items() if not used.get(group)]
    return "all" if not missing else "not " + ", ".join(missing)


def archive_runs(journal: JournalStorage, work: Path, stream: str, rows: int, files: int,
                 repeat: int, deadline: Deadline, kind: str) -> dict[str, list[float]]:
    """One archiver of `stream`, kept running as a broker keeps it: each repeat appends the
    next `files * rows` readings to the journal (untimed), times the `flush` that archives
    them (a file of `rows` each), then times pyarrow writing the table of one file of the
    archive (the first, archived by an untimed warm-up flush) with the archiver's options,
    back to back, so that the machine's drift weighs on both alike. Returns the wall and CPU
    seconds of each: `archiver_wall`, `archiver_cpu`, `pyarrow_wall`, `pyarrow_cpu`, and the
    table as `table` (one element)."""
    per_ms = 1 + (repeat + 1) * files * rows // HOUR_MS  # every file in one hour partition
    settings = ArchiveSettings(target_rows=rows, max_delay_s=3600, compaction=False)
    archiver = Archiver(journal, (work / f"archive-{kind}").as_uri(),
                        lambda: [(stream, 1, "json")], settings, registered_schema=typed(kind))
    found: dict[str, list[Any]] = {"archiver_wall": [], "archiver_cpu": [], "pyarrow_wall": [],
                                   "pyarrow_cpu": []}
    with asyncio.Runner() as runner:
        fill(journal, stream, files * rows, kind=kind, per_ms=per_ms)
        runner.run(archiver.flush())  # the warm-up: the table pyarrow writes
        first = list_stream_files(archiver.fs, archiver.root, stream)[0]
        table = pq.read_table(first.path)  # the file's own columns (no partition columns)
        for attempt in range(1, repeat + 1):
            if deadline.passed() and found["archiver_wall"]:
                break
            fill(journal, stream, files * rows, start=attempt * files * rows, kind=kind,
                 per_ms=per_ms)
            wall, used = time.perf_counter(), cpu()
            runner.run(archiver.flush())
            found["archiver_wall"].append(time.perf_counter() - wall)
            found["archiver_cpu"].append(cpu() - used)
            target = work / f"pyarrow-{kind}-{stream}.parquet"
            wall, used = time.perf_counter(), cpu()
            pq.write_table(table, target, compression_level=settings.compression_level,
                           row_group_size=settings.row_group_rows, **PARQUET_OPTIONS)
            found["pyarrow_wall"].append(time.perf_counter() - wall)
            found["pyarrow_cpu"].append(cpu() - used)
            target.unlink()
        runner.run(archiver.stop(flush=False))
    count = len(list_stream_files(archiver.fs, archiver.root, stream))
    assert count == files * (len(found["archiver_wall"]) + 1), "a file of `rows` records each"
    assert table.num_rows == rows, "the archive holds every row"
    found["table"] = [table]
    return found


def typed_throughput(work: Path, rows: int, repeat: int, deadline: Deadline,
                     kind: str = "json", files: int = 3) -> dict[str, Any]:
    """Rows/s archiving into typed columns, one file at a time (each flush archives one file:
    its latency) and sustained (each flush archives `files` files: the archiver reads and
    builds the next file while the one before is encoded, as under a steady load), against
    pyarrow writing the table of one file (`archive_runs`)."""
    load_at_start = load_average()
    journal = JournalStorage(work / f"journal-typed-{kind}", fsync="os")
    try:
        one = archive_runs(journal, work, "readings", rows, 1, repeat, deadline, kind)
        many = archive_runs(journal, work, "sustained", rows, files, repeat, deadline, kind)
    finally:
        journal.close()
    table = one["table"][0]
    columns = [name for name in table.column_names if name in SCHEMA["properties"]]
    typed_payloads = table.column("payload").null_count
    assert typed_payloads == rows, f"every row decoded into the typed columns ({typed_payloads})"
    per_file = [wall / files for wall in many["archiver_wall"]]
    many_cpu = [used / files for used in many["archiver_cpu"]]
    result: dict[str, Any] = {
        "rows": rows, "typed_columns": columns, "load_average_at_start": load_at_start,
        "load_average_at_end": load_average(), "compiled": compiled_build(),
        "repeats": len(one["archiver_wall"]),
    }
    for name, walls, cpus, base in (("sustained", per_file, many_cpu, many),
                                    ("one_file", one["archiver_wall"], one["archiver_cpu"], one)):
        result[f"{name}_rows_per_s"] = round(rows / statistics.median(walls))
        result[f"{name}_pyarrow_rows_per_s"] = round(rows / statistics.median(base["pyarrow_wall"]))
        result[f"{name}_ratio_wall_median"] = round(
            statistics.median(base["pyarrow_wall"]) / statistics.median(walls), 2)
        result[f"{name}_ratio_wall_best"] = round(min(base["pyarrow_wall"]) / min(walls), 2)
        result[f"{name}_ratio_cpu_median"] = round(
            statistics.median(base["pyarrow_cpu"]) / statistics.median(cpus), 2)
        result[f"{name}_median_wall_s"] = round(statistics.median(walls), 4)
        result[f"{name}_pyarrow_median_wall_s"] = round(statistics.median(base["pyarrow_wall"]), 4)
    return result


def day_of_files(work: Path, hours: int, deadline: Deadline) -> dict[str, Any]:
    """One reading a second, one flush per simulated minute (a live broker's `max_delay_s`)."""
    journal = JournalStorage(work / "journal-day", fsync="os")
    out = work / "day"
    settings = ArchiveSettings(max_delay_s=60, compact_after_s=0, compact_interval_s=3600)
    archiver = Archiver(journal, out.as_uri(), lambda: [("readings", 1, "json")], settings,
                        registered_schema=typed())

    async def run() -> dict[str, Any]:
        minutes = 0
        for minute in range(hours * 60):
            if deadline.passed():
                break
            fill(journal, "readings", 60, step_ms=1000, start=minute * 60)
            await archiver.flush()
            minutes += 1
        before = list_stream_files(archiver.fs, archiver.root, "readings")
        wall = time.perf_counter()
        replaced = await archiver.compact()
        wall = time.perf_counter() - wall
        after = list_stream_files(archiver.fs, archiver.root, "readings")
        scale = 24 * 60 / max(minutes, 1)
        return {
            "simulated_minutes": minutes, "scaled_to_24h_by": round(scale, 2),
            "files_before": len(before), "files_after": len(after),
            "files_per_day_before": round(len(before) * scale),
            "files_per_day_after": round(len(after) * scale),
            "mean_bytes_before": round(sum(f.size for f in before) / max(len(before), 1)),
            "mean_bytes_after": round(sum(f.size for f in after) / max(len(after), 1)),
            "replaced": replaced, "compaction_s": round(wall, 3),
            "rows": sum(pq.read_metadata(f.path).num_rows for f in after),
        }

    try:
        return asyncio.run(run())
    finally:
        journal.close()


SPARK_QUERY = "count(*) where temp > 30"


def spark_queries(work: Path, rows: int, repeat: int, deadline: Deadline) -> dict[str, Any]:
    try:
        import pyspark  # noqa: F401
    except ImportError:
        return {"skipped": "pyspark is not installed"}
    if shutil.which("java") is None and not os.environ.get("JAVA_HOME"):
        return {"skipped": "no JVM (java) found"}
    journal = JournalStorage(work / "journal-spark", fsync="os")
    try:
        fill(journal, "readings", rows)
        settings = ArchiveSettings(target_rows=max(rows // 8, 1), max_delay_s=3600, compaction=False)
        typed_url, json_url = (work / "spark-typed").as_uri(), (work / "spark-json").as_uri()
        asyncio.run(Archiver(journal, typed_url, lambda: [("readings", 1, "json")], settings,
                             registered_schema=typed()).flush())
        asyncio.run(Archiver(journal, json_url, lambda: [("readings", 1, "json")],
                             settings).flush())
    finally:
        journal.close()
    if deadline.passed():
        return {"skipped": "the deadline passed before Spark"}
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    from pyspark.sql import SparkSession
    from pyspark.sql import functions as F
    from pyspark.sql.types import DoubleType, StringType, StructField, StructType
    from shardgate.storage.spark import read_archive

    spark = (SparkSession.builder.master("local[2]").appName("shardgate-archive-bench")
             .config("spark.ui.enabled", "false").config("spark.ui.showConsoleProgress", "false")
             .config("spark.sql.session.timeZone", "UTC")
             .config("spark.driver.bindAddress", "127.0.0.1").getOrCreate())
    spark.sparkContext.setLogLevel("ERROR")
    fields = StructType([StructField("device", StringType()), StructField("temp", DoubleType()),
                         StructField("site", StringType())])
    try:
        def pushed() -> Any:
            return read_archive(spark, typed_url, stream="readings").where(F.col("temp") > 30)

        def parsed() -> Any:
            frame = read_archive(spark, json_url, stream="readings")
            return (frame.withColumn("reading", F.from_json("payload_json", fields))
                    .where(F.col("reading.temp") > 30))

        result: dict[str, Any] = {"query": SPARK_QUERY, "rows": rows}
        counts = {}
        for build in (pushed, parsed):  # untimed: the JVM's warm-up goes to neither
            build().count()
        for name, build in (("typed_pushdown", pushed), ("json_parse", parsed)):
            best = None
            for _ in range(repeat):
                if deadline.passed() and best is not None:
                    break
                wall = time.perf_counter()
                counts[name] = build().count()
                wall = time.perf_counter() - wall
                best = wall if best is None else min(best, wall)
            result[f"{name}_s"] = round(best or 0.0, 3)
        plan = pushed()._jdf.queryExecution().executedPlan().toString()
        result["pushed_filter_in_plan"] = "GreaterThan(temp" in plan
        result["same_count"] = counts.get("typed_pushdown") == counts.get("json_parse")
        if result.get("typed_pushdown_s"):
            result["speedup"] = round(result["json_parse_s"] / result["typed_pushdown_s"], 2)
        return result
    finally:
        spark.stop()


def markdown(results: dict[str, Any]) -> str:
    lines = ["## Archive as a typed table", ""]
    for phase, values in results.items():
        lines.append(f"### {phase}")
        lines.append("")
        lines.append("| measure | value |")
        lines.append("|---|---|")
        lines += [f"| {key} | {value} |" for key, value in values.items()]
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=200_000)
    parser.add_argument("--day-hours", type=int, default=24)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--files", type=int, default=3,
                        help="files a sustained flush archives (default 3)")
    parser.add_argument("--no-spark", action="store_true")
    parser.add_argument("--max-seconds", type=float, default=900.0)
    parser.add_argument("--dir", type=Path, default=None, help="work directory (default: a temp dir)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of markdown")
    args = parser.parse_args(argv)
    tune_malloc()  # the archiver runs under `shardgate serve`'s allocator settings
    deadline = Deadline(args.max_seconds)
    work = Path(tempfile.mkdtemp(prefix="shardgate-archive-table-", dir=args.dir))
    results: dict[str, Any] = {}
    try:
        results["typed rows per second"] = typed_throughput(
            work, args.rows, args.repeat, deadline, files=args.files)
        if not deadline.passed():
            results["typed rows per second, Avro schema"] = typed_throughput(
                work, args.rows, args.repeat, deadline, kind="avro", files=args.files)
        if not deadline.passed():
            results["files per shard per day at 1 msg/s"] = day_of_files(work, args.day_hours,
                                                                         deadline)
        if args.no_spark:
            results["spark"] = {"skipped": "--no-spark"}
        elif deadline.passed():
            results["spark"] = {"skipped": "the deadline passed"}
        else:
            results["spark"] = spark_queries(work, args.rows, args.repeat, deadline)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(json.dumps(results, indent=2) if args.json else markdown(results))
    return results


if __name__ == "__main__":
    main()
