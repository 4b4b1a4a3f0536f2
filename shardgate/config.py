"""Configuration: defaults, then a TOML file, then SHARDGATE_* environment variables, then flags.

Every setting has one dotted name (`listeners.mqtt_port`, `mqtt.max_packet_size`,
`journal.fsync`); the environment spells it `SHARDGATE_LISTENERS__MQTT_PORT` (sections joined by
a double underscore), and the common ones also as `SHARDGATE_MQTT_PORT`, `SHARDGATE_DATA_DIR`.
"""

from __future__ import annotations

import os
import tomllib
from dataclasses import MISSING, dataclass, field, fields
from pathlib import Path
from typing import Any, ClassVar

from .cluster.settings import ClusterSettings
from .protocols.amqp.settings import AmqpSettings
from .protocols.grpc.settings import GrpcSettings
from .protocols.mqtt.settings import MqttSettings
from .protocols.read_budget import DEFAULT_READ_BUDGET_S
from .security.auth import AuthSettings

# one setting's value, coerced and checked (old import paths keep working)
from .setting_values import CHOICES as CHOICES
from .setting_values import ConfigError as ConfigError
from .setting_values import Range as Range
from .setting_values import check_choice, check_port, check_range, check_type, coerce


@dataclass(slots=True)
class ListenerConfig:
    host: str = "127.0.0.1"
    # 0 turns a listener off.
    mqtt_port: int = 1883
    mqtt_ws_port: int = 8083
    mqtts_port: int = 0
    mqtt_wss_port: int = 0
    amqp_port: int = 5672
    amqps_port: int = 0
    grpc_port: int = 6650
    grpcs_port: int = 0
    http_port: int = 8080
    # The admin API has no authentication of its own yet: it stays on loopback unless told.
    http_host: str = "127.0.0.1"
    # Host names the admin API answers to besides localhost, loopback addresses and the
    # address a request came in on (DNS rebinding: a page of evil.example resolving its name
    # to this broker gets 421). "*": any.
    http_allowed_hosts: list[str] = field(default_factory=list)
    # Seconds of client reads one event-loop turn handles, every client listener together
    # (MQTT, MQTT over WebSocket, AMQP, with TLS or not); later reads wait for the next turns
    # (their sockets are not read meanwhile), so that new connections are accepted and
    # CONNECTs / connection.opens answered between turns under load. 0: no limit.
    read_budget_s: float = DEFAULT_READ_BUDGET_S

    RANGES: ClassVar[dict[str, Range]] = {"read_budget_s": (0, None)}


@dataclass(slots=True)
class TlsConfig:
    cert_file: str | None = None
    key_file: str | None = None
    ca_file: str | None = None
    require_client_cert: bool = False
    # A verified client certificate's subject CN becomes the user name (no password needed),
    # as Mosquitto's use_identity_as_username; ACL rules then apply to that user.
    use_identity_as_username: bool = False


@dataclass(slots=True)
class JournalConfig:
    fsync: str = "always"
    fsync_interval_ms: int = 50
    segment_bytes: int = 64 * 1024 * 1024
    segment_ms: int = 3_600_000
    # By default a shard keeps 7 days (Kafka's default), less what no durable cursor and no
    # archiver still needs; None keeps everything.
    retention_ms: int | None = 7 * 24 * 3_600_000
    retention_bytes: int | None = None
    # Segment and reservation files open at once, every shard together: the journal opens the
    # others when used and closes the least recently used (a descriptor per file otherwise).
    max_open_files: int = 1024

    RANGES: ClassVar[dict[str, Range]] = {
        "fsync_interval_ms": (1, None), "segment_bytes": (256, None), "segment_ms": (1, None),
        "retention_ms": (1, None), "retention_bytes": (1, None), "max_open_files": (16, None),
    }


@dataclass(slots=True)
class ArchiveConfig:
    enabled: bool = True
    # fsspec URL; empty: file://<data_dir>/archive. s3://bucket/prefix needs s3fs.
    url: str = ""
    # a cluster refuses an archive in each node's data directory (the archive would be split
    # across machines) unless this says it is meant
    per_node: bool = False
    target_rows: int = 100_000
    target_bytes: int = 32 * 1024 * 1024
    max_delay_s: float = 60.0
    # a stream with a registered schema is archived as typed columns; also keep payload bytes
    keep_typed_payload: bool = False
    # compaction: merge a shard's small files of an hour into files of this size,
    # compact_after_s after the hour ended
    compaction: bool = True
    file_target_bytes: int = 128 * 1024 * 1024
    compact_after_s: float = 3600.0
    endpoint_url: str | None = None
    region: str | None = None
    access_key_id: str | None = None
    secret_access_key: str | None = None

    RANGES: ClassVar[dict[str, Range]] = {
        "target_rows": (1, None), "target_bytes": (1, None), "max_delay_s": (0, None),
        "file_target_bytes": (1, None), "compact_after_s": (0, None),
    }


