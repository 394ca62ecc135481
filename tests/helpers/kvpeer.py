"""Test harness: one prefill or decode side of kvtransfer in its own OS process.

The test process drives a peer through ``PeerProcess.call(method, ...)`` (multiprocessing pipe;
every peer its own process with its own Mooncake engine, forked from :mod:`peer_procs`'s
forkserver). Buffers are numpy arrays; a tiny page allocator per entry lets tests check that
every page is freed exactly once.
"""

from __future__ import annotations

import hashlib
import multiprocessing as mp
import os
import sys
import threading
import time
import traceback

import numpy as np

from tests.helpers import peer_procs

LAYOUTS = {
    # name -> EntryLayout kwargs without num_pages/base_addr
    "gqa": dict(attn="gqa", dtype="bfloat16", num_layers=4, kv_heads=2, head_dim=32),
    "mla": dict(
        attn="mla", dtype="bfloat16", num_layers=4, head_dim=96, kv_lora_rank=64, rope_dim=32
    ),
    "draft_gqa": dict(attn="gqa", dtype="float32", num_layers=2, kv_heads=1, head_dim=16),
    "draft_gqa_wide": dict(attn="gqa", dtype="float32", num_layers=2, kv_heads=1, head_dim=32),
    # fp8 KV: one byte per element, a power-of-two scale per (layer, component)
    "fp8_gqa": dict(attn="gqa", dtype="float8_e4m3fn", num_layers=4, kv_heads=2, head_dim=32,
                    scale_log2=[-3, -5, -2, -4, -2, -4, -3, -4]),
    "fp8_gqa_rescaled": dict(attn="gqa", dtype="float8_e4m3fn", num_layers=4, kv_heads=2,
                             head_dim=32, scale_log2=[-3, -5, -2, -4, -2, -3, -3, -4]),
    "fp8_mla": dict(attn="mla", dtype="float8_e4m3fn", num_layers=4, head_dim=96,
                    kv_lora_rank=64, rope_dim=32, scale_log2=[-2, -3, -2, -2]),
}


class Allocator:
    def __init__(self, num_pages: int, seed: int):
        self.free = list(range(num_pages))
        self.rng = np.random.default_rng(seed)

    def alloc(self, n: int, fragmented: bool) -> list[int]:
        if n > len(self.free):
            raise RuntimeError("out of pages")
        if fragmented:
            idx = sorted(self.rng.choice(len(self.free), n, replace=False).tolist(), reverse=True)
            pages = [self.free.pop(i) for i in idx]
            self.rng.shuffle(pages)
            return [int(p) for p in pages]
        pages, self.free = self.free[:n], self.free[n:]
        return pages

    def release(self, pages: list[int]) -> None:
        dup = set(pages) & set(self.free)
        if dup:
            raise RuntimeError(f"double free of pages {sorted(dup)[:4]}")
        self.free.extend(pages)


