"""bench_transfer.py --tp: KV between a prefill and a decode of different TP sizes.

Every rank is its own OS process with its own Mooncake engine, pool shard and staging slots
(:class:`kvtransfer.shards.RankShards`), as a TP stage's ranks are. For one request the pieces
come from :func:`kvtransfer.layout.shard_pieces` (which prefill rank sends which heads to which
decode rank; MLA once per decode rank, from prefill rank 0) and each piece of each layer group
(:class:`kvtransfer.LayerGroupPolicy`) is cut into slot-sized chunks
(:func:`kvtransfer.shards.piece_chunks`). A prefill rank gathers a chunk's head slice into a local
slot while its writer thread writes the previous one (ONE Mooncake write per chunk) into a slot
that the destination decode rank lent it (two per rank pair); the decode rank scatters the slot
into its heads of the request's pages and lends the slot back. Timed from the start signal until
every decode rank scattered its last chunk; every decode shard is then compared byte for byte
with what it must hold.

In the same run, ``link``: raw Mooncake moving the same bytes as ONE block per rank pair (all
pairs at once). ``link_ratio`` = link time / kvtransfer time. ``writes_per_request`` counts the
Mooncake writes of one request (slot-sized: a few per layer group and rank pair), beside
``groups x pairs`` and the copies a per-token, per-head transfer would make
(``copies_per_token_and_head``).

This drives the rank-shard data path the stages will use; the control plane (Register, Grant,
Staged) does not carry ranks yet, so the bench's driver plays its part.
"""

from __future__ import annotations

import math
import multiprocessing as mp
import queue
import statistics
import threading
import time
from dataclasses import asdict, astuple
from multiprocessing.connection import wait

TP_LAYOUTS = {
    # a Llama-3-8B-like GQA target: 8 KV heads split over the ranks
    "gqa": {"target": dict(attn="gqa", num_layers=32, kv_heads=8, head_dim=128)},
    # the seed case: a DeepSeek MLA target (latent on every rank) + a one-layer GQA draft head
    "mla+gqa-draft": {
        "target": dict(attn="mla", num_layers=61, head_dim=576, kv_lora_rank=512, rope_dim=64),
        "draft": dict(attn="gqa", num_layers=1, kv_heads=8, head_dim=128),
    },
}
SLOTS_PER_PAIR = 2


def rank_layouts(name: str, size: int, rank: int, page_size: int, num_pages: int, dtype: str):
    """role -> this rank's EntryLayout (GQA: its head shard; MLA: the whole latent)."""
    from kvtransfer import EntryLayout

    out = {}
    for role, kw in TP_LAYOUTS[name].items():
        kw = dict(kw, role=role, dtype=dtype, page_size=page_size, num_pages=num_pages)
        if kw["attn"] == "gqa":
            per = kw["kv_heads"] // size
            kw.update(kv_heads=per, head_start=rank * per, total_kv_heads=per * size)
        out[role] = EntryLayout(**kw)
    return out


def full_values(lay, seed: int):
    """The whole model's KV of entry ``lay`` (every head) as int16 words, from ``seed``."""
    import torch

    heads = lay.total_kv_heads if lay.attn == "gqa" else lay.kv_heads
    shape = list(lay.buffer_shape())
    if lay.attn == "gqa":
        shape[-2] = heads
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-(1 << 15), 1 << 15, shape, generator=g, dtype=torch.int16)


def head_slice(t, lay):
    """``lay``'s shard of a whole-entry tensor (heads are the second-to-last dimension)."""
    if lay.attn != "gqa":
        return t
    return t[..., lay.head_start : lay.head_start + lay.kv_heads, :]


