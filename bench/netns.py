"""An emulated cluster on one machine: each node a Linux network namespace, joined through a
bridge in a hub namespace by veth pairs whose both ends are shaped with ``tc`` (rate with
``tbf``; delay with ``netem`` where the kernel has it), so traffic between nodes crosses a link of the chosen speed while ranks of one node
talk over loopback. Needs root and iproute2; everything it creates is named ``s4b<tag>-...``,
lives in namespaces it created, and is removed when the ``with`` block ends (also on errors
and Ctrl-C).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
from dataclasses import dataclass

#: The interface name inside every node namespace (names are per namespace).
NODE_IFACE = "s4b0"


class ClusterUnavailable(RuntimeError):
    """This host cannot build the emulated cluster (not root, no iproute2, no netns)."""


def check_host() -> None:
    """Raises ClusterUnavailable naming what is missing."""
    if os.geteuid() != 0:
        raise ClusterUnavailable("the emulated cluster needs root (network namespaces, tc)")
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            raise ClusterUnavailable(f"the emulated cluster needs iproute2's `{tool}`")


def _run(*cmd: str) -> None:
    result = subprocess.run(cmd, capture_output=True, text=True)
    if result.returncode != 0:
        raise ClusterUnavailable(f"`{' '.join(cmd)}` failed: {result.stderr.strip()}")


@dataclass
class Link:
    """One direction of every node's link to the switch."""

    rate_mbit: float
    delay_ms: float


class Cluster:
    """``nodes`` namespaces on a shaped bridge. Use as a context manager."""

    def __init__(self, nodes: int, link: Link, tag: int | None = None):
        self.nodes, self.link = nodes, link
        self.tag = tag if tag is not None else os.getpid() % 200 + 1
        self.prefix = f"s4b{self.tag}"
        self.hub = f"{self.prefix}-hub"
        self._made: list[str] = []

    def namespace(self, node: int) -> str:
        return f"{self.prefix}-n{node}"

    def address(self, node: int) -> str:
        return f"10.{77 + self.tag // 250}.{self.tag % 250}.{node + 1}"

    def __enter__(self) -> Cluster:
        check_host()
        self._previous = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
        for s in self._previous:
            signal.signal(s, self._on_signal)
        try:
            self._build()
        except BaseException:
            self.remove()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.remove()
        for s, handler in self._previous.items():
            signal.signal(s, handler)

    def _on_signal(self, signum, frame):
        self.remove()
        raise KeyboardInterrupt(f"signal {signum}: emulated cluster removed")

    def _shape(self, netns: str, iface: str) -> None:
        """Rate (token bucket, `tbf`) and, when a delay is asked for, `netem` below it."""
        burst = max(int(self.link.rate_mbit * 1e6 / 8 * 0.004), 32 * 1024)  # 4 ms of traffic
        tbf = ["tbf", "rate", f"{self.link.rate_mbit}mbit", "burst", str(burst),
               "latency", "100ms"]
        if self.link.delay_ms <= 0:
            _run("ip", "netns", "exec", netns, "tc", "qdisc", "add", "dev", iface, "root", *tbf)
            return
        _run("ip", "netns", "exec", netns, "tc", "qdisc", "add", "dev", iface, "root",
             "handle", "1:", *tbf)
        try:
            _run("ip", "netns", "exec", netns, "tc", "qdisc", "add", "dev", iface, "parent",
                 "1:1", "handle", "10:", "netem", "delay", f"{self.link.delay_ms}ms",
                 "limit", "100000")
        except ClusterUnavailable as error:
            raise ClusterUnavailable(f"{error} (this kernel has no netem, so link latency "
                                     "cannot be emulated: use a delay of 0)") from None

    def _build(self) -> None:
        _run("ip", "netns", "add", self.hub)
        self._made.append(self.hub)
        _run("ip", "netns", "exec", self.hub, "ip", "link", "add", "br0", "type", "bridge")
        _run("ip", "netns", "exec", self.hub, "ip", "link", "set", "br0", "up")
        for node in range(self.nodes):
            ns = self.namespace(node)
            _run("ip", "netns", "add", ns)
            self._made.append(ns)
            hub_end = f"p{node}"
            _run("ip", "link", "add", NODE_IFACE, "netns", ns, "type", "veth", "peer", "name",
                 hub_end, "netns", self.hub)
            _run("ip", "netns", "exec", ns, "ip", "addr", "add", f"{self.address(node)}/24",
                 "dev", NODE_IFACE)
            _run("ip", "netns", "exec", ns, "ip", "link", "set", NODE_IFACE, "up")
            _run("ip", "netns", "exec", ns, "ip", "link", "set", "lo", "up")
            _run("ip", "netns", "exec", self.hub, "ip", "link", "set", hub_end, "master", "br0")
            _run("ip", "netns", "exec", self.hub, "ip", "link", "set", hub_end, "up")
            self._shape(ns, NODE_IFACE)  # the node's uplink
            self._shape(self.hub, hub_end)  # its downlink

    def remove(self) -> None:
        """Deletes every namespace this cluster made (their veths go with them)."""
        while self._made:
            subprocess.run(["ip", "netns", "delete", self._made.pop()], capture_output=True)

    def popen(self, node: int, argv: list[str], env: dict[str, str], **kwargs) -> subprocess.Popen:
        """Starts `argv` inside node `node`'s namespace with `env` added."""
        full_env = {**os.environ, **env, "GLOO_SOCKET_IFNAME": NODE_IFACE}
        return subprocess.Popen(["ip", "netns", "exec", self.namespace(node), *argv],
                                env=full_env, **kwargs)
