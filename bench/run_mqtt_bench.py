"""Run the MQTT benchmark scenarios against several brokers and tabulate the results.

For each broker (Shardgate, mosquitto, amqtt) and each scenario, the runner starts a fresh
broker on an ephemeral loopback port, drives it with ``mqtt_load.py`` (one child process per
repeat, each with its own time limit), stops the broker, and keeps the median of the repeats.
It prints a markdown table (one row per scenario, one column per broker, and the
Shardgate/mosquitto ratio); ``--write`` also records it in the ``## MQTT broker`` section of
``bench/RESULTS.md``, leaving the other sections of that file alone.

The machine has few cores and the broker and the generator share them, so by default the broker
is pinned to CPU 0 and the generator to CPU 1; before each repeat the runner waits (a bounded
time) for the rest of the machine to go quiet, and records how busy it was during each run.

This script only starts processes and reads their output; it must not import shardgate, so
that every broker is driven exactly the same way.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import os
import platform
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from _proc import stop_process

BENCH_DIR = Path(__file__).resolve().parent
LOAD = BENCH_DIR / "mqtt_load.py"
RESULTS = BENCH_DIR / "RESULTS.md"
SECTION = "## MQTT broker"
BROKERS = ("shardgate", "mosquitto", "amqtt", "shardgate-memory")
START_TIMEOUT = 30.0


# --------------------------------------------------------------------------- scenarios


@dataclass(frozen=True)
class Metric:
    """One table row: a value picked from a scenario's result."""

    label: str
    key: str
    unit: str
    higher_is_better: bool
    digits: int = 0
    scale: float = 1.0


@dataclass(frozen=True)
class Scenario:
    name: str
    mode: str
    args: tuple[str, ...]
    metrics: tuple[Metric, ...]
    repeated: bool = True


def scenarios(idle_connections: int, latency_rate: int) -> list[Scenario]:
    rate = Metric
    return [
        Scenario("qos0_1to1", "throughput", ("--qos", "0"),
                 (rate("QoS 0, 1 → 1", "rate", "msg/s", True),)),
        Scenario("qos1_1to1", "throughput", ("--qos", "1"),
                 (rate("QoS 1, 1 → 1 (window 100)", "rate", "msg/s", True),)),
        Scenario("fanin_8to1", "throughput", ("--qos", "0", "--publishers", "8"),
                 (rate("fan-in 8 → 1, QoS 0", "rate", "msg/s", True),)),
        Scenario("fanout_1to8", "throughput", ("--qos", "0", "--subscribers", "8"),
                 (rate("fan-out 1 → 8, QoS 0 (out-rate)", "rate", "msg/s", True),)),
        Scenario(
            "latency", "latency", ("--qos", "1", "--rate", str(latency_rate)),
            (
                Metric(f"latency p50, QoS 1 at {latency_rate:,} msg/s", "p50_ms", "ms", False, 3),
                Metric(f"latency p99, QoS 1 at {latency_rate:,} msg/s", "p99_ms", "ms", False, 3),
                Metric("rate reached in the latency run", "delivered_rate", "msg/s", True),
            ),
        ),
        Scenario(
            "idle", "idle", ("--connections", str(idle_connections)),
            (Metric(f"memory per idle connection ({idle_connections:,} conns)",
                    "bytes_per_connection", "KiB", False, 1, 1 / 1024),),
            repeated=False,
        ),
    ]


# --------------------------------------------------------------------------- brokers


