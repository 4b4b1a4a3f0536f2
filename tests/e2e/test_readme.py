"""The README, run as printed: every command of its shell blocks (in a fresh directory, against
`shardgate serve` on the default ports), and its Python snippets (aio-pika, the SDK, Spark).

Two commands are checked elsewhere: the test-suite command (`pip install -q -e '.[test]' &&
python -m pytest -q -n auto`) is what `.ci/run` runs verbatim (running it here would recurse), and the
"Running a cluster" and "Multi-core on one host" blocks have their own test
(`test_readme_cluster.py`)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.e2e.readme_shell import end_groups, port_free

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
TEST_SUITE = "pip install -q -e '.[test]' && python -m pytest -q -n auto"
DEFAULT_PORTS = (1883, 8083, 5672, 6650, 8080)


CLUSTER_SECTIONS = ("Running a cluster", "Multi-core on one host")


def blocks(language: str) -> list[tuple[str, str]]:
    """(section title, block text) of every fenced block in `language`, outside the cluster
    sections."""
    found = []
    section = ""
    lines = README.read_text().splitlines()
    index = 0
    while index < len(lines):
        line = lines[index]
        if line.startswith("## "):
            section = line[3:].strip()
        if line == f"```{language}":
            end = lines.index("```", index + 1)
            if section not in CLUSTER_SECTIONS:
                found.append((section, "\n".join(lines[index + 1:end])))
            index = end
        index += 1
    return found


def commands() -> list[str]:
    return [line for _, block in blocks("sh") for line in block.splitlines() if line.strip()]


def snippet(start: str) -> str:
    for _, block in blocks("python"):
        if block.startswith(start):
            return block
    raise AssertionError(f"no Python block starting with {start!r} in the README")


@pytest.fixture
def shell(tmp_path: Path) -> Iterator[tuple[dict[str, str], list[subprocess.Popen[str]]]]:
    """The environment the README's commands run in: a virtual environment of its own (on top
    of this interpreter's packages), so that the README's `pip install -e .` installs there and
    never replaces the package that the other tests (other xdist workers) import meanwhile."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(venv)],
                   check=True, capture_output=True, timeout=300)
    env = {k: v for k, v in os.environ.items() if not k.startswith("SHARDGATE_")}
    env.pop("PYTHONHOME", None)
    env["VIRTUAL_ENV"] = str(venv)
    env["PATH"] = os.pathsep.join(
        [str(venv / "bin"), str(Path(sys.executable).parent), env.get("PATH", "")])
    env["SPARK_LOCAL_IP"] = "127.0.0.1"
    (tmp_path / "examples").symlink_to(ROOT / "examples")
    background: list[subprocess.Popen[str]] = []
    yield env, background
    end_groups(background)


def wrapped(code: str, timeout_s: float) -> str:
    """A snippet with top-level `await` as a script: its body in a coroutine run with a timeout
    (a consumer loop runs until then)."""
    return (
        "import asyncio\n\nasync def snippet():\n" + textwrap.indent(code, "    ") + "\n\n"
        "try:\n"
        f"    asyncio.run(asyncio.wait_for(snippet(), {timeout_s}))\n"
        "except TimeoutError:\n    pass\n"
    )


def test_the_test_suite_command_is_what_ci_runs() -> None:
    assert TEST_SUITE in commands()
    assert TEST_SUITE in (ROOT / ".ci" / "run").read_text().splitlines()


