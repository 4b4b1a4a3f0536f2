"""Delayed messages in a cluster: how fast their publishes are acknowledged (each held message is
put in etcd before its PUBACK, batched per transaction, shardgate/cluster/delayed.py) against
plain QoS 1 publishes on the same nodes, and whether every one is released exactly once.

Starts a real etcd and two `shardgate serve --cluster` nodes on loopback; a paho publisher on
n1 (200 in flight) sends `--messages` QoS 1 publishes of 100 bytes, `$delayed/2/bench/<i>` or
plain `bench/<i>`, runs interleaved; a subscriber on n2 counts what arrives. It prints the
acknowledged publishes per second of each (median of `--runs`), then the count of messages
received against the count sent once everything was due and a quiet second passed.

    python bench/delayed_cluster.py --messages 2000 --runs 3

Like the other runners it only starts processes and talks to them as a client would.
"""

from __future__ import annotations

import argparse
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

import paho.mqtt.client as mqtt
from _cluster import print_medians, two_nodes


def publish_all(port: int, prefix: str, count: int, run: int) -> float:
    """Publish `count` QoS 1 messages under `prefix`; acknowledged messages per second."""
    client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=f"pub-{run}-{len(prefix)}",
                         protocol=mqtt.MQTTv5)
    client.max_inflight_messages_set(200)
    client.max_queued_messages_set(0)
    acked = threading.Semaphore(0)
    client.on_publish = lambda c, u, mid, rc, props: acked.release()
    client.connect("127.0.0.1", port)
    client.loop_start()
    try:
        started = time.perf_counter()
        for index in range(count):
            client.publish(f"{prefix}bench/{run}/{index}", b"x" * 100, 1)
        for _ in range(count):
            if not acked.acquire(timeout=60):
                raise SystemExit("publishes not acknowledged within 60 s")
        return count / (time.perf_counter() - started)
    finally:
        client.loop_stop()
        client.disconnect()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--messages", type=int, default=2000)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-delayed-") as tmp, two_nodes(Path(tmp), "mqtt") as nodes:
        received: Counter[str] = Counter()
        subscriber = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id="sub", protocol=mqtt.MQTTv5)
        subscriber.on_message = lambda c, u, m: received.update([m.topic])
        subscriber.connect("127.0.0.1", nodes["n2"]["mqtt"])
        subscriber.loop_start()
        subscriber.subscribe("bench/#", 1)
        time.sleep(1)  # the route reaches n1
        rates: dict[str, list[float]] = {"plain QoS 1": [], "$delayed QoS 1": []}
        for run in range(args.runs):
            rates["plain QoS 1"].append(publish_all(nodes["n1"]["mqtt"], "", args.messages, run))
            rates["$delayed QoS 1"].append(
                publish_all(nodes["n1"]["mqtt"], "$delayed/2/", args.messages, args.runs + run))
        print_medians(rates)
        expected = 2 * args.runs * args.messages
        deadline = time.monotonic() + 120
        while sum(received.values()) < expected and time.monotonic() < deadline:
            time.sleep(0.2)
        time.sleep(1)
        subscriber.loop_stop()
        twice = sum(1 for n in received.values() if n > 1)
        print(f"received {sum(received.values())} of {expected} (distinct {len(received)}, more than once {twice})")


if __name__ == "__main__":
    main()
