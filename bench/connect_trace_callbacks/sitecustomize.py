"""How long the broker's event-loop callbacks take under a load: a diagnostic, never part of
the broker.

Put this folder first on ``PYTHONPATH`` and name an output file in ``CALLBACK_TRACE``; every
`shardgate serve` started with that environment (`bench/soak.py` passes its environment on)
then times the loop callbacks that can make a turn long, and writes, when it exits, one JSON
object: for each callback its calls, total seconds, and the calls (and their seconds) longer
than 2 ms and 5 ms. Other processes (the soak's generator) are left alone.

``CALLBACK_TRACE_TURN_PUMP_S`` (seconds) also sets `core.replay_turns.TURN_PUMP_S`, the replay time
per turn, for A/B runs of one checkout:

    PYTHONPATH=bench/connect_trace_callbacks CALLBACK_TRACE=/tmp/callbacks.json \\
        python bench/soak.py --minutes 1.5 --clients 200 --rounds 1 --settle 10 --probe
"""

from __future__ import annotations

import atexit
import importlib
import json
import os
import time
from collections.abc import Callable
from typing import Any

_PATH = os.environ.get("CALLBACK_TRACE")
_TURN_PUMP_S = os.environ.get("CALLBACK_TRACE_TURN_PUMP_S")

TIMED = (
    ("shardgate.core.durable", "PumpQueue", "_run"),
    ("shardgate.protocols.read_budget", "ReadBudget", "_next_turn"),
    ("shardgate.protocols.mqtt.server", "MqttProtocol", "data_received"),
    ("shardgate.protocols.mqtt.server", "MqttProtocol", "connection_made"),
    ("shardgate.protocols.mqtt.server", "MqttProtocol", "connection_lost"),
    ("shardgate.protocols.output", "OutputBatcher", "flush"),
    ("shardgate.protocols.listener", "TcpListener", "_accept"),
)


def _is_broker() -> bool:
    try:
        with open("/proc/self/cmdline", "rb") as cmdline:
            return b"serve" in cmdline.read().split(b"\0")
    except OSError:
        return False


def _timed(original: Callable[..., Any], record: list[float]) -> Callable[..., Any]:
    clock = time.perf_counter

    def timed(self: object, *args: object, **kwargs: object) -> Any:
        start = clock()
        try:
            return original(self, *args, **kwargs)
        finally:
            took = clock() - start
            record[0] += 1
            record[1] += took
            if took > 0.002:
                record[2] += 1
                record[3] += took
                if took > 0.005:
                    record[4] += 1
                    record[5] += took

    return timed


def _install(path: str) -> None:
    # per callback: calls, seconds, calls > 2 ms, their seconds, calls > 5 ms, their seconds
    records: dict[str, list[float]] = {}
    for module_name, class_name, method in TIMED:
        cls = getattr(importlib.import_module(module_name), class_name)
        record = records[f"{class_name}.{method}"] = [0, 0.0, 0, 0.0, 0, 0.0]
        setattr(cls, method, _timed(getattr(cls, method), record))

    def dump() -> None:
        with open(path, "w") as out:
            json.dump(records, out)

    atexit.register(dump)


if _is_broker():
    if _PATH:
        _install(_PATH)
    if _TURN_PUMP_S:
        from shardgate.core import replay_turns

        replay_turns.TURN_PUMP_S = float(_TURN_PUMP_S)
