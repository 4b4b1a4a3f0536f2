"""Configuration loading (`shardgate/config.py`): values of the wrong kind or out of range are
refused with the file and the setting named, and the README's configuration reference lists
every real setting, each one that loads."""

from __future__ import annotations

import re
from dataclasses import fields
from pathlib import Path

import pytest

from shardgate.bridges.amqp_bridge import AmqpBridgeSettings
from shardgate.bridges.bridge import BridgeSettings
from shardgate.config import (
    NOT_SETTINGS_ENV,
    SECTIONS,
    SHORT_ENV,
    Config,
    ConfigError,
    StreamEntry,
    load_config,
)

README = Path(__file__).resolve().parents[2] / "README.md"


def load_text(tmp_path: Path, text: str) -> Config:
    path = tmp_path / "shardgate.toml"
    path.write_text(text)
    return load_config(path, environ={})


@pytest.mark.parametrize(("text", "message"), [
    ("[listeners]\nmqtt_port = [1]\n", "listeners.mqtt_port must be an integer, got [1]"),
    ("[mqtt]\nmax_packet_size = 1.5\n", "mqtt.max_packet_size must be an integer"),
    ('[mqtt]\nmax_packet_size = "big"\n', "mqtt.max_packet_size: expected an integer"),
    ("[mqtt]\nretain_available = 3\n", "mqtt.retain_available must be true or false"),
    ("[listeners]\nhost = 5\n", "listeners.host must be a string"),
    ('[amqp]\nusers = "guest"\n', "amqp.users must be a table"),
    ('[amqp]\nvhosts = "/"\n', "amqp.vhosts must be a list"),
    ("[listeners]\nmqtt_port = 70000\n", "listeners.mqtt_port = 70000 is not a port number"),
    ("[cluster]\nport = -1\n", "cluster.port = -1 is not a port number"),
    ('[listeners]\nmqtt_port = "21884"\n',
     "listeners.mqtt_port must be an integer, got '21884' (a string: write the value without quotes)"),
    ("[mqtt]\nreceive_maximum = 0\n", "mqtt.receive_maximum = 0 is out of range (allowed: 1 to 65,535)"),
    ("[mqtt]\nmax_inflight = -1\n", "mqtt.max_inflight = -1 is out of range (allowed: 1 to 65,535)"),
    ("[archive]\ntarget_rows = 0\n", "archive.target_rows = 0 is out of range (allowed: at least 1)"),
    ("[archive]\nmax_delay_s = -5\n", "archive.max_delay_s = -5 is out of range (allowed: at least 0)"),
    ('[[streams]]\nname = "sensors"\npartitions = 0\n',
     "[[streams]] #1 ('sensors'): partitions = 0 is out of range (allowed: 1 to 1,024)"),
    ("[amqp]\nframe_max = 1000\n", "amqp.frame_max = 1000 is out of range (allowed: 4,096 to 4,294,967,295)"),
    ("[grpc]\ndefault_credit = 0\n", "grpc.default_credit = 0 is out of range (allowed: at least 1)"),
    ("[journal]\nsegment_bytes = 0\n", "journal.segment_bytes = 0 is out of range"),
    ("[cluster]\nlease_ttl_s = 0\n", "cluster.lease_ttl_s = 0 is out of range (allowed: at least 1)"),
    ('[[bridges]]\nname = "b"\nremote = "mqtt://h:1"\nwindow = 0\n',
     "[[bridges]] #1 ('b'): window = 0 is out of range (allowed: 1 to 65,535)"),
])
def test_a_value_of_the_wrong_kind_or_range_names_the_file_and_the_setting(
    tmp_path: Path, text: str, message: str,
) -> None:
    with pytest.raises(ConfigError) as refused:
        load_text(tmp_path, text)
    assert str(refused.value).startswith(str(tmp_path / "shardgate.toml") + ": ")
    assert message in str(refused.value)


