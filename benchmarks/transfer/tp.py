"""``python -m benchmarks.transfer --tp``: KV between a prefill and a decode of different TP sizes.

The product's path, rank for rank: prefill rank 0 is a ``KVSender`` in this process, decode rank
0 a ``KVReceiver`` in a child process, and every other rank its own OS process with its own pool
shard and KV agent (:mod:`kvtransfer.tp.agent`: own Mooncake engine and staging slots), as a TP
stage's worker ranks are. Decode registers (protocol 6: every decode rank's session, slots and
heads), prefill pairs the ranks (:func:`kvtransfer.shard_pieces`: MLA once per decode rank
from prefill rank 0) and streams each layer group of each piece through slots (one Mooncake write
per slot-sized chunk, by the rank that holds the heads), the decode rank scatters it into its
heads. Timed from the first ``send_group`` until prefill's room is Success (Complete goes after
every write landed and was scattered); every decode shard is then compared byte for byte with
what it must hold (zero outside the request's pages).

In the same run, ``link``: raw Mooncake moving the same bytes as ONE block per rank pair (all
pairs at once). ``link_ratio`` = link time / kvtransfer time. ``writes_per_request`` counts the
Mooncake writes of one request (slot-sized: a few per layer group and rank pair), beside
``groups x pairs`` and the copies a per-token, per-head transfer would make
(``copies_per_token_and_head``).
"""

from __future__ import annotations

import math
import multiprocessing as mp
import statistics
import threading
import time
from dataclasses import asdict

TP_LAYOUTS = {
    # a Llama-3-8B-like GQA target: 8 KV heads split over the ranks
    "gqa": {"target": dict(attn="gqa", num_layers=32, kv_heads=8, head_dim=128)},
    # the seed case: a DeepSeek MLA target (latent on every rank) + a one-layer GQA draft head
    "mla+gqa-draft": {
        "target": dict(attn="mla", num_layers=61, head_dim=576, kv_lora_rank=512, rope_dim=64),
        "draft": dict(attn="gqa", num_layers=1, kv_heads=8, head_dim=128),
    },
}


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


def make_shards(side: str, layouts_kw: dict, seed: int):
    """(tensors, wholes, layouts) of one rank: prefill's shards hold their heads of the seeded
    model KV, decode's are zero; ``wholes``: what each shard holds (prefill) / must hold where
    the request's pages are (decode)."""
    import torch

    from kvtransfer import EntryLayout

    tensors, wholes, layouts = {}, {}, {}
    for k, (role, kw) in enumerate(layouts_kw.items()):
        lay = EntryLayout(**kw)
        whole = head_slice(full_values(lay, seed + k), lay).contiguous()
        t = whole if side == "prefill" else torch.zeros_like(whole)
        wholes[role], tensors[role] = whole, t.view(torch.bfloat16)
        layouts[role] = lay.with_pool(lay.num_pages, t.data_ptr())
    return tensors, wholes, layouts


def bench_commands(conn, tensors: dict, wholes: dict, engine, extra=None) -> None:
    """The bench's commands to one rank: info, zero, check, link (raw one-block writes), and
    whatever ``extra(cmd)`` answers (not None); until exit."""
    import torch

    while True:
        cmd = conn.recv()
        if cmd[0] == "exit":
            conn.send("bye")
            return
        out = extra(cmd) if extra is not None else None
        if out is not None:
            conn.send(out)
        elif cmd[0] == "info":
            conn.send((engine().session_id, {r: t.data_ptr() for r, t in tensors.items()}))
        elif cmd[0] == "zero":
            for t in tensors.values():
                t.view(torch.int16).zero_()
            conn.send("ok")
        elif cmd[0] == "check":
            conn.send(check_shard(tensors, wholes, *cmd[1:]))
        elif cmd[0] == "link":
            conn.send(link_writes(engine(), cmd[1]))


def rank_main(agent_conn, conn, side: str, layouts_kw: dict, seed: int) -> None:
    """Rank 1..N-1 of one side: its shard, its KV agent serving rank 0 on ``agent_conn``."""
    import torch

    from kvtransfer import serve_start

    torch.set_num_threads(1)
    tensors, wholes, layouts = make_shards(side, layouts_kw, seed)
    started = threading.Event()
    holder = {}

    def on_start(agent) -> None:  # its engine registered the pool: the raw baseline writes there
        holder["engine"] = agent.engine
        started.set()

    pools = lambda ids: (tensors, layouts)  # noqa: E731 - every entry of this rank
    threading.Thread(target=serve_start, args=(agent_conn, pools, on_start), daemon=True).start()
    bench_commands(conn, tensors, wholes, lambda: started.wait(60) and holder["engine"])