@pytest.mark.timeout(1800)  # pip install -e ., four Spark jobs, on a loaded machine
def test_readme_commands_and_snippets_run_as_printed(
    tmp_path: Path, shell: tuple[dict[str, str], list[subprocess.Popen[str]]],
) -> None:
    for tool in ("mosquitto_sub", "mosquitto_pub", "java"):
        if shutil.which(tool) is None:
            pytest.skip(f"{tool} is not installed")
    busy = [port for port in DEFAULT_PORTS if not port_free(port)]
    if busy:
        pytest.skip(f"default ports the README uses are busy on this machine: {busy}")
    env, background = shell

    def run(command: str, cwd: Path = tmp_path, stdin: str | None = None,
            timeout: float = 120) -> subprocess.CompletedProcess[str]:
        result = subprocess.run(command, shell=True, cwd=cwd, env=env, capture_output=True,
                                text=True, timeout=timeout, input=stdin)
        assert result.returncode == 0, f"{command}\n{result.stdout}\n{result.stderr}"
        return result

    def in_background(command: str) -> subprocess.Popen[str]:
        output = open(tmp_path / "background.log", "a")  # noqa: SIM115
        process = subprocess.Popen(command, shell=True, cwd=tmp_path, env=env, text=True,
                                   start_new_session=True, stdout=output, stderr=output)
        background.append(process)
        return process

    done: list[str] = []
    timing = open(tmp_path / "timing.log", "a")  # noqa: SIM115
    for command in commands():
        if command == TEST_SUITE:
            continue  # what .ci/run runs, see the test above
        started = time.monotonic()
        if command == "pip install -e .":
            run(command, cwd=ROOT, timeout=300)  # in the checkout, as the README says
        elif command.endswith("&"):
            in_background(command[:-1])  # no wait here: the README's next command is its own
        elif command.startswith("mosquitto_sub") and " -C 2" in command:
            assert run(command, timeout=60).stdout.split() == ["21.5", "22.0"]
        elif command.startswith("shardgate sub "):
            received = [json.loads(line) for line in run(command).stdout.splitlines()]
            assert [(m["topic"], m["payload"]) for m in received] == [
                ("sensors/t1", "21.5"), ("sensors/t2", "22.0")]
        elif command.startswith("shardgate streams list"):
            assert re.search(r"^orders\s+reliable\s+4\s+json", run(command).stdout, re.M)
        elif command.startswith("shardgate users add"):
            # before it: the Python snippets, while the broker is still open (no user yet)
            run_snippets(tmp_path, env)
            run(command, stdin="alice-secret\n")
        elif command.startswith("shardgate users list"):
            assert "alice" in run(command).stdout
        elif command.startswith("python examples/sensor_aggregates.py"):
            assert "dev-000" in run(command, timeout=600).stdout  # Spark starts slowly when loaded
        else:
            run(command, timeout=300)
        done.append(command)
        # seconds per command (a Spark job, the install): where this test's time goes
        print(f"{time.monotonic() - started:7.1f} s  {command}", file=timing, flush=True)
    assert "shardgate users list" in done and "shardgate health --wait" in done


def run_snippets(cwd: Path, env: dict[str, str]) -> None:
    aio_pika = wrapped(snippet("import aio_pika"), 20)
    result = subprocess.run([sys.executable, "-c", aio_pika], cwd=cwd, env=env,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    run_sdk_snippet(cwd, env)
    spark = snippet("from datetime import")
    result = subprocess.run([sys.executable, "-c", spark], cwd=cwd, env=env,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert "sensors/t1" in result.stdout and "count" in result.stdout


def run_sdk_snippet(cwd: Path, env: dict[str, str]) -> None:
    """The SDK snippet, whose consumer loop never ends: it runs until it printed the message it
    sent (or, failing that, until the timeout given to `wrapped`)."""
    sdk = wrapped(snippet("from shardgate.client import"), 60)
    expected = "sensors/t1 b'21.5'"
    with open(cwd / "sdk-snippet.err", "w+") as errors:
        process = subprocess.Popen([sys.executable, "-u", "-c", sdk], cwd=cwd, env=env,
                                   stdout=subprocess.PIPE, stderr=errors, text=True)
        assert process.stdout is not None
        printed = []
        for line in process.stdout:
            printed.append(line.rstrip("\n"))
            if printed[-1] == expected:
                break
        process.terminate()
        process.wait(10)
        process.stdout.close()
        errors.seek(0)
        assert expected in printed, f"{printed}\n{errors.read()}"