@dataclass(slots=True)
class StreamEntry:
    name: str
    mode: str = "reliable"
    partitions: int = 1
    schema: str = "bytes"
    routes: list[str] = field(default_factory=list)
    retention_ms: int | None = None
    retention_bytes: int | None = None
    # In a cluster: copies of each shard of a reliable stream (default 3, capped by the live
    # nodes) and how many must hold a message before it is acknowledged (default 2)
    replicas: int | None = None
    min_insync_replicas: int | None = None
    # A payload schema registered at start (a new version when the file changed): a JSON
    # Schema or an Avro schema file, checked under `compatibility` (default: the stream's
    # mode so far, backward at first)
    schema_file: str = ""
    schema_type: str = "json"
    compatibility: str = ""

    RANGES: ClassVar[dict[str, Range]] = {
        "partitions": (1, 1024), "retention_ms": (1, None), "retention_bytes": (1, None),
        "replicas": (1, 16), "min_insync_replicas": (1, 16),
    }

    def problem(self) -> str:
        """What is wrong with the entry as a whole ("" when nothing)."""
        if (self.replicas is not None and self.min_insync_replicas is not None
                and self.min_insync_replicas > self.replicas):
            return (f"min_insync_replicas ({self.min_insync_replicas}) cannot exceed "
                    f"replicas ({self.replicas})")
        return ""


@dataclass(slots=True)
class Config:
    data_dir: Path = Path("./shardgate-data")
    log_level: str = "info"
    log_json: bool = False
    # SIGTERM/Ctrl-C: the most a graceful stop may take (drain clients, flush the journal,
    # archive what it holds); past it the process exits and the journal keeps the rest.
    shutdown_timeout_s: float = 30.0
    default_stream_mode: str = "reliable"
    # Above this resident memory publishers are blocked until it falls below 90 % of it
    # (`shardgate.resources`): a fraction of the machine's (or cgroup's) memory, as RabbitMQ's
    # vm_memory_high_watermark, or bytes above 1; 0 turns it off.
    memory_high_watermark: float = 0.4
    # Below this many free bytes on the data directory's disk, reliable publishes are refused
    # (MQTT 5 0x97, AMQP nack, gRPC RESOURCE_EXHAUSTED), as RabbitMQ's disk_free_limit; 0 off.
    disk_free_limit: int = 512 * 1024 * 1024
    default_stream_partitions: int = 1
    listeners: ListenerConfig = field(default_factory=ListenerConfig)
    tls: TlsConfig = field(default_factory=TlsConfig)
    mqtt: MqttSettings = field(default_factory=MqttSettings)
    amqp: AmqpSettings = field(default_factory=AmqpSettings)
    grpc: GrpcSettings = field(default_factory=GrpcSettings)
    journal: JournalConfig = field(default_factory=JournalConfig)
    archive: ArchiveConfig = field(default_factory=ArchiveConfig)
    auth: AuthSettings = field(default_factory=AuthSettings)
    cluster: ClusterSettings = field(default_factory=ClusterSettings)
    bridges: list[Any] = field(default_factory=list)
    amqp_bridges: list[Any] = field(default_factory=list)
    streams: list[StreamEntry] = field(default_factory=list)

    RANGES: ClassVar[dict[str, Range]] = {
        "shutdown_timeout_s": (0.001, None), "default_stream_partitions": (1, 1024),
        "memory_high_watermark": (0, None), "disk_free_limit": (0, None),
    }