def start_agents(conns: list, config, slots: int):
    from kvtransfer import AgentClient

    agents = [AgentClient(c, k) for k, c in enumerate(conns, 1)]
    for a in agents:
        a.start(config, {}, slots, config.staging_slot_bytes, 120)
    return agents


def decode0_main(conn, layouts_kw: dict, seed: int, agent_conns: list, config_kw: dict) -> None:
    """Decode rank 0: a KVReceiver over its shard, with the other decode ranks' agents."""
    import torch

    from kvtransfer import KVReceiver, TransferConfig

    torch.set_num_threads(1)
    tensors, wholes, layouts = make_shards("decode", layouts_kw, seed)
    cfg = TransferConfig(**config_kw)
    agents = start_agents(agent_conns, cfg, cfg.staging_recv_slots)
    rx = KVReceiver(cfg, layouts, tensors, agents)

    def extra(cmd):
        if cmd[0] == "register":
            _, room, addr, pages, tokens = cmd
            rx.register(room, [addr], pages, tokens, lambda r, s: None)
            return "ok"
        if cmd[0] == "wait":
            return rx.wait(cmd[1], 120).name
        return None

    conn.send("ready")
    try:
        bench_commands(conn, tensors, wholes, lambda: rx.engine, extra)
    finally:
        rx.close()
        for a in agents:
            a.close()


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
        self.lay = {side: [rank_layouts(name, n, r, page_size, self.pool_pages, args.dtype)
                           for r in range(n)]
                    for side, n in (("prefill", prefill_tp), ("decode", decode_tp))}  # fmt: skip
        inflight = args.inflight
        self.config_kw = dict(host="127.0.0.1", staging_slot_bytes=int(args.slot_mb * (1 << 20)),
                              staging_inflight=inflight, staging_slots=inflight + 1,
                              staging_grants_per_room=inflight + 1)  # fmt: skip
        self.rooms = iter(range(1, 1 << 30))

    def _kw(self, side: str, rank: int) -> dict:
        return {role: asdict(lay) for role, lay in self.lay[side][rank].items()}

    def start(self) -> None:
        from kvtransfer import KVSender, TransferConfig

        ctx, seed = mp.get_context("spawn"), 7
        self.conns, self.procs, agent_ends = {}, [], {"prefill": [], "decode": []}
        for side, n in (("prefill", self.p), ("decode", self.d)):
            for r in range(1, n):
                (a0, a1), (b0, b1) = ctx.Pipe(), ctx.Pipe()
                self._spawn(ctx, rank_main, (a1, b1, side, self._kw(side, r), seed))
                agent_ends[side].append(a0)
                self.conns[side, r] = b0
        mine, child = ctx.Pipe()
        self._spawn(ctx, decode0_main, (child, self._kw("decode", 0), seed, agent_ends["decode"],
                                        self.config_kw))  # fmt: skip
        self.conns["decode", 0] = mine
        assert mine.recv() == "ready"
        tensors, _, layouts = make_shards("prefill", self._kw("prefill", 0), seed)
        cfg = TransferConfig(**self.config_kw)
        self.agents = start_agents(agent_ends["prefill"], cfg, cfg.staging_slots)
        self.tx = KVSender(cfg, layouts, tensors, self.agents)
        self.info = {("prefill", 0): (self.tx.engine.session_id,
                                      {r: t.data_ptr() for r, t in tensors.items()})}  # fmt: skip
        for key, c in self.conns.items():
            c.send(("info",))
            self.info[key] = c.recv()

    def _spawn(self, ctx, target, args) -> None:
        proc = ctx.Process(target=target, args=args, daemon=True)
        proc.start()
        self.procs.append(proc)

    def stop(self) -> None:
        self.tx.close()
        for a in self.agents:
            a.close()
        for c in self.conns.values():
            c.send(("exit",))
            c.recv()
        for p in self.procs:
            p.join(10)

    def plan(self, rng):
        """One request: random fragmented page tables, its bytes per rank pair, and counts."""
        from kvtransfer import group_units, shard_pieces

        roles = list(TP_LAYOUTS[self.name])
        pick = lambda: [int(x) for x in rng.permutation(self.pool_pages)[: self.n_pages]]  # noqa: E731
        src, dst = {r: pick() for r in roles}, {r: pick() for r in roles}
        pair_bytes: dict[tuple[int, int], int] = {}
        groups, copies = {}, 0
        for role in roles:
            pl = [x[role] for x in self.lay["prefill"]]
            dl = [x[role] for x in self.lay["decode"]]
            groups[role] = self.policy().groups(self.args.tokens, pl[0].num_layers)
            for a, b in groups[role]:
                units = group_units(pl[0], self.n_pages, range(a, b))
                for piece in shard_pieces(pl, dl):
                    key = (piece.src, piece.dst)
                    pair_bytes[key] = pair_bytes.get(key, 0) + units * piece.unit_bytes(pl[0])
                    copies += units * pl[0].page_size * piece.heads
        return src, dst, groups, pair_bytes, copies

    @staticmethod
    def policy():
        from backends.stages.policy import LayerGroupPolicy

        return LayerGroupPolicy()

    def run_kv(self, src, dst, groups) -> tuple[float, int]:
        """One request through KVSender -> KVReceiver; (seconds, Mooncake writes)."""
        room, d0 = next(self.rooms), self.conns["decode", 0]
        d0.send(("register", room, self.tx.bootstrap_addr, dst, self.args.tokens))
        assert d0.recv() == "ok"
        done, before = threading.Event(), self.tx.staging.counts["chunks"]
        self.tx.start_room(room, src, lambda r, s: done.set())
        while self.tx.poll(room).name == "Bootstrapping":  # the claim (Ack) is not timed
            time.sleep(0.001)
        t0 = time.perf_counter()
        for role, gs in groups.items():
            for a, b in gs:
                self.tx.send_group(room, role, range(a, b))
        self.tx.finish(room, 1)
        assert done.wait(120)
        dt = time.perf_counter() - t0
        assert self.tx.poll(room).name == "Success", self.tx.failure_reason(room)
        d0.send(("wait", room))
        assert d0.recv() == "Success"
        return dt, self.tx.staging.counts["chunks"] - before

    def run_link(self, pair_bytes) -> float:
        """One block per rank pair, from the prefill rank's pool to the decode rank's pool
        (the first entry's buffer: at least as large as any pair's bytes here)."""
        blocks = {p: [] for p in range(self.p)}
        for (p, d), n in pair_bytes.items():
            session, addrs = self.info["decode", d]
            src_addr = next(iter(self.info["prefill", p][1].values()))
            blocks[p].append((session, src_addr, next(iter(addrs.values())), n))
        t0 = time.perf_counter()
        for p in range(1, self.p):
            self.conns["prefill", p].send(("link", blocks[p]))
        link_writes(self.tx.engine, blocks[0])
        for p in range(1, self.p):
            self.conns["prefill", p].recv()
        return time.perf_counter() - t0

    def decode_ranks(self, *cmd) -> list:
        for d in range(self.d):
            self.conns["decode", d].send(cmd)
        return [self.conns["decode", d].recv() for d in range(self.d)]


