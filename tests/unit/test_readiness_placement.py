"""`/readyz`'s placement check (`shardgate.admin.health.placement_served`): a cluster node is
ready only when it serves every shard the placement gives it."""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

from shardgate.admin.health import placement_served
from shardgate.cluster.placement import ShardPlacement


@dataclass
class View:
    node_id: str = "n1"
    controller_id: str | None = "n1"
    streams: dict[str, Any] = field(default_factory=dict)
    placement: dict[str, list[ShardPlacement]] = field(default_factory=dict)
    led: set[tuple[str, int]] = field(default_factory=set)

    def leads(self, stream: str, shard: int) -> bool:
        return (stream, shard) in self.led


def broker(**streams: tuple[str, int, bool]) -> Any:
    """streams: name -> (mode, shard count, journal open)."""
    return SimpleNamespace(streams={
        name: SimpleNamespace(config=SimpleNamespace(mode=mode), shards=[
            SimpleNamespace(log=object() if opened else None) for _ in range(count)])
        for name, (mode, count, opened) in streams.items()})


def two_shards() -> View:
    return View(streams={"data": {}}, placement={"data": [ShardPlacement.single("n1", 1),
                                                            ShardPlacement.single("n2", 1)]},
                led={("data", 0)})


def test_a_node_serving_its_shards_is_ready() -> None:
    assert placement_served(broker(data=("reliable", 2, True)), two_shards()) == (
        True, "serves its 1 shards")


def test_no_controller_or_an_unplaced_stream_is_not_ready() -> None:
    view = two_shards()
    view.controller_id = None
    assert placement_served(broker(data=("reliable", 2, True)), view)[0] is False
    view = two_shards()
    view.streams["new"] = {}
    ok, detail = placement_served(broker(data=("reliable", 2, True)), view)
    assert not ok and "new" in detail


def test_a_shard_placed_here_but_not_led_open_or_journaled_is_not_ready() -> None:
    view = two_shards()
    view.led.clear()  # lease lapsed, or released by a drain
    ok, detail = placement_served(broker(data=("reliable", 2, True)), view)
    assert not ok and "data/0 (not led here)" in detail
    ok, detail = placement_served(broker(), two_shards())
    assert not ok and "data/0 (stream not open)" in detail
    ok, detail = placement_served(broker(data=("reliable", 2, False)), two_shards())
    assert not ok and "data/0 (journal not open)" in detail
    assert placement_served(broker(data=("non-reliable", 2, False)), two_shards())[0] is True
