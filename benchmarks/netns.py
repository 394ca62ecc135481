"""Link emulation in network namespaces, for the benchmarks and the multi-host tests.

Two shapes, one rate limiter (a ``tc`` token bucket filter, :func:`tbf_command`):

* **one rate-limited loopback** (the benchmarks' ``--link-gbit``): :func:`reexec_in_netns`
  re-runs the benchmark's command line under ``unshare -n``, which gives the process tree its
  own loopback (down; we bring it up), and the filter on it caps every TCP byte: Mooncake's data
  plane and the ZMQ control plane alike. Needs root (CAP_NET_ADMIN) and ``unshare``/``ip``/``tc``.
* **a private multi-host bed** (:class:`TestBed`): one named namespace per server, veth pairs
  on a bridge. The bridge lives in a namespace of its own too, so the private addresses (a
  random ``10.X.Y.0/24``) exist only inside the namespaces this module made: nothing is added
  to the host's network. Each node's link gets the filter. Needs root and iproute2;
  :func:`available` says whether this host can do it.
"""

from __future__ import annotations

import os
import random
import shutil
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field

ENV_FLAG = "BENCH_TTFT_IN_NETNS"


def tbf_command(dev: str, rate: str, burst: str, latency: str) -> list[str]:
    """``tc`` capping ``dev``'s egress at ``rate`` (e.g. "2gbit"), bucket ``burst``, queue
    ``latency``."""
    return ["tc", "qdisc", "add", "dev", dev, "root", "tbf", "rate", rate, "burst", burst,
            "latency", latency]  # fmt: skip


def tc_command(rate_gbit: float, burst: str, latency: str) -> str:
    return " ".join(tbf_command("lo", f"{rate_gbit:g}gbit", burst, latency))


def reexec_in_netns(module: str, rate_gbit: float, burst: str, latency: str) -> int:
    """Run this very command line (``python -m module ...``) again inside the namespace; returns
    its exit status."""
    for tool in ("unshare", "ip", "tc"):
        if shutil.which(tool) is None:
            raise SystemExit(f"--link-gbit needs `{tool}` on PATH (iproute2 / util-linux)")
    inner = f'ip link set lo up && {tc_command(rate_gbit, burst, latency)} && exec "$@"'
    argv = [sys.executable, "-m", module, *sys.argv[1:]]
    cmd = ["unshare", "-n", "sh", "-c", inner, "sh", *argv]
    env = dict(os.environ, **{ENV_FLAG: "1"})
    try:
        return subprocess.call(cmd, env=env)
    except PermissionError as e:
        raise SystemExit(f"--link-gbit: no network namespace ({e}); run as root") from e


def in_netns() -> bool:
    return os.environ.get(ENV_FLAG) == "1"


def qdisc() -> str:
    """What the loopback's qdisc actually is (printed with the results)."""
    try:
        out = subprocess.run(["tc", "qdisc", "show", "dev", "lo"], capture_output=True, text=True)
        return out.stdout.strip()
    except OSError:
        return ""


def measure_tcp_gbit(seconds: float = 0.5, rate_hint_gbit: float = 1.0) -> float:
    """Achieved loopback TCP rate: one stream of ~``seconds`` at the hinted rate."""
    nbytes = int(max(4 << 20, min(512 << 20, rate_hint_gbit * 1e9 / 8 * seconds)))
    chunk = 1 << 20
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)

    def sink() -> None:
        conn, _ = srv.accept()
        got = 0
        while got < nbytes:
            b = conn.recv(chunk)
            if not b:
                break
            got += len(b)
        conn.sendall(b"k")
        conn.close()

    t = threading.Thread(target=sink, daemon=True)
    t.start()
    s = socket.create_connection(srv.getsockname())
    buf = b"\0" * chunk
    t0 = time.perf_counter()
    sent = 0
    while sent < nbytes:
        n = min(chunk, nbytes - sent)
        s.sendall(buf[:n])
        sent += n
    s.recv(1)
    dt = time.perf_counter() - t0
    s.close()
    srv.close()
    t.join(5)
    return nbytes * 8 / dt / 1e9


def describe(rate_gbit: float | None, burst: str, latency: str) -> dict:
    """Link settings + measured rate, for the JSON and the table header."""
    out = {"emulated": rate_gbit is not None}
    if rate_gbit is not None:
        out.update(
            rate_gbit=rate_gbit,
            burst=burst,
            latency=latency,
            command=f"unshare -n; ip link set lo up; {tc_command(rate_gbit, burst, latency)}",
            qdisc=qdisc(),
        )
    out["tcp_gbit_measured"] = [
        round(measure_tcp_gbit(rate_hint_gbit=rate_gbit or 8.0), 4) for _ in range(3)
    ]
    return out


# ---- the multi-host test bed --------------------------------------------------------------------


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
        tbf = tbf_command(host_if, self.rate, "1mb", "50ms")
        subprocess.run(["ip", "netns", "exec", ns, *tbf], check=True, capture_output=True)
        self.addr[node] = addr
        return addr

    def run_prefix(self, node: str) -> list[str]:
        """Command prefix that runs a program inside ``node``'s namespace."""
        return ["ip", "netns", "exec", self.ns(node)]

    def close(self) -> None:
        for node in list(self.addr):
            subprocess.run(["ip", "netns", "del", self.ns(node)], capture_output=True)
        subprocess.run(["ip", "netns", "del", self.bridge], capture_output=True)
