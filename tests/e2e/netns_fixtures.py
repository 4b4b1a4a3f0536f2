"""Linux network namespaces for partition tests: each node in its own namespace with two links,
one to a "front" bridge and one to a "peer" bridge, both in the root namespace, so that a test
can cut a node from its peers only (its peer link down) or from everything (both links down)
and heal it again. Traffic stays on this machine: nothing is routed beyond the two bridges.

- The front bridge has an address in the root namespace (`PartitionNet.front_host`): the
  test's clients and etcd reach the nodes there, and the nodes reach etcd.
- The peer bridge has none: node-to-node traffic (each node's `[cluster] advertise_address`,
  a fixed port in its own namespace) goes only over it, and no process of the root namespace
  can reach it.
- A cut sets the root namespace's end of a link down: the node's own end loses its carrier and
  what it sends is dropped, as on a pulled cable (no refusal, no reset: peers time out).
- Every namespace, link and bridge is named with this process's id and a counter, and the
  front subnet (10.213.N.0/24) is one the root namespace does not have yet, so that runs on
  the same machine do not meet. `close()` deletes everything, whatever happened.

A node's admin API stays on 127.0.0.1 in its own namespace (an open broker serves it only on
loopback): `netns_connection` opens a socket from inside a namespace (a thread that joins it
with setns(2), which needs root), which the caller then uses from any thread.

Creating namespaces needs root and iproute2's `ip`: `PartitionNet.create` skips the test
(pytest.skip, with the reason) where either is missing or a namespace cannot be made.

A link can also be made slow and lossy instead of cut (`impair_peer_link`: iproute2's `tc`
with the kernel's netem queueing discipline, both ways); `netem_missing` says why that cannot
be done here (no `tc`, or a kernel built without netem), tried in a namespace of its own.
"""

from __future__ import annotations

import contextlib
import ctypes
import http.client
import itertools
import os
import re
import shutil
import socket
import subprocess
import threading
from collections.abc import Callable
from typing import TypeVar

import pytest

IP = shutil.which("ip") or next((path for path in ("/usr/sbin/ip", "/sbin/ip") if os.path.exists(path)), None)
TC = shutil.which("tc") or next((path for path in ("/usr/sbin/tc", "/sbin/tc") if os.path.exists(path)), None)
CLONE_NEWNET = 0x40000000
_RUNS = itertools.count()
T = TypeVar("T")


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    assert IP is not None
    done = subprocess.run([IP, *args], capture_output=True, text=True, check=False, timeout=30)
    if check and done.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {done.stderr.strip()}")
    return done


def _tc(*args: str, netns: str | None = None) -> None:
    assert TC is not None and IP is not None
    command = [TC, *args] if netns is None else [IP, "netns", "exec", netns, TC, *args]
    done = subprocess.run(command, capture_output=True, text=True, check=False, timeout=30)
    if done.returncode != 0:
        raise RuntimeError(f"tc {' '.join(args)}: {done.stderr.strip()}")


def netem_missing() -> str | None:
    """Why a link cannot be made slow and lossy here (None: it can): tried on the loopback of
    a namespace made for it (root and `ip` are needed, as for `PartitionNet`)."""
    if IP is None:
        return "no iproute2 `ip` command to make network namespaces with"
    if TC is None:
        return "no iproute2 `tc` command to shape a link with"
    if os.geteuid() != 0:
        return "network namespaces and queueing disciplines need root"
    probe = f"sg{os.getpid()}{next(_RUNS)}"[-8:] + "nm"
    done = _ip("netns", "add", probe, check=False)
    if done.returncode != 0:
        return f"cannot create a network namespace: {done.stderr.strip()}"
    try:
        _ip("-n", probe, "link", "set", "lo", "up")
        _tc("qdisc", "add", "dev", "lo", "root", "netem", "delay", "1ms", netns=probe)
    except RuntimeError as exc:
        return (f"this kernel cannot delay or drop packets with netem (CONFIG_NET_SCH_NETEM; "
                f"{exc})")
    finally:
        _ip("netns", "del", probe, check=False)
    return None