SECTIONS = {
    "listeners": ListenerConfig, "tls": TlsConfig, "mqtt": MqttSettings, "amqp": AmqpSettings,
    "grpc": GrpcSettings,
    "journal": JournalConfig, "archive": ArchiveConfig, "auth": AuthSettings,
    "cluster": ClusterSettings,
}
SHORT_ENV = {
    "SHARDGATE_DATA_DIR": ("data_dir",),
    "SHARDGATE_HOST": ("listeners", "host"),
    "SHARDGATE_MQTT_PORT": ("listeners", "mqtt_port"),
    "SHARDGATE_MQTT_WS_PORT": ("listeners", "mqtt_ws_port"),
    "SHARDGATE_AMQP_PORT": ("listeners", "amqp_port"),
    "SHARDGATE_AMQPS_PORT": ("listeners", "amqps_port"),
    "SHARDGATE_GRPC_PORT": ("listeners", "grpc_port"),
    "SHARDGATE_GRPCS_PORT": ("listeners", "grpcs_port"),
    "SHARDGATE_HTTP_PORT": ("listeners", "http_port"),
    "SHARDGATE_HTTP_HOST": ("listeners", "http_host"),
    "SHARDGATE_LOG_LEVEL": ("log_level",),
}
# Former names of settings, still taken: the setting each one now is.
RENAMED: dict[tuple[str, ...], tuple[str, ...]] = {
    ("mqtt", "read_budget_s"): ("listeners", "read_budget_s"),  # one budget for every listener
}
# SHARDGATE_* variables that are not settings: the CLI's server URL and config file, and
# SHARDGATE_PURE=1 (run the Python sources instead of compiled builds, core/native.py).
NOT_SETTINGS_ENV = ("SHARDGATE_URL", "SHARDGATE_CONFIG", "SHARDGATE_PURE")


def _entries(key: str, value: Any, cls: type, path: Path) -> list[Any]:
    """The `[[key]]` array of tables of a config file as `cls` instances, every mistake named
    by the setting, the entry and the file, with the allowed names or values."""
    if not isinstance(value, list) or not all(isinstance(entry, dict) for entry in value):
        raise ConfigError(f"{path}: {key} must be an array of tables ([[{key}]])")
    known = {f.name: f for f in fields(cls)}
    required = [f.name for f in fields(cls)
                if f.default is MISSING and f.default_factory is MISSING]  # type: ignore[misc]
    entries = []
    for number, entry in enumerate(value, 1):
        label = f"{path}: [[{key}]] #{number}"
        if isinstance(entry.get("name"), str):
            label += f" ({entry['name']!r})"
        unknown = sorted(set(entry) - set(known))
        if unknown:
            raise ConfigError(f"{label}: unknown setting {unknown[0]!r}; the settings of "
                              f"[[{key}]] are {', '.join(known)}")
        missing = [name for name in required if name not in entry]
        if missing:
            raise ConfigError(f"{label}: {missing[0]!r} is required")
        values = {}
        for name, raw in entry.items():
            dotted = f"{key}.{name}"
            annotation = str(known[name].type)
            if annotation.startswith("list"):
                if not isinstance(raw, list) or not all(isinstance(item, str) for item in raw):
                    raise ConfigError(f"{label}: {name} must be a list of strings, got {raw!r}")
                values[name] = raw
                continue
            values[name] = coerce(raw, known[name].default if known[name].default is not MISSING
                                   else None, f"{label}: {name}", annotation)
            check_type(values[name], annotation, raw, f"{label}: {name}")
            check_range(cls, name, values[name], f"{label}: {name}", raw)
            try:
                check_choice(dotted, values[name], label)
            except ConfigError as exc:
                raise ConfigError(str(exc).replace(f"{dotted} =", f"{name} =")) from None
        built = cls(**values)
        problem = getattr(built, "problem", None)
        if problem is not None and problem():
            raise ConfigError(f"{label}: {problem()}")
        entries.append(built)
    return entries


def _set(config: Config, path: tuple[str, ...], value: Any, source: str, typed: bool = False) -> None:
    """Set one setting from `source`; `typed`: the source carries types (a TOML file), so a
    string is not taken for a number or a flag (`mqtt_port = "21884"`)."""
    written = ".".join(path)
    path = RENAMED.get(path, path)
    target: Any = config
    for part in path[:-1]:
        if not hasattr(target, part):
            raise ConfigError(f"{source}: unknown section {part!r}")
        target = getattr(target, part)
    key = path[-1]
    known = {f.name: f for f in fields(target)}
    if key not in known:
        raise ConfigError(f"{source}: unknown setting {'.'.join(path)!r}")
    annotation = str(known[key].type)
    dotted = ".".join(path)
    if written != dotted:
        dotted = f"{written} (now {dotted})"
    name = dotted if source == "command line" else f"{source}: {dotted}"
    coerced = coerce(value, getattr(target, key), name, annotation)
    if typed and isinstance(value, str):
        try:
            check_type(value, annotation, value, name)
        except ConfigError as exc:
            raise ConfigError(f"{exc} (a string: write the value without quotes)") from None
    check_type(coerced, annotation, value, name)
    if key == "port" or key.endswith("_port"):
        check_port(name, coerced)
    check_range(type(target), key, coerced, name, value)
    check_choice(".".join(path), coerced.lower() if path == ("log_level",) and isinstance(coerced, str)
                  else coerced, source)
    setattr(target, key, coerced)