def rank_main(conn, peers: dict, side: str, layouts_kw: dict, slot_bytes: int, seed: int):
    """One rank. ``peers``: the other side's rank -> pipe. Commands from the driver on ``conn``."""
    import torch

    from kvtransfer import EntryLayout, TransferConfig
    from kvtransfer.engine import Engine
    from kvtransfer.layout import ShardPiece
    from kvtransfer.shards import RankShards

    torch.set_num_threads(1)
    layouts = {role: EntryLayout(**kw) for role, kw in layouts_kw.items()}
    tensors, wholes = {}, {}
    for k, (role, lay) in enumerate(layouts.items()):
        whole = head_slice(full_values(lay, seed + k), lay).contiguous()
        t = whole if side == "prefill" else torch.zeros_like(whole)
        wholes[role] = whole  # decode: what its shard must hold (checks)
        tensors[role] = t.view(torch.bfloat16)
        layouts[role] = lay.with_pool(lay.num_pages, t.data_ptr())
    engine = Engine(TransferConfig(host="127.0.0.1"))
    slots = SLOTS_PER_PAIR * max(1, len(peers)) if side == "decode" else SLOTS_PER_PAIR
    shards = RankShards(engine, tensors, layouts, slots, slot_bytes)
    for t in tensors.values():  # the pools too, for the raw one-block baseline
        engine.register(t.data_ptr(), t.numel() * t.element_size())
    addrs = {role: t.data_ptr() for role, t in tensors.items()}
    conn.send((engine.session_id, [shards.slot_addr(s) for s in range(slots)], addrs))
    while True:
        cmd = conn.recv()
        if cmd[0] == "exit":
            engine.close()
            conn.send("bye")
            return
        if cmd[0] == "zero":
            for t in tensors.values():
                t.view(torch.int16).zero_()
            conn.send("ok")
        elif cmd[0] == "check":
            conn.send(check_shard(tensors, wholes, *cmd[1:]))
        elif cmd[0] == "link":
            conn.send(link_writes(engine, cmd[1]))
        elif side == "prefill":
            conn.send(send_tasks(shards, peers, cmd[1], ShardPiece))
        else:
            conn.send(receive_tasks(shards, peers, cmd[1], ShardPiece))


def send_tasks(shards, peers: dict, tasks: dict, piece_cls) -> int:
    """Prefill rank: every chunk of ``tasks`` (decode rank -> [(piece, pages, layers, chunk,
    slot addresses)]) gathered here, written into a slot its decode rank lent. Returns writes."""
    from kvtransfer.layout import staging_rows

    order = [(d, i) for i in range(max(map(len, tasks.values()), default=0))
             for d in tasks if i < len(tasks[d])]  # fmt: skip
    credits = {d: [] for d in tasks}
    free_local = queue.Queue()
    for s in range(SLOTS_PER_PAIR):
        free_local.put(s)
    out: queue.Queue = queue.Queue()
    failed = []

    def writer() -> None:
        while (job := out.get()) is not None:
            d, i, local, remote_slot, addr, nbytes, session = job
            if not shards.engine.write_sync(session, shards.slot_addr(local), addr, nbytes):
                failed.append((d, i))
            free_local.put(local)
            peers[d].send(("landed", i, remote_slot))

    th = threading.Thread(target=writer, daemon=True)
    th.start()
    for d, i in order:
        piece, pages, layers, chunk, session, slot_addrs = tasks[d][i]
        while not credits[d]:
            credits[d].append(peers[d].recv())
        remote = credits[d].pop(0)
        local = free_local.get()
        piece = piece_cls(*piece)
        lay = shards.layouts[piece.role]
        rows = staging_rows(lay, pages, range(*layers), *chunk)
        shards.staging.gather(piece.role, rows, local, heads=(piece.src_off, piece.heads))
        out.put((d, i, local, remote, slot_addrs[remote], chunk[1] * piece.unit_bytes(lay),
                 session))  # fmt: skip
    out.put(None)
    th.join()
    for d in tasks:  # the last credits: the decode rank scattered every chunk
        while len(credits[d]) < SLOTS_PER_PAIR:
            credits[d].append(peers[d].recv())
    if failed:
        raise RuntimeError(f"{len(failed)} writes failed")
    return len(order)


def receive_tasks(shards, peers: dict, tasks: dict, piece_cls) -> int:
    """Decode rank: lend two slots to each prefill rank, scatter every landed chunk of ``tasks``
    (prefill rank -> [(piece, pages, layers, chunk)]) and lend its slot again."""
    base = {p: k * SLOTS_PER_PAIR for k, p in enumerate(sorted(peers))}
    for p in tasks:
        for s in range(SLOTS_PER_PAIR):
            peers[p].send(s)
    left = sum(map(len, tasks.values()))
    by_conn = {peers[p]: p for p in tasks}
    while left:
        for c in wait(list(by_conn)):
            p = by_conn[c]
            _, i, slot = c.recv()
            piece, pages, layers, chunk = tasks[p][i]
            shards.receive(piece_cls(*piece), pages, range(*layers), tuple(chunk), base[p] + slot)
            c.send(slot)
            left -= 1
    return 0


def link_writes(engine, blocks: list) -> int:
    """Raw Mooncake: ONE write per block (session, local addr, remote addr, bytes)."""
    for session, src, dst, nbytes in blocks:
        assert engine.write_sync(session, src, dst, nbytes), "link write failed"
    return len(blocks)


