"""An idle broker hands back what a burst of load left: its per-topic caches are dropped
(rebuilt on demand) once per idle period, never while traffic flows."""

from __future__ import annotations

from pathlib import Path

from shardgate.core.broker import Broker
from shardgate.core.message import Message
from shardgate.storage.metadata import SqliteMetadataStore

from shardgate.persistence import Persistence


class Recorder:
    consumer_id = "recorder"
    available = True

    def __init__(self) -> None:
        self.got: list[str] = []

    def deliver(self, message: Message, subscription: object, filters: tuple[str, ...]) -> None:
        self.got.append(message.topic)


def test_caches_are_released_once_per_idle_period(tmp_path: Path) -> None:
    store = SqliteMetadataStore(tmp_path / "meta.db")
    try:
        broker = Broker()
        persistence = Persistence(broker, store)
        live = broker.subscription("live")
        broker.add_filter(live, "t/#")
        recorder = Recorder()
        broker.attach(live, recorder)
        durable = broker.durable_subscription("kept")
        broker.add_filter(durable, "t/#")
        for i in range(100):
            broker.publish(Message(f"t/{i}", b"x"))
        durable._filters_for("t/1")
        assert len(broker._match_cache) == 100

        assert not persistence.check_idle()  # first look: traffic since the start
        assert persistence.check_idle()  # nothing since: released
        assert broker._match_cache == {} and broker._topic_stream_cache == {}
        assert durable._matching_cache == {}
        assert not persistence.check_idle()  # once per idle period

        broker.publish(Message("t/again", b"x"))
        assert not persistence.check_idle()  # busy again
        assert broker._match_cache  # caches refill as they are used
        assert persistence.check_idle()
        # Delivery works as before with the caches rebuilt on demand.
        broker.publish(Message("t/1", b"x"))
        assert recorder.got[-1] == "t/1" and len(recorder.got) == 102
    finally:
        store.close()