def in_netns(netns: str, work: Callable[[], T]) -> T:
    """`work()` run on a thread that joined network namespace `netns` first: a socket it makes
    lives in that namespace for good (the thread, and its namespace, end with it)."""
    outcome: list[T] = []
    failure: list[BaseException] = []

    def run() -> None:
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            fd = os.open(f"/run/netns/{netns}", os.O_RDONLY)
            try:
                if libc.setns(fd, CLONE_NEWNET) != 0:
                    error = ctypes.get_errno()
                    raise OSError(error, f"setns({netns}): {os.strerror(error)}")
            finally:
                os.close(fd)
            outcome.append(work())
        except BaseException as exc:  # noqa: BLE001  (raised again by the caller)
            failure.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join()
    if failure:
        raise failure[0]
    return outcome[0]


class NetnsHTTPConnection(http.client.HTTPConnection):
    """An HTTP connection to `host:port` as seen from inside network namespace `netns`."""

    def __init__(self, netns: str, host: str, port: int, timeout: float = 5) -> None:
        super().__init__(host, port, timeout=timeout)
        self.netns = netns

    def connect(self) -> None:
        self.sock = in_netns(self.netns, lambda: socket.create_connection(
            (self.host, self.port), self.timeout))


def netns_get(netns: str, port: int, path: str, timeout: float = 5) -> bytes:
    """The body of GET `path` from 127.0.0.1:`port` in namespace `netns`; OSError if it failed
    (a connection error, or a status other than 200)."""
    connection = NetnsHTTPConnection(netns, "127.0.0.1", port, timeout)
    try:
        connection.request("GET", path)
        response = connection.getresponse()
        body = response.read()
        if response.status != 200:
            raise OSError(f"GET {path}: HTTP {response.status}")
        return body
    except http.client.HTTPException as exc:
        raise OSError(f"GET {path}: {exc!r}") from exc
    finally:
        connection.close()