def check_shard(tensors: dict, wholes: dict, src_pages: dict, dst_pages: dict) -> str:
    """'' when this decode shard holds exactly its heads of the source pages in ``dst_pages``
    (zero elsewhere), else what differs."""
    import torch

    for role, whole in wholes.items():
        want = torch.zeros_like(whole)
        lead = (slice(None),) * (2 if whole.dim() == 6 else 1)  # GQA [L, 2, pages], MLA [L, pages]
        want[(*lead, dst_pages[role])] = whole[(*lead, src_pages[role])]
        if not torch.equal(want, tensors[role].view(torch.int16)):
            return f"entry {role}: decode shard differs"
    return ""


class TPCell:
    """One row: ``prefill_tp`` -> ``decode_tp`` for layout ``name`` at ``page_size``."""

    def __init__(self, name: str, prefill_tp: int, decode_tp: int, page_size: int, args):
        self.name, self.p, self.d, self.page = name, prefill_tp, decode_tp, page_size
        self.args = args
        self.n_pages = math.ceil(args.tokens / page_size)
        self.pool_pages = self.n_pages + self.n_pages // 4
        self.slot_bytes = int(args.slot_mb * (1 << 20))
        self.lay = {side: [rank_layouts(name, n, r, page_size, self.pool_pages, args.dtype)
                           for r in range(n)]
                    for side, n in (("prefill", prefill_tp), ("decode", decode_tp))}  # fmt: skip

    def start(self) -> None:
        ctx = mp.get_context("spawn")
        pairs = {(p, d): ctx.Pipe() for p in range(self.p) for d in range(self.d)}
        self.conns, self.procs, self.info = {}, [], {}
        for side, n in (("prefill", self.p), ("decode", self.d)):
            for r in range(n):
                peers = ({d: pairs[r, d][0] for d in range(self.d)} if side == "prefill"
                         else {p: pairs[p, r][1] for p in range(self.p)})  # fmt: skip
                kw = {role: asdict(lay) for role, lay in self.lay[side][r].items()}
                mine, child = ctx.Pipe()
                proc = ctx.Process(target=rank_main, daemon=True,
                                   args=(child, peers, side, kw, self.slot_bytes, 7))  # fmt: skip
                proc.start()
                self.conns[side, r], self.procs = mine, self.procs + [proc]
        for key, c in self.conns.items():
            self.info[key] = c.recv()

    def stop(self) -> None:
        for c in self.conns.values():
            c.send(("exit",))
            c.recv()
        for p in self.procs:
            p.join(10)

    def plan(self, rng):
        """One request's tasks per rank and its bytes per rank pair (fragmented page tables)."""
        from kvtransfer import LayerGroupPolicy
        from kvtransfer.layout import group_units, shard_pieces
        from kvtransfer.shards import piece_chunks

        src = {role: [int(x) for x in rng.permutation(self.pool_pages)[: self.n_pages]]
               for role in TP_LAYOUTS[self.name]}  # fmt: skip
        dst = {role: [int(x) for x in rng.permutation(self.pool_pages)[: self.n_pages]]
               for role in TP_LAYOUTS[self.name]}  # fmt: skip
        send = {p: {} for p in range(self.p)}
        recv = {d: {} for d in range(self.d)}
        pair_bytes: dict[tuple[int, int], int] = {}
        groups, self.per_head_copies = 0, 0
        for role in TP_LAYOUTS[self.name]:
            pl = [x[role] for x in self.lay["prefill"]]
            dl = [x[role] for x in self.lay["decode"]]
            layer_groups = LayerGroupPolicy().groups(self.args.tokens, pl[0].num_layers)
            groups += len(layer_groups)
            for a, b in layer_groups:
                for piece in shard_pieces(pl, dl):
                    layers = range(a, b)
                    units = group_units(pl[0], self.n_pages, layers)
                    key = (piece.src, piece.dst)
                    pair_bytes[key] = pair_bytes.get(key, 0) + units * piece.unit_bytes(pl[0])
                    self.per_head_copies += units * pl[0].page_size * piece.heads
                    session, slots, _ = self.info["decode", piece.dst]
                    base = sorted(range(self.p)).index(piece.src) * SLOTS_PER_PAIR
                    mine = slots[base : base + SLOTS_PER_PAIR]
                    for chunk in piece_chunks(piece, pl[0], self.n_pages, layers, self.slot_bytes):
                        t = (astuple(piece), (a, b), chunk)
                        send[piece.src].setdefault(piece.dst, []).append(
                            (t[0], src[role], t[1], t[2], session, mine)
                        )
                        recv[piece.dst].setdefault(piece.src, []).append(
                            (t[0], dst[role], t[1], t[2]))  # fmt: skip
        return src, dst, send, recv, pair_bytes, groups

    def run_kv(self, send, recv) -> float:
        t0 = time.perf_counter()
        for d in range(self.d):
            self.conns["decode", d].send(("run", recv[d]))
        for p in range(self.p):
            self.conns["prefill", p].send(("run", send[p]))
        writes = sum(self.conns["prefill", p].recv() for p in range(self.p))
        for d in range(self.d):
            self.conns["decode", d].recv()
        return time.perf_counter() - t0, writes

    def run_link(self, pair_bytes) -> float:
        """One block per rank pair, from the prefill rank's pool to the decode rank's pool
        (the first entry's buffer: at least as large as any pair's bytes here)."""
        blocks = {p: [] for p in range(self.p)}
        for (p, d), n in pair_bytes.items():
            session, _, addrs = self.info["decode", d]
            src_addr = next(iter(self.info["prefill", p][2].values()))
            blocks[p].append((session, src_addr, next(iter(addrs.values())), n))
        t0 = time.perf_counter()
        for p in range(self.p):
            self.conns["prefill", p].send(("link", blocks[p]))
        for p in range(self.p):
            self.conns["prefill", p].recv()
        return time.perf_counter() - t0

    def check(self, src, dst) -> None:
        for d in range(self.d):
            self.conns["decode", d].send(("check", src, dst))
        errs = [self.conns["decode", d].recv() for d in range(self.d)]
        assert not any(errs), errs

    def zero(self) -> None:
        for d in range(self.d):
            self.conns["decode", d].send(("zero",))
            self.conns["decode", d].recv()


