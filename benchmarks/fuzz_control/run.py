"""Control-plane fuzzer: malformed, unsigned, stale and hostile-but-well-formed messages against
a live prefill (KVSender), a live decode (KVReceiver) and a decode's cancel listener, each in its
own process with real Mooncake, while legitimate rooms go through.

Passes when: every process is still alive and answering; every legitimate room arrived byte for
byte; no byte landed outside a claimed page (decode's other pages are still zero); every frame
that can never be valid (garbage, broken, unsigned, wrongly signed, stale, a wrong frame count)
was dropped and counted by its target; and each process's memory (RSS) grew by less than
``--max-rss-growth-mb``.

A frame over a target's size limit makes it disconnect the sender, and zmq then discards whatever
else that connection had in flight; such frames go over a socket of their own, so the rest of the
run reaches the target and can be accounted for.

    .venv/bin/python -m benchmarks.fuzz_control --messages 100000        # the full run
    .venv/bin/python -m benchmarks.fuzz_control --messages 3000 --json   # what CI runs

The peers are the integration tests' (``tests/helpers/kvpeer.py``): run it from the repository's
root.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import random
import sys
import time

import zmq

from backends.stages.cancel import MAX_CANCEL_FRAME
from benchmarks.common import print_result
from kvtransfer.control.loop import CONTROL_FRAME_BYTES
from kvtransfer.protocol.messages import MessageError
from tests.helpers.kvpeer import PeerProcess

from .frames import Mutator

os.environ.setdefault("GLOG_minloglevel", "2")

SECRET = b"fuzz-control-secret-0123456789ab"
ENTRIES = {"target": ("gqa", 16, 128)}
INVALID_KINDS = MessageError.KINDS
# legitimate rooms use ids that no fuzzed frame names (those pick 1-99, the victims 900-903, or
# at random): any authenticated peer may end a room that nobody registered yet, by design
LEGIT_ROOM0 = 10**6


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        line = next(ln for ln in f if ln.startswith("VmRSS:"))
    return int(line.split()[1]) / 1024


def cancel_listener_main(conn) -> None:
    from backends.stages.cancel import CancelListener

    got: list[int] = []
    lis = CancelListener("127.0.0.1", got.append, SECRET)
    conn.send(lis.addr)
    while conn.recv() != "exit":
        conn.send((len(got), lis.dropped))
    lis.close()
    conn.send("bye")


class Target:
    """One attacked endpoint: its sockets, and how fuzzed frames reach it. Frames over ``limit``
    go over ``oversize`` (the target disconnects it); ``must_drop`` counts the frames sent over
    the other sockets that the target has to drop. ``exact``: its count of invalid frames must
    equal ``must_drop`` (else it may be more: the cancel listener counts every drop)."""

    def __init__(
        self, name, pid, sockets, multipart, limit=CONTROL_FRAME_BYTES, oversize=None, exact=True
    ):
        self.name, self.pid, self.sockets, self.multipart = name, pid, sockets, multipart
        self.limit, self.oversize_socket, self.exact = limit, oversize, exact
        self.rss0 = rss_mb(pid)
        self.sent = self.must_drop = self.oversize = 0

    def send(self, rng: random.Random, frame: bytes, must_drop: bool) -> None:
        self.sent += 1
        if len(frame) > self.limit:
            if self.oversize_socket is None:
                raise ValueError(f"a {len(frame)}-byte frame for {self.name} has no socket")
            self.oversize_socket.send(frame, zmq.NOBLOCK)
            self.oversize += 1
            return
        s = rng.choice(self.sockets)
        if self.multipart and rng.random() < 0.05:
            s.send_multipart([frame, frame])  # a wrong frame count
            must_drop = True
        else:
            s.send(frame, zmq.NOBLOCK)
        self.must_drop += must_drop


def legit_room(prefill, decode, room: int) -> str:
    """One real room through both peers; "" when it arrived byte for byte, else why not."""
    prefill.alloc_pages(room, {"target": 4})
    decode.alloc_pages(room, {"target": 4})
    decode.register(room, [prefill.info["bootstrap_addr"]], 60)
    prefill.start_room(room)
    prefill.run_prefill(room, [("target", 0, 2), ("target", 2, 4)], 0.0, 0.0, 1, None)
    status = tuple(decode.wait(room, 60))
    why = "" if status == ("Success", "") else f"decode ended {status}"
    if not why and decode.digest(room, "target", 4) != prefill.digest(room, "target", 4):
        why = "its pages differ"
    prefill.wait(room, 30)
    if not why:  # a failed room's pages were freed by its release already (prefill's always are)
        decode.free_room(room)
    return why


def fake_prefill(ctx, decode, rooms: list[int]) -> tuple[zmq.Socket, bytes]:
    """A ROUTER posing as a prefill that decode registered ``rooms`` with; returns it and
    decode's identity on it (the fuzzer then answers decode with hostile messages)."""
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    for room in rooms:
        decode.alloc_pages(room, {"target": 2})
        decode.register(room, [f"127.0.0.1:{port}"], 20)
    assert router.poll(10000), "decode never registered with the fake prefill"
    ident, _ = router.recv_multipart()
    return router, ident


