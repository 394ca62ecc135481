"""KV between prefill and decode stages of different TP sizes, byte for byte over real Mooncake:
each rank is its own OS process with its own engine and pool shard (kvtransfer/tp/shards.py).
Every piece :func:`~kvtransfer.layout.shard_pieces` plans is gathered into a registered slot on
its prefill rank, written with one Mooncake write into a decode rank's slot and scattered there
into that rank's heads only. Cases: GQA 1 -> 2, 2 -> 1, 2 -> 2 and the seed case, an MLA target
with a GQA draft, at 2 -> 1 and 1 -> 2; the target entry at page 16, the draft at page 1, both
with fragmented page tables. Checked: every decode shard equals what the model's heads hold in
the claimed pages and is untouched (-1) everywhere else; MLA bytes leave prefill rank 0 only,
once per decode rank; writes per layer group = sum over pieces of ceil(units / units per slot).
"""

from __future__ import annotations

from dataclasses import astuple

import numpy as np
import pytest
from kvpeer import PeerProcess
from shardpeer import SLOT_BYTES

from kvtransfer import EntryLayout
from kvtransfer.memory.layout import group_units, shard_pieces
from kvtransfer.tp.shards import piece_chunks

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]
HEADS = 4
GQA = dict(attn="gqa", dtype="bfloat16", page_size=16, num_layers=3, num_pages=12, head_dim=16)
MLA = dict(attn="mla", dtype="bfloat16", page_size=16, num_layers=3, num_pages=12, head_dim=24,
           kv_lora_rank=16, rope_dim=8)  # fmt: skip
DRAFT = dict(attn="gqa", dtype="float32", page_size=1, num_layers=2, num_pages=200, head_dim=8)
GROUPS = {"target": [(0, 1), (1, 3)], "draft": [(0, 2)]}


@pytest.fixture(scope="module")
def ranks():
    """Two prefill-side and two decode-side rank processes, shared by every case."""
    procs = {side: [PeerProcess("shards", {}, {}, seed=10 * i + (side == "decode"))
                    for i in range(2)] for side in ("prefill", "decode")}  # fmt: skip
    yield procs
    for side in procs.values():
        for p in side:
            p.stop()


def shard(kw: dict, size: int, rank: int) -> dict:
    if kw["attn"] == "mla":
        return dict(kw)
    per = HEADS // size
    return dict(kw, kv_heads=per, head_start=rank * per, total_kv_heads=HEADS)


def pages(rng, lay: dict, n: int) -> list[int]:
    return [int(p) for p in rng.permutation(lay["num_pages"])[:n]]


def expected(src: list[np.ndarray], src_lay, d: EntryLayout, src_pages, dst_pages, layers):
    """Decode shard ``d`` as it must be after the move: -1 but the claimed pages of ``layers``."""
    want = np.full(d.buffer_shape(), -1.0, np.float32)
    for layer in layers:
        for s, t in zip(src_pages, dst_pages, strict=True):
            if d.attn == "mla":
                want[layer, t] = src[0][layer, s]
                continue
            for h in range(d.head_start, d.head_start + d.kv_heads):
                r = next(i for i, sl in enumerate(src_lay)
                         if sl.head_start <= h < sl.head_start + sl.kv_heads)  # fmt: skip
                got = src[r][layer, :, s, :, h - src_lay[r].head_start]
                want[layer, :, t, :, h - d.head_start] = got
    return want


@pytest.mark.parametrize(
    ("case", "target", "sizes"),
    [("gqa-1-2", GQA, (1, 2)), ("gqa-2-1", GQA, (2, 1)), ("gqa-2-2", GQA, (2, 2)),
     ("mla-2-1", MLA, (2, 1)), ("mla-1-2", MLA, (1, 2))],
)  # fmt: skip
def test_shards_move_byte_exact_between_tp_sizes(ranks, case, target, sizes):
    entries = {"target": target, "draft": DRAFT}
    rng = np.random.default_rng(sum(map(ord, case)))
    tokens = 70  # 5 pages of 16, 70 pages of 1
    want_pages = {"target": -(-tokens // 16), "draft": tokens}
    src_pages = {r: pages(rng, entries[r], n) for r, n in want_pages.items()}
    dst_pages = {r: pages(rng, entries[r], n) for r, n in want_pages.items()}
    sides = {}
    for side, size in zip(("prefill", "decode"), sizes, strict=True):
        lays = [{r: shard(kw, size, i) for r, kw in entries.items()} for i in range(size)]
        slots = [ranks[side][i].make(case, lays[i], side == "prefill") for i in range(size)]
        sides[side] = (lays, slots)
    sent_by = {}  # (prefill rank, role) -> bytes written
    for role in entries:
        src_lay = [EntryLayout(role=role, **lay[role]) for lay in sides["prefill"][0]]
        dst_lay = [EntryLayout(role=role, **lay[role]) for lay in sides["decode"][0]]
        pieces = shard_pieces(src_lay, dst_lay)
        writes = 0
        for a, b in GROUPS[role]:
            for p in pieces:
                chunks = piece_chunks(p, src_lay[0], want_pages[role], range(a, b), SLOT_BYTES)
                for chunk in chunks:
                    remote = sides["decode"][1][p.dst][0]
                    session = ranks["decode"][p.dst].info["session"]
                    assert ranks["prefill"][p.src].send(case, astuple(p),
                        src_pages[role], (a, b), chunk, 0, session, remote)  # fmt: skip
                    ranks["decode"][p.dst].receive(case, astuple(p),
                                                   dst_pages[role], (a, b), chunk, 0)  # fmt: skip
                    key = (p.src, role)
                    sent_by[key] = sent_by.get(key, 0) + chunk[1] * p.unit_bytes(src_lay[0])
                writes += len(chunks)
                units = group_units(src_lay[0], want_pages[role], range(a, b))
                assert len(chunks) == -(-units // (SLOT_BYTES // p.unit_bytes(src_lay[0])))
        assert writes < tokens  # per slot, never per token or per head
        src = [ranks["prefill"][i].buffer(case, role) for i in range(sizes[0])]
        layers = range(0, max(b for _, b in GROUPS[role]))
        for d, lay in enumerate(dst_lay):
            got = ranks["decode"][d].buffer(case, role)
            want = expected(src, src_lay, lay, src_pages[role], dst_pages[role], layers)
            np.testing.assert_array_equal(got, want, err_msg=f"{case} {role} decode rank {d}")
    if target is MLA:  # the latent leaves prefill rank 0 only, once per decode rank
        lay = EntryLayout(role="target", **target)
        once = sum(len(range(a, b)) * want_pages["target"] * lay.page_bytes
                   for a, b in GROUPS["target"])  # fmt: skip
        assert sent_by.get((0, "target")) == once * sizes[1]
        assert (1, "target") not in sent_by
        assert sizes[0] == 1 or sent_by.get((1, "draft"), 0) > 0  # every rank sends its draft