def free_port() -> int:
    """An ephemeral loopback port that was free a moment ago."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def mqtt_ready(port: int) -> bool:
    """True when the port answers an MQTT 3.1.1 CONNECT with CONNACK 0 (§3.2)."""
    connect = bytes.fromhex("100f00044d5154540402003c0003") + b"rdy"
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=2) as sock:
            sock.sendall(connect)
            reply = sock.recv(4)
            sock.sendall(b"\xe0\x00")
            return len(reply) == 4 and reply[0] == 0x20 and reply[3] == 0
    except OSError:
        return False


@dataclass
class BrokerSpec:
    """How to start one broker; ``command`` gets the port and a scratch directory."""

    name: str
    command: Callable[[int, Path], list[str]]
    probe: Callable[[], str | None]
    """Returns None when the broker can run here, else why not."""
    version: Callable[[], str]


def _run_quiet(cmd: list[str], timeout: float = 30) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                          stdin=subprocess.DEVNULL)


def _mosquitto_command(port: int, workdir: Path) -> list[str]:
    conf = workdir / "mosquitto.conf"
    conf.write_text(
        f"listener {port} 127.0.0.1\n"
        "allow_anonymous true\n"
        "persistence false\n"
        "max_connections -1\n"
        "log_dest none\n"
    )
    return [shutil.which("mosquitto") or "/usr/sbin/mosquitto", "-c", str(conf)]


def _mosquitto_probe() -> str | None:
    return None if (shutil.which("mosquitto") or Path("/usr/sbin/mosquitto").exists()) \
        else "mosquitto not installed (apt-get install -y mosquitto)"


def _mosquitto_version() -> str:
    try:
        out = _run_quiet([shutil.which("mosquitto") or "/usr/sbin/mosquitto", "-h"]).stdout
        return out.splitlines()[0].replace("version ", "")
    except (OSError, IndexError, subprocess.SubprocessError):
        return "mosquitto"


def _amqtt_command(port: int, workdir: Path) -> list[str]:
    # Only the anonymous-auth plugin: no packet/event logging and no $SYS publisher.
    conf = workdir / "amqtt.yaml"
    conf.write_text(
        "listeners:\n"
        "  default:\n"
        "    type: tcp\n"
        f"    bind: 127.0.0.1:{port}\n"
        "plugins:\n"
        "  amqtt.plugins.authentication.AnonymousAuthPlugin:\n"
        "    allow_anonymous: true\n"
    )
    # The `amqtt` console script runs this module; invoking it directly keeps the broker's
    # PID ours (no launcher shim in between) and on this interpreter.
    return [sys.executable, "-m", "amqtt.scripts.broker_script", "-c", str(conf)]


def _amqtt_probe() -> str | None:
    result = _run_quiet([sys.executable, "-c", "import amqtt.scripts.broker_script"])
    return None if result.returncode == 0 else "amqtt not installed (pip install amqtt)"


def _amqtt_version() -> str:
    result = _run_quiet([sys.executable, "-c", "import amqtt; print(amqtt.__version__)"])
    return f"amqtt {result.stdout.strip()}" if result.returncode == 0 else "amqtt"


def _shardgate_command(port: int, workdir: Path) -> list[str]:
    return [sys.executable, "-m", "shardgate", "serve", "--host", "127.0.0.1",
            "--mqtt-port", str(port), "--mqtt-ws-port", "0", "--grpc-port", "0",
            "--http-port", "0", "--amqp-port", "0", "--data-dir", str(workdir / "data")]


def _shardgate_memory_command(port: int, workdir: Path) -> list[str]:
    """Shardgate with its default stream non-reliable (memory only, no journal, no archive):
    the baseline for what the journal costs."""
    config = workdir / "memory.toml"
    config.write_text('default_stream_mode = "non-reliable"\n[archive]\nenabled = false\n')
    return [*_shardgate_command(port, workdir), "--config", str(config)]


def _shardgate_probe() -> str | None:
    try:
        result = _run_quiet([sys.executable, "-m", "shardgate", "serve", "--help"])
    except subprocess.SubprocessError as exc:
        return f"`python -m shardgate serve --help` failed: {exc}"
    if result.returncode != 0:
        last = (result.stderr.strip().splitlines() or ["?"])[-1]
        return f"`python -m shardgate serve --help` failed: {last}"
    return None


def _shardgate_version() -> str:
    try:
        rev = _run_quiet(["git", "-C", str(BENCH_DIR), "rev-parse", "--short", "HEAD"])
        return f"shardgate @ {rev.stdout.strip()}" if rev.returncode == 0 else "shardgate"
    except (OSError, subprocess.SubprocessError):
        return "shardgate"


BROKER_SPECS = {
    "mosquitto": BrokerSpec("mosquitto", _mosquitto_command, _mosquitto_probe,
                            _mosquitto_version),
    "amqtt": BrokerSpec("amqtt", _amqtt_command, _amqtt_probe, _amqtt_version),
    "shardgate": BrokerSpec("shardgate", _shardgate_command, _shardgate_probe,
                            _shardgate_version),
    "shardgate-memory": BrokerSpec("shardgate-memory", _shardgate_memory_command,
                                   _shardgate_probe, _shardgate_version),
}


class BrokerStartError(Exception):
    """The broker exited or did not answer MQTT in time."""


def _pin(cpus: set[int] | None) -> Callable[[], None] | None:
    if not cpus:
        return None
    return lambda: os.sched_setaffinity(0, cpus)


@contextlib.contextmanager
def running_broker(spec: BrokerSpec, cpus: set[int] | None) -> Iterator[tuple[int, int]]:
    """Start the broker on a free loopback port; yield (port, pid); stop it after."""
    with tempfile.TemporaryDirectory(prefix=f"bench-{spec.name}-") as tmp:
        workdir = Path(tmp)
        port = free_port()
        log = open(workdir / "broker.log", "wb")  # noqa: SIM115 - closed below
        proc = subprocess.Popen(
            spec.command(port, workdir), stdout=log, stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL, cwd=workdir, preexec_fn=_pin(cpus),
            start_new_session=True,
        )
        try:
            deadline = time.monotonic() + START_TIMEOUT
            while not mqtt_ready(port):
                if proc.poll() is not None or time.monotonic() > deadline:
                    log.flush()
                    tail = (workdir / "broker.log").read_text(errors="replace")[-800:]
                    raise BrokerStartError(f"{spec.name} did not start on port {port}: {tail}")
                time.sleep(0.1)
            yield port, proc.pid
        finally:
            stop_process(proc, grace=10)
            log.close()


# --------------------------------------------------------------------------- running


def cpu_busy_cores(window: float = 0.5) -> float:
    """How many cores' worth of CPU the whole machine used over ``window`` seconds."""

    def read() -> tuple[int, int]:
        with open("/proc/stat") as fh:
            values = [int(v) for v in fh.readline().split()[1:]]
        total = sum(values[:8])
        return total - values[3] - values[4], total

    busy0, total0 = read()
    time.sleep(window)
    busy1, total1 = read()
    return (busy1 - busy0) / max(total1 - total0, 1) * (os.cpu_count() or 1)


