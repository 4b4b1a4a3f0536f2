"""The randomized fault run (`bench/cluster_chaos.py`), short and with a fixed seed, sized for
CI: etcd and three nodes, paho MQTT 5 publishers and persistent sessions, an aio-pika publisher
with confirms and a durable-queue consumer, a gRPC SDK producer and durable consumer, spread
over the nodes, while nodes are SIGKILLed, SIGTERMed and frozen, etcd restarts and clients move.
At the end: no acknowledged message lost, duplicates only across faults, each publisher's
order per topic kept, no traceback in any node's log, no stuck client.

Seed 1 applies, in order: SIGKILL, etcd restart (twice), a client moved, SIGTERM, SIGSTOP,
SIGKILL... (each fault waits for the cluster to settle). Longer runs with other seeds:
`python bench/cluster_chaos.py --seed N --minutes M`."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.cluster_chaos import run
from tests.e2e.cluster_fixtures import ETCD

SEED = 1
FAULT_SECONDS = 30
EVERY_KIND = 6
"""Seed 1's first six faults hold every kind: on a loaded machine, where each settle takes
longer, the run goes on past its 30 s until they were applied."""


@pytest.mark.chaos
@pytest.mark.timeout(420)
def test_a_short_fault_run_loses_no_acknowledged_message(tmp_path: Path) -> None:
    if ETCD is None:
        pytest.skip("etcd is not installed (apt-get install etcd-server)")
    result = run(tmp_path, SEED, FAULT_SECONDS, min_faults=EVERY_KIND, report=print)
    kinds = {fault.split()[0] for fault in result.faults}
    assert {"SIGKILL", "SIGTERM", "SIGSTOP", "restart", "move"} <= kinds, result.faults
    publishers = {"mpub1", "mpub2", "apub", "gpub"}
    assert publishers <= {name for name, count in result.acknowledged.items() if count > 0}
    findings = result.findings
    # every consumer: nothing lost, duplicates only across a fault, each publisher's order kept
    assert not findings.failed, findings.summary()