def bench_tp_cell(name: str, spec: str, page_size: int, args) -> dict:
    """``spec``: "P:D" (prefill TP : decode TP)."""
    p, d = (int(x) for x in spec.split(":"))
    cell = TPCell(name, p, d, page_size, args)
    import numpy as np

    rng = np.random.default_rng(3)
    res = {"kvtransfer": [], "link": []}
    writes = groups = 0
    pair_bytes: dict = {}
    cell.start()
    try:
        for i in range(args.requests + 1):  # request 0 warms up
            src, dst, send, recv, pair_bytes, groups = cell.plan(rng)
            total = sum(pair_bytes.values())
            for mode in ("kvtransfer", "link") if i % 2 else ("link", "kvtransfer"):
                if mode == "link":
                    dt = cell.run_link(pair_bytes)
                else:
                    cell.zero()
                    dt, writes = cell.run_kv(send, recv)
                    cell.check(src, dst)
                if i:
                    res[mode].append(total / dt / 1e9)
    finally:
        cell.stop()
    med = {k: statistics.median(v) for k, v in res.items()}
    return {
        "layout": name, "prefill_tp": p, "decode_tp": d, "page": page_size,
        "tokens": args.tokens, "dtype": args.dtype, "bytes_per_request": sum(pair_bytes.values()),
        "rank_pairs": len(pair_bytes), "groups": groups, "writes_per_request": writes,
        "writes_bound_groups_x_pairs": groups * len(pair_bytes),
        "copies_per_token_and_head": cell.per_head_copies,
        "slot_mb": args.slot_mb, "kvtransfer_gbps": med["kvtransfer"], "link_gbps": med["link"],
        "link_ratio": med["kvtransfer"] / med["link"], "runs": res,
    }  # fmt: skip


def tp_table(rows: list[dict]) -> str:
    head = ("| layout | prefill TP -> decode TP | page | MB / request | writes / request "
            "(groups x pairs) | kvtransfer GB/s | link GB/s | link_ratio |\n"
            "|---|---|---|---|---|---|---|---|")  # fmt: skip
    lines = [head]
    for r in rows:
        lines.append(
            f"| {r['layout']} | {r['prefill_tp']} -> {r['decode_tp']} | {r['page']} | "
            f"{r['bytes_per_request'] / 1e6:.0f} | {r['writes_per_request']} "
            f"({r['writes_bound_groups_x_pairs']}) | {r['kvtransfer_gbps']:.3f} | "
            f"{r['link_gbps']:.3f} | {r['link_ratio']:.2f} |"
        )
    return "\n".join(lines)