@dataclass
class QuietGate:
    """Before each run, wait for the machine to go quiet: bounded per run and in total."""

    threshold: float
    per_run: float
    budget: float

    def wait(self) -> float:
        """Wait until under ``threshold`` cores are busy; return the last reading."""
        start = time.monotonic()
        deadline = start + min(self.per_run, max(self.budget, 0.0))
        busy = cpu_busy_cores()
        while busy > self.threshold and time.monotonic() < deadline:
            busy = cpu_busy_cores()
        self.budget -= time.monotonic() - start
        return busy


@dataclass
class Outcome:
    """The runs of one scenario on one broker."""

    max_other: float = float("inf")
    """A run during which the rest of the machine used more cores than this is disturbed."""
    runs: list[dict[str, Any]] = field(default_factory=list)
    error: str | None = None
    broker_failed: bool = False

    def disturbed(self, run: dict[str, Any]) -> bool:
        return run.get("other_cpu", 0.0) > self.max_other

    def clean_runs(self) -> list[dict[str, Any]]:
        return [r for r in self.runs if not self.disturbed(r)]

    def median(self, key: str) -> float | None:
        """Median over the undisturbed runs, or over all runs when every one was disturbed."""
        runs = self.clean_runs() or self.runs
        values = [r[key] for r in runs if isinstance(r.get(key), int | float)]
        return statistics.median(values) if values else None


def run_load(mode: str, port: int, pid: int, args: list[str], timeout: float,
             cpus: set[int] | None) -> dict[str, Any]:
    cmd = [sys.executable, str(LOAD), mode, "--port", str(port), "--broker-pid", str(pid), *args]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                              stdin=subprocess.DEVNULL, preexec_fn=_pin(cpus))
    except subprocess.TimeoutExpired:
        return {"error": f"generator timed out after {timeout:.0f} s"}
    lines = proc.stdout.strip().splitlines()
    try:
        return json.loads(lines[-1])
    except (IndexError, json.JSONDecodeError):
        return {"error": f"generator exit {proc.returncode}: {proc.stderr.strip()[-300:]}"}


@dataclass
class RetryAllowance:
    """Extra runs allowed in the whole session to replace runs disturbed by other work."""

    left: int


def run_scenario(spec: BrokerSpec, scenario: Scenario, opts: argparse.Namespace,
                 gate: QuietGate, retries: RetryAllowance,
                 log: Callable[[str], None]) -> Outcome:
    """Run one scenario on a fresh broker; a broker that fails to start gets a second try."""
    outcome = run_scenario_once(spec, scenario, opts, gate, retries, log)
    if outcome.broker_failed:
        time.sleep(5)
        outcome = run_scenario_once(spec, scenario, opts, gate, retries, log)
    return outcome


