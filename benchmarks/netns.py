"""Link emulation: re-run the benchmark in a private network namespace with a rate-limited loopback.

``unshare -n`` gives the process tree its own loopback (down; we bring it up), and a token
bucket filter on it caps every TCP byte: Mooncake's data plane and the ZMQ control plane alike.
Needs root (CAP_NET_ADMIN) and the ``unshare``/``ip``/``tc`` tools.
"""

from __future__ import annotations

import os
import shlex
import shutil
import socket
import subprocess
import sys
import threading
import time

ENV_FLAG = "BENCH_TTFT_IN_NETNS"


def tc_command(rate_gbit: float, burst: str, latency: str) -> str:
    return f"tc qdisc add dev lo root tbf rate {rate_gbit:g}gbit burst {burst} latency {latency}"


def reexec_in_netns(rate_gbit: float, burst: str, latency: str) -> int:
    """Run this very command line again inside the namespace; returns its exit status."""
    for tool in ("unshare", "ip", "tc"):
        if shutil.which(tool) is None:
            raise SystemExit(f"--link-gbit needs `{tool}` on PATH (iproute2 / util-linux)")
    inner = f'ip link set lo up && {tc_command(rate_gbit, burst, latency)} && exec "$@"'
    argv = [sys.executable, os.path.abspath(sys.argv[0]), *sys.argv[1:]]
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


def shell_join(argv: list[str]) -> str:
    return " ".join(shlex.quote(a) for a in argv)
