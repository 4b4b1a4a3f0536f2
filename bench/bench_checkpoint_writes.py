"""etcd writes made by the checkpoints of connected persistent sessions: what shortening the
repeat window after a holder's SIGKILL costs etcd.

Two `shardgate serve --cluster` nodes on a local etcd. `--sessions` persistent MQTT 5 sessions
(clean start off, one-hour expiry) on n1 subscribe to `cp/#` at QoS 1 and acknowledge every
message (paho); a publisher on n2 sends QoS 1 messages to `cp/<i>` at `--rate` per second
for `--duration` seconds. etcd's own counters (`/metrics`: `etcd_mvcc_put_total`,
`etcd_mvcc_txn_total`, WAL fsyncs) are read before and after the measured stretch, so every
write counts, whoever made it; with no other activity, they are the checkpoints.

    python bench/bench_checkpoint_writes.py [--sessions 20] [--rate 200] [--duration 10]
"""

from __future__ import annotations

import argparse
import re
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import paho.mqtt.client as mqtt  # noqa: E402
from _cluster import Processes, start_etcd  # noqa: E402
from _proc import free_port, http_json, wait_until  # noqa: E402

COUNTERS = ("etcd_mvcc_put_total", "etcd_mvcc_txn_total", "etcd_disk_wal_fsync_duration_seconds_count")


def etcd_counters(url: str) -> dict[str, float]:
    with urllib.request.urlopen(f"{url}/metrics", timeout=5) as reply:
        text = reply.read().decode()
    return {name: float(re.search(rf"^{name} (\S+)$", text, re.M).group(1))  # type: ignore[union-attr]
            for name in COUNTERS}


def session(port: int, client_id: str, received: list[int]) -> mqtt.Client:
    client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=client_id, protocol=mqtt.MQTTv5)
    subscribed = threading.Event()
    client.on_message = lambda c, u, m: received.append(1)
    client.on_subscribe = lambda *args: subscribed.set()
    properties = mqtt.Properties(mqtt.PacketTypes.CONNECT)
    properties.SessionExpiryInterval = 3600
    client.connect("127.0.0.1", port, clean_start=False, properties=properties)
    client.loop_start()
    client.subscribe("cp/#", qos=1)
    if not subscribed.wait(30):
        raise SystemExit(f"{client_id} was not subscribed")
    return client


def start_nodes(procs: Processes, etcd_url: str) -> dict[str, int]:
    """n1 and n2 with MQTT only; their MQTT ports once both serve and the shards are placed."""
    ports: dict[str, int] = {}
    http: dict[str, int] = {}
    for node_id in ("n1", "n2"):
        ports[node_id], http[node_id] = free_port(), free_port()
        procs.start(node_id, [
            sys.executable, "-m", "shardgate", "serve", "--cluster", etcd_url, "--node-id", node_id,
            "--cluster-port", "0", "--host", "127.0.0.1", "--mqtt-port", str(ports[node_id]),
            "--mqtt-ws-port", "0", "--grpc-port", "0", "--amqp-port", "0",
            "--http-port", str(http[node_id]), "--data-dir", str(procs.workdir / node_id),
        ])

    def placed() -> bool:
        for port in http.values():
            status = http_json(f"http://127.0.0.1:{port}/api/cluster")
            if len(status["nodes"]) != 2 or "default" not in status["placement"]:
                return False
        return True

    wait_until(placed, 60, "the two nodes")
    return ports


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sessions", type=int, default=20)
    parser.add_argument("--rate", type=float, default=200.0)
    parser.add_argument("--duration", type=float, default=10.0)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as workdir:
        procs = Processes(Path(workdir))
        try:
            rates, sent, received = measure(procs, args)
        finally:
            procs.stop()
    print(f"{args.sessions} sessions, {sent} messages at {args.rate:.0f}/s for "
          f"{args.duration:.0f} s, {received} deliveries")
    print("| etcd counter | per second |")
    print("|---|---:|")
    for name, rate in rates.items():
        print(f"| {name} | {rate:.1f} |")


def measure(procs: Processes, args: argparse.Namespace) -> tuple[dict[str, float], int, int]:
    """The etcd counters' rates over the measured stretch, messages sent, deliveries."""
    etcd_url = start_etcd(procs)
    nodes = start_nodes(procs, etcd_url)
    received: list[int] = []
    clients = [session(nodes["n1"], f"cp-{index}", received) for index in range(args.sessions)]
    publisher = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id="cp-pub", protocol=mqtt.MQTTv5)
    publisher.connect("127.0.0.1", nodes["n2"])
    publisher.loop_start()
    time.sleep(2.5)  # (the sessions' first snapshots and the routes settle first)
    before, started = etcd_counters(etcd_url), time.monotonic()
    sent = 0
    while (elapsed := time.monotonic() - started) < args.duration:
        due = int(elapsed * args.rate)
        while sent < due:
            publisher.publish(f"cp/{sent % 16}", b"x" * 64, qos=1)
            sent += 1
        time.sleep(0.005)
    after, took = etcd_counters(etcd_url), time.monotonic() - started
    for client in [*clients, publisher]:
        client.loop_stop()
        client.disconnect()
    return {name: (after[name] - before[name]) / took for name in COUNTERS}, sent, len(received)


if __name__ == "__main__":
    main()
