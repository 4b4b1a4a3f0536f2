"""README "Running a cluster" and "Multi-core on one host": every command of each section's
shell blocks, run exactly as printed, in order, once each (in a temporary directory): etcd, the
nodes (three; two pinned one per core), `shardgate health --wait`, `shardgate cluster status`, a
stream created on the first node, a persistent subscriber on the last node that gets a message
published on the first."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.e2e.readme_shell import end_groups, port_free

README = Path(__file__).resolve().parents[2] / "README.md"


def cluster_commands(heading: str = "## Running a cluster") -> list[str]:
    """Every command of every shell block of the section (up to the next heading)."""
    text = README.read_text()
    section = text[text.index(heading) + len(heading):]
    section = section[:section.index("\n## ")] if "\n## " in section else section
    blocks = re.findall(r"```sh\n(.*?)```", section, re.S)
    assert blocks, f"no shell block under {heading}"
    return [line for block in blocks for line in block.splitlines() if line.strip()]


def ports_in(commands: list[str]) -> list[int]:
    """Every port the commands name (the four- and five-digit numbers), and etcd's peer port."""
    numbers = re.findall(r"(?<![\d.])(\d{4,5})(?![\d.])", " ".join(commands))
    return sorted({2380, *(int(number) for number in numbers)})


@pytest.fixture
def shell(tmp_path: Path) -> Iterator[tuple[dict[str, str], list[subprocess.Popen[bytes]]]]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SHARDGATE_")}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    background: list[subprocess.Popen[bytes]] = []
    yield env, background
    end_groups(background, timeout=30)


def test_readme_cluster_commands_run_as_printed(
    tmp_path: Path, shell: tuple[dict[str, str], list[subprocess.Popen[bytes]]],
) -> None:
    run_as_printed(cluster_commands(), tmp_path, shell)


def test_readme_multi_core_commands_run_as_printed(
    tmp_path: Path, shell: tuple[dict[str, str], list[subprocess.Popen[bytes]]],
) -> None:
    if shutil.which("taskset") is None or len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs taskset and two cores")
    run_as_printed(cluster_commands("## Multi-core on one host"), tmp_path, shell)


def run_as_printed(
    commands: list[str], tmp_path: Path, shell: tuple[dict[str, str], list[subprocess.Popen[bytes]]],
) -> None:
    node_ids = re.findall(r"--node-id (\S+)", " ".join(commands))
    for tool in ("etcd", "mosquitto_sub", "mosquitto_pub"):
        if shutil.which(tool) is None:
            pytest.skip(f"{tool} is not installed")
    # (etcd's ports are shared by both sections: the previous test's etcd may still be exiting)
    deadline = time.monotonic() + 15
    while busy := [port for port in ports_in(commands) if not port_free(port)]:
        if time.monotonic() > deadline:
            pytest.skip(f"ports the README uses are busy on this machine: {busy}")
        time.sleep(0.2)
    env, background = shell
    log = open(tmp_path / "commands.log", "ab")  # noqa: SIM115

    def run(command: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(command, shell=True, cwd=tmp_path, env=env, capture_output=True,
                              text=True, timeout=60)

    # Each command once, as pasted, in order: no retry and no wait the README does not show
    # (its `shardgate health --wait` is the readiness step).
    published = None
    for command in commands:
        if command.endswith("&"):
            background.append(subprocess.Popen(command[:-1], shell=True, cwd=tmp_path, env=env,
                                               start_new_session=True, stdout=log, stderr=log))
            continue
        result = run(command)
        log.write(f"$ {command}\n{result.stdout}{result.stderr}".encode())
        assert result.returncode == 0, f"{command}\n{result.stdout}\n{result.stderr}"
        if command.startswith("shardgate cluster status"):
            assert f"{len(node_ids)} nodes" in result.stdout, result.stdout
            for node in node_ids:
                assert f"\n{node} " in result.stdout, result.stdout
        elif command.startswith("mosquitto_pub"):
            sent = re.search(r" -m (\S+)", command)
            assert sent is not None
            published = sent.group(1)
        elif command.startswith("mosquitto_sub") and " -C " in command:
            assert published is not None and result.stdout.strip() == published, result.stdout
    assert published is not None
    log.close()
    # the nodes share one archive directory, none keeps one in its data directory
    assert (tmp_path / "archive").is_dir()
    assert not [node for node in node_ids if (tmp_path / node / "archive").exists()]