class PartitionNet:
    """Namespaces for `count` nodes on a front and a peer bridge (see the module docstring)."""

    def __init__(self, count: int) -> None:
        self.count = count
        self.tag = f"{os.getpid()}{next(_RUNS)}"[-8:]
        self.front_bridge = f"sg{self.tag}F"
        self.peer_bridge = f"sg{self.tag}P"
        self.subnet = 0  # N of the front subnet 10.213.N.0/24 (the peer one is 10.214.N.0/24)
        self.namespaces: list[str] = []
        self._bridges: list[str] = []

    @classmethod
    def create(cls, count: int) -> PartitionNet:
        """The namespaces, links and bridges, all up; skips the test where they cannot be made
        (not root, no `ip`, a kernel without namespaces, veth pairs or bridges), once what was
        made is gone."""
        if IP is None:
            pytest.skip("no iproute2 `ip` command to make network namespaces with")
        if os.geteuid() != 0:
            pytest.skip("network namespaces need root")
        net = cls(count)
        probe = f"sg{net.tag}probe"
        done = _ip("netns", "add", probe, check=False)
        if done.returncode != 0:
            pytest.skip(f"cannot create a network namespace: {done.stderr.strip()}")
        _ip("netns", "del", probe, check=False)
        try:
            net._build()
        except RuntimeError as exc:  # (an `ip` command refused)
            net.close()
            pytest.skip(f"cannot build the test's network: {exc}")
        except BaseException:
            net.close()
            raise
        return net

    def _free_subnet(self) -> int:
        used = set(re.findall(r"\b10\.21[34]\.(\d+)\.", _ip("-4", "-o", "addr", "show").stdout
                              + _ip("-4", "route", "show", "table", "all").stdout))
        start = (os.getpid() + int(self.tag[-1])) % 250
        for step in range(250):
            candidate = (start + step) % 250 + 1
            if str(candidate) not in used:
                return candidate
        raise RuntimeError("no free 10.213.N.0/24 subnet for the partition test")

    def _build(self) -> None:
        self.subnet = self._free_subnet()
        for bridge in (self.front_bridge, self.peer_bridge):
            _ip("link", "add", bridge, "type", "bridge")
            self._bridges.append(bridge)
            _ip("link", "set", bridge, "up")
        _ip("addr", "add", f"{self.front_host}/24", "dev", self.front_bridge)
        for index in range(1, self.count + 1):
            netns = f"sg{self.tag}n{index}"
            _ip("netns", "add", netns)
            self.namespaces.append(netns)
            for end, bridge, inside in ((self._front_link(index), self.front_bridge, "front"),
                                        (self._peer_link(index), self.peer_bridge, "peer")):
                _ip("link", "add", end, "type", "veth", "peer", "name", inside, "netns", netns)
                _ip("link", "set", end, "master", bridge, "up")
            _ip("-n", netns, "addr", "add", f"{self.front_address(index)}/24", "dev", "front")
            _ip("-n", netns, "addr", "add", f"{self.peer_address(index)}/24", "dev", "peer")
            for device in ("lo", "front", "peer"):
                _ip("-n", netns, "link", "set", device, "up")

    @property
    def front_host(self) -> str:
        """The root namespace's address on the front bridge (etcd listens there)."""
        return f"10.213.{self.subnet}.1"

    def front_address(self, index: int) -> str:
        """Node `index`'s (1-based) address on the front bridge: its client listeners."""
        return f"10.213.{self.subnet}.{10 + index}"

    def peer_address(self, index: int) -> str:
        """Node `index`'s address on the peer bridge: its cluster port."""
        return f"10.214.{self.subnet}.{10 + index}"

    def netns(self, index: int) -> str:
        return self.namespaces[index - 1]

    def _front_link(self, index: int) -> str:
        return f"sg{self.tag}f{index}"

    def _peer_link(self, index: int) -> str:
        return f"sg{self.tag}p{index}"

    def command_prefix(self, index: int) -> list[str]:
        """What runs a command in node `index`'s namespace (`ip netns exec` execs it: the
        process started is the command's own)."""
        assert IP is not None
        return [IP, "netns", "exec", self.netns(index)]

    def cut_from_peers(self, index: int) -> None:
        _ip("link", "set", self._peer_link(index), "down")

    def cut_from_everything(self, index: int) -> None:
        _ip("link", "set", self._peer_link(index), "down")
        _ip("link", "set", self._front_link(index), "down")

    def impair_peer_link(self, index: int, *netem: str) -> None:
        """Make node `index`'s peer link slow or lossy both ways: `netem` is what follows
        `tc qdisc add ... netem` (e.g. "delay", "200ms", "loss", "5%"); each way gets it."""
        _tc("qdisc", "add", "dev", self._peer_link(index), "root", "netem", *netem)
        _tc("qdisc", "add", "dev", "peer", "root", "netem", *netem, netns=self.netns(index))

    def restore_peer_link(self, index: int) -> None:
        """Node `index`'s peer link as it was before `impair_peer_link`."""
        _tc("qdisc", "del", "dev", self._peer_link(index), "root")
        _tc("qdisc", "del", "dev", "peer", "root", netns=self.netns(index))

    def heal(self, index: int) -> None:
        _ip("link", "set", self._peer_link(index), "up")
        _ip("link", "set", self._front_link(index), "up")

    def close(self) -> None:
        """Deletes the links (a pair goes at once with its root end; a namespace may outlive
        its deletion for a while, until the kernel lets go of its last sockets), the
        namespaces and the bridges; anything already gone is passed over."""
        for index in range(1, len(self.namespaces) + 1):
            for link in (self._front_link(index), self._peer_link(index)):
                with contextlib.suppress(Exception):
                    _ip("link", "del", link, check=False)
        for netns in self.namespaces:
            with contextlib.suppress(Exception):
                _ip("netns", "del", netns, check=False)
        for bridge in self._bridges:
            with contextlib.suppress(Exception):
                _ip("link", "del", bridge, check=False)
        self.namespaces.clear()
        self._bridges.clear()
