"""What a process tree is and what it listens on, read from /proc (Linux; no extra tools)."""

from __future__ import annotations

import os
import socket


def _stat(pid: int) -> tuple[int, int] | None:
    """(parent pid, process group id) of ``pid``, or None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return int(fields[1]), int(fields[2])
    except (OSError, IndexError, ValueError):
        return None


def tree(root: int) -> list[int]:
    """``root`` and every process below it (children of children included)."""
    parents: dict[int, int] = {}
    for d in os.listdir("/proc"):
        if d.isdigit() and (st := _stat(int(d))) is not None:
            parents[int(d)] = st[0]
    out, todo = [], [root]
    while todo:
        p = todo.pop()
        if p in parents or p == root:
            out.append(p)
            todo += [c for c, pp in parents.items() if pp == p]
    return [p for p in out if _stat(p) is not None]


def group(pgid: int) -> list[int]:
    """Every live process of process group ``pgid`` (orphans included)."""
    return [
        int(d) for d in os.listdir("/proc") if d.isdigit() and (_stat(int(d)) or (0, -1))[1] == pgid
    ]


def cmdline(pid: int) -> bytes:
    """``pid``'s command line (arguments separated by NUL), or b"" when it is gone: a process
    of a live group can exit between a listing and this read."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read()
    except OSError:
        return b""


def stage_stub(pgid: int, stage: str) -> int | None:
    """The live stub process of ``stage`` (its ``/STAGE/1/model.py``) in group ``pgid``, or
    None."""
    for p in group(pgid):
        if f"/{stage}/1/model.py".encode() in cmdline(p):
            return p
    return None


def _socket_inodes(pid: int) -> set[str]:
    out = set()
    try:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if link.startswith("socket:["):
                out.add(link[8:-1])
    except OSError:
        pass
    return out


def _addr(hex_ip: str, v6: bool) -> str:
    raw = bytes.fromhex(hex_ip)
    if not v6:
        return socket.inet_ntop(socket.AF_INET, raw[::-1])
    words = b"".join(raw[i : i + 4][::-1] for i in range(0, 16, 4))
    return socket.inet_ntop(socket.AF_INET6, words)


def listeners(pids: list[int]) -> list[tuple[int, str, int]]:
    """(pid, address, port) of every listening TCP socket of ``pids``."""
    owner = {inode: pid for pid in pids for inode in _socket_inodes(pid)}
    out = []
    for path, v6 in (("/proc/net/tcp", False), ("/proc/net/tcp6", True)):
        with open(path) as f:
            for line in f.read().splitlines()[1:]:
                cols = line.split()
                if cols[3] != "0A" or cols[9] not in owner:  # 0A: LISTEN
                    continue
                ip_hex, port_hex = cols[1].split(":")
                out.append((owner[cols[9]], _addr(ip_hex, v6), int(port_hex, 16)))
    return sorted(out)


def is_on(address: str, host: str) -> bool:
    """``address`` (as listed) is ``host`` itself (an IPv4 host may show as ::ffff:host)."""
    return address in (host, f"::ffff:{host}")