def test_every_numeric_setting_has_a_range_its_default_is_inside() -> None:
    """No number goes unchecked: each section says the allowed range of each of its numbers."""
    for section in (Config, *SECTIONS.values(), StreamEntry, BridgeSettings, AmqpBridgeSettings):
        ranges = getattr(section, "RANGES", {})
        for field in fields(section):
            kind = str(field.type)
            if not kind.startswith(("int", "float")) or field.name.endswith("port"):
                continue
            assert field.name in ranges, f"{section.__name__}.{field.name} has no range"
            default = field.default
            low, high = ranges[field.name]
            if isinstance(default, int | float):
                assert (low is None or default >= low) and (high is None or default <= high)


def test_ranges_apply_to_environment_variables_too() -> None:
    with pytest.raises(ConfigError, match="^SHARDGATE_MQTT__RECEIVE_MAXIMUM: mqtt.receive_maximum "
                                          "= '0' is out of range"):
        load_config(environ={"SHARDGATE_MQTT__RECEIVE_MAXIMUM": "0"})
    assert load_config(environ={"SHARDGATE_MQTT__RECEIVE_MAXIMUM": "10"}).mqtt.receive_maximum == 10


def test_environment_and_command_line_ports_are_checked_too() -> None:
    with pytest.raises(ConfigError, match="^SHARDGATE_MQTT_PORT: listeners.mqtt_port = -1 is not"):
        load_config(environ={"SHARDGATE_MQTT_PORT": "-1"})
    with pytest.raises(ConfigError, match="^listeners.grpc_port = 65536 is not a port number"):
        load_config(environ={}, overrides={("listeners", "grpc_port"): 65536})
    assert load_config(environ={"SHARDGATE_MQTT_PORT": "0"}).listeners.mqtt_port == 0


def test_a_setting_of_several_kinds_takes_each() -> None:
    assert load_config(environ={"SHARDGATE_CLUSTER__ETCD": "http://a:1"}).cluster.etcd == "http://a:1"


def readme_config_blocks() -> list[str]:
    """The README's TOML blocks that are configuration files (not the ACL file's rules)."""
    blocks = re.findall(r"```toml\n(.*?)```", README.read_text(), re.S)
    return [block for block in blocks if not block.lstrip().startswith(("[[allow]]", "[[deny]]"))]


def test_every_configuration_block_of_the_readme_loads(tmp_path: Path) -> None:
    blocks = readme_config_blocks()
    assert len(blocks) >= 4
    for block in blocks:
        load_text(tmp_path, block)


def test_the_readme_configuration_reference_lists_every_setting() -> None:
    """Each setting stands in a README block of its section (as a key, or named in the
    block's comments)."""
    text_of: dict[str, str] = {}
    for block in readme_config_blocks():
        section = ""  # top level, until the block's first table
        for line in block.splitlines():
            header = re.match(r"\[\[?(\w+)\]\]?", line)
            if header:
                section = header.group(1)
            text_of[section] = text_of.get(section, "") + line + "\n"
    classes: dict[str, type] = {
        **SECTIONS, "streams": StreamEntry, "bridges": BridgeSettings,
        "amqp_bridges": AmqpBridgeSettings,
    }
    missing = []
    for section, cls in classes.items():
        for setting in fields(cls):
            if not re.search(rf"\b{setting.name}\b", text_of.get(section, "")):
                missing.append(f"{section}.{setting.name}")
    for setting in fields(Config):
        if setting.name not in classes and not re.search(rf"^{setting.name} =", text_of[""], re.M):
            missing.append(setting.name)
    assert not missing, f"settings the README's configuration reference does not list: {missing}"


