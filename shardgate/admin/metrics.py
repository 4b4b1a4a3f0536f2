"""Prometheus metrics for one Shardgate node, read from the broker's own counters at scrape time.

A custom `Collector` walks the broker, the protocol services and the journal only when
`/metrics` is scraped: nothing here runs on the message hot path, and nothing is registered in
prometheus-client's global registry (each node gets its own `CollectorRegistry`, so several
brokers in one process never clash). Every name starts with `shardgate_`, but the standard
`process_*` ones (resident memory, CPU seconds, descriptors). Names follow Prometheus'
conventions (checked by `promtool check metrics` in the tests): counters end in `_total`,
durations are in seconds and sizes in bytes, gauges are levels. The number of series is
bounded by what an operator configures (protocols, streams, shards, subscriptions, bridges),
never by the number of clients: MQTT sessions (one subscription per client id) are summed up
in `shardgate_session_*`, not listed one by one.

What it reads off the composition root (connections per protocol, a subscription's queue, the
archiver's totals) it shares with the admin HTTP API (`node_readings.py`). It must not change
broker state.
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Iterable, Iterator
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.process_collector import ProcessCollector
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from .. import __version__

# read off the composition root, once in this module (old import paths keep working)
from .node_readings import archive_status as archive_status
from .node_readings import connection_counts as connection_counts
from .node_readings import grpc_server as grpc_server
from .node_readings import subscription_queue as subscription_queue

PREFIX = "shardgate"
# The reasons a bridge drops a message, each direction: every one has a series from the start.
BRIDGE_DROPS_OUT = ("queue_full", "expired", "outside_prefix")
BRIDGE_DROPS_IN = ("outside_prefix", "refused_locally")
# Subscriptions named after an MQTT client id (its session's): not one series each.
SESSION_PREFIX = "mqtt:"
# Archiver status fields that only grow: counters.
ARCHIVE_COUNTERS = frozenset({"failures", "skipped"})
CONTENT_TYPE = CONTENT_TYPE_LATEST
# The protocol label of messages the broker makes itself (producer protocol "").
INTERNAL = "internal"

_JOURNAL_COUNTERS = (
    ("passes", "Group-commit passes run by the journal committer"),
    ("groups", "Commit groups written by the journal"),
    ("records", "Records written to the journal"),
    ("bytes", "Bytes written to the journal"),
    ("fsyncs", "fsync calls made by the journal"),
    ("failures", "Journal commit passes that failed with an I/O error"),
)


# ---------------------------------------------------------------------------- the collector
def _metric_name(text: str) -> str:
    return re.sub(r"[^a-zA-Z0-9_]", "_", text).strip("_").lower()


class ShardgateCollector(Collector):
    """Yields the node's metrics from live broker state whenever the registry is scraped."""

    def __init__(self, app: Any) -> None:
        self.app = app

    def describe(self) -> Iterable[Metric]:
        return []  # no collect() at registration: the broker may not have started yet

    def collect(self) -> Iterator[Metric]:
        """Every family; in a cluster each sample also carries `node` (this node's id), so
        the series of several nodes scraped into one Prometheus stay apart and sum right."""
        cluster = getattr(self.app, "cluster", None)
        node_id = getattr(cluster, "node_id", None)
        for metric in self._collect():
            if node_id:
                metric.samples = [
                    sample if "node" in sample.labels
                    else sample._replace(labels={"node": node_id, **sample.labels})
                    for sample in metric.samples
                ]
            yield metric

    def _collect(self) -> Iterator[Metric]:
        app = self.app
        info = GaugeMetricFamily(f"{PREFIX}_info", "Shardgate version", labels=["version"])
        info.add_metric([__version__], 1)
        yield info
        edge = getattr(app, "edge", None)
        if edge is None:
            return
        stats = edge.stats
        yield GaugeMetricFamily(f"{PREFIX}_start_time_seconds", "When the broker started (Unix time)",
                                value=stats.started_at)
        yield GaugeMetricFamily(f"{PREFIX}_uptime_seconds", "Seconds since the broker started",
                                value=max(0.0, time.time() - stats.started_at))

        connections = GaugeMetricFamily(f"{PREFIX}_connections", "Open client connections",
                                        labels=["protocol"])
        for protocol, count in sorted(connection_counts(app).items()):
            connections.add_metric([protocol], count)
        yield connections

        for name, value, text in (
            ("messages_received", stats.messages_in, "Messages accepted from publishers"),
            ("messages_sent", stats.messages_out, "Messages delivered to subscribers"),
            ("bytes_received", stats.bytes_in, "Payload bytes accepted from publishers"),
            ("bytes_sent", stats.bytes_out, "Payload bytes delivered to subscribers"),
            ("messages_dropped", stats.messages_dropped,
             "Messages dropped (full queues, slow consumers, expiry)"),
            ("messages_without_subscriber", stats.messages_without_subscriber,
             "Messages that matched no subscription"),
        ):
            yield CounterMetricFamily(f"{PREFIX}_{name}", text, value=value)

        yield from self._traffic(stats, connection_counts(app), edge.streams)
        yield from self._drops(stats)
        yield from self._schema_rejections(edge)
        yield self._histogram(
            "publish_durable_latency_seconds",
            "Seconds from the first append of a commit group on a reliable stream to the group "
            "being durable, when its acknowledgements may go out (one observation per group)",
            stats.commit_latency,
        )
        yield from self._streams(edge)
        yield from self._subscriptions(edge)
        yield from self._sessions(app)
        yield GaugeMetricFamily(f"{PREFIX}_retained_messages", "Retained messages held",
                                value=edge.retained_count)
        yield from self._journal(app)
        yield from self._host(app)
        yield from self._archive(app)
        yield from self._security(app)
        yield from self._bridges(app)
        plane = getattr(app, "data_plane", None)
        if plane is not None:
            from ..cluster.metrics import data_plane_metrics

            yield from data_plane_metrics(plane)
        cluster = getattr(app, "cluster", None)
        if cluster is not None:
            from ..cluster.metrics import control_plane_metrics

            yield from control_plane_metrics(cluster)

    @staticmethod
    def _traffic(stats: Any, protocols: dict[str, int], streams: dict[str, Any]) -> Iterator[Metric]:
        """Messages and payload bytes in and out, by protocol and by stream. Every running
        protocol and every stream gets a series, at zero until traffic moves it."""
        for label, families in (
            ("protocol", (
                ("messages_received", stats.in_by_protocol, "Messages accepted from publishers"),
                ("bytes_received", stats.bytes_in_by_protocol, "Payload bytes accepted from publishers"),
                ("messages_sent", stats.out_by_protocol, "Messages delivered to subscribers"),
                ("bytes_sent", stats.bytes_out_by_protocol, "Payload bytes delivered to subscribers"),
            )),
            ("stream", (
                ("messages_received", stats.in_by_stream, "Messages accepted from publishers"),
                ("bytes_received", stats.bytes_in_by_stream, "Payload bytes accepted from publishers"),
                ("messages_sent", stats.out_by_stream, "Messages delivered to subscribers"),
                ("bytes_sent", stats.bytes_out_by_stream, "Payload bytes delivered to subscribers"),
            )),
        ):
            known = protocols if label == "protocol" else streams
            for name, counts, text in families:
                values = dict.fromkeys(known, 0)
                for key, count in dict(counts).items():
                    key = key or INTERNAL
                    values[key] = values.get(key, 0) + count
                family = CounterMetricFamily(f"{PREFIX}_{label}_{name}", f"{text}, by {label}",
                                             labels=[label])
                for key, count in sorted(values.items()):
                    family.add_metric([key], count)
                yield family

    @staticmethod
    def _drops(stats: Any) -> Iterator[Metric]:
        """Dropped messages by reason; drops counted without one (`messages_dropped += n`)
        show as reason "other", so the reasons add up to `shardgate_messages_dropped_total`."""
        counted = dict(stats.dropped_by_reason)
        other = stats.messages_dropped - sum(counted.values())
        reasons = dict.fromkeys(("no_consumer", "other"), 0) | counted
        reasons["other"] += max(0, other)
        family = CounterMetricFamily(f"{PREFIX}_messages_dropped_by_reason", "Messages dropped, by reason",
                                     labels=["reason"])
        for reason, count in sorted(reasons.items()):
            family.add_metric([reason], count)
        yield family
        rejected = CounterMetricFamily(
            f"{PREFIX}_messages_rejected", "Publishes refused before they were stored, by reason "
            "(schema: the payload does not fit its stream's schema)", labels=["reason"])
        for reason, count in sorted((dict.fromkeys(("schema",), 0)
                                     | dict(getattr(stats, "rejected_by_reason", {}))).items()):
            rejected.add_metric([reason], count)
        yield rejected

    @staticmethod
    def _schema_rejections(edge: Any) -> Iterator[Metric]:
        """Payloads refused by a stream's registered schema, per stream with a schema."""
        registry = edge.schemas
        family = CounterMetricFamily(
            f"{PREFIX}_schema_rejected", "Payloads refused by the stream's registered schema",
            labels=["stream"])
        for stream in sorted(set(registry.streams()) | set(registry.rejected)):
            family.add_metric([stream], registry.rejected.get(stream, 0))
        yield family

    @staticmethod
    def _histogram(name: str, text: str, histogram: Any) -> Metric:
        buckets, total = histogram.snapshot()
        return HistogramMetricFamily(
            f"{PREFIX}_{name}", text,
            buckets=[(floatToGoString(bound), count) for bound, count in buckets], sum_value=total,
        )

    @staticmethod
    def _security(app: Any) -> Iterator[Metric]:
        security = getattr(app, "security", None)
        denials = getattr(security, "denials", None)
        if denials is None:
            return
        family = CounterMetricFamily(
            f"{PREFIX}_security_denials",
            "Refused authentications and actions (connect, publish, subscribe, admin), by protocol",
            labels=["protocol", "action"],
        )
        for (protocol, action), count in sorted(dict(denials).items()):
            family.add_metric([protocol, action], count)
        yield family

    @staticmethod
    def _bridges(app: Any) -> Iterator[Metric]:
        bridges = list(getattr(app, "bridges", None) or ())
        if not bridges:
            return
        connected = GaugeMetricFamily(f"{PREFIX}_bridge_connected",
                                      "1 while a bridge is connected to its remote broker", labels=["bridge"])
        queued = GaugeMetricFamily(f"{PREFIX}_bridge_queued",
                                   "Messages a bridge holds for its remote broker", labels=["bridge"])
        forwarded = CounterMetricFamily(
            f"{PREFIX}_bridge_forwarded", "Messages a bridge forwarded, out to its remote or in from it",
            labels=["bridge", "direction"],
        )
        dropped = CounterMetricFamily(
            f"{PREFIX}_bridge_dropped",
            "Messages a bridge dropped, by direction and reason: out queue_full (non-reliable "
            "streams beyond max_queued), expired, outside_prefix; in outside_prefix, "
            "refused_locally", labels=["bridge", "direction", "reason"])
        connects = CounterMetricFamily(f"{PREFIX}_bridge_connects",
                                       "Connections a bridge made to its remote", labels=["bridge"])
        for bridge in bridges:
            status = bridge.status()
            name = [str(status.get("name", ""))]
            connected.add_metric(name, 1 if status.get("connected") else 0)
            queued.add_metric(name, status.get("queued", 0))
            forwarded.add_metric([*name, "out"], status.get("forwarded_out", 0))
            forwarded.add_metric([*name, "in"], status.get("forwarded_in", 0))
            for direction, key, reasons in (("out", "drops", BRIDGE_DROPS_OUT),
                                            ("in", "drops_in", BRIDGE_DROPS_IN)):
                counts = status.get(key, {})
                for reason in sorted({*reasons, *counts}):
                    dropped.add_metric([*name, direction, reason], counts.get(reason, 0))
            connects.add_metric(name, status.get("connects", 0))
        yield from (connected, queued, forwarded, dropped, connects)

    @staticmethod
    def _streams(edge: Any) -> Iterator[Metric]:
        streams = edge.streams
        yield GaugeMetricFamily(f"{PREFIX}_streams", "Streams defined", value=len(streams))
        offsets = GaugeMetricFamily(
            f"{PREFIX}_stream_offset", "Next offset of each shard (messages appended since creation)",
            labels=["stream", "shard"],
        )
        low = GaugeMetricFamily(
            f"{PREFIX}_stream_low_watermark", "Oldest offset still held by a reliable shard's journal",
            labels=["stream", "shard"],
        )
        for name, stream in sorted(streams.items()):
            for shard in stream.shards:
                labels = [name, str(shard.index)]
                offsets.add_metric(labels, shard.next_offset)
                if shard.log is not None:
                    low.add_metric(labels, shard.log.low_watermark)
        yield offsets
        yield low

    @staticmethod
    def _subscriptions(edge: Any) -> Iterator[Metric]:
        subs = list(edge.subscriptions.values())
        yield GaugeMetricFamily(f"{PREFIX}_subscriptions", "Subscriptions defined", value=len(subs))
        lag = GaugeMetricFamily(
            f"{PREFIX}_subscription_lag", "Messages a durable subscription has yet to consume",
            labels=["subscription"],
        )
        inflight = GaugeMetricFamily(
            f"{PREFIX}_subscription_inflight", "Messages delivered and not yet acknowledged",
            labels=["subscription"],
        )
        consumers = GaugeMetricFamily(
            f"{PREFIX}_subscription_consumers", "Consumers attached to a subscription",
            labels=["subscription"],
        )
        queued = GaugeMetricFamily(
            f"{PREFIX}_subscription_queued", "Messages queued for a subscription's consumers "
            "(an MQTT session's queue, an AMQP queue's ready messages)", labels=["subscription"],
        )
        for sub in subs:
            if sub.name.startswith(SESSION_PREFIX):
                continue  # one per MQTT client: summed up in shardgate_session_* instead
            consumers.add_metric([sub.name], len(sub.consumers))
            queue = subscription_queue(sub)
            if queue is not None:
                queued.add_metric([sub.name], len(queue))
            if callable(getattr(sub, "lag", None)):
                lag.add_metric([sub.name], sub.lag())
                inflight.add_metric([sub.name], sub.inflight_count())
        yield lag
        yield inflight
        yield consumers
        yield queued

    @staticmethod
    def _sessions(app: Any) -> Iterator[Metric]:
        mqtt = getattr(app, "mqtt", None)
        if mqtt is None:
            return
        sessions = list(mqtt.sessions.values())
        connected = sum(1 for session in sessions if session.connection is not None)
        gauge = GaugeMetricFamily(f"{PREFIX}_sessions", "MQTT sessions held", labels=["state"])
        gauge.add_metric(["connected"], connected)
        gauge.add_metric(["disconnected"], len(sessions) - connected)
        yield gauge
        yield GaugeMetricFamily(
            f"{PREFIX}_session_queued_messages", "Messages queued in MQTT sessions, waiting to be sent",
            value=sum(len(session.queue) for session in sessions),
        )
        yield GaugeMetricFamily(
            f"{PREFIX}_session_inflight_messages", "QoS 1/2 messages in flight to MQTT clients",
            value=sum(len(session.inflight) for session in sessions),
        )
        lags = [sub.lag() for name, sub in list(app.edge.subscriptions.items())
                if name.startswith(SESSION_PREFIX) and callable(getattr(sub, "lag", None))]
        yield GaugeMetricFamily(
            f"{PREFIX}_session_lag_messages", "Messages stored for MQTT persistent sessions and "
            "not yet acknowledged by their clients (online or not), all sessions together",
            value=sum(lags))
        yield GaugeMetricFamily(
            f"{PREFIX}_session_lag_max_messages", "The largest lag of one MQTT persistent session",
            value=max(lags, default=0))
        yield CounterMetricFamily(
            f"{PREFIX}_mqtt_connections_accepted", "MQTT connections accepted since start",
            value=getattr(mqtt, "total_connections", 0),
        )

    @staticmethod
    def _journal(app: Any) -> Iterator[Metric]:
        journal = getattr(app, "journal", None)
        stats = getattr(journal, "stats", None)
        if stats is None:
            return
        for field_name, text in _JOURNAL_COUNTERS:
            value = getattr(stats, field_name, None)
            if value is not None:
                yield CounterMetricFamily(f"{PREFIX}_journal_{field_name}", text, value=value)
        latency = getattr(stats, "fsync_latency", None)
        if latency is not None:
            yield ShardgateCollector._histogram(
                "journal_fsync_latency_seconds", "Seconds each journal fsync took", latency)

    @staticmethod
    def _host(app: Any) -> Iterator[Metric]:
        """The data directory's file system and the memory this process may use: what the
        disk-filling and memory-high alerts compare against."""
        config = getattr(app, "config", None)
        if config is not None:
            try:
                fs = os.statvfs(config.data_dir)
            except OSError:
                pass
            else:
                yield GaugeMetricFamily(
                    f"{PREFIX}_data_dir_free_bytes",
                    "Bytes free for the broker on the file system of its data directory",
                    value=fs.f_bavail * fs.f_frsize)
                yield GaugeMetricFamily(
                    f"{PREFIX}_data_dir_size_bytes",
                    "Size of the file system of the data directory", value=fs.f_blocks * fs.f_frsize)
        limit = memory_limit_bytes()
        if limit:
            yield GaugeMetricFamily(
                f"{PREFIX}_memory_limit_bytes", "Memory this process may use: its cgroup's limit, "
                "else the machine's physical memory", value=limit)

    @staticmethod
    def _archive(app: Any) -> Iterator[Metric]:
        status = archive_status(app)
        if status is None:
            return
        for key, value in status.items():
            if isinstance(value, bool) or not isinstance(value, int | float):
                continue
            name = _metric_name(str(key))
            if not name:
                continue
            if name.endswith("_ms"):  # base units: seconds
                yield GaugeMetricFamily(f"{PREFIX}_archive_{name[:-3]}_seconds",
                                        f"Archiver status field {key}, in seconds", value=value / 1000)
            elif name in ARCHIVE_COUNTERS:
                yield CounterMetricFamily(f"{PREFIX}_archive_{name}",
                                          f"Archiver status field {key} (since start)", value=value)
            else:
                yield GaugeMetricFamily(f"{PREFIX}_archive_{name}", f"Archiver status field {key}",
                                        value=value)


def memory_limit_bytes() -> int:
    """The cgroup (v2, then v1) memory limit of this process, else the physical memory."""
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            with open(path) as file:
                text = file.read().strip()
        except OSError:
            continue
        if text.isdigit() and int(text) < 1 << 60:
            return int(text)
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        return 0


def create_registry(app: Any, *, process: bool = True) -> CollectorRegistry:
    """A registry of its own for `app`: the broker collector, plus process memory/CPU/fds."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(ShardgateCollector(app))
    if process:  # the standard names: process_resident_memory_bytes, process_open_fds, ...
        ProcessCollector(registry=registry)
    return registry


def render(registry: CollectorRegistry) -> bytes:
    """The Prometheus text exposition of `registry` (serve it with `CONTENT_TYPE`)."""
    return generate_latest(registry)
