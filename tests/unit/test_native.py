"""Compiled (mypyc) and pure-Python builds of the hot modules behave the same.

`pip install` may compile the MQTT codec and the topic modules (setup.py, core/native.py);
`SHARDGATE_PURE=1` makes a process run their Python sources instead. The same script runs in
this process's build and in a pure subprocess, and their outputs must be identical: the bytes
of every encoded packet, the packets parsed back, the errors raised on bad input, topic checks
and trie matches.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

SCRIPT = r'''
import json
from shardgate.core.native import compiled_in_use
from shardgate.core.topics import TopicError, validate_topic_filter, validate_topic_name
from shardgate.core.trie import TopicTrie
from shardgate.protocols.mqtt import packets as p
from shardgate.protocols.mqtt.codec import MQTTCodecError, PacketParser, encode, encode_publish

out = {"compiled": compiled_in_use()}
props = p.Properties(
    payload_format_indicator=1, message_expiry_interval=60, content_type="text/plain",
    response_topic="r/1", correlation_data=b"c", user_properties=[("k", "v"), ("k", "w")],
)
packets = [
    (p.Connect("MQTT", 5, True, 30, "c1", p.Will("w/t", b"bye", 1, True), "u", b"pw"), 5),
    (p.Connect("MQTT", 4, False, 60, "c2"), 4),
    (p.Connack(True, 0), 4),
    (p.Publish("a/b", b"x" * 200, 1, True, False, 7, props), 5),
    (p.Publish("a/b", b"hello", 0), 4),
    (p.Puback(9, 0x10, p.Properties(reason_string="none")), 5),
    (p.Subscribe(3, [p.SubscriptionRequest("a/+", 1, True, False, 2)]), 5),
    (p.Suback(3, [1, 0x80]), 4),
    (p.Unsubscribe(4, ["a/#"]), 4),
    (p.Disconnect(0x04), 5),
]
encoded = []
for packet, version in packets:
    data = encode(packet, version)
    parser = PacketParser()
    parser.version = version
    encoded.append([data.hex(), [repr(x) for x in parser.feed(data)]])
out["packets"] = encoded
out["publish"] = encode_publish("t/1", b"p", 1, False, True, 300, props, 5).hex()
errors = []
for bad in (b"\x30\x03\x00\x05a", b"\x00\x00", b"\x32\x05\x00\x01a\x00\x00", b"\x30\xff\xff\xff\xff\x7f"):
    parser = PacketParser()
    try:
        parser.feed(bad)
        errors.append("accepted")
    except MQTTCodecError as exc:
        errors.append([type(exc).__name__, exc.reason_code, str(exc)])
out["errors"] = errors
checks = []
for name in ("a/b", "a/+/b", "", "a/#/b", "a\x00", "$SYS/x"):
    for check in (validate_topic_name, validate_topic_filter):
        try:
            check(name)
            checks.append("ok")
        except TopicError as exc:
            checks.append(str(exc))
out["topics"] = checks
trie = TopicTrie()
for value, topic_filter in enumerate(["a/+", "a/#", "#", "a/b", "+/b", "$SYS/#"]):
    trie.add(topic_filter, value)
out["matches"] = {t: sorted(trie.match(t)) for t in ("a/b", "a", "x/b", "$SYS/y", "a/b/c")}
print(json.dumps(out))
'''


def run(pure: bool) -> dict:
    env = dict(os.environ)
    env.pop("SHARDGATE_PURE", None)
    if pure:
        env["SHARDGATE_PURE"] = "1"
    result = subprocess.run(
        [sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=60,
        check=True,
    )
    return json.loads(result.stdout)


def test_pure_sources_run_when_asked() -> None:
    pure = run(pure=True)
    assert pure["compiled"] and not any(pure["compiled"].values())


def test_installed_build_and_pure_sources_agree() -> None:
    installed, pure = run(pure=False), run(pure=True)
    installed.pop("compiled")
    pure.pop("compiled")
    assert installed == pure
    assert len(pure["packets"]) == 10 and all(parsed for _, parsed in pure["packets"])


def test_pure_switch_is_not_read_as_a_setting() -> None:
    from shardgate.config import load_config

    config = load_config(environ={"SHARDGATE_PURE": "1", "SHARDGATE_MQTT_PORT": "1999"})
    assert config.listeners.mqtt_port == 1999


def test_only_the_build_commands_analyse_the_compiled_modules() -> None:
    """pip asks setup.py for the build's requirements (`egg_info`) and the metadata
    (`dist_info`) before the build: those run no mypyc analysis (most of a minute each), the
    builds (editable or not) still compile."""
    import runpy
    from pathlib import Path

    setup = runpy.run_path(str(Path(__file__).resolve().parents[2] / "setup.py"))
    only_metadata = setup["only_metadata"]
    assert only_metadata(["egg_info"])
    assert only_metadata(["dist_info", "--output-dir", "/tmp/x", "--keep-egg-info"])
    assert not only_metadata(["editable_wheel", "--dist-info-dir", "/tmp/x"])
    assert not only_metadata(["bdist_wheel", "--dist-dir", "/tmp/x"])
    assert not only_metadata(["build_ext", "--inplace"])