def run_scenario_once(spec: BrokerSpec, scenario: Scenario, opts: argparse.Namespace,
                      gate: QuietGate, retries: RetryAllowance,
                      log: Callable[[str], None]) -> Outcome:
    outcome = Outcome(max_other=opts.max_other)
    broker_cpus, load_cpus = ({0}, {1}) if opts.pin else (None, None)
    if scenario.mode == "idle":
        extra: list[str] = []
        timeout = 180.0
    else:
        extra = ["--duration", str(opts.duration), "--warmup", str(opts.warmup)]
        if opts.split:
            extra.append("--split")
        timeout = opts.duration + opts.warmup + 60.0
    repeats = opts.repeats if scenario.repeated else 1
    try:
        with running_broker(spec, broker_cpus) as (port, pid):
            attempts = 0
            while len(outcome.clean_runs()) < repeats:
                if attempts >= repeats:  # a disturbed run is replaced while allowance lasts
                    if attempts >= repeats + 2 or retries.left <= 0:
                        break
                    retries.left -= 1
                attempts += 1
                background = gate.wait()
                result = run_load(scenario.mode, port, pid, [*scenario.args, *extra],
                                  timeout, load_cpus)
                result["background_before"] = round(background, 2)
                log(f"  {spec.name:9} {scenario.name:11} run {attempts}: " + json.dumps(result))
                if "error" in result:
                    outcome.error = result["error"]
                    break
                outcome.runs.append(result)
    except BrokerStartError as exc:
        outcome.error = str(exc)
        outcome.broker_failed = True
        log(f"  {spec.name:9} {scenario.name:11} failed: {exc}")
    except (OSError, subprocess.SubprocessError) as exc:
        outcome.error = str(exc)
        log(f"  {spec.name:9} {scenario.name:11} failed: {exc}")
    return outcome


# --------------------------------------------------------------------------- reporting


def fmt(value: float | None, metric: Metric) -> str:
    if value is None:
        return "—"
    value *= metric.scale
    return f"{value:,.{metric.digits}f}"


def ratio(a: float | None, b: float | None) -> str:
    if a is None or b is None or b == 0:
        return "—"
    return f"{a / b:.2f}×"


def results_table(brokers: list[str], plan: list[Scenario],
                  outcomes: dict[tuple[str, str], Outcome], skipped: dict[str, str]) -> str:
    head = ["scenario", *brokers]
    with_ratio = "shardgate" in brokers and "mosquitto" in brokers
    if with_ratio:
        head.append("shardgate / mosquitto")
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" + "---:|" * (len(head) - 1)]
    for scenario in plan:
        for metric in scenario.metrics:
            cells = [f"{metric.label} ({metric.unit}, {'higher' if metric.higher_is_better else 'lower'} is better)"]
            values: dict[str, float | None] = {}
            for broker in brokers:
                if broker in skipped:
                    cells.append("skipped")
                    values[broker] = None
                    continue
                outcome = outcomes.get((broker, scenario.name))
                values[broker] = outcome.median(metric.key) if outcome else None
                if values[broker] is not None:
                    only_disturbed = outcome is not None and not outcome.clean_runs() \
                        and scenario.mode != "idle"
                    cells.append(fmt(values[broker], metric) + ("*" if only_disturbed else ""))
                else:
                    cells.append("error" if outcome else "not run")
            if with_ratio:
                cells.append(ratio(values["shardgate"], values["mosquitto"]))
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def details_table(brokers: list[str], plan: list[Scenario],
                  outcomes: dict[tuple[str, str], Outcome]) -> str:
    """Every run, with the CPU use of broker, generator and the rest of the machine."""
    lines = [
        "| scenario | broker | runs | broker CPU | msg/s per broker core | generator CPU "
        "| other CPU | written off |",
        "|---|---|---|---:|---:|---:|---:|---:|",
    ]
    for scenario in plan:
        key = scenario.metrics[0].key
        for broker in brokers:
            outcome = outcomes.get((broker, scenario.name))
            if outcome is None:
                continue
            if not outcome.runs:
                lines.append(f"| {scenario.name} | {broker} | error: "
                             f"{(outcome.error or '?')[:120].replace('|', '/')} | | | | | |")
                continue
            def mark(r: dict[str, Any], o: Outcome = outcome) -> str:
                return "*" if o.disturbed(r) else ""

            runs = " / ".join(fmt(r.get(key), scenario.metrics[0]) + mark(r)
                              for r in outcome.runs)
            if scenario.mode == "latency":
                runs += " (p99: " + " / ".join(
                    fmt(r.get("p99_ms"), scenario.metrics[1]) + mark(r)
                    for r in outcome.runs) + ")"
            if scenario.mode == "idle":
                r = outcome.runs[0]
                runs += (f" ({r.get('alive')}/{r.get('requested')} alive, "
                         f"RSS {r.get('rss_before', 0) / 2**20:.1f} → "
                         f"{r.get('rss_after', 0) / 2**20:.1f} MiB)")
            if outcome.error:
                runs += f"; then error: {outcome.error[:80]}"

            def cpu(k: str, o: Outcome = outcome) -> str:
                v = o.median(k)
                return "—" if v is None else f"{v:.2f}"

            per_core = [r["rate"] / r["broker_cpu"] for r in outcome.clean_runs() or outcome.runs
                        if r.get("rate") and r.get("broker_cpu")]
            efficiency = f"{statistics.median(per_core):,.0f}" if per_core else "—"
            written_off = sum(r.get("written_off", 0) for r in outcome.runs)
            lines.append(f"| {scenario.name} | {broker} | {runs} | {cpu('broker_cpu')} | "
                         f"{efficiency} | {cpu('generator_cpu')} | {cpu('other_cpu')} | "
                         f"{written_off:,} |")
    return "\n".join(lines)


