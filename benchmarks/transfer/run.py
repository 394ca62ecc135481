"""KV transfer throughput: kvtransfer vs the link (raw Mooncake, one large block) and raw copies.

Two OS processes on one host (decode = child process, prefill = this process). For each layout
and page size, several synthetic requests of ``--tokens`` tokens move prefill's pages into
decode's pages; in the same run, per request (mode order rotated):

* link: raw Mooncake writing ONE contiguous block of the request's size (one write, status
  polled with short sleeps) -- the link limit on this host;
* fragmented: kvtransfer on random fragmented page tables (both sides): timed from the first
  ``send_group`` to the room's Success on prefill (Complete goes after every byte landed);
  staged through registered slots when the page runs are small;
* contiguous: kvtransfer on contiguous page tables (direct copies, one per layer and component);
* raw: raw Mooncake with the very copies a fragmented table needs without staging
  (``batch_transfer_sync_write`` in chunks of ``--raw-batch``), skipped above ``--raw-max-copies``.

Decode's pages are zeroed before each kvtransfer/raw mode and every byte is checked after it
(order-sensitive checksum). ``--json`` prints one object: per cell ``link_gbps``,
``fragmented_gbps`` (= ``kvtransfer_gbps``), ``contiguous_gbps``, ``raw_gbps``, ``ratio``
(kvtransfer / raw) and ``link_ratio`` (fragmented / link); the top-level keys are those of page
size ``--headline-page`` over all layouts. ``--link-gbit R`` re-runs the whole command inside
``unshare -n`` with a ``tc tbf`` rate limit on the namespace's loopback (as benchmarks.ttft does).
``--tp P:D ...`` measures heterogeneous TP instead (:mod:`benchmarks.transfer.tp`).

    .venv/bin/python -m benchmarks.transfer --requests 5
    .venv/bin/python -m benchmarks.transfer --requests 5 --link-gbit 4

``--checksum`` turns ``kv_checksum`` on in both processes (so the kvtransfer modes include
prefill's CRC32C before Complete and decode's check) and also times one side's checksum of a
request alone, contiguous and fragmented: ``checksum_ms`` and ``checksum_ratio`` (both sides'
checksum time / the transfer time of the same request at the measured contiguous / fragmented
rate; prefill and decode each sum once, one after the other, so both count).

    .venv/bin/python -m benchmarks.transfer --layouts smollm2-gqa --page-sizes 16 \
        --requests 3 --checksum
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing as mp
import os
import statistics
import sys
import threading
import time

import numpy as np

from benchmarks import netns
from benchmarks.common import command_line

from .report import headline, table
from .tp import TP_LAYOUTS, bench_tp_cell, tp_table

os.environ.setdefault("GLOG_minloglevel", "2")

LAYOUTS = {
    "smollm2-gqa": dict(attn="gqa", num_layers=30, kv_heads=3, head_dim=64),
    "deepseek-mla": dict(attn="mla", num_layers=61, head_dim=576, kv_lora_rank=512, rope_dim=64),
    # the 8B shapes of benchmarks.gpu_roofline (128 and 144 KiB a token in bfloat16)
    "llama8b-gqa": dict(attn="gqa", num_layers=32, kv_heads=8, head_dim=128),
    "qwen3-8b-gqa": dict(attn="gqa", num_layers=36, kv_heads=8, head_dim=128),
}
DEFAULT_LAYOUTS = ("smollm2-gqa", "deepseek-mla")  # 94 and 288 MB at 4K tokens
MODES = ("link", "fragmented", "contiguous", "raw")
MODULE = "benchmarks.transfer"  # how it is run (and re-run inside a namespace)


def entry(name: str, dtype: str, page_size: int, num_pages: int, layers: int | None):
    from kvtransfer import SCALED_DTYPES, EntryLayout

    kw = dict(LAYOUTS[name])
    if layers:
        kw["num_layers"] = min(layers, kw["num_layers"])
    if dtype in SCALED_DTYPES:  # fp8: one scale per (layer, component); the bytes are random
        kw["scale_log2"] = [0] * kw["num_layers"] * (2 if kw["attn"] == "gqa" else 1)
    return EntryLayout(role="target", dtype=dtype, page_size=page_size, num_pages=num_pages, **kw)


def pick_pages(rng, num_pages: int, n: int, fragmented: bool) -> list[int]:
    if not fragmented:
        start = int(rng.integers(0, num_pages - n + 1))
        return list(range(start, start + n))
    return [int(p) for p in rng.permutation(num_pages)[:n]]


class Buffer:
    """A pool's bytes on ``device`` (numpy on the CPU, a torch tensor on a GPU); ``host()`` is
    a numpy view (a copy from a GPU) for checks, never on the timed path."""

    def __init__(self, data: np.ndarray, device: str):
        self.np, self.t = data, None
        self.addr = data.ctypes.data
        if device != "cpu":
            import torch

            self.t = torch.from_numpy(data).to(device)
            self.addr = self.t.data_ptr()

    def tensor(self):
        """The bytes as a torch tensor (shares memory): kvtransfer stages from / into it."""
        import torch

        return self.t if self.t is not None else torch.from_numpy(self.np)

    def host(self) -> np.ndarray:
        return self.np if self.t is None else self.t.cpu().numpy()

    def zero(self) -> None:
        if self.t is None:
            self.np[:] = 0
        else:
            self.t.zero_()


def decode_main(conn, layout_kw: dict, config_kw: dict, device: str) -> None:
    from kvtransfer import KVReceiver, TransferConfig

    lay = entry(**layout_kw)
    pool = Buffer(np.zeros(lay.nbytes, np.uint8), device)
    lay = lay.with_pool(lay.num_pages, pool.addr)
    rx = KVReceiver(TransferConfig(**config_kw), {"target": lay}, {"target": pool.tensor()})
    conn.send((rx.session_id, lay.base_addr))
    while True:
        cmd = conn.recv()
        if cmd[0] == "exit":
            rx.close()
            conn.send("bye")
            return
        if cmd[0] == "register":
            _, room, addr, pages, tokens = cmd
            rx.register(room, [addr], {"target": pages}, tokens, lambda r, s: None)
            conn.send("ok")
        elif cmd[0] == "wait":
            conn.send(rx.wait(cmd[1], 120).name)
        elif cmd[0] == "zero":  # clear the pool, so each mode must deliver every byte
            pool.zero()
            conn.send("ok")
        elif cmd[0] == "digest":
            conn.send(page_digest(lay, pool.host(), cmd[1]))


def slab(lay, buf, layer: int, comp: int) -> np.ndarray:
    """[num_pages, page_bytes] view of one (layer, component)."""
    off = lay.slab_addr(layer, comp) - lay.base_addr
    return buf[off : off + lay.num_pages * lay.page_bytes].reshape(lay.num_pages, lay.page_bytes)


def page_digest(lay, buf, pages) -> int:
    """Order-sensitive checksum of every byte of ``pages`` in every layer and component."""
    w = np.arange(1, len(pages) + 1, dtype=np.uint64)
    total = 0
    for layer in range(lay.num_layers):
        for c in range(lay.components):
            rows = slab(lay, buf, layer, c)[pages].view(np.uint64).sum(axis=1, dtype=np.uint64)
            total = (total * 31 + int((rows * w).sum(dtype=np.uint64))) % (1 << 64)
    return total


def run_raw(te, session: str, ts, batch: int) -> float:
    """The same copies straight through Mooncake, sync batches of ``batch`` entries."""
    t0 = time.perf_counter()
    for c in range(0, len(ts), batch):
        ch = ts[c : c + batch]
        srcs, dsts, lens = [t.src for t in ch], [t.dst for t in ch], [t.length for t in ch]
        rc = te.batch_transfer_sync_write(session, srcs, dsts, lens)
        assert rc == 0, f"raw batch failed: {rc}"
    return time.perf_counter() - t0


def run_link(te, session: str, src: int, dst: int, nbytes: int) -> float:
    """One contiguous block of ``nbytes``: one write, polled with 100 us sleeps (the link limit;
    Mooncake's blocking status call busy-waits and takes a core from its own TCP threads here)."""
    t0 = time.perf_counter()
    tid = te.transfer_submit_write(session, src, dst, nbytes)
    assert tid is not None and tid >= 0, f"link write not submitted: {tid}"
    while (rc := te.transfer_check_status(tid)) == 0:
        time.sleep(1e-4)
    assert rc == 1, f"link write failed: {rc}"
    return time.perf_counter() - t0


def run_kvtransfer(tx, conn, room: int, s_pages, d_pages, groups, tokens: int) -> float:
    """First send_group -> Success on prefill (Complete goes after every write landed)."""
    conn.send(("register", room, tx.bootstrap_addr, d_pages, tokens))
    conn.recv()
    done = threading.Event()
    tx.start_room(room, {"target": s_pages}, lambda r, s: done.set())
    while tx.poll(room).name == "Bootstrapping":  # the claim (Ack) is not timed
        time.sleep(0.001)
    t0 = time.perf_counter()
    for a, b in groups:
        tx.send_group(room, "target", range(a, b))
    tx.finish(room, 1)
    done.wait(120)
    dt = time.perf_counter() - t0
    assert tx.poll(room).name == "Success", tx.failure_reason(room)
    conn.send(("wait", room))
    assert conn.recv() == "Success"
    return dt


def bench_cell(name: str, page_size: int, args) -> dict:
    from backends.stages.policy import LayerGroupPolicy
    from kvtransfer import KVSender, TransferConfig, group_transfers

    n_pages = math.ceil(args.tokens / page_size)
    pool_pages = n_pages + n_pages // 4
    layout_kw = dict(
        name=name, dtype=args.dtype, page_size=page_size, num_pages=pool_pages, layers=args.layers
    )
    config_kw = dict(
        host="127.0.0.1",
        staging_slot_bytes=int(args.slot_mb * (1 << 20)),
        staging_inflight=args.inflight,
        staging_slots=args.inflight + 1,
        staging_grants_per_room=args.inflight + 1,
        kv_checksum=args.checksum,
    )
    ctx = mp.get_context("spawn")
    conn, child = ctx.Pipe()
    proc = ctx.Process(
        target=decode_main, args=(child, layout_kw, config_kw, args.device), daemon=True
    )
    proc.start()
    session, dst_base = conn.recv()

    lay = entry(**layout_kw)
    data = np.random.default_rng(0).integers(0, 256, lay.nbytes, dtype=np.uint8)
    source = Buffer(data, args.device)  # the source bytes never change: `data` is their copy
    src = lay.with_pool(pool_pages, source.addr)
    dst = lay.with_pool(pool_pages, dst_base)
    tx = KVSender(TransferConfig(**config_kw), {"target": src}, {"target": source.tensor()})
    te = tx.engine._te  # the raw Mooncake handle of the same engine
    groups = LayerGroupPolicy().groups(args.tokens, lay.num_layers)
    rng = np.random.default_rng(1)
    res: dict[str, list[float]] = {mode: [] for mode in MODES}
    frag_copies = len(
        group_transfers(
            src, dst, *(pick_pages(rng, pool_pages, n_pages, True) for _ in range(2)),
            range(lay.num_layers),
        )
    )  # fmt: skip
    modes = [m for m in MODES if m != "raw" or frag_copies <= args.raw_max_copies]
    nbytes = n_pages * lay.page_bytes * lay.components * lay.num_layers
    try:
        for i in range(args.requests + 1):  # request 0 warms every path up
            for mode in modes[i % len(modes) :] + modes[: i % len(modes)]:
                dt = one_mode(mode, i, tx, te, conn, session, src, dst, groups, rng, args, data)
                if i > 0:
                    res[mode].append(nbytes / dt / 1e9)
        sums = time_checksums(src, source, rng, n_pages, args) if args.checksum else {}
    finally:
        tx.close()
        conn.send(("exit",))
        conn.recv()
        proc.join(10)
    med = {m: statistics.median(v) if v else None for m, v in res.items()}
    out = {
        "layout": name,
        "layers": lay.num_layers,
        "dtype": args.dtype,
        "page_size": page_size,
        "tokens": args.tokens,
        "bytes_per_request": nbytes,
        "bytes_per_token": lay.bytes_per_token_all_layers(),
        "bytes_per_token_bfloat16": entry(**{**layout_kw, "dtype": "bfloat16"})
        .bytes_per_token_all_layers(),
        "copies_fragmented_direct": frag_copies,
        "groups": len(groups),
        "slot_mb": args.slot_mb,
        "link_gbps": med["link"],
        "fragmented_gbps": med["fragmented"],
        "contiguous_gbps": med["contiguous"],
        "kvtransfer_gbps": med["fragmented"],
        "raw_gbps": med["raw"],
        "ratio": med["fragmented"] / med["raw"] if med["raw"] else None,
        "link_ratio": med["fragmented"] / med["link"],
        "contiguous_link_ratio": med["contiguous"] / med["link"],
        "runs": res,
    }
    if sums:
        out["checksum_ms"] = sums
        out["checksum_ratio"] = {
            m: 2 * sums[m] / 1e3 / (nbytes / (med[m] * 1e9)) for m in sums if med.get(m)
        }
    return out


def time_checksums(src, source, rng, n_pages: int, args) -> dict[str, float]:
    """Median ms of one side's kv_checksum of a request (prefill's before Complete; decode's
    check costs the same), contiguous and fragmented page tables."""
    from kvtransfer import entry_checksums

    out = {}
    for mode, frag in (("contiguous", False), ("fragmented", True)):
        times = []
        for _ in range(max(args.requests, 3)):
            pages = pick_pages(rng, src.num_pages, n_pages, frag)
            t0 = time.perf_counter()
            entry_checksums(src, source.tensor(), pages)
            times.append((time.perf_counter() - t0) * 1e3)
        out[mode] = statistics.median(times)
    return out


def one_mode(mode, i, tx, te, conn, session, src, dst, groups, rng, args, data) -> float:
    """Run one mode for request ``i``; checks every byte decode got (not for link)."""
    from kvtransfer import group_transfers

    n_pages = math.ceil(args.tokens / src.page_size)
    if mode == "link":
        nbytes = n_pages * src.page_bytes * src.components * src.num_layers
        return run_link(te, session, src.base_addr, dst.base_addr, nbytes)
    frag = mode != "contiguous"
    s_pages = pick_pages(rng, src.num_pages, n_pages, frag)
    d_pages = pick_pages(rng, src.num_pages, n_pages, frag)
    conn.send(("zero", d_pages))
    conn.recv()
    if mode == "raw":
        ts = group_transfers(src, dst, s_pages, d_pages, range(src.num_layers))
        dt = run_raw(te, session, ts, args.raw_batch)
    else:
        room = 100 * (i + 1) + MODES.index(mode)
        dt = run_kvtransfer(tx, conn, room, s_pages, d_pages, groups, args.tokens)
    conn.send(("digest", d_pages))
    assert conn.recv() == page_digest(src, data, s_pages), f"{mode}: bytes differ at decode"
    return dt


def main() -> None:
    ap = argparse.ArgumentParser(prog=f"python -m {MODULE}", description=__doc__.split("\n")[0])
    ap.add_argument("--layouts", nargs="+", default=list(DEFAULT_LAYOUTS), choices=list(LAYOUTS))
    ap.add_argument("--page-sizes", nargs="+", type=int, default=[1, 16, 64])
    ap.add_argument("--headline-page", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--requests", type=int, default=5, help="measured requests per cell")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "float8_e4m3fn"],
                    help="the pools' dtype (auto: --dtype), as the stage parameter")
    ap.add_argument("--layers", type=int, default=None, help="cap layers (memory/time)")
    ap.add_argument("--slot-mb", type=float, default=8.0, help="staging slot size (MiB)")
    ap.add_argument("--inflight", type=int, default=2, help="staged writes in flight")
    ap.add_argument("--raw-batch", type=int, default=1024, help="raw batch size (entries)")
    ap.add_argument("--raw-max-copies", type=int, default=20000, help="skip the raw-copies mode"
                    " for cells needing more copies (page 1: 245,760 for GQA)")
    ap.add_argument("--device", default="cpu", help="where both pools live: cpu or cuda[:N]")
    ap.add_argument("--link-gbit", type=float, default=None, help="emulated link rate (Gbit/s)")
    ap.add_argument("--link-burst", default="1mb")
    ap.add_argument("--link-latency", default="50ms")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--checksum", action="store_true",
                    help="kv_checksum on; time the CRC32C (see above)")
    ap.add_argument("--tp", nargs="+", metavar="P:D", default=None,
                    help="heterogeneous TP rows instead (prefill TP : decode TP), e.g. 2:1 1:2")
    ap.add_argument("--tp-layouts", nargs="+", default=list(TP_LAYOUTS), choices=list(TP_LAYOUTS))
    args = ap.parse_args()  # fmt: skip
    if args.kv_cache_dtype != "auto":
        args.dtype = args.kv_cache_dtype
    if args.link_gbit is not None and not netns.in_netns():
        sys.exit(netns.reexec_in_netns(MODULE, args.link_gbit, args.link_burst, args.link_latency))
    link = netns.describe(args.link_gbit, args.link_burst, args.link_latency)
    if args.tp:
        tp_main(args, link)
        return
    cells = [bench_cell(n, p, args) for n in args.layouts for p in args.page_sizes]
    out = {**headline(cells, args.headline_page), "link": link, "cells": cells}
    out["command"] = command_line(MODULE)
    out["load_avg"] = os.getloadavg()
    if args.json:
        print(json.dumps(out))
        return
    print(table(cells, link))
    h = {k: v for k, v in out.items() if k.endswith(("gbps", "ratio")) and v is not None}
    print("page", args.headline_page, ", ".join(f"{k} {v:.3f}" for k, v in h.items()))
    for c in cells:
        if "checksum_ms" in c:
            ms, ratio = c["checksum_ms"], c["checksum_ratio"]
            print(
                f"{c['layout']} page {c['page_size']}: checksum per side"
                + "".join(f" {m} {ms[m]:.1f} ms ({ratio.get(m, 0):.1%} of transfer)" for m in ms)
            )


def tp_main(args, link: dict) -> None:
    """The heterogeneous-TP rows (:mod:`.tp`): one per layout, TP pair and page size."""
    rows = [bench_tp_cell(n, spec, p, args)
            for n in args.tp_layouts for spec in args.tp for p in args.page_sizes]  # fmt: skip
    out = {"tp_rows": rows, "min_link_ratio": min(r["link_ratio"] for r in rows), "link": link}
    out["command"] = command_line(MODULE)
    out["load_avg"] = os.getloadavg()
    print(json.dumps(out) if args.json else tp_table(rows))
