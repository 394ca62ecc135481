#!/usr/bin/env python
"""KV transfer throughput: kvtransfer (layer groups, async batches, control plane) vs raw Mooncake.

Two OS processes on one host (decode = child process, prefill = this process). For each layout,
several synthetic requests of ``--tokens`` tokens move prefill's pages into decode's pages:

* kvtransfer: decode registers the room, prefill ``start_room`` / ``send_group`` per policy group /
  ``finish``; timed from the first ``send_group`` to the room's Success on prefill (Complete sent
  after every write landed);
* raw: the very same copies (same addresses, same coalescing) with
  ``batch_transfer_sync_write`` in chunks of ``--raw-batch`` entries on the same engine;
* raw_async: the same chunks with ``batch_transfer_async_write`` + ``get_batch_transfer_status``
  (the calls kvtransfer's workers use) — the fairest raw baseline.

Before each mode decode's pages are zeroed; after it every byte is checked (order-sensitive
checksum), so each mode must deliver the whole request.

Mode order rotates per request; the script reports medians. ``--json`` prints one JSON object with
``kvtransfer_gbps``, ``raw_gbps``, ``ratio`` and per-layout detail.

    .venv/bin/python scripts/bench/bench_transfer.py --requests 5
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
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
os.environ.setdefault("GLOG_minloglevel", "2")

import numpy as np  # noqa: E402

from backends.stages.params import StageParams  # noqa: E402

LAYOUTS = {
    "smollm2-gqa": dict(attn="gqa", num_layers=30, kv_heads=3, head_dim=64),
    "deepseek-mla": dict(attn="mla", num_layers=61, head_dim=576, kv_lora_rank=512, rope_dim=64),
}


def entry(name: str, dtype: str, page_size: int, num_pages: int, layers: int | None):
    from kvtransfer import EntryLayout

    kw = dict(LAYOUTS[name])
    if layers:
        kw["num_layers"] = min(layers, kw["num_layers"])
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
    rx = KVReceiver(TransferConfig(**config_kw), {"target": lay})
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


def run_raw(te, session: str, ts, batch: int, use_async: bool) -> float:
    """The same copies straight through Mooncake: sync batches, or async batches + wait."""
    t0 = time.perf_counter()
    for c in range(0, len(ts), batch):
        ch = ts[c : c + batch]
        srcs, dsts, lens = [t.src for t in ch], [t.dst for t in ch], [t.length for t in ch]
        if use_async:
            bid = te.batch_transfer_async_write(session, srcs, dsts, lens)
            rc = te.get_batch_transfer_status([bid]) if bid else -1
        else:
            rc = te.batch_transfer_sync_write(session, srcs, dsts, lens)
        assert rc == 0, f"raw batch failed: {rc}"
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


def bench_layout(name: str, args) -> dict:
    from kvtransfer import KVSender, LayerGroupPolicy, TransferConfig
    from kvtransfer.layout import group_transfers

    n_pages = math.ceil(args.tokens / args.page_size)
    pool_pages = n_pages + n_pages // 4
    layout_kw = dict(
        name=name,
        dtype=args.dtype,
        page_size=args.page_size,
        num_pages=pool_pages,
        layers=args.layers,
    )
    config_kw = dict(host="127.0.0.1", max_batch_entries=args.batch)
    ctx = mp.get_context("spawn")
    conn, child = ctx.Pipe()
    args_ = (child, layout_kw, config_kw, args.device)
    proc = ctx.Process(target=decode_main, args=args_, daemon=True)
    proc.start()
    session, dst_base = conn.recv()

    lay = entry(**layout_kw)
    data = np.random.default_rng(0).integers(0, 256, lay.nbytes, dtype=np.uint8)
    source = Buffer(data, args.device)  # lives for the whole run
    buf = data  # the source bytes never change: the host array is their exact copy
    src = lay.with_pool(pool_pages, source.addr)
    dst = lay.with_pool(pool_pages, dst_base)
    tx = KVSender(TransferConfig(**config_kw), {"target": src})
    te = tx.engine._te  # the raw Mooncake handle of the same engine
    groups = LayerGroupPolicy().groups(args.tokens, lay.num_layers)
    rng = np.random.default_rng(1)
    modes = ["kvtransfer", "raw", "raw_async"]
    res: dict[str, list[float]] = {mode: [] for mode in modes}
    nbytes = entries = 0
    try:
        for i in range(args.requests + 1):  # request 0 warms every path up
            s_pages = pick_pages(rng, pool_pages, n_pages, args.fragmented)
            d_pages = pick_pages(rng, pool_pages, n_pages, args.fragmented)
            ts = group_transfers(src, dst, s_pages, d_pages, range(lay.num_layers))
            nbytes, entries = sum(t.length for t in ts), len(ts)
            want = page_digest(src, buf, s_pages)
            for mode in modes[i % 3 :] + modes[: i % 3]:  # rotate the order per request
                conn.send(("zero", d_pages))
                conn.recv()
                if mode == "kvtransfer":
                    room = 1000 * (i + 1) + 1
                    dt = run_kvtransfer(tx, conn, room, s_pages, d_pages, groups, args.tokens)
                else:
                    dt = run_raw(te, session, ts, args.raw_batch, mode == "raw_async")
                if i > 0:
                    res[mode].append(nbytes / dt / 1e9)
                conn.send(("digest", d_pages))
                assert conn.recv() == want, f"{mode}: bytes differ at decode"
    finally:
        tx.close()
        conn.send(("exit",))
        conn.recv()
        proc.join(10)
    kv, raw, raw_async = (statistics.median(res[mode]) for mode in modes)
    return {
        "layout": name,
        "layers": lay.num_layers,
        "dtype": args.dtype,
        "page_size": args.page_size,
        "tokens": args.tokens,
        "fragmented": args.fragmented,
        "bytes_per_request": nbytes,
        "copies_per_request": entries,
        "groups": len(groups),
        "kvtransfer_gbps": kv,
        "raw_gbps": raw,
        "raw_async_gbps": raw_async,
        "ratio": kv / raw,
        "ratio_vs_raw_async": kv / raw_async,
        "runs": res,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--requests", type=int, default=5, help="measured requests per layout")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--page-size", type=int, default=StageParams.page_size)
    ap.add_argument("--layers", type=int, default=None, help="cap layers (memory/time)")
    ap.add_argument(
        "--contiguous",
        dest="fragmented",
        action="store_false",
        help="contiguous page runs instead of random fragmented page tables",
    )
    ap.add_argument("--batch", type=int, default=1024, help="kvtransfer max_batch_entries")
    ap.add_argument("--raw-batch", type=int, default=1024, help="raw batch size (entries)")
    ap.add_argument("--device", default="cpu", help="where both pools live: cpu or cuda[:N]")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()

    detail = [bench_layout(name, args) for name in args.layouts]
    total = sum(d["bytes_per_request"] for d in detail)

    def overall(key: str) -> float:  # total bytes / total median time
        return total / sum(d["bytes_per_request"] / d[key] for d in detail)

    kv, raw, raw_async = overall("kvtransfer_gbps"), overall("raw_gbps"), overall("raw_async_gbps")
    out = {
        "kvtransfer_gbps": kv,
        "raw_gbps": raw,
        "ratio": kv / raw,
        "raw_async_gbps": raw_async,
        "ratio_vs_raw_async": kv / raw_async,
        "layouts": detail,
    }
    if args.json:
        print(json.dumps(out))
        return
    for d in detail:
        print(
            f"{d['layout']:>13}: {d['layers']} layers {d['dtype']} page {d['page_size']},"
            f" {d['bytes_per_request'] / 1e6:.1f} MB/request in {d['copies_per_request']} copies,"
            f" {d['groups']} groups: kvtransfer {d['kvtransfer_gbps']:.2f} GB/s,"
            f" raw sync {d['raw_gbps']:.2f} GB/s (ratio {d['ratio']:.3f}),"
            f" raw async {d['raw_async_gbps']:.2f} GB/s (ratio {d['ratio_vs_raw_async']:.3f})"
        )
    print(
        f"overall: kvtransfer {kv:.2f} GB/s, raw sync {raw:.2f} GB/s (ratio {kv / raw:.3f}),"
        f" raw async {raw_async:.2f} GB/s (ratio {kv / raw_async:.3f})"
    )


if __name__ == "__main__":
    main()