class RouterTo:
    """Sends to one identity through a ROUTER (decode's side of the fake prefill)."""

    def __init__(self, router: zmq.Socket, ident: bytes):
        self.router, self.ident = router, ident

    def send(self, frame: bytes, flags: int = 0) -> None:
        self.router.send_multipart([self.ident, frame], flags)

    def send_multipart(self, frames: list[bytes]) -> None:
        self.router.send_multipart([self.ident, *frames])


def run(args) -> dict:
    rng = random.Random(args.seed)
    cfg = dict(shared_secret=SECRET, bootstrap_timeout_s=20.0, transfer_timeout_s=60.0)
    prefill = PeerProcess("prefill", ENTRIES, cfg, seed=1)
    decode = PeerProcess("decode", ENTRIES, cfg, seed=2)
    ctx = zmq.Context()
    pipe, child = mp.get_context("spawn").Pipe()
    lis = mp.get_context("spawn").Process(target=cancel_listener_main, args=(child,), daemon=True)
    lis.start()
    cancel_addr = pipe.recv()
    victim_rooms = list(range(900, 904))
    router, decode_ident = fake_prefill(ctx, decode, victim_rooms)
    mut = Mutator(rng, SECRET, decode.call("session_id"), decode.call("base_addr", "target"))
    targets = [
        Target(
            "prefill",
            prefill.info["pid"],
            _sockets(ctx, zmq.DEALER, prefill.info["bootstrap_addr"], 4),
            True,
            prefill.call("frame_limit"),
            _sockets(ctx, zmq.DEALER, prefill.info["bootstrap_addr"], 1)[0],
        ),
        Target("decode", decode.info["pid"], [RouterTo(router, decode_ident)], True),
        Target(
            "cancel",
            lis.pid,
            _sockets(ctx, zmq.PUSH, cancel_addr, 2),
            False,
            MAX_CANCEL_FRAME,
            _sockets(ctx, zmq.PUSH, cancel_addr, 1)[0],
            exact=False,
        ),
    ]
    legit, failures, t0 = [], [], time.time()
    try:
        for i in range(args.messages):
            target = targets[i % len(targets)]
            target.send(rng, *mut.frame(target.name, victim_rooms))
            if i % args.legit_every == 0:
                room = LEGIT_ROOM0 + len(legit)
                legit.append(room)
                why = legit_room(prefill, decode, room)
                if why:
                    failures.append(f"legit room {room}: {why}")
            if i % 2000 == 0 and args.progress:
                print(f"[fuzz] {i}/{args.messages} messages", file=sys.stderr, flush=True)
        _settle(targets, prefill, decode, pipe, args.settle_s)
        final = LEGIT_ROOM0 + len(legit)
        legit.append(final)
        why = legit_room(prefill, decode, final)
        if why:
            failures.append(f"the last legit room: {why}")
        result = _verdict(args, targets, prefill, decode, pipe, legit, failures, mut.counts)
    finally:
        ctx.destroy(linger=0)
        prefill.stop()
        decode.stop()
        try:
            pipe.send("exit")
        except (BrokenPipeError, OSError):
            pass
        lis.join(5)
    result["seconds"] = round(time.time() - t0, 1)
    return result


