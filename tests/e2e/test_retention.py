"""Journal retention never deletes what a durable cursor still needs."""

from __future__ import annotations

from tests.mqtt_clients import V5, Paho


def test_retention_waits_for_offline_session_then_frees_space(broker_factory):
    broker = broker_factory(journal={"segment_bytes": 4096, "retention_bytes": 8192})
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