# Settings the README's reference gives an example value for, not the default (its comments say
# what the default is): a certificate path, "unset by default" retention, a cluster to join
# and its secure setup (etcd's TLS files and user, the cluster secret's file).
README_EXAMPLE_VALUES = {
    "tls.cert_file", "tls.key_file", "journal.retention_ms", "journal.retention_bytes",
    "cluster.etcd", "cluster.node_id", "cluster.ca_file", "cluster.cert_file",
    "cluster.key_file", "cluster.username", "cluster.password", "cluster.secret_file",
    "cluster.tls_cert_file", "cluster.tls_key_file", "cluster.tls_ca_file",
}


def test_the_readme_configuration_reference_gives_each_setting_its_default() -> None:
    """A value the reference prints is what the broker uses when the setting is left out. An
    empty string stands for a setting that is unset by default, as does 0 for one that means
    "no limit" when unset."""
    import tomllib

    defaults = load_config(environ={})
    wrong = []
    for block in readme_config_blocks():
        for key, value in tomllib.loads(block).items():
            if isinstance(value, list) and value and isinstance(value[0], dict):
                continue  # [[streams]], [[bridges]]: examples of entries, not settings
            items = value.items() if isinstance(value, dict) else [(None, value)]
            for setting, shown in items:
                name = f"{key}.{setting}" if setting else key
                if name in README_EXAMPLE_VALUES:
                    continue
                default = getattr(getattr(defaults, key), setting) if setting else getattr(defaults, key)
                if isinstance(default, Path):
                    shown = Path(shown)
                elif isinstance(default, tuple):
                    default = list(default)
                if default is None and shown in ("", 0):
                    continue
                if shown != default:
                    wrong.append(f"{name}: README {shown!r}, default {default!r}")
    assert not wrong, f"the README's configuration reference shows other values: {wrong}"


def test_the_readme_names_every_environment_variable_the_broker_reads() -> None:
    text = README.read_text()
    missing = [name for name in (*SHORT_ENV, *NOT_SETTINGS_ENV) if f"`{name}" not in text]
    assert not missing, f"environment variables the README does not name: {missing}"


def test_the_read_budget_is_one_setting_for_every_listener_and_keeps_its_former_name(
    tmp_path: Path,
) -> None:
    assert load_text(tmp_path, "[listeners]\nread_budget_s = 0.002\n").listeners.read_budget_s == 0.002
    # mqtt.read_budget_s, in earlier configuration files and the environment, is the same setting
    assert load_text(tmp_path, "[mqtt]\nread_budget_s = 0.001\n").listeners.read_budget_s == 0.001
    assert load_config(
        environ={"SHARDGATE_MQTT__READ_BUDGET_S": "0.003"}).listeners.read_budget_s == 0.003
    with pytest.raises(ConfigError, match=r"mqtt.read_budget_s \(now listeners.read_budget_s\): expected a number"):
        load_text(tmp_path, '[mqtt]\nread_budget_s = "fast"\n')


def test_the_journal_keeps_seven_days_by_default_and_bounds_its_open_files() -> None:
    """A QoS 0 flood into a default broker no longer keeps its journal forever (issue 26, 10)."""
    journal = load_config(environ={}).journal
    assert journal.retention_ms == 7 * 24 * 3_600_000
    assert journal.max_open_files == 1024


def test_a_stream_entry_refuses_more_in_sync_replicas_than_replicas(tmp_path: Path) -> None:
    path = tmp_path / "shardgate.toml"
    path.write_text('[[streams]]\nname = "orders"\nreplicas = 2\nmin_insync_replicas = 3\n')
    with pytest.raises(ConfigError, match=r"\('orders'\): min_insync_replicas \(3\) cannot "
                                          r"exceed replicas \(2\)"):
        load_config(path, environ={})
    path.write_text('[[streams]]\nname = "orders"\nreplicas = 17\n')
    with pytest.raises(ConfigError, match="replicas = 17 is out of range"):
        load_config(path, environ={})
    path.write_text('[[streams]]\nname = "orders"\nreplicas = 3\n')
    entry = load_config(path, environ={}).streams[0]
    assert (entry.replicas, entry.min_insync_replicas) == (3, None)