def machine_description() -> str:
    model = "unknown CPU"
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    nproc = len(os.sched_getaffinity(0))
    load = " / ".join(f"{v:.2f}" for v in os.getloadavg())
    return (f"{nproc} CPUs (nproc), {model}; Linux {platform.release()}; "
            f"Python {platform.python_version()}; {dt.date.today().isoformat()}; "
            f"load average at start {load}")


def write_section(text: str, path: Path = RESULTS) -> None:
    """Replace (or add) the ``## MQTT broker`` section of RESULTS.md, keep the rest."""
    old = path.read_text() if path.exists() else "# Benchmark results\n"
    lines = old.splitlines()
    start = next((i for i, line in enumerate(lines) if line.strip() == SECTION), None)
    if start is None:
        new = old.rstrip("\n") + "\n\n" + text.rstrip("\n") + "\n"
    else:
        end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith("## ")),
                   len(lines))
        before = "\n".join(lines[:start]).rstrip("\n")
        after = "\n".join(lines[end:])
        new = (before + "\n\n" if before else "") + text.rstrip("\n") + "\n"
        if after:
            new += "\n" + after.rstrip("\n") + "\n"
    path.write_text(new)


def section_text(command: str, machine: str, versions: list[str], table: str, details: str,
                 skipped: dict[str, str], opts: argparse.Namespace) -> str:
    skipped_lines = "".join(f"- {name}: {why}\n" for name, why in skipped.items())
    return f"""{SECTION}

Recorded by `{command}` (method and caveats: [README.md](README.md)).

- Machine: {machine}.
- Brokers: {"; ".join(versions)}.
- Generator: `bench/mqtt_load.py` (uvloop, raw MQTT 3.1.1), {opts.duration:g} s measured after
  {opts.warmup:g} s warm-up, median of {opts.repeats} runs, 64-byte payloads;
  {"broker pinned to CPU 0, generator to CPU 1" if opts.pin else "no CPU pinning"}{
  ", subscribers in their own process" if opts.split else ""}.
{skipped_lines}
{table}

Ratios above 1 favour Shardgate for rates and mosquitto for latency and memory. A value
marked * comes only from runs disturbed by other work on the machine (see below): read it as a
lower bound for rates, an upper bound for latency.

<details><summary>Every run, with CPU use (1.00 = one core busy)</summary>

"other CPU" is what the rest of the machine used during the measured window; where it is high,
the brokers were sharing their cores and the rates are lower than the machine can give.
"msg/s per broker core" (rate ÷ broker CPU) is less sensitive to that. Runs marked * had
other CPU above {opts.max_other:g}: they were replaced by further runs while the allowance lasted
and count in the median only when no undisturbed run was left. "written off" counts, over all
runs, the messages the generator gave up waiting for (nothing arrived for 0.5 s while the
subscribers lagged by the limit): QoS 0 messages the broker dropped or held back that long.

{details}

</details>
"""