def _sockets(ctx, kind: int, addr: str, n: int) -> list[zmq.Socket]:
    """``n`` connected sockets of ``kind`` (DEALER: to prefill's ROUTER; PUSH: to the cancel
    listener) that queue a whole flood without blocking."""
    out = []
    for _ in range(n):
        s = ctx.socket(kind)
        s.setsockopt(zmq.LINGER, 0)
        s.setsockopt(zmq.SNDHWM, 100000)
        s.connect(f"tcp://{addr}")
        out.append(s)
    return out


def _drop_counts(prefill, decode, pipe) -> tuple[dict[str, int], int]:
    """Frames each target dropped as invalid (prefill and decode count by kind; the cancel
    listener counts every drop, a well-formed message of the wrong type included), and the
    cancels the listener saw."""
    pipe.send("stats")
    cancels_seen, cancel_dropped = pipe.recv()
    counts = {
        "prefill": sum(n for k, n in prefill.dropped().items() if k in INVALID_KINDS),
        "decode": sum(n for k, n in decode.dropped().items() if k in INVALID_KINDS),
        "cancel": cancel_dropped,
    }
    return counts, cancels_seen


def _all_dropped(targets, counts) -> bool:
    """Prefill and decode dropped exactly the invalid frames (none let through, no valid frame
    counted as invalid); the cancel listener at least those."""
    return all(
        counts[t.name] == t.must_drop if t.exact else counts[t.name] >= t.must_drop for t in targets
    )


def _settle(targets, prefill, decode, pipe, limit_s: float) -> None:
    """Wait until every target has counted its must-drop frames, or its count stopped moving
    for a second, at most ``limit_s`` (a loaded machine processes the burst late)."""
    deadline, last, still_since = time.time() + limit_s, None, time.time()
    while time.time() < deadline:
        counts = _drop_counts(prefill, decode, pipe)[0]
        if _all_dropped(targets, counts):
            return
        if counts != last:
            last, still_since = counts, time.time()
        elif time.time() - still_since > 1.0:
            return
        time.sleep(0.1)


def _verdict(args, targets, prefill, decode, pipe, legit, failures, kinds) -> dict:
    growth = {t.name: round(rss_mb(t.pid) - t.rss0, 1) for t in targets}
    counts, cancels_seen = _drop_counts(prefill, decode, pipe)
    untouched = decode.untouched(legit + list(range(900, 904)))
    checks = {
        "all_processes_alive": all(os.path.exists(f"/proc/{t.pid}") for t in targets),
        "legit_rooms_byte_exact": not failures,
        "no_write_outside_claimed_pages": untouched,
        "invalid_frames_dropped": _all_dropped(targets, counts),
        "memory_bounded": all(g < args.max_rss_growth_mb for g in growth.values()),
    }
    return {
        "ok": all(checks.values()),
        "checks": checks,
        "messages": sum(t.sent for t in targets),
        "per_target": {t.name: t.sent for t in targets},
        "must_drop": {t.name: t.must_drop for t in targets},
        "oversize": {t.name: t.oversize for t in targets},
        "invalid_dropped": counts,
        "frame_kinds": kinds,
        "legit_rooms": len(legit),
        "failures": failures,
        "rss_growth_mb": growth,
        "prefill_dropped": prefill.dropped(),
        "decode_dropped": decode.dropped(),
        "cancel_listener": {"cancels": cancels_seen, "dropped": counts["cancel"]},
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.fuzz_control",
                                 description=__doc__.split("\n")[0])
    ap.add_argument("--messages", type=int, default=100_000)
    ap.add_argument("--legit-every", type=int, default=2000, help="a legit room every N messages")
    ap.add_argument("--max-rss-growth-mb", type=float, default=256.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--settle-s", type=float, default=30.0, help="longest wait for the last frames' drops"
    )
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--no-progress", dest="progress", action="store_false")
    args = ap.parse_args(argv)
    return print_result(run(args), args.json)
