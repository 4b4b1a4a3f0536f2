"""The cluster fixtures leave no `shardgate serve` behind, however a test fails.

A fixture that starts nodes one after another (as `amqp_nodes` does) and whose second node
fails to start never reaches its own teardown: the first node used to outlive the test run.
Every node process is now tracked and ended after its test (`_end_processes_left_running` in
tests/conftest.py). This test runs such tests in a child pytest, with the fixtures of the
suite, and checks that their nodes are gone when the child ends.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.e2e.cluster_fixtures import ETCD

INNER_TEST = '''
from pathlib import Path

import pytest

from tests.e2e.cluster_fixtures import ClusterNodeProcess


@pytest.fixture
def two_nodes(etcd, tmp_path):
    nodes = [
        ClusterNodeProcess(tmp_path / f"n{index}", f"n{index}", etcd.url,
                           extra_args=["--no-such-option"] if index == 2 else []).start()
        for index in (1, 2)
    ]
    yield nodes  # (never reached: n2 fails, n1 is up)
    for node in nodes:
        node.kill()


def test_second_node_fails(etcd, tmp_path, request):
    first = ClusterNodeProcess(tmp_path / "first", "first", etcd.url).start()
    Path(request.config.getoption("--pid-file")).write_text(str(first.proc.pid))
    request.getfixturevalue("two_nodes")


def test_the_test_itself_fails(etcd, tmp_path, request):
    node = ClusterNodeProcess(tmp_path / "alone", "alone", etcd.url).start()
    with open(request.config.getoption("--pid-file"), "a") as pids:
        pids.write(f" {node.proc.pid}")
    raise AssertionError("the test failed with its node up")
'''

INNER_CONFTEST = '''
from tests.conftest import _end_processes_left_running  # noqa: F401
from tests.e2e.cluster_fixtures import cluster, etcd  # noqa: F401


def pytest_addoption(parser):
    parser.addoption("--pid-file")
'''


def running(pid: int) -> bool:
    """Whether `pid` is a live process (not a zombie)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, IndexError):
        return False
    return state != "Z"


def test_nodes_started_by_a_failing_test_or_fixture_do_not_outlive_it(tmp_path: Path) -> None:
    if ETCD is None:
        pytest.skip("etcd is not installed (apt-get install etcd-server)")
    inner = tmp_path / "inner"
    inner.mkdir()
    (inner / "conftest.py").write_text(INNER_CONFTEST)
    (inner / "test_inner.py").write_text(INNER_TEST)
    pid_file = tmp_path / "pids"
    repository = Path(__file__).resolve().parents[2]
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--rootdir", str(inner),
         str(inner), f"--pid-file={pid_file}", "--basetemp", str(tmp_path / "basetemp")],
        cwd=repository, capture_output=True, text=True, timeout=300,
        env={**os.environ, "PYTHONPATH": str(repository)})
    output = result.stdout + result.stderr
    assert "2 failed" in output, output  # both inner tests failed, as they should
    assert "--no-such-option" in output or "did not start" in output, output  # n2 did not start
    pids = [int(pid) for pid in pid_file.read_text().split()]
    assert len(pids) == 2, output
    # every node the child started, n1 of the fixture included, is gone with the child
    leftover = [pid for pid in pids if running(pid)]
    leftover += [int(line.split()[0]) for line in subprocess.run(
        ["pgrep", "-af", str(tmp_path / "basetemp")], capture_output=True, text=True).stdout.splitlines()
        if "shardgate" in line]
    leftover = sorted(set(leftover))
    for pid in leftover:  # (not to leave them to the next test)
        os.kill(pid, 9)
    assert not leftover, f"left running: {leftover}\n{output}"
