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

A link can also be made slow and lossy instead of cut (`impair_peer_link`, both ways), by
one of two means, whichever `link_impairment()` finds this kernel has (tried once, in a
namespace of its own):

- netem (iproute2's `tc` with the kernel's netem queueing discipline): a fixed delay and a
  random loss, as asked;
- else the token bucket filter (`tc ... tbf`: a rate limit; what exceeds it waits in its queue,
  up to its `latency`, and is dropped past that) and iptables' `statistic` match dropping a
  random share of the packets the node sends and receives on its peer link (kernels built
  without netem, as this project's CI machine is, do have these). The delay is then the
  rate's and the queue's: a full packet waits about the delay asked for, a small one less,
  a burst up to twice that.

`link_impairment()` returns None (with the reason) where neither can be done: no `tc`, no
iptables for the second, not root.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import http.client
import itertools
import os
import re
import shutil
import socket
import subprocess
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import pytest

IP = shutil.which("ip") or next((path for path in ("/usr/sbin/ip", "/sbin/ip") if os.path.exists(path)), None)
TC = shutil.which("tc") or next((path for path in ("/usr/sbin/tc", "/sbin/tc") if os.path.exists(path)), None)
# iptables-nft and iptables-legacy both work with a kernel of the CI machine's kind; the first
# that can add a `statistic` rule in a namespace is used
IPTABLES = [path for path in dict.fromkeys(
    shutil.which(name) or next((f"{d}/{name}" for d in ("/usr/sbin", "/sbin") if os.path.exists(f"{d}/{name}")), "")
    for name in ("iptables", "iptables-legacy", "iptables-nft")) if path]
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


def _iptables(iptables: str, netns: str, *args: str) -> None:
    assert IP is not None
    done = subprocess.run([IP, "netns", "exec", netns, iptables, "-w", *args], capture_output=True,
                          text=True, check=False, timeout=30)
    if done.returncode != 0:
        raise RuntimeError(f"{os.path.basename(iptables)} {' '.join(args)}: {done.stderr.strip()}")


@dataclass(frozen=True)
class LinkImpairment:
    """How this kernel can make a link slow and lossy: "netem", or "tbf" with `iptables` (the
    binary that can drop at random in a namespace). See the module docstring."""

    kind: str
    iptables: str | None = None

    def __str__(self) -> str:
        if self.kind == "netem":
            return "netem"
        return f"tbf + {os.path.basename(self.iptables or 'iptables')} statistic (no netem in this kernel)"


@functools.cache
def link_impairment() -> LinkImpairment | str:
    """How a link can be made slow and lossy here, or why it cannot (a string): tried once on
    the loopback of a namespace made for it (root and `ip` are needed, as for
    `PartitionNet`)."""
    if IP is None:
        return "no iproute2 `ip` command to make network namespaces with"
    if TC is None:
        return "no iproute2 `tc` command to shape a link with"
    if os.geteuid() != 0:
        return "network namespaces, queueing disciplines and iptables rules need root"
    probe = f"sg{os.getpid()}{next(_RUNS)}"[-8:] + "nm"
    done = _ip("netns", "add", probe, check=False)
    if done.returncode != 0:
        return f"cannot create a network namespace: {done.stderr.strip()}"
    try:
        _ip("-n", probe, "link", "set", "lo", "up")
        try:
            _tc("qdisc", "add", "dev", "lo", "root", "netem", "delay", "1ms", netns=probe)
            return LinkImpairment("netem")
        except RuntimeError as exc:
            no_netem = f"no netem in this kernel (CONFIG_NET_SCH_NETEM; {exc})"
        try:
            _tc("qdisc", "add", "dev", "lo", "root", "tbf", "rate", "1mbit", "burst", "32kbit",
                "latency", "400ms", netns=probe)
        except RuntimeError as exc:
            return f"{no_netem}, and no tbf either ({exc})"
        if not IPTABLES:
            return f"{no_netem}, and no iptables for random loss (apt-get install iptables)"
        refused = []
        for iptables in IPTABLES:
            try:
                _iptables(iptables, probe, "-A", "INPUT", "-m", "statistic", "--mode", "random",
                          "--probability", "0.05", "-j", "DROP")
                return LinkImpairment("tbf", iptables)
            except RuntimeError as exc:
                refused.append(str(exc))
        return f"{no_netem}, and iptables cannot drop at random here: {'; '.join(refused)}"
    finally:
        _ip("netns", "del", probe, check=False)


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
        # the iptables rules of `impair_peer_link` by node (they go with its namespace too)
        self._random_drops: dict[int, list[tuple[str, ...]]] = {}

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

    def impair_peer_link(self, index: int, delay_ms: int, loss_percent: float) -> LinkImpairment:
        """Make node `index`'s peer link slow and lossy both ways, by the means this kernel has
        (`link_impairment()`, see the module docstring; the test has skipped where it has
        none): with netem, `delay_ms` of delay and `loss_percent` % loss each way; else a tbf
        rate limit at which a full packet takes `delay_ms` (60 kbit/s for 200 ms), its queue
        holding a packet up to twice `delay_ms`, and `loss_percent` % of the packets in and out
        dropped at random."""
        means = link_impairment()
        assert isinstance(means, LinkImpairment), means
        node, root_end = self.netns(index), self._peer_link(index)
        if means.kind == "netem":
            netem = ("netem", "delay", f"{delay_ms}ms", "loss", f"{loss_percent}%")
            _tc("qdisc", "add", "dev", root_end, "root", *netem)
            _tc("qdisc", "add", "dev", "peer", "root", *netem, netns=node)
            return means
        assert means.iptables is not None
        # a full packet (1,500 bytes) waits about `delay_ms` at an empty bucket, smaller ones
        # less; past twice `delay_ms` in the queue, packets are dropped
        tbf = ("tbf", "rate", f"{1500 * 8 * 1000 // delay_ms}bit", "burst", "1600",
               "latency", f"{2 * delay_ms}ms")
        _tc("qdisc", "add", "dev", root_end, "root", *tbf)
        _tc("qdisc", "add", "dev", "peer", "root", *tbf, netns=node)
        self._random_drops[index] = drops = [
            (chain, way, "peer", "-m", "statistic", "--mode", "random", "--probability",
             f"{loss_percent / 100:.4f}", "-j", "DROP")
            for chain, way in (("INPUT", "-i"), ("OUTPUT", "-o"))]
        for rule in drops:
            _iptables(means.iptables, node, "-A", *rule)
        return means

    def impairment_counts(self, index: int) -> dict[str, int]:
        """What the impairment of node `index`'s peer link did so far, as its kernel counts it:
        the packets the queueing disciplines of both ends dropped or held back
        (`qdisc_dropped`, `qdisc_overlimits`) and, without netem, those iptables dropped at
        random (`random_drops`)."""
        assert TC is not None and IP is not None
        counts = {"qdisc_dropped": 0, "qdisc_overlimits": 0, "random_drops": 0}
        for command in ([TC, "-s", "qdisc", "show", "dev", self._peer_link(index)],
                        [IP, "netns", "exec", self.netns(index), TC, "-s", "qdisc", "show", "dev", "peer"]):
            shown = subprocess.run(command, capture_output=True, text=True, check=False, timeout=30).stdout
            for dropped, overlimits in re.findall(r"dropped (\d+), overlimits (\d+)", shown):
                counts["qdisc_dropped"] += int(dropped)
                counts["qdisc_overlimits"] += int(overlimits)
        means = link_impairment()
        if isinstance(means, LinkImpairment) and means.iptables is not None:
            shown = subprocess.run([IP, "netns", "exec", self.netns(index), means.iptables, "-w",
                                    "-L", "-v", "-x", "-n"], capture_output=True, text=True,
                                   check=False, timeout=30).stdout
            counts["random_drops"] = sum(int(packets) for packets in re.findall(
                r"^\s*(\d+)\s+\d+\s+DROP\b.*statistic", shown, re.MULTILINE))
        return counts

    def restore_peer_link(self, index: int) -> None:
        """Node `index`'s peer link as it was before `impair_peer_link`."""
        _tc("qdisc", "del", "dev", self._peer_link(index), "root")
        _tc("qdisc", "del", "dev", "peer", "root", netns=self.netns(index))
        means = link_impairment()
        for rule in self._random_drops.pop(index, []):
            assert isinstance(means, LinkImpairment) and means.iptables is not None
            _iptables(means.iptables, self.netns(index), "-D", *rule)

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
