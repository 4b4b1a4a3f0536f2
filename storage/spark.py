"""Spark helpers for the Parquet archive: open it as a DataFrame with partition pruning.

The archive is plain Hive-partitioned Parquet (`stream=<name>/date=YYYY-MM-DD/hour=H/`, each
shard's files in a `shardNNNN/` directory below, which is no partition), so
`spark.read.parquet(url)` works on its own, with no option and no warning; `read_archive` adds what is easy to get wrong:
an explicit schema (so that partition values are never type-inferred and a stream named
`007` stays the string "007"), reading only the stream's directory, and filters on the
`stream`, `date` and `hour` partition columns that Spark turns into PartitionFilters before
the exact filter on `publish_time`. `read_archive_files` reads exactly the files
`storage.archive.archive_files` names (every row once while an object-store compaction runs).

For `s3://` archives Spark needs the hadoop-aws connector (not shipped with pyspark):

    spark = (SparkSession.builder
             .config("spark.jars.packages", "org.apache.hadoop:hadoop-aws:3.5.0")
             .config("spark.hadoop.fs.s3a.endpoint", "https://s3.eu-west-1.amazonaws.com")
             .getOrCreate())

and reads `s3a://bucket/prefix` (`read_archive` rewrites `s3://` to `s3a://`). The hadoop-aws
version must match the Hadoop jars of the pyspark installation (`pyspark/jars/hadoop-client-*`).

pyspark is imported lazily: this module imports without it. It never writes the archive.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pyspark.sql import Column, DataFrame, SparkSession
    from pyspark.sql.types import StructType

PARTITION_COLUMNS = ("stream", "date", "hour")
TimeBound = datetime | int | float | str | None
"""A time bound: an aware datetime (naive means UTC), milliseconds since the epoch, or an
ISO 8601 string."""


def archive_schema() -> StructType:
    """The Spark schema of the archive: `stream` (the partition directory, a string), the
    Parquet columns, then the `date` (DateType) and `hour` (IntegerType) partition columns.
    (Files of format 2 and older also held a `stream` column, of the same value.)"""
    from pyspark.sql import types as T

    def field(name: str, data_type: Any) -> Any:
        return T.StructField(name, data_type, True)

    return T.StructType([
        field("stream", T.StringType()),
        field("shard", T.IntegerType()),
        field("offset", T.LongType()),
        field("publish_time", T.TimestampType()),
        field("topic", T.StringType()),
        field("key", T.BinaryType()),
        field("payload", T.BinaryType()),
        field("headers", T.MapType(T.StringType(), T.StringType(), True)),
        field("content_type", T.StringType()),
        field("producer_protocol", T.StringType()),
        field("producer_id", T.StringType()),
        field("qos", T.ByteType()),
        field("retain", T.BooleanType()),
        field("correlation_data", T.BinaryType()),
        field("reply_to", T.StringType()),
        field("payload_format", T.ByteType()),
        field("expires_at", T.TimestampType()),
        field("payload_string", T.StringType()),
        field("payload_int64", T.LongType()),
        field("payload_json", T.StringType()),
        field("native_properties", T.MapType(T.StringType(), T.BinaryType(), True)),
        field("date", T.DateType()),
        field("hour", T.IntegerType()),
    ])


def typed_fields(spark: SparkSession, url: str, stream: str) -> list[Any]:
    """The typed columns of `stream` (its registered schema's fields, `storage.archive.typed`)
    over every schema version, as Spark's `mergeSchema` finds them in the files' footers;
    empty for a stream without files or without a schema."""
    from pyspark.errors import AnalysisException

    try:
        inferred = (spark.read.option("mergeSchema", "true")
                    .parquet(f"{spark_path(url)}/stream={stream}").schema)
    except AnalysisException:
        return []
    known = set(archive_schema().fieldNames())
    return [field for field in inferred.fields if field.name not in known]


def stream_schema(spark: SparkSession, url: str, stream: str | None) -> StructType:
    """`archive_schema()`, with the typed columns of `stream` before the partition columns."""
    from pyspark.sql import types as T

    schema = archive_schema()
    if stream is None:
        return schema
    extra = typed_fields(spark, url, stream)
    if not extra:
        return schema
    fields = schema.fields
    return T.StructType([*fields[:-2], *extra, *fields[-2:]])


def spark_path(url: str) -> str:
    """The archive URL as Hadoop names it: `s3://` becomes `s3a://`, a bare path `file://`."""
    url = url.rstrip("/")
    if url.startswith("s3://"):
        return "s3a://" + url[len("s3://"):]
    if "://" not in url:
        return "file://" + url
    return url


def to_datetime(bound: TimeBound) -> datetime | None:
    """A time bound as an aware UTC datetime."""
    if bound is None:
        return None
    if isinstance(bound, datetime):
        return bound.replace(tzinfo=UTC) if bound.tzinfo is None else bound.astimezone(UTC)
    if isinstance(bound, int | float):
        return datetime.fromtimestamp(bound / 1000, UTC)
    return to_datetime(datetime.fromisoformat(bound))


def partition_filter(start: TimeBound = None, end: TimeBound = None) -> Column | None:
    """A condition on the `date` and `hour` partition columns that keeps every partition
    that can hold a record published in [start, end)."""
    from pyspark.sql import functions as F

    condition = None
    lower, upper = to_datetime(start), to_datetime(end)
    if lower is not None:
        day = F.lit(lower.date())
        condition = (F.col("date") > day) | (
            (F.col("date") == day) & (F.col("hour") >= F.lit(lower.hour)))
    if upper is not None:
        day = F.lit(upper.date())
        below = (F.col("date") < day) | ((F.col("date") == day) & (F.col("hour") <= F.lit(upper.hour)))
        condition = below if condition is None else condition & below
    return condition


def read_archive(
    spark: SparkSession,
    url: str,
    stream: str | None = None,
    start: TimeBound = None,
    end: TimeBound = None,
) -> DataFrame:
    """The archive at `url` as a DataFrame (schema: `archive_schema()`, and for one stream
    with a registered schema its typed columns, over every version: `stream_schema`),
    optionally one stream and the records published in [start, end). Pruned by partition: only the
    matching `stream=/date=/hour=` directories are read. An archive (or stream) with no
    files yet gives an empty DataFrame."""
    from pyspark.errors import AnalysisException
    from pyspark.sql import functions as F

    base = spark_path(url)
    schema = stream_schema(spark, url, stream)
    reader = spark.read.schema(schema).option("basePath", base)
    path = base if stream is None else f"{base}/stream={stream}"
    try:
        frame = reader.parquet(path)
    except AnalysisException as exc:
        if "PATH_NOT_FOUND" not in str(exc) and "does not exist" not in str(exc):
            raise
        return spark.createDataFrame([], schema)
    if stream is not None:
        frame = frame.where(F.col("stream") == F.lit(stream))
    pruning = partition_filter(start, end)
    if pruning is not None:
        frame = frame.where(pruning)
    lower, upper = to_datetime(start), to_datetime(end)
    if lower is not None:
        frame = frame.where(F.col("publish_time") >= F.lit(lower))
    if upper is not None:
        frame = frame.where(F.col("publish_time") < F.lit(upper))
    return frame


def read_archive_files(
    spark: SparkSession,
    url: str,
    stream: str | None = None,
    settings: Any = None,
    files: list[str] | None = None,
) -> DataFrame:
    """Exactly the files `storage.archive.archive_files` names (or `files`, such a list), as
    a DataFrame of `read_archive`'s columns: every row once at any moment, also while a
    compaction runs on an object store, where `read_archive` (which lists the root) may count
    short for a moment (`storage.archive.compaction`). `settings`: the archive's
    `ArchiveSettings` (an object store's credentials and endpoint).

    `spark.read.parquet(*files)` cannot read that list as it is: a merged file not yet in
    place lies in the staging area beside the root (`<parent>/.<root name>.compacting/`,
    under the same `stream=/date=/hour=` directories), and Spark refuses paths outside the
    one `basePath` that partition discovery needs. So the files under the root and those
    staged are read each with their own `basePath`, with the same explicit schema (typed
    columns included, from these files' footers), and unioned by name. A file can vanish
    between the listing and the read (compacted meanwhile): call again."""
    from pyspark.sql import functions as F

    from .archive.layout import archive_files, is_local, open_filesystem, staging_root

    fs, root = open_filesystem(url, settings)
    if files is None:
        files = archive_files(url, stream, settings)

    def spark_url(path: str) -> str:
        return spark_path(path if is_local(fs) else fs.unstrip_protocol(path))

    bases = [spark_url(root)]
    staging = staging_root(root)
    if staging is not None:
        bases.append(spark_url(staging))
    groups: dict[str, list[str]] = {}
    for path in files:
        located = spark_path(path)
        base = next((b for b in bases[1:] if located.startswith(b + "/")), bases[0])
        groups.setdefault(base, []).append(located)
    schema = archive_schema()
    if stream is not None:
        known = set(schema.fieldNames())
        typed: dict[str, Any] = {}
        for base, paths in groups.items():
            merged = spark.read.option("mergeSchema", "true").option("basePath", base)
            for field in merged.parquet(*paths).schema.fields:
                if field.name not in known:
                    typed.setdefault(field.name, field)
        if typed:
            from pyspark.sql import types as T

            fields = schema.fields
            schema = T.StructType([*fields[:-2], *typed.values(), *fields[-2:]])
    frames = [spark.read.schema(schema).option("basePath", base).parquet(*paths)
              for base, paths in groups.items()]
    if not frames:
        return spark.createDataFrame([], schema)
    frame = frames[0]
    for other in frames[1:]:
        frame = frame.unionByName(other)
    return frame if stream is None else frame.where(F.col("stream") == F.lit(stream))


def read_archive_stream(spark: SparkSession, url: str, stream: str | None = None,
                        max_files_per_trigger: int | None = None,
                        schema: StructType | None = None) -> DataFrame:
    """The archive as a Structured Streaming source: each new Parquet file is picked up
    once (files are renamed or uploaded whole, so a file is never read half-written).
    Files that compaction merged (`*.c.parquet`) are skipped: their rows arrived in the files
    they replace, which compaction only merges `compact_after_s` (an hour) after their hour
    ended, so a query must run at least that often.

    The file source discovers partitions from the archive root (it ignores `basePath`), so
    a stream is selected with a filter on the `stream` partition column. `schema` defaults
    to `stream_schema`: the stream's typed columns as its files have them when the query
    starts (pass one to take in columns of a later schema version)."""
    from pyspark.sql import functions as F

    from .archive.layout import WRITTEN_GLOB

    if schema is None:  # a stream's typed columns as its files have them when the query starts
        schema = stream_schema(spark, url, stream)
    reader = spark.readStream.schema(schema).option("pathGlobFilter", WRITTEN_GLOB)
    if max_files_per_trigger is not None:
        reader = reader.option("maxFilesPerTrigger", max_files_per_trigger)
    frame = reader.parquet(spark_path(url))
    return frame if stream is None else frame.where(F.col("stream") == F.lit(stream))