def load_config(
    path: Path | None = None,
    environ: dict[str, str] | None = None,
    overrides: dict[tuple[str, ...], Any] | None = None,
) -> Config:
    config = Config()
    if path is not None:
        try:
            data = tomllib.loads(Path(path).read_text())
        except FileNotFoundError:
            raise ConfigError(f"config file {path} does not exist") from None
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"config file {path}: {exc}") from None
        for key, value in data.items():
            if key == "streams":
                config.streams = _entries(key, value, StreamEntry, path)
            elif key == "bridges":
                from .bridges.bridge import BridgeSettings  # imports amqtt: only when configured

                config.bridges = _entries(key, value, BridgeSettings, path)
            elif key == "amqp_bridges":
                from .bridges.amqp_bridge import AmqpBridgeSettings

                config.amqp_bridges = _entries(key, value, AmqpBridgeSettings, path)
            elif key in SECTIONS:
                if not isinstance(value, dict):
                    raise ConfigError(f"{key} must be a table")
                for inner, inner_value in value.items():
                    _set(config, (key, inner), inner_value, str(path), typed=True)
            else:
                _set(config, (key,), value, str(path), typed=True)
    env = os.environ if environ is None else environ
    for name, value in env.items():
        if not name.startswith("SHARDGATE_") or name in NOT_SETTINGS_ENV:
            continue
        if name in SHORT_ENV:
            _set(config, SHORT_ENV[name], value, name)
            continue
        parts = tuple(part.lower() for part in name[len("SHARDGATE_"):].split("__"))
        _set(config, parts, value, name)
    for key_path, value in (overrides or {}).items():
        if value is not None:
            _set(config, key_path, value, "command line")
    return config


def check_config(config: Config) -> None:
    """What no single setting shows: entries named twice, bounds that must agree. Raises
    `ConfigError` naming the settings (called by `serve` and `shardgate config check`)."""
    seen: set[str] = set()
    for entry in config.streams:
        if entry.name in seen:
            raise ConfigError(f"[[streams]] {entry.name!r} is defined twice")
        seen.add(entry.name)
    for key in ("bridges", "amqp_bridges"):
        names: set[str] = set()
        for bridge in getattr(config, key):
            if bridge.name in names:
                raise ConfigError(f"[[{key}]] {bridge.name!r} is defined twice")
            names.add(bridge.name)
            _check_bridge_filters(key, bridge)
            if bridge.reconnect_min_s > bridge.reconnect_max_s:
                raise ConfigError(f"[[{key}]] {bridge.name!r}: reconnect_min_s = "
                                  f"{bridge.reconnect_min_s} is more than reconnect_max_s = "
                                  f"{bridge.reconnect_max_s}")


def check_cluster_archive(config: Config) -> None:
    """A cluster archives into one table only if every node is given the same URL: refuse an
    archive in each node's own data directory (the default) unless `per_node` says so. Called
    by `serve` once etcd has answered (so that a node that cannot join says why first) and by
    `shardgate config check`."""
    archive = config.archive
    if not archive.enabled or archive.per_node or not config.cluster.enabled:
        return
    url = archive.url
    if url:
        scheme, sep, rest = url.partition("://")
        if "::" in url or (sep and scheme not in ("file", "local")):
            return  # object storage, a chained URL: one place every node reaches
        path = Path(rest if sep else url).resolve()
    else:
        path = (Path(config.data_dir) / "archive").resolve()
    data_dir = Path(config.data_dir).resolve()
    if path != data_dir and data_dir not in path.parents:
        return  # a directory outside the data directory: taken as one every node mounts
    shown = f"archive.url = {url!r}" if url else "archive.url is not set"
    raise ConfigError(
        f"{shown}: in a cluster each node would archive into its own data directory "
        f"({path}), so the archive would be split across machines; give every node the same "
        "archive URL (object storage such as s3://bucket/prefix, or a directory every node "
        "mounts: --archive-url, [archive] url), or set [archive] per_node = true if a "
        "separate archive per node is meant")


def _check_bridge_filters(key: str, bridge: Any) -> None:
    """A bridge filter outside its side's prefix (`bridges.base.check_filters_under_prefix`)."""
    import logging

    from .bridges.base import check_filters_under_prefix

    quiet = logging.getLogger("shardgate.config.check")
    try:
        check_filters_under_prefix(key[:-1], bridge.name, "out", bridge.out, "local_prefix",
                                   bridge.local_prefix, quiet)
        if key == "bridges":
            check_filters_under_prefix(key[:-1], bridge.name, "inbound", bridge.inbound,
                                       "remote_prefix", bridge.remote_prefix, quiet)
    except ValueError as exc:
        raise ConfigError(f"[[{key}]] {exc}") from None
