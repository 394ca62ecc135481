"""A private multi-host test bed: one network namespace per server, veth pairs on a bridge.

The bridge lives in a namespace of its own too, so the private addresses (a random
``10.X.Y.0/24``) exist only inside the namespaces this module made: nothing is added to the
host's network. Each node's link gets a ``tc`` token-bucket rate limit. Needs root
(CAP_NET_ADMIN) and iproute2; :func:`available` says whether this host can do it.
"""

from __future__ import annotations

import os
import random
import subprocess
from dataclasses import dataclass, field


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


def available() -> str:
    """'' when namespaces can be made here, else why not."""
    name = f"pdprobe{os.getpid()}"
    try:
        _ip("netns", "add", name)
    except (OSError, subprocess.CalledProcessError) as e:
        err = getattr(e, "stderr", "") or str(e)
        return f"cannot create a network namespace: {err.strip()}"
    _ip("netns", "del", name)
    return ""


@dataclass
class TestBed:
    """Namespaces ``<prefix>-<node>``; ``addr[node]`` is the node's private address."""

    prefix: str
    rate: str = "2gbit"
    addr: dict[str, str] = field(default_factory=dict)
    subnet: str = ""

    def __post_init__(self) -> None:
        self.subnet = f"10.{random.randint(64, 250)}.{random.randint(1, 250)}"
        self.bridge = f"{self.prefix}-br"
        _ip("netns", "add", self.bridge)
        _ip("-n", self.bridge, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.bridge, "link", "set", "br0", "up")

    def ns(self, node: str) -> str:
        return f"{self.prefix}-{node}"

    def add(self, node: str) -> str:
        """A namespace for ``node`` linked to the bridge; returns its address."""
        ns, i = self.ns(node), len(self.addr) + 2
        host_if, br_if = f"eth{i}", f"p{i}"
        _ip("netns", "add", ns)
        _ip("link", "add", host_if, "netns", ns, "type", "veth", "peer", "name", br_if,
            "netns", self.bridge)  # fmt: skip
        _ip("-n", self.bridge, "link", "set", br_if, "master", "br0")
        _ip("-n", self.bridge, "link", "set", br_if, "up")
        addr = f"{self.subnet}.{i}"
        _ip("-n", ns, "addr", "add", f"{addr}/24", "dev", host_if)
        _ip("-n", ns, "link", "set", host_if, "up")
        _ip("-n", ns, "link", "set", "lo", "up")
        tbf = ["root", "tbf", "rate", self.rate, "burst", "1mb", "latency", "50ms"]
        subprocess.run(
            ["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", host_if, *tbf],
            check=True, capture_output=True,
        )  # fmt: skip
        self.addr[node] = addr
        return addr

    def run_prefix(self, node: str) -> list[str]:
        """Command prefix that runs a program inside ``node``'s namespace."""
        return ["ip", "netns", "exec", self.ns(node)]

    def close(self) -> None:
        for node in list(self.addr):
            subprocess.run(["ip", "netns", "del", self.ns(node)], capture_output=True)
        subprocess.run(["ip", "netns", "del", self.bridge], capture_output=True)
