"""Count the broker's work per message on the MQTT hot path, without sockets or a load generator.

Wall-clock throughput on a shared machine swings with whatever else runs; the CPU time a broker
spends per message does not (much). This script assembles a real `Shardgate` node (its defaults:
a reliable default stream, fsync = always, the archiver, security) in this process, connects
in-memory MQTT 3.1.1 clients to its `MqttService` (the same `MqttConnection` the TCP adapter
feeds), and drives one of the throughput scenarios of `../shared/bench/mqtt_load.py`: each
publisher hands the broker a read of 512 pre-encoded PUBLISH frames (QoS 0) or keeps a window of
500 (QoS 1), subscribers PUBACK what they get. It prints the process CPU µs per delivered
message (broker plus these thin clients, which cost little) and, with `--profile`, the cProfile
functions that took the most time.

    python bench/hotpath.py --scenario qos0 --messages 200000
    python bench/hotpath.py --scenario fanin --mode non-reliable --profile 25
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import json
import os
import pstats
import tempfile
import time
from pathlib import Path

from shardgate.protocols.mqtt.connection import MqttConnection

from shardgate.app import Shardgate
from shardgate.config import Config

SCENARIOS = {  # name: (qos, publishers, subscribers, topic mode)
    "qos0": (0, 1, 1, "same"),
    "qos1": (1, 1, 1, "same"),
    "fanin": (0, 8, 1, "wildcard"),
    "fanout": (0, 1, 8, "same"),
}
BATCH = 512
WINDOW = 500


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _str(text: str) -> bytes:
    raw = text.encode()
    return len(raw).to_bytes(2, "big") + raw


def connect(client_id: str) -> bytes:
    body = _str("MQTT") + bytes([4, 2]) + (120).to_bytes(2, "big") + _str(client_id)
    return b"\x10" + _varint(len(body)) + body


def subscribe(topic_filter: str, qos: int) -> bytes:
    body = (1).to_bytes(2, "big") + _str(topic_filter) + bytes([qos])
    return b"\x82" + _varint(len(body)) + body


def publish(topic: str, payload: bytes, qos: int, packet_id: int) -> bytes:
    body = _str(topic) + (packet_id.to_bytes(2, "big") if qos else b"") + payload
    return bytes([0x30 | qos << 1]) + _varint(len(body)) + body


class Client:
    """An in-memory link: counts PUBLISH and PUBACK packets the broker writes to it."""

    def __init__(self, app: Shardgate, client_id: str, qos_acks: bool) -> None:
        assert app.mqtt is not None
        self.published = 0
        self.acked = 0
        self.qos_acks = qos_acks
        self.pending = bytearray()
        self.connection = MqttConnection(app.mqtt, self, client_id, "tcp")
        app.mqtt.connection_made(self.connection)
        self.connection.data_received(connect(client_id))

    # Link
    def write(self, data: bytes) -> None:
        buf = self.pending
        buf += data
        pos, size, acks = 0, len(buf), bytearray()
        while size - pos >= 2:
            length = buf[pos + 1]
            start = pos + 2
            if length & 0x80:
                length, shift, start = length & 0x7F, 7, pos + 2
                while buf[start] & 0x80:
                    length |= (buf[start] & 0x7F) << shift
                    shift += 7
                    start += 1
                length |= buf[start] << shift
                start += 1
            end = start + length
            if end > size:
                break
            kind = buf[pos] >> 4
            if kind == 3:
                self.published += 1
                if buf[pos] & 0x06:
                    topic_end = start + 2 + int.from_bytes(buf[start:start + 2], "big")
                    acks += b"\x40\x02" + buf[topic_end:topic_end + 2]
            elif kind == 4:
                self.acked += 1
            pos = end
        del buf[:pos]
        if acks and self.qos_acks:
            self.connection.data_received(bytes(acks))

    def close(self) -> None:
        pass

    def buffered(self) -> int:
        return 0

    def throttle(self, seconds: float) -> None:
        pass

    def resume(self) -> None:
        pass


async def until(condition: object, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():  # type: ignore[operator]
        if time.monotonic() > deadline:
            raise TimeoutError("the broker stopped making progress")
        await asyncio.sleep(0)


async def run(scenario: str, messages: int, mode: str, profile: int) -> dict[str, object]:
    qos, pubs, subs, topic_mode = SCENARIOS[scenario]
    with tempfile.TemporaryDirectory() as tmp:
        config = Config(data_dir=Path(tmp), default_stream_mode=mode)
        listeners = config.listeners
        for name in ("mqtt_port", "mqtt_ws_port", "amqp_port", "grpc_port", "http_port"):
            setattr(listeners, name, 0)
        app = Shardgate(config)
        await app.start()
        try:
            subscribers = [Client(app, f"sub{i}", True) for i in range(subs)]
            for sub in subscribers:
                sub.connection.data_received(subscribe("bench/+" if topic_mode == "wildcard" else "bench/t0", qos))
            publishers = [Client(app, f"pub{i}", False) for i in range(pubs)]
            topics = [f"bench/t{i if topic_mode == 'wildcard' else 0}" for i in range(pubs)]
            payload = bytes(64)
            if qos == 0:
                reads = [b"".join(publish(t, payload, 0, 0) for _ in range(BATCH)) for t in topics]
            else:
                reads = [b"".join(publish(t, payload, 1, 1 + i) for i in range(WINDOW)) for t in topics]
            await asyncio.sleep(0.05)
            profiler = cProfile.Profile() if profile else None
            per_round = WINDOW if qos else BATCH
            rounds = max(1, messages // (per_round * pubs))
            expected = rounds * per_round * pubs
            if profiler is not None:
                profiler.enable()
            usage = os.times()
            cpu, wall = time.process_time(), time.perf_counter()
            for _ in range(rounds):
                for client, read in zip(publishers, reads, strict=True):
                    client.connection.data_received(read)
                if qos:
                    target = publishers[0].acked + per_round
                    await until(lambda t=target: publishers[0].acked >= t)
                else:
                    await asyncio.sleep(0)
            await until(lambda: all(s.published >= expected for s in subscribers))
            cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
            after = os.times()
            system = after.system - usage.system
            if profiler is not None:
                profiler.disable()
                pstats.Stats(profiler).sort_stats("tottime").print_stats(profile)
            delivered = expected * subs
            return {
                "scenario": scenario, "mode": mode, "delivered": delivered,
                "cpu_us_per_msg": round(cpu / delivered * 1e6, 2),
                "of_which_system_us": round(system / delivered * 1e6, 2),
                "msgs_per_cpu_s": round(delivered / cpu),
                "wall_msgs_per_s": round(delivered / wall),
            }
        finally:
            await app.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scenario", choices=sorted(SCENARIOS), default="qos0")
    parser.add_argument("--messages", type=int, default=200_000)
    parser.add_argument("--mode", choices=("reliable", "non-reliable"), default="reliable")
    parser.add_argument("--profile", type=int, default=0, help="print the N costliest functions")
    args = parser.parse_args()
    try:
        import uvloop
    except ImportError:  # pragma: no cover
        result = asyncio.run(run(args.scenario, args.messages, args.mode, args.profile))
    else:
        result = uvloop.run(run(args.scenario, args.messages, args.mode, args.profile))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