class Peer:
    """side: "prefill" | "decode"; entries: role -> (layout name, page_size, num_pages)."""

    def __init__(self, side: str, entries: dict, config: dict, seed: int = 0, device="cpu"):
        from kvtransfer import EntryLayout, KVReceiver, KVSender, TransferConfig

        self.side, self.device = side, device
        rng = np.random.default_rng(seed + (0 if side == "prefill" else 1))
        self.bufs, self.dev, self.layouts, self.alloc = {}, {}, {}, {}
        for role, (name, page_size, num_pages) in entries.items():
            lay = EntryLayout(role=role, page_size=page_size, num_pages=num_pages, **LAYOUTS[name])
            if side == "prefill":  # never zero, so decode can see bytes land
                buf = rng.integers(1, 256, lay.nbytes, dtype=np.uint8)
            else:
                buf = np.zeros(lay.nbytes, np.uint8)
            addr = buf.ctypes.data
            if device != "cpu":  # the pool lives on the GPU (Mooncake's CUDA build)
                import torch

                self.dev[role] = torch.from_numpy(buf).to(device)
                addr = self.dev[role].data_ptr()
            self.bufs[role] = buf
            self.layouts[role] = lay.with_pool(num_pages, addr)
            self.alloc[role] = Allocator(num_pages, seed + len(self.alloc))
        cfg = TransferConfig(**config)
        cls = KVSender if side == "prefill" else KVReceiver
        import torch  # the pools' tensors: staged transfers gather / scatter them

        tensors = {r: self.dev.get(r, None) for r in self.bufs}
        tensors = {
            r: t if t is not None else torch.from_numpy(self.bufs[r]) for r, t in tensors.items()
        }
        self.kv = cls(cfg, self.layouts, tensors)
        self.pages: dict[int, dict[str, list[int]]] = {}  # live allocations
        self.history: dict[int, dict[str, list[int]]] = {}  # every room's pages, kept
        self.released: dict[int, list[str]] = {}
        self.release_time: dict[int, float] = {}
        self.landed: dict[int, list] = {}
        self.expect_pages: dict[int, dict[str, int]] = {}
        self.complete_saw_all_bytes: dict[int, bool] = {}
        self.runs: dict[int, dict] = {}
        self.lock = threading.Lock()

    # ---- helpers -----------------------------------------------------------------------------
    def host(self, role: str) -> np.ndarray:
        """The entry's bytes as they are now (a host copy when the pool is on a GPU)."""
        if role in self.dev:
            return self.dev[role].cpu().numpy()
        return self.bufs[role]

    def info(self) -> dict:
        return {
            "bootstrap_addr": getattr(self.kv, "bootstrap_addr", None),
            "pid": os.getpid(),
            "free": self.free_counts(),
        }

    def free_counts(self) -> dict[str, int]:
        return {role: len(a.free) for role, a in self.alloc.items()}

    def alloc_pages(self, room: int, num_pages: dict[str, int], fragmented: bool = True):
        self.pages[room] = {r: self.alloc[r].alloc(n, fragmented) for r, n in num_pages.items()}
        self.history[room] = self.pages[room]
        return self.pages[room]

    def _on_release(self, room: int, status) -> None:
        if self.side == "decode" and status.name == "Success":
            # Complete must come after every write of the room: all its bytes are here now
            self.complete_saw_all_bytes[room] = all(
                self._landed(room, role, 0, self.layouts[role].num_layers, n)
                for role, n in self.expect_pages[room].items()
            )
        with self.lock:
            self.released.setdefault(room, []).append(status.name)
            self.release_time[room] = time.time()
        if self.side == "prefill" or status.name == "Failed":
            self.free_room(room)

    def free_room(self, room: int) -> None:
        for role, pages in self.pages.pop(room, {}).items():
            self.alloc[role].release(pages)

    def digest(self, room: int, role: str, n_pages: int | None = None, start: int = 0) -> str:
        """sha256 over the room's pages [start, n_pages) of every (layer, component), in
        page-list order."""
        lay, buf = self.layouts[role], self.host(role)
        pages = self.history[room][role][start:n_pages]
        h = hashlib.sha256()
        for layer in range(lay.num_layers):
            for comp in range(lay.components):
                for p in pages:
                    off = lay.page_addr(layer, comp, p) - lay.base_addr
                    h.update(buf[off : off + lay.page_bytes].tobytes())
        return h.hexdigest()

    def pages_zero(self, room: int, role: str, start: int, stop: int) -> bool:
        """Every byte of the room's pages [start, stop) is still zero (nothing landed there)."""
        lay, buf = self.layouts[role], self.host(role)
        for p in self.history[room][role][start:stop]:
            for layer in range(lay.num_layers):
                for comp in range(lay.components):
                    off = lay.page_addr(layer, comp, p) - lay.base_addr
                    if buf[off : off + lay.page_bytes].any():
                        return False
        return True

    def session_id(self) -> str:
        return self.kv.engine.session_id

    def base_addr(self, role: str) -> int:
        return self.layouts[role].base_addr

    def frame_limit(self) -> int:
        """The largest frame prefill's bootstrap socket takes (``MAXMSGSIZE``)."""
        import zmq

        return self.kv.router.getsockopt(zmq.MAXMSGSIZE)

    def untouched(self, rooms: list[int]) -> bool:
        """Every byte of every page outside these rooms' pages is still zero (decode side:
        no write landed outside a claimed page)."""
        for role, lay in self.layouts.items():
            buf = self.host(role)
            claimed = {p for r in rooms for p in self.history.get(r, {}).get(role, [])}
            for layer in range(lay.num_layers):
                for comp in range(lay.components):
                    for p in set(range(lay.num_pages)) - claimed:
                        off = lay.page_addr(layer, comp, p) - lay.base_addr
                        if buf[off : off + lay.page_bytes].any():
                            return False
        return True

    def untouched_except_prompts(self, rooms: list[int], tokens: dict) -> bool:
        """Like :meth:`untouched`, counting only each room's prompt pages as claimed."""
        keep = self.history
        self.history = {
            r: {role: p[: -(-tokens[r] // self.layouts[role].page_size)] for role, p in h.items()}
            for r, h in keep.items()
            if r in rooms
        }
        try:
            return self.untouched(rooms)
        finally:
            self.history = keep

    def set_faults(self, spec: str) -> None:
        """Fault injection on this side's sender (``KVTRANSFER_FAULTS`` syntax)."""
        from kvtransfer.link.faults import Faults

        self.kv.faults = Faults.from_env(spec)

    def page_size(self, role: str) -> int:
        return self.layouts[role].page_size

    def quarantined(self) -> set[int]:
        return self.kv.quarantined()

    def release_at(self, room: int) -> float | None:
        return self.release_time.get(room)

    def released_counts(self) -> dict[str, int]:
        return {str(room): len(v) for room, v in self.released.items()}

    def status(self, room: int) -> str:
        return self.kv.poll(room).name

    def wait(self, room: int, timeout: float) -> tuple[str, str]:
        st = self.kv.wait(room, timeout)
        return st.name, self.kv.failure_reason(room)

    def ended(self, room: int) -> tuple[str, str] | None:
        """(status, reason) once the room has ended, its pages released or not (``wait`` also
        waits for the release, which a quarantined room holds back); None before."""
        st = self.kv.poll(room)
        return (st.name, self.kv.failure_reason(room)) if st.ended else None

    def stats(self) -> dict:
        return self.kv.stats()

    def dropped(self) -> dict:
        return dict(self.kv.dropped)

    def room_stats(self, room: int):
        return self.kv.stats_for(room) if hasattr(self.kv, "stats_for") else None

    # ---- prefill -----------------------------------------------------------------------------
    def start_room(self, room: int) -> None:
        self.kv.start_room(room, self.pages[room], self._on_release)

    def run_prefill(
        self,
        room: int,
        groups: list,
        layer_sleep: float,
        draft_sleep: float,
        first_token: int,
        extra: dict | None,
    ) -> None:
        """Compute stub in a thread: sleep per layer, hand each group over when 'computed'."""

        def go():
            log = self.runs.setdefault(room, {"computed": []})
            for role, a, b in groups:
                time.sleep(layer_sleep * (b - a) if role == "target" else draft_sleep)
                log["computed"].append((role, a, b, time.time()))
                self.kv.send_group(room, role, range(a, b))
            log["finish_called"] = time.time()
            self.kv.finish(room, first_token, extra)

        threading.Thread(target=go, daemon=True).start()

    def prefill_log(self, room: int) -> dict:
        return self.runs.get(room, {})

    def abort(self, room: int, reason: str) -> None:
        self.kv.abort(room, reason)

    # ---- decode ------------------------------------------------------------------------------
    def register(
        self,
        room: int,
        addrs: list[str],
        num_tokens: int,
        watch: list | None = None,
        watch_pages: dict | None = None,
        first: dict | None = None,
    ) -> None:
        """Register the room; ``watch`` = [(role, a, b)]: record when those layers' bytes land
        in the first ``watch_pages[role]`` pages. ``first`` (role -> block): decode holds the
        blocks before it (a cached prefix) and registers pages from there on."""
        self.expect_pages[room] = {
            role: -(-num_tokens // self.layouts[role].page_size) for role in self.pages[room]
        }
        if watch:
            args = (room, watch, watch_pages or {})
            threading.Thread(target=self._watch, args=args, daemon=True).start()
        first = first or {}
        prompt = {
            role: self.pages[room][role][first.get(role, 0) : n]
            for role, n in self.expect_pages[room].items()
        }
        self.kv.register(room, addrs, prompt, num_tokens, self._on_release, first=first)

    def _watch(self, room: int, groups: list, npages: dict) -> None:
        out = self.landed.setdefault(room, [])
        for role, a, b in groups:
            lay = self.layouts[role]
            # the last byte of every page of every component of the group's layers
            offs = [
                lay.page_addr(layer, c, p) - lay.base_addr + lay.page_bytes - 1
                for layer in range(a, b)
                for c in range(lay.components)
                for p in self.history[room][role][: npages.get(role)]
            ]
            offs = np.array(offs)
            deadline = time.time() + 60
            while time.time() < deadline and not self.host(role)[offs].all():
                time.sleep(0.002)
            out.append((role, a, b, time.time()))

    def _landed(self, room: int, role: str, a: int, b: int, n: int) -> bool:
        """Every byte of layers [a, b) of the room's first n pages is written (non-zero)."""
        lay, buf = self.layouts[role], self.host(role)
        for layer in range(a, b):
            for c in range(lay.components):
                for p in self.history[room][role][:n]:
                    off = lay.page_addr(layer, c, p) - lay.base_addr
                    if not buf[off : off + lay.page_bytes].all():
                        return False
        return True

    def saw_all_bytes_at_complete(self, room: int) -> bool | None:
        return self.complete_saw_all_bytes.get(room)

    def landed_times(self, room: int) -> list:
        return list(self.landed.get(room, []))

    def result(self, room: int):
        return self.kv.result(room)

    def close(self) -> None:
        self.kv.close()


def serve(conn, side: str, entries: dict, config: dict, seed: int, device: str) -> None:
    os.environ.setdefault("GLOG_minloglevel", "2")
    try:
        if side == "shards":  # one rank of a TP stage (tests/helpers/shardpeer.py)
            from shardpeer import ShardPeer as cls
        else:
            cls = Peer
        peer = cls(side, entries, config, seed, device)
        conn.send(("ok", peer.info()))
    except Exception:
        conn.send(("err", traceback.format_exc()))
        return
    while True:
        try:
            method, args, kwargs = conn.recv()
        except EOFError:
            break
        if method == "exit":
            peer.close()
            conn.send(("ok", None))
            sys.stdout.flush()
            sys.stderr.flush()
            # closed above; the interpreter's own teardown (torch, Mooncake) took ~1.5 s a peer
            os._exit(0)
        try:
            conn.send(("ok", getattr(peer, method)(*args, **kwargs)))
        except Exception:
            conn.send(("err", traceback.format_exc()))


class PeerError(RuntimeError):
    pass


class PeerProcess:
    """A Peer in its own process. ``device``: where its pools live (default: $PD_TEST_DEVICE,
    else cpu), so scripts/gpu_check.sh runs the same transfer tests from CUDA pools."""

    def __init__(
        self, side: str, entries: dict, config: dict | None = None, seed: int = 0, device=None
    ):
        self.conn, child = mp.Pipe()
        device = device or os.environ.get("PD_TEST_DEVICE", "cpu")
        args = (child, side, entries, dict(config or {}), seed, device)
        self.proc = peer_procs.process(serve, args)
        self.proc.start()
        self.info = self._recv(timeout=60)

    def _recv(self, timeout: float):
        if not self.conn.poll(timeout):
            raise PeerError(f"peer did not answer in {timeout}s")
        kind, value = self.conn.recv()
        if kind == "err":
            raise PeerError(value)
        return value

    def call(self, method: str, *args, timeout: float = 60, **kwargs):
        self.conn.send((method, args, kwargs))
        return self._recv(timeout)

    def __getattr__(self, method: str):
        if method.startswith("_"):
            raise AttributeError(method)
        return lambda *a, **kw: self.call(method, *a, **kw)

    def kill(self) -> None:
        self.proc.kill()
        self.proc.join(10)

    def stop(self) -> None:
        if self.proc.is_alive():
            try:
                self.call("exit", timeout=10)
            except Exception:
                pass
            self.proc.join(5)
            if self.proc.is_alive():
                self.kill()
