"""Archive throughput: journal records → Parquet files, against pyarrow writing the same rows.

A journal is filled with N message records (MQTT-like: a topic per device, a 100-byte
payload, QoS 1, producer identity; every 4th with two headers). Then, in the same run:

- **archiver**: `Archiver.flush()` from an empty archive: journal reads, decoding of the
  message records, Arrow columns, zstd Parquet encoding and atomic local writes (temp file,
  fsync, rename), in files of `--file-rows` rows;
- **limit**: pyarrow alone writing the same rows, already decoded into Python column lists,
  as the same schema into files of the same size with the archiver's own Parquet options
  (`PARQUET_OPTIONS`: zstd, the same compression level, row group size, dictionary columns
  and statistics) and no journal, no decoding, no fsync: what Parquet encoding costs from
  Python values, the most any archiver can do.

Each run is timed by the wall clock and by the process's CPU time (all threads): on a shared
machine the CPU time is the steadier of the two. The ratio is reported for both.

MB/s counts journal record bytes (the message records as the journal holds them). Prints a
markdown table; `--write` also replaces the `## Archive` section of bench/RESULTS.md.

    python bench/bench_archive.py [--records 300000] [--file-rows 100000] [--repeat 3] [--write]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import re
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
from shardgate.core.records import MessageRecord, decode_message, encode_message
from shardgate.storage.allocators import tune_malloc
from shardgate.storage.archive import ARROW_SCHEMA, Archiver, ArchiveSettings
from shardgate.storage.archive.columns import PARQUET_OPTIONS
from shardgate.storage.journal import JournalStorage

RESULTS = Path(__file__).with_name("RESULTS.md")
T0 = 1_700_000_000_000 - 1_700_000_000_000 % 3_600_000


def fill_journal(journal: JournalStorage, count: int) -> int:
    log = journal.open_shard("bench", 0)
    total = 0
    batch = []
    for i in range(count):
        headers = [("unit", "C"), ("seq", str(i))] if i % 4 == 0 else None
        data = encode_message(MessageRecord(
            f"sensors/dev-{i % 500:04d}/reading", os.urandom(50) + b"x" * 50, 1, False, T0 + i,
            headers=headers, producer_protocol="mqtt", producer_id=f"dev-{i % 500:04d}",
        ))
        total += len(data)
        batch.append((T0 + i // 100, data))  # 1000 records per second: one hour partition
        if len(batch) == 10_000:
            log.append(batch)
            batch = []
            journal.flush_sync()
    log.append(batch)
    journal.flush_sync()
    return total


def decoded_columns(journal: JournalStorage, count: int) -> list[pa.Array]:
    """The rows as Python lists per column (decoded outside the measured window)."""
    log = journal.open_shard("bench", 0)
    cols: dict[str, list] = {field.name: [] for field in ARROW_SCHEMA}
    offset = 0
    while offset < count:
        for record in log.read(offset, 10_000):
            m = decode_message(record.data)
            for name, value in (
                ("shard", 0), ("offset", record.offset),
                ("publish_time", record.timestamp_ms), ("topic", m.topic), ("key", m.key),
                ("payload", m.payload), ("headers", m.headers), ("content_type", m.content_type),
                ("producer_protocol", m.producer_protocol), ("producer_id", m.producer_id),
                ("qos", m.qos), ("retain", m.retain), ("correlation_data", m.correlation_data),
                ("reply_to", m.reply_to), ("payload_format", m.payload_format),
                ("expires_at", m.expires_at_ms), ("payload_string", None),
                ("payload_int64", None), ("payload_json", None), ("native_properties", None),
            ):
                cols[name].append(value)
            offset = record.offset + 1
    return cols  # type: ignore[return-value]


def pyarrow_limit(cols: dict[str, list], out: Path, file_rows: int) -> float:
    """Seconds for pyarrow to turn the column lists into zstd Parquet files of file_rows."""
    count = len(cols["offset"])
    start = time.perf_counter()
    for index, first in enumerate(range(0, count, file_rows)):
        arrays = []
        for field in ARROW_SCHEMA:
            values = cols[field.name][first:first + file_rows]
            if pa.types.is_timestamp(field.type):
                arrays.append(pa.array(values, pa.int64()).cast(field.type))
            else:
                arrays.append(pa.array(values, field.type))
        table = pa.Table.from_arrays(arrays, schema=ARROW_SCHEMA)
        pq.write_table(table, out / f"part-{index}.parquet", compression_level=3,
                       row_group_size=64 * 1024, **PARQUET_OPTIONS)
    return time.perf_counter() - start


def archiver_run(journal: JournalStorage, out: Path, file_rows: int) -> float:
    settings = ArchiveSettings(target_rows=file_rows, target_bytes=1 << 40, max_delay_s=3600)

    async def run() -> float:
        archiver = Archiver(journal, f"file://{out}", lambda: [("bench", 1, "bytes")], settings)
        start = time.perf_counter()
        await archiver.flush()
        return time.perf_counter() - start

    return asyncio.run(run())


def git_commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, check=True, cwd=RESULTS.parent).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--records", type=int, default=300_000)
    parser.add_argument("--file-rows", type=int, default=100_000)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--dir", type=Path, default=None)
    parser.add_argument("--write", action="store_true", help="update bench/RESULTS.md")
    args = parser.parse_args()
    tune_malloc()  # the archiver runs under `shardgate serve`'s allocator settings
    base = Path(tempfile.mkdtemp(prefix="bench-archive-", dir=args.dir))
    try:
        journal = JournalStorage(base / "journal", fsync="os")
        record_bytes = fill_journal(journal, args.records)
        cols = decoded_columns(journal, args.records)
        runs: dict[str, list[float]] = {"archiver": [], "limit": []}
        cpu: dict[str, list[float]] = {"archiver": [], "limit": []}
        sizes: dict[str, int] = {}
        for attempt in range(args.repeat):
            for name in ("limit", "archiver"):
                out = base / f"{name}-{attempt}"
                out.mkdir()
                cpu_start = time.process_time()
                if name == "limit":
                    seconds = pyarrow_limit(cols, out, args.file_rows)
                else:
                    seconds = archiver_run(journal, out, args.file_rows)
                cpu[name].append(time.process_time() - cpu_start)
                runs[name].append(seconds)
                sizes[name] = sum(p.stat().st_size for p in out.rglob("*.parquet"))
                shutil.rmtree(out)
        journal.close()
    finally:
        shutil.rmtree(base, ignore_errors=True)

    mb = record_bytes / 1e6
    lines = [
        "| writer | rows/s | MB/s (journal bytes) | s per run | rows per CPU s | CPU s per run "
        "| Parquet bytes/row |",
        "|---|---:|---:|---|---:|---|---:|",
    ]
    medians = {}
    cpu_medians = {}
    for name, label in (("archiver", "Archiver.flush (journal → Parquet files)"),
                        ("limit", "pyarrow alone, same rows as Python lists")):
        median = medians[name] = statistics.median(runs[name])
        cpu_median = cpu_medians[name] = statistics.median(cpu[name])
        lines.append(
            f"| {label} | {args.records / median:,.0f} | {mb / median:,.1f} | "
            f"{' / '.join(f'{s:.2f}' for s in runs[name])} | {args.records / cpu_median:,.0f} | "
            f"{' / '.join(f'{s:.2f}' for s in cpu[name])} | {sizes[name] / args.records:.1f} |"
        )
    ratio = medians["limit"] / medians["archiver"]
    cpu_ratio = cpu_medians["limit"] / cpu_medians["archiver"]
    lines.append("")
    lines.append(
        f"Archiver / limit: **{ratio:.2f}×** by wall clock, **{cpu_ratio:.2f}×** by CPU time "
        f"(medians of {args.repeat} runs each)."
    )
    table = "\n".join(lines)
    print(table)
    if args.write:
        load = ", ".join(f"{v:.2f}" for v in os.getloadavg())
        section = (
            "## Archive\n\n"
            f"Recorded by `python bench/bench_archive.py --records {args.records} "
            f"--file-rows {args.file_rows} --repeat {args.repeat} --write`.\n\n"
            f"- Machine: {os.cpu_count()} CPUs; {platform.system()} {platform.release()}; "
            f"Python {platform.python_version()}; pyarrow {pa.__version__}; shardgate @ "
            f"{git_commit()}; {time.strftime('%Y-%m-%d')}; load average at start {load}.\n"
            f"- {args.records:,} message records of {record_bytes / args.records:.0f} bytes "
            "(MQTT-like: 100-byte payload, topic per device, every 4th with two headers), one "
            f"shard, one hour partition; files of {args.file_rows:,} rows, zstd level 3; both "
            "writers with the archive's Parquet options (`PARQUET_OPTIONS`: dictionary pages "
            "for the name columns only, statistics on).\n"
            "- The limit builds the same Arrow columns from lists already decoded and writes "
            "without fsync; the archiver also reads the journal, decodes each record and "
            "fsyncs and renames each file.\n\n"
            f"{table}\n"
        )
        write_section(section)


def write_section(section: str) -> None:
    """Replace (or append) the `## Archive` section of RESULTS.md, re-reading it first so
    that other sections written meanwhile are kept."""
    text = RESULTS.read_text() if RESULTS.exists() else "# Benchmark results\n"
    pattern = re.compile(r"^## Archive\n.*?(?=^## |\Z)", re.S | re.M)
    if pattern.search(text):
        text = pattern.sub(lambda _m: section + "\n", text, count=1)
    else:
        text = text.rstrip("\n") + "\n\n" + section
    RESULTS.write_text(text.rstrip("\n") + "\n")


if __name__ == "__main__":
    main()
