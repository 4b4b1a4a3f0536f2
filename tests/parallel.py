"""How the suite runs in parallel: pytest-xdist workers (`python -m pytest -n auto`; pyproject's
addopts add `--dist loadgroup --no-loadscope-reorder`), each its own process with its own
session fixtures (one RabbitMQ node per worker that needs one) and its own temporary directory.

Each test is a unit of work a worker takes when it has little left, except the tests that must
stay together on one worker, which get an `xdist_group` here:

- `readme`: the README tests run `shardgate serve`, etcd and cluster nodes on the fixed ports
  the README prints, so they run one after another;
- the tests of a module (or class) whose fixture is module- (or class-) scoped: a Spark
  session, a browser, a moto server, a cluster its tests share start once, on one worker;
- tests that start server processes (a fixture in PROCESS_FIXTURES in their closure: etcd,
  cluster nodes, `shardgate serve`) are marked `processes`. They compute while they start
  (an interpreter and the broker's imports per node), so they are spread over PROCESS_GROUPS
  groups, balanced by their recorded seconds, a module's tests in one group (so a module's
  shared cluster too): at most that many run at once, beside workers running the tests that
  wait on sockets rather than compute.

Units start longest first, by the seconds recorded in tests/durations.json (setup, call and
teardown per test; a test not in it counts DEFAULT_SECONDS). `--record-durations` writes that
file from a run (a full run: it replaces the file).

Workers share the cores, so a test takes longer in a parallel run than alone: a test with no
time limit of its own gets SLOWDOWN times its recorded seconds when that is more than the
suite's limit (pyproject's `timeout`), so that a long property test or cluster test is not
cut off by the run's load alone (a limit a test sets itself is left as it is).

`-n auto` starts WORKERS_PER_CORE workers per core the process may use: the tests mostly wait.
This module must not change what a test asserts, only where and when it runs.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

DURATIONS = Path(__file__).with_name("durations.json")
DEFAULT_SECONDS = 1.0
WORKERS_PER_CORE = 2
# fixtures that start server processes: a test using one (directly or through another) is
# marked `processes`
PROCESS_FIXTURES = frozenset({"etcd", "module_etcd", "cluster", "broker_process"})
# (2 made the process groups the run's longest path: by tests/durations.json they hold more than
# half of the suite's seconds, so two workers ran them while the others ran out of work)
PROCESS_GROUPS = 3
# in a parallel run, a test's time limit is at least this many times its recorded seconds
SLOWDOWN = 3.0
# modules that start server processes without those fixtures, or on the README's fixed ports
README_MODULES = frozenset({"tests/e2e/test_readme.py", "tests/e2e/test_readme_cluster.py"})


def pytest_addoption(parser: pytest.Parser, pluginmanager: pytest.PytestPluginManager) -> None:
    parser.addoption(
        "--record-durations", action="store_true", default=False,
        help="write the seconds of each test (setup, call, teardown) to tests/durations.json; "
             "the scheduling of parallel runs reads it (longest first)")
    if not pluginmanager.has_plugin("xdist"):
        # `-p no:xdist` (or no pytest-xdist): pyproject's addopts still name xdist's options,
        # which mean nothing then; accepted here so that the run starts
        group = parser.getgroup("xdist-absent", "pytest-xdist's options, without pytest-xdist")
        group.addoption("--dist", dest="dist", default="no", help="(ignored)")
        group.addoption("--no-loadscope-reorder", dest="loadscopereorder", action="store_false",
                        default=True, help="(ignored)")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "processes: starts server processes (etcd, cluster nodes, shardgate serve); "
                   "set from the fixtures a test uses (tests/parallel.py)")
    if config.getoption("record_durations") and not hasattr(config, "workerinput"):
        config.pluginmanager.register(DurationRecorder(), "shardgate-duration-recorder")


@pytest.hookimpl(optionalhook=True)  # (a hook of pytest-xdist's)
def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """`-n auto`: WORKERS_PER_CORE per usable core (the tests mostly wait on sockets)."""
    return WORKERS_PER_CORE * len(os.sched_getaffinity(0))


def recorded_seconds() -> dict[str, float]:
    try:
        return {str(k): float(v) for k, v in json.loads(DURATIONS.read_text()).items()}
    except (OSError, ValueError):
        return {}


def scoped_fixture_owner(item: pytest.Item) -> str | None:
    """The node id of the module or class whose scoped fixture `item` uses, if any."""
    info = getattr(item, "_fixtureinfo", None)
    if info is None:
        return None
    scopes = {defs[-1].scope for defs in info.name2fixturedefs.values() if defs}
    if "class" in scopes and item.cls is not None:
        return item.nodeid.rsplit("::", 2)[0] + "::" + item.cls.__name__
    if "module" in scopes or "package" in scopes or "class" in scopes:
        return item.nodeid.split("::", 1)[0]
    return None


def starts_processes(item: pytest.Item) -> bool:
    return bool(PROCESS_FIXTURES & set(getattr(item, "fixturenames", ())))


@pytest.hookimpl(tryfirst=True)  # before xdist's, which reads the groups into the node ids
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark, group and order the tests (see the module's docstring)."""
    seconds = recorded_seconds()

    def cost(item: pytest.Item) -> float:
        return seconds.get(item.nodeid, DEFAULT_SECONDS)

    groups: dict[int, str] = {}  # id(item) -> group
    process_items: list[pytest.Item] = []
    for item in items:
        module = item.nodeid.split("::", 1)[0]
        if module in README_MODULES:
            groups[id(item)] = "readme"
        elif starts_processes(item):
            # into a process group below, with the rest of its module: a module- or
            # class-scoped fixture (a cluster its tests share) still starts once there
            process_items.append(item)
        elif (owner := scoped_fixture_owner(item)) is not None:
            groups[id(item)] = owner
        if starts_processes(item):
            item.add_marker(pytest.mark.processes)
    # process tests: longest first onto the group with the fewest seconds so far; a module's
    # tests stay together in one group (they share helpers and often a kind of cluster)
    by_module: dict[str, list[pytest.Item]] = {}
    for item in process_items:
        by_module.setdefault(item.nodeid.split("::", 1)[0], []).append(item)
    loads = [0.0] * PROCESS_GROUPS
    for module_items in sorted(by_module.values(), key=lambda m: -sum(map(cost, m))):
        index = loads.index(min(loads))
        loads[index] += sum(map(cost, module_items))
        for item in module_items:
            groups[id(item)] = f"processes-{index + 1}"

    weights: dict[str, float] = {}
    first: dict[str, int] = {}
    for index, item in enumerate(items):
        unit = groups.get(id(item), item.nodeid)
        weights[unit] = weights.get(unit, 0.0) + cost(item)
        first.setdefault(unit, index)
        if id(item) in groups and hasattr(config, "workerinput"):
            item.add_marker(pytest.mark.xdist_group(unit))
    if hasattr(config, "workerinput"):
        widen_time_limits(config, items, cost)
    if hasattr(config, "workerinput"):  # the order xdist hands out units: longest first, a
        # unit's tests together and in their order
        items.sort(key=lambda item: (-weights[u := groups.get(id(item), item.nodeid)], first[u]))


def widen_time_limits(config: pytest.Config, items: list[pytest.Item],
                      cost: Any) -> None:
    """Give a test without a timeout mark SLOWDOWN times its recorded seconds, where that is
    more than the suite's limit (see the module's docstring)."""
    try:  # `--timeout`, else pyproject's
        limit = float(config.getoption("timeout", None) or config.getini("timeout") or 0)
    except (ValueError, TypeError):
        return
    if limit <= 0:
        return
    for item in items:
        wanted = SLOWDOWN * cost(item)
        if wanted > limit and item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(int(wanted) + 1))


class DurationRecorder:
    """Sums setup, call and teardown seconds per test; writes tests/durations.json at the end
    (on the controller when run with xdist: workers send it every report)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    def pytest_runtest_logreport(self, report: Any) -> None:
        nodeid = report.nodeid.rpartition("@")[0] or report.nodeid  # (xdist: `id@group`)
        self.seconds[nodeid] = self.seconds.get(nodeid, 0.0) + report.duration

    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        rounded = {nodeid: round(value, 1) for nodeid, value in sorted(self.seconds.items())}
        DURATIONS.write_text(json.dumps(rounded, indent=0) + "\n")