# --------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--brokers", default=",".join(BROKERS),
                        help="comma-separated: shardgate,mosquitto,amqtt")
    parser.add_argument("--scenarios", default="",
                        help="comma-separated subset of: qos0_1to1, qos1_1to1, fanin_8to1, "
                             "fanout_1to8, latency, idle (default all)")
    parser.add_argument("--duration", type=float, default=5.0, help="measured seconds per run")
    parser.add_argument("--warmup", type=float, default=1.0, help="warm-up seconds per run")
    parser.add_argument("--repeats", type=int, default=3, help="runs per scenario (median)")
    parser.add_argument("--idle-connections", type=int, default=5000)
    parser.add_argument("--latency-rate", type=int, default=5000)
    parser.add_argument("--quick", action="store_true",
                        help="smoke run: 2 s, one run, 1,000 idle connections")
    parser.add_argument("--split", action="store_true",
                        help="generator runs its subscribers in a second process")
    parser.add_argument("--no-pin", dest="pin", action="store_false",
                        help="do not pin broker and generator to separate CPUs")
    parser.add_argument("--quiet-threshold", type=float, default=0.3,
                        help="before each run, wait until the machine uses fewer cores than this")
    parser.add_argument("--quiet-wait", type=float, default=10.0,
                        help="... but at most this many seconds per run")
    parser.add_argument("--quiet-budget", type=float, default=90.0,
                        help="... and at most this many seconds in all")
    parser.add_argument("--max-other", type=float, default=0.5,
                        help="a run during which other work used more cores than this is "
                             "disturbed: replaced by another run if allowed, left out of the "
                             "median if enough others are not")
    parser.add_argument("--extra-runs", type=int, default=12,
                        help="replacement runs allowed in all (at most 2 per scenario)")
    parser.add_argument("--write", action="store_true",
                        help="record the results in the MQTT section of bench/RESULTS.md")
    opts = parser.parse_args(argv)
    if opts.quick:
        opts.duration, opts.warmup, opts.repeats = 2.0, 0.5, 1
        opts.idle_connections = min(opts.idle_connections, 1000)
        opts.quiet_wait = min(opts.quiet_wait, 3.0)
        opts.quiet_budget = min(opts.quiet_budget, 30.0)
        opts.extra_runs = min(opts.extra_runs, 3)
    if opts.pin and len(os.sched_getaffinity(0)) < 2:
        opts.pin = False
    return opts


def main(argv: list[str] | None = None) -> int:
    opts = parse_args(argv)
    brokers = [b.strip() for b in opts.brokers.split(",") if b.strip()]
    unknown = [b for b in brokers if b not in BROKER_SPECS]
    if unknown:
        print(f"unknown broker(s): {', '.join(unknown)}", file=sys.stderr)
        return 2
    plan = scenarios(opts.idle_connections, opts.latency_rate)
    if opts.scenarios:
        wanted = {s.strip() for s in opts.scenarios.split(",")}
        plan = [s for s in plan if s.name in wanted]

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    # 5,000 client sockets here and as many in the broker, which inherits this limit.
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = opts.idle_connections * 2 + 1024
    if soft != resource.RLIM_INFINITY and soft < want:
        resource.setrlimit(resource.RLIMIT_NOFILE,
                           (want if hard == resource.RLIM_INFINITY else min(want, hard), hard))

    started = time.monotonic()
    gate = QuietGate(opts.quiet_threshold, opts.quiet_wait, opts.quiet_budget)
    retries = RetryAllowance(opts.extra_runs)
    machine = machine_description()
    skipped: dict[str, str] = {}
    failed: dict[str, str] = {}
    versions: list[str] = []
    outcomes: dict[tuple[str, str], Outcome] = {}
    for name in brokers:
        spec = BROKER_SPECS[name]
        why = spec.probe()
        if why:
            skipped[name] = f"skipped: {why}"
            log(f"{name}: skipped ({why})")
            continue
        versions.append(spec.version())
        log(f"{name}: {versions[-1]}")
        for scenario in plan:
            outcome = run_scenario(spec, scenario, opts, gate, retries, log)
            outcomes[(name, scenario.name)] = outcome
            if outcome.broker_failed:
                failed[name] = (f"stopped after failing to start for {scenario.name}: "
                                + (outcome.error or "").strip().splitlines()[-1][-200:])
                break
    log(f"done in {time.monotonic() - started:.0f} s")

    table = results_table(brokers, plan, outcomes, skipped)
    print(table)
    if opts.write:
        shown = argv if argv is not None else sys.argv[1:]
        command = " ".join(["python bench/run_mqtt_bench.py", *shown])
        details = details_table(brokers, plan, outcomes)
        write_section(section_text(command, machine, versions, table, details,
                                   {**skipped, **failed}, opts))
        log(f"wrote the MQTT section of {RESULTS}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
