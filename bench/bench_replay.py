"""CPU cost of durable replay: one journal shard of RECORDS records over TOPICS topics, a
durable subscription that wants one of them, replayed from the start by a consumer that takes
and acknowledges everything at once.

    python bench/bench_replay.py [--records 200000] [--topics 10] [--payload 100] [--repeat 3]
                                 [--no-index | --per-record] [--dir PATH]

Prints the process CPU time of each replay (fresh subscription each time, the journal's files
in the page cache), its median and the CPU time per record in the shard. The journal is keyed
by topic as `shardgate serve` builds it, so replay reads the wanted topic's records through the
segments' key index; `--no-index` builds it without keys, so replay scans blocks
(`read_block`), the path before the index; `--per-record` also hides `read_block`, so replay
goes through `read` (one `StoredRecord` per record). Nothing here is imported by the broker.
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from shardgate.core.broker import Broker
from shardgate.core.index_keys import record_index_key
from shardgate.core.message import Message
from shardgate.core.streams import StreamConfig
from shardgate.storage.journal import JournalStorage


class PerRecordLog:
    """A shard log without `read_block`: everything else is the journal's."""

    def __init__(self, inner: object) -> None:
        self._inner = inner

    def __getattr__(self, name: str) -> object:
        if name == "read_block":
            raise AttributeError(name)
        return getattr(self._inner, name)


class Taker:
    """A consumer that takes everything and acknowledges it at once."""

    consumer_id = "bench"
    connected = True
    available = True

    def __init__(self) -> None:
        self.count = 0

    def deliver(self, message: Message, subscription, filters) -> None:  # noqa: ANN001
        self.count += 1
        subscription.ack(message)


async def fill(broker: Broker, journal: JournalStorage, records: int, topics: int, size: int) -> None:
    payload = b"p" * size
    for i in range(records):
        broker.publish(Message(f"sensors/{i % topics}/value", payload))
        if i % 10_000 == 9_999:
            await journal.flush()
    await journal.flush()


async def replay_once(broker: Broker, name: str, topic: int, wanted: int) -> float:
    subscription = broker.durable_subscription(name, initial_position="earliest")
    broker.add_filter(subscription, f"sensors/{topic}/+")
    taker = Taker()
    started = time.process_time()
    broker.attach(subscription, taker)
    while taker.count < wanted:
        await asyncio.sleep(0)
    elapsed = time.process_time() - started
    broker.detach(subscription, taker)
    return elapsed


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--records", type=int, default=200_000)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--topics", type=int, default=10)
    parser.add_argument("--payload", type=int, default=100)
    parser.add_argument("--no-index", action="store_true")
    parser.add_argument("--per-record", action="store_true")
    parser.add_argument("--dir", type=Path, default=None)
    args = parser.parse_args()
    directory = Path(tempfile.mkdtemp(prefix="bench-replay-", dir=args.dir))
    try:
        keyed = not (args.no_index or args.per_record)
        journal = JournalStorage(directory, index_key=record_index_key if keyed else None)
        broker = Broker(storage=journal, default_stream=StreamConfig("default", mode="reliable"))
        shard = broker.stream("default").shards[0]
        await fill(broker, journal, args.records, args.topics, args.payload)
        if args.per_record:
            shard.log = PerRecordLog(shard.log)  # type: ignore[assignment]
        topic = 3 % args.topics
        wanted = len(range(topic, args.records, args.topics))
        times = [await replay_once(broker, f"replay{run}", topic, wanted)
                 for run in range(args.repeat)]
        median = statistics.median(times)
        path = "read (per record)" if args.per_record else "key index" if keyed else "read_block"
        print(f"| {path} | {args.records:,} | {args.topics} | {args.payload} | {wanted:,} | "
              f"{' / '.join(f'{t:.3f}' for t in times)} | {median:.3f} | "
              f"{median / args.records * 1e6:.2f} |")
        journal.close()
    finally:
        shutil.rmtree(directory, ignore_errors=True)


if __name__ == "__main__":
    asyncio.run(main())