def bench_tp_cell(name: str, spec: str, page_size: int, args) -> dict:
    """``spec``: "P:D" (prefill TP : decode TP)."""
    import numpy as np

    p, d = (int(x) for x in spec.split(":"))
    cell = TPCell(name, p, d, page_size, args)
    rng = np.random.default_rng(3)
    res = {"kvtransfer": [], "link": []}
    cell.start()
    try:
        for i in range(args.requests + 1):  # request 0 warms up
            src, dst, groups, pair_bytes, copies = cell.plan(rng)
            total = sum(pair_bytes.values())
            for mode in ("kvtransfer", "link") if i % 2 else ("link", "kvtransfer"):
                if mode == "link":
                    dt = cell.run_link(pair_bytes)
                else:
                    cell.decode_ranks("zero")
                    dt, writes = cell.run_kv(src, dst, groups)
                    errs = cell.decode_ranks("check", src, dst)
                    assert not any(errs), errs
                if i:
                    res[mode].append(total / dt / 1e9)
    finally:
        cell.stop()
    med = {k: statistics.median(v) for k, v in res.items()}
    n_groups = sum(map(len, groups.values()))
    return {
        "layout": name, "prefill_tp": p, "decode_tp": d, "page": page_size,
        "tokens": args.tokens, "dtype": args.dtype, "bytes_per_request": total,
        "rank_pairs": len(pair_bytes), "groups": n_groups, "writes_per_request": writes,
        "writes_bound_groups_x_pairs": n_groups * len(pair_bytes),
        "copies_per_token_and_head": copies, "slot_mb": args.slot_mb,
        "kvtransfer_gbps": med["kvtransfer"], "link_gbps": med["link"],
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
