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
  random share of the packets the node sends and receives on its peer link, where they
  arrive (kernels built without netem, as this project's CI machine is, do have these). The
  delay is then the rate's and the queue's: a full packet waits about the delay asked for, a
  small one less, a burst up to twice that.

`link_impairment()` returns the reason instead where neither can be done: no `tc`, no iptables
for the second, not root.

Between two nodes only, what one sends the other can be lost (`cut_between`, iptables): both
ways, one way, or only its bigger packets (a path-MTU black hole); `iptables_in_netns()` says
whether iptables can do it here.

The iptables rules drop packets where they arrive, as a lossy path does: a rule on the
sender's way out would make its kernel refuse to send, which TCP treats otherwise than a loss.
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
from collections.abc import Callable, Iterator
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


@contextlib.contextmanager
def _probe_netns() -> Iterator[str]:
    """A namespace of its own, its loopback up, for a probe; RuntimeError if it cannot be made."""
    probe = f"sg{os.getpid()}{next(_RUNS)}"[-8:] + "nm"
    done = _ip("netns", "add", probe, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"cannot create a network namespace: {done.stderr.strip()}")
    try:
        _ip("-n", probe, "link", "set", "lo", "up")
        yield probe
    finally:
        _ip("netns", "del", probe, check=False)


def _needs() -> str | None:
    if IP is None:
        return "no iproute2 `ip` command to make network namespaces with"
    if os.geteuid() != 0:
        return "network namespaces, queueing disciplines and iptables rules need root"
    return None


@functools.cache
def iptables_in_netns() -> tuple[str | None, str]:
    """The iptables command that can add rules, the `statistic` match's included, in a
    namespace (tried once, in one of its own), or None and why not."""
    missing = _needs()
    if missing is not None:
        return None, missing
    if not IPTABLES:
        return None, "no iptables command (apt-get install iptables)"
    refused = []
    try:
        with _probe_netns() as probe:
            for iptables in IPTABLES:
                try:
                    _iptables(iptables, probe, "-A", "INPUT", "-m", "statistic", "--mode", "random",
                              "--probability", "0.05", "-j", "DROP")
                    return iptables, ""
                except RuntimeError as exc:
                    refused.append(str(exc))
    except RuntimeError as exc:
        return None, str(exc)
    return None, f"iptables cannot add rules in a namespace here: {'; '.join(refused)}"


@functools.cache
def link_impairment() -> LinkImpairment | str:
    """How a link can be made slow and lossy here, or why it cannot (a string): tried once on
    the loopback of a namespace made for it (root and `ip` are needed, as for
    `PartitionNet`)."""
    missing = _needs()
    if missing is not None:
        return missing
    if TC is None:
        return "no iproute2 `tc` command to shape a link with"
    try:
        with _probe_netns() as probe:
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
    except RuntimeError as exc:
        return str(exc)
    iptables, why_not = iptables_in_netns()
    if iptables is None:
        return f"{no_netem}, and no iptables for random loss: {why_not}"
    return LinkImpairment("tbf", iptables)


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
        # the iptables rules of `impair_peer_link` and `cut_between` (see `_add_rules`)
        self._rules: dict[str, list[tuple[int, tuple[str, ...]]]] = {}

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
        # dropped where they arrive, as a lossy path drops them (the sender's TCP sees a loss,
        # not a local refusal to send): what comes in over the node's peer link, and what
        # comes from it into each other node
        probability = ("-m", "statistic", "--mode", "random", "--probability",
                       f"{loss_percent / 100:.4f}", "-j", "DROP")
        rules = [(index, ("INPUT", "-i", "peer", *probability))]
        rules += [(peer, ("INPUT", "-s", self.peer_address(index), *probability))
                  for peer in range(1, self.count + 1) if peer != index]
        self._add_rules(f"impair {index}", rules)
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
        iptables, _why_not = iptables_in_netns()
        if iptables is not None and f"impair {index}" in self._rules:
            for netns in self.namespaces:
                shown = subprocess.run([IP, "netns", "exec", netns, iptables, "-w", "-L", "-v",
                                        "-x", "-n"], capture_output=True, text=True, check=False,
                                       timeout=30).stdout
                counts["random_drops"] += sum(int(packets) for packets in re.findall(
                    r"^\s*(\d+)\s+\d+\s+DROP\b.*statistic", shown, re.MULTILINE))
        return counts

    def restore_peer_link(self, index: int) -> None:
        """Node `index`'s peer link as it was before `impair_peer_link`."""
        _tc("qdisc", "del", "dev", self._peer_link(index), "root")
        _tc("qdisc", "del", "dev", "peer", "root", netns=self.netns(index))
        self._remove_rules(f"impair {index}")

    def cut_between(self, index: int, other: int, both_ways: bool = True,
                    from_bytes: int | None = None) -> None:
        """Drop the packets between node `index` and node `other` on the peer bridge, where
        they arrive (iptables; `iptables_in_netns()` must have found a command). Both ways,
        their established connections go silent, as on a pulled cable; else only what `index`
        sends to `other` is lost, and what `other` sends arrives; `from_bytes`: only what
        `index` sends in packets of that many bytes or more (as a path-MTU black hole loses
        the big packets, while bare acknowledgements, about 60 bytes, pass). Each node still
        reaches the third one, etcd and its clients."""
        sized = ("-m", "length", "--length", f"{from_bytes}:65535") if from_bytes is not None else ()
        rules = [(other, ("INPUT", "-s", self.peer_address(index), *sized, "-j", "DROP"))]
        if both_ways:
            rules.append((index, ("INPUT", "-s", self.peer_address(other), "-j", "DROP")))
        self._add_rules(f"cut {index} {other}", rules)

    def heal_between(self, index: int, other: int) -> None:
        """Undo `cut_between(index, other)`."""
        self._remove_rules(f"cut {index} {other}")

    def _add_rules(self, key: str, rules: list[tuple[int, tuple[str, ...]]]) -> None:
        """Append iptables `rules` (node index, rule) under `key`, for `_remove_rules(key)`
        (they also go with the namespaces, at `close()`)."""
        iptables, why_not = iptables_in_netns()
        assert iptables is not None, why_not
        added = self._rules.setdefault(key, [])
        for index, rule in rules:
            _iptables(iptables, self.netns(index), "-A", *rule)
            added.append((index, rule))

    def _remove_rules(self, key: str) -> None:
        iptables, _why_not = iptables_in_netns()
        for index, rule in self._rules.pop(key, []):
            assert iptables is not None
            _iptables(iptables, self.netns(index), "-D", *rule)

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
