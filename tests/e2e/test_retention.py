"""Journal retention never deletes what a durable cursor still needs."""

from __future__ import annotations

from tests.mqtt_clients import V5, Paho


def test_retention_waits_for_offline_session_then_frees_space(broker_factory):
    broker = broker_factory(journal={"segment_bytes": 4096, "retention_bytes": 8192}, archive={"enabled": False})
    sub = Paho(broker.mqtt_port, "slow", V5, clean=False, session_expiry=600)
    sub.subscribe("ret/#", 1)
    sub.disconnect()
    pub = Paho(broker.mqtt_port, "pub", V5)
    for index in range(300):
        pub.publish("ret/x", f"{index:04d}" + "x" * 100, 1, wait=index % 50 == 49)
    pub.publish("ret/x", "end", 1)

    def shard_state() -> tuple[int, int]:
        broker.app.persistence.apply_retention()
        shard_log = broker.app.broker.stream("default").shards[0].log
        return shard_log.low_watermark, shard_log.next_offset

    low, end = broker.call(shard_state)
    assert low == 0  # the offline session still needs everything
    back = Paho(broker.mqtt_port, "slow", V5, clean=False, session_expiry=600)
    received = [back.expect().payload for _ in range(301)]
    assert received[-1] == b"end" and received[0].startswith(b"0000")

    def after_ack() -> int:
        broker.app.persistence.flush()
        return shard_state()[0]

    from tests.conftest import wait_for

    assert wait_for(lambda: broker.call(after_ack) > 0, timeout=10)


def test_retention_waits_for_the_archiver(broker_factory):
    broker = broker_factory(journal={"segment_bytes": 4096, "retention_bytes": 8192})
    pub = Paho(broker.mqtt_port, "pub", V5)
    for index in range(200):
        pub.publish("arch/x", f"{index:04d}" + "y" * 100, 1, wait=index % 50 == 49)
    pub.publish("arch/x", "end", 1)

    def low_after_retention() -> int:
        broker.app.persistence.apply_retention()
        return broker.app.broker.stream("default").shards[0].log.low_watermark

    assert broker.call(low_after_retention) == 0  # nothing archived yet: the journal keeps it
    broker.call(broker.app.archiver.flush(timeout=30), timeout=40)
    assert broker.call(low_after_retention) > 0
    status = broker.call(broker.app.archiver.status)
    default = next(s for s in status if s["stream"] == "default")
    assert default["archived_next"] == default["journal_next"]


def test_tiered_replay_reads_the_archive_then_the_journal_then_live(broker_factory):
    broker = broker_factory(journal={"segment_bytes": 4096, "retention_bytes": 8192})
    # A durable gRPC-style subscription created at the start, its consumer away.
    sub = Paho(broker.mqtt_port, "archivist", V5, clean=False, session_expiry=600)
    sub.subscribe("tier/#", 1)
    sub.disconnect()
    pub = Paho(broker.mqtt_port, "pub", V5)
    for index in range(200):
        pub.publish("tier/x", f"{index:04d}", 1, wait=index % 50 == 49)

    def archive_and_cut() -> int:
        # The session's cursor alone would hold retention: forget it to let the journal go,
        # as a session would whose cursor is older than the journal (restored from backup).
        session_sub = broker.app.broker.subscriptions["mqtt:archivist"]
        saved = {key: cursor.position for key, cursor in session_sub.cursors.items()}
        session_sub.cursors.clear()
        broker.app.persistence.apply_retention()
        for (stream, shard), position in saved.items():
            from shardgate.core.durable import ShardCursor

            log = broker.app.broker.stream(stream).shards[shard].log
            session_sub.cursors[(stream, shard)] = ShardCursor(stream, shard, log, position)
        return broker.app.broker.stream("default").shards[0].log.low_watermark

    broker.call(broker.app.archiver.flush(timeout=30), timeout=40)
    assert broker.call(archive_and_cut) > 0  # the oldest records are only in the archive now
    back = Paho(broker.mqtt_port, "archivist", V5, clean=False, session_expiry=600)
    pub.publish("tier/x", "live", 1)
    received = [back.expect().payload for _ in range(201)]
    assert received == [f"{i:04d}".encode() for i in range(200)] + [b"live"]
    back.expect_none()


def test_a_session_whose_filters_never_match_a_stream_does_not_hold_its_journal(broker_factory):
    """Every durable subscription has a cursor on every reliable shard; one whose filters match
    nothing there must not keep the journal from the offset where it opened. A connected
    persistent session on `other/#` while `ret/x` fills the same stream: retention still runs.
    Then a message it does match still reaches it."""
    broker = broker_factory(journal={"segment_bytes": 4096, "retention_bytes": 8192}, archive={"enabled": False})
    elsewhere = Paho(broker.mqtt_port, "elsewhere", V5, clean=False, session_expiry=600)
    elsewhere.subscribe("other/#", 1)
    pub = Paho(broker.mqtt_port, "pub", V5)
    for index in range(300):
        pub.publish("ret/x", f"{index:04d}" + "x" * 100, 1, wait=index % 50 == 49)
    pub.publish("ret/x", "end", 1)

    def low_watermark() -> int:
        broker.app.persistence.flush()
        broker.app.persistence.apply_retention()
        return broker.app.broker.stream("default").shards[0].log.low_watermark

    from tests.conftest import wait_for

    assert wait_for(lambda: broker.call(low_watermark) > 0, timeout=10)
    pub.publish("other/y", "for you", 1)
    assert elsewhere.expect().payload == b"for you"
    elsewhere.expect_none(0.3)
