"""`bench/bench_archive_table.py` runs with one command and stays within its time bound: a tiny
run (no Spark) measures every phase and counts every row."""

from __future__ import annotations

import os
import time

from bench.bench_archive_table import main


def test_a_tiny_run_measures_each_phase_within_its_bound() -> None:
    started = time.monotonic()
    results = main(["--rows", "2000", "--day-hours", "1", "--repeat", "1", "--no-spark",
                    "--max-seconds", "120", "--json"])
    assert time.monotonic() - started < 240
    typed = results["typed rows per second"]
    assert typed["rows"] == 2000 and typed["typed_columns"] == ["device", "temp", "site"]
    assert typed["sustained_rows_per_s"] > 0 and typed["one_file_rows_per_s"] > 0
    assert typed["sustained_pyarrow_rows_per_s"] > 0 and typed["one_file_pyarrow_rows_per_s"] > 0
    assert typed["compiled"] == "all" or os.environ.get("SHARDGATE_PURE") == "1"
    avro = results["typed rows per second, Avro schema"]
    assert avro["rows"] == 2000 and avro["typed_columns"] == ["device", "temp", "site"]
    day = results["files per shard per day at 1 msg/s"]
    assert day["simulated_minutes"] == 60 and day["files_before"] == 60
    assert day["files_after"] == 1 and day["rows"] == 3600
    assert results["spark"] == {"skipped": "--no-spark"}
