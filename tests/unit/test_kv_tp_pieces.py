"""Heterogeneous tensor parallelism, the address side: which prefill rank sends which KV heads to
which decode rank (:func:`~kvtransfer.layout.shard_pieces`), and head slices moved through
staging slots (gather on each prefill rank, one slot write, scatter on decode) byte for byte,
with nothing written outside the claimed pages or the slice's heads."""

from __future__ import annotations

import pytest
import torch

from kvtransfer.memory.layout import (
    EntryLayout,
    ShardPiece,
    group_units,
    shard_pieces,
    staging_rows,
)
from kvtransfer.memory.staging import StagingArea


def gqa(heads: tuple[int, int], total: int = 4, role: str = "target", **kw) -> EntryLayout:
    args = dict(role=role, attn="gqa", dtype="float32", page_size=4, num_layers=3,
                num_pages=10, head_dim=8, kv_heads=heads[1], head_start=heads[0],
                total_kv_heads=total)  # fmt: skip
    return EntryLayout(**{**args, **kw})


def mla(**kw) -> EntryLayout:
    args = dict(role="target", attn="mla", dtype="float32", page_size=4, num_layers=3,
                num_pages=10, head_dim=12, kv_lora_rank=8, rope_dim=4)  # fmt: skip
    return EntryLayout(**{**args, **kw})


def tp(size: int, total: int = 4, **kw) -> list[EntryLayout]:
    if size <= total:  # split
        per = total // size
        return [gqa((r * per, per), total, **kw) for r in range(size)]
    return [gqa((r * total // size, 1), total, **kw) for r in range(size)]  # replicated


def P(src, dst, head, heads, src_off, dst_off, role="target"):
    return ShardPiece(role, src, dst, head, heads, src_off, dst_off)


def test_pieces_between_tp_sizes():
    # 2 -> 1: each prefill rank sends its half into decode's one shard at its head offset
    assert shard_pieces(tp(2), tp(1)) == [P(0, 0, 0, 2, 0, 0), P(1, 0, 2, 2, 0, 2)]
    # 1 -> 2: the one prefill rank sends each decode rank its half
    assert shard_pieces(tp(1), tp(2)) == [P(0, 0, 0, 2, 0, 0), P(0, 1, 2, 2, 2, 0)]
    # same TP: whole shards, rank to rank (direct copies)
    pieces = shard_pieces(tp(2), tp(2))
    assert pieces == [P(0, 0, 0, 2, 0, 0), P(1, 1, 2, 2, 0, 0)]
    assert all(p.whole(tp(2)[p.src], tp(2)[p.dst]) for p in pieces)
    # SmolLM2's 3 KV heads at TP 3 -> 1
    assert shard_pieces(tp(3, 3), tp(1, 3)) == [P(r, 0, r, 1, 0, r) for r in range(3)]


def test_replicated_heads_come_from_one_rank_and_reach_every_decode_rank():
    # TP 4 over 2 heads: ranks 0, 1 hold head 0; ranks 2, 3 hold head 1
    assert shard_pieces(tp(4, 2), tp(1, 2)) == [P(0, 0, 0, 1, 0, 0), P(2, 0, 1, 1, 0, 1)]
    assert shard_pieces(tp(1, 2), tp(4, 2)) == [
        P(0, 0, 0, 1, 0, 0), P(0, 1, 0, 1, 0, 0), P(0, 2, 1, 1, 1, 0), P(0, 3, 1, 1, 1, 0),
    ]  # fmt: skip


def test_mla_goes_once_per_decode_rank_from_prefill_rank_0_and_the_draft_from_every_rank():
    assert shard_pieces([mla()] * 2, [mla()]) == [P(0, 0, 0, 1, 0, 0)]
    assert shard_pieces([mla()], [mla()] * 2) == [P(0, 0, 0, 1, 0, 0), P(0, 1, 0, 1, 0, 0)]
    draft = shard_pieces(tp(2, role="draft"), tp(1, role="draft"))
    assert {p.src for p in draft} == {0, 1}


@pytest.mark.parametrize(
    ("prefill", "decode", "words"),
    [
        (tp(2), tp(1, page_size=8), "page_size differs"),
        (tp(2), tp(1, dtype="bfloat16"), "dtype differs"),
        (tp(2), tp(1, num_layers=4), "num_layers differs"),
        (tp(2), [gqa((0, 3), 3)], "3 KV heads in all"),
        (tp(2), [gqa((0, 2))], "decode ranks hold KV heads [0, 1], not all 4"),
        ([gqa((0, 2))], tp(2), "KV head 2 of decode rank 1 is held by no prefill rank"),
        ([mla()], [mla(num_layers=2)], "num_layers differs"),
        ([mla()], tp(1), "attn differs"),
    ],
)
def test_shards_that_cannot_pair_are_refused_naming_why(prefill, decode, words):
    with pytest.raises(ValueError, match=words.replace("[", r"\[").replace("]", r"\]")):
        shard_pieces(prefill, decode)


# ---- bytes through staging ----------------------------------------------------------------
class Rank:
    """One rank's pool entry (a torch buffer) and its staging slots."""

    def __init__(self, lay: EntryLayout, fill: float | None):
        buf = torch.full(lay.buffer_shape(), -1.0) if fill is None else torch.randn(
            lay.buffer_shape()
        )  # fmt: skip
        self.buf = buf
        self.lay = lay.with_pool(lay.num_pages, buf.data_ptr())
        self.staging = StagingArea({lay.role: buf}, {lay.role: self.lay}, slots=2, slot_bytes=4096)


def move(pieces, prefill: list[Rank], decode: list[Rank], src_pages, dst_pages, layers) -> int:
    """Every piece through staging, chunk by chunk; returns the slot writes made."""
    writes = 0
    for p in pieces:
        src, dst = prefill[p.src], decode[p.dst]
        units = group_units(src.lay, len(src_pages), layers)
        per = src.staging.fits(p.role, (p.src_off, p.heads))
        for start in range(0, units, per):
            n = min(per, units - start)
            rows = staging_rows(src.lay, src_pages, layers, start, n)
            src.staging.gather(p.role, rows, 0, heads=(p.src_off, p.heads))
            dst.staging.buffer[:] = src.staging.buffer  # the one write of the slot
            rows = staging_rows(dst.lay, dst_pages, layers, start, n)
            dst.staging.scatter(p.role, rows, 0, heads=(p.dst_off, p.heads))
            writes += 1
    return writes


def gqa_expected(prefill: list[Rank], d: EntryLayout, src_pages, dst_pages, layers):
    """Decode rank ``d``'s buffer as it must be: its heads from whichever prefill rank holds
    them, in the claimed pages of the moved layers; -1 everywhere else."""
    want = torch.full(d.buffer_shape(), -1.0)
    for h in range(d.head_start, d.head_start + d.kv_heads):
        r = next(r for r in prefill if r.lay.head_start <= h < r.lay.head_start + r.lay.kv_heads)
        for layer in layers:
            for s, t in zip(src_pages, dst_pages, strict=True):
                want[layer, :, t, :, h - d.head_start] = r.buf[layer, :, s, :, h - r.lay.head_start]
    return want


@pytest.mark.parametrize("sizes", [(1, 2), (2, 1), (2, 2), (4, 1)])
@pytest.mark.parametrize("page_size", [1, 16])
def test_head_slices_land_byte_exact_and_nowhere_else(sizes, page_size):
    src_pages, dst_pages = [7, 2, 5, 3, 9], [1, 8, 4, 6, 0]  # fragmented on both sides
    layers = range(1, 3)
    prefill = [Rank(lay, 0.0) for lay in tp(sizes[0], page_size=page_size)]
    decode = [Rank(lay, None) for lay in tp(sizes[1], page_size=page_size)]
    pieces = shard_pieces([r.lay for r in prefill], [r.lay for r in decode])
    writes = move(pieces, prefill, decode, src_pages, dst_pages, layers)
    for d in decode:
        torch.testing.assert_close(
            d.buf, gqa_expected(prefill, d.lay, src_pages, dst_pages, layers), rtol=0, atol=0
        )
    # one write per full slot per piece (rank pair), never per token or per head
    units = group_units(prefill[0].lay, len(src_pages), layers)
    per_slot = [prefill[p.src].staging.fits("target", (p.src_off, p.heads)) for p in pieces]
    assert writes == sum(-(-units // n) for n in per_slot)
    assert len(pieces) == max(sizes)


def test_mla_target_with_gqa_draft_moves_the_latent_once_and_every_draft_shard():
    src_pages, dst_pages, layers = [3, 0, 6], [5, 2, 9], range(0, 3)
    pre_t = [Rank(mla(), 0.0) for _ in range(2)]
    dec_t = [Rank(mla(), None)]
    t_pieces = shard_pieces([r.lay for r in pre_t], [r.lay for r in dec_t])
    assert [p.src for p in t_pieces] == [0]  # rank 1 sends no target bytes
    for p in t_pieces:  # whole latent rows: no head slice
        units = group_units(pre_t[0].lay, 3, layers)
        pre_t[p.src].staging.gather("target", staging_rows(pre_t[0].lay, src_pages, layers, 0,
                                                           units), 0)  # fmt: skip
        dec_t[0].staging.buffer[:] = pre_t[p.src].staging.buffer
        dec_t[0].staging.scatter("target", staging_rows(dec_t[0].lay, dst_pages, layers, 0,
                                                        units), 0)  # fmt: skip
    want = torch.full(dec_t[0].buf.shape, -1.0)
    want[:, dst_pages] = pre_t[0].buf[:, src_pages]
    torch.testing.assert_close(dec_t[0].buf, want, rtol=0, atol=0)

    pre_d = [Rank(lay, 0.0) for lay in tp(2, role="draft")]
    dec_d = [Rank(lay, None) for lay in tp(1, role="draft")]
    d_pieces = shard_pieces([r.lay for r in pre_d], [r.lay for r in dec_d])
    move(d_pieces, pre_d, dec_d, src_pages, dst_pages, layers)
    want = gqa_expected(pre_d, dec_d[0].lay, src_pages, dst_pages, layers)
    torch.testing.assert_close(dec_d[0].buf, want, rtol=0, atol=0)


def test_a_head_slice_outside_the_shard_is_refused():
    r = Rank(tp(2)[0], 0.0)
    with pytest.raises(IndexError, match="heads"):
        r.staging.gather("target", [0], 0, heads=(1, 2))


# ---- the handshake: decode's Register (protocol 6) against prefill's ranks -----------------
def register(rank0: EntryLayout, ranks: list[dict], slots: int = 2, slot_bytes: int = 1024):
    from kvtransfer import messages as m

    entry = m.EntrySpec("target", rank0.signature(), [0], 4096, 8)
    dests = [m.RankDest(f"127.0.0.1:{9000 + k}", 64, b"t" * 32, 8192, slots, slot_bytes, heads)
             for k, heads in enumerate(ranks)]  # fmt: skip
    return m.Register(7, "127.0.0.1:8999", [entry], 4, staging_addr=4096, staging_slots=2,
                      staging_slot_bytes=1024, ranks=dests)  # fmt: skip


def dst_of(rank0: EntryLayout) -> dict:
    return {"target": rank0.with_pool(8, 4096)}


def test_a_register_covering_every_head_gives_the_pieces():
    from kvtransfer.sender.registration import check_ranks

    reg = register(gqa((0, 2)), [{"target": [2, 2]}])
    pieces = check_ranks(reg, dst_of(gqa((0, 2))), {"target": dict(enumerate(tp(4)))})
    assert pieces["target"] == [P(0, 0, 0, 1, 0, 0), P(1, 0, 1, 1, 0, 1),
                                P(2, 1, 2, 1, 0, 0), P(3, 1, 3, 1, 0, 1)]  # fmt: skip


@pytest.mark.parametrize(("ranks", "slots", "words"), [
    ([{"target": [2, 1]}], 2, "not all 4"),  # head 3 held by no decode rank
    ([{"target": [2, 3]}], 2, "head_start + kv_heads exceeds"),  # past the model's heads
    ([{"target": [-1, 1]}], 2, "held by no prefill rank"),
    ([{"draft": [2, 2]}], 2, "head ranges for ['draft']"),
    ([{"target": [2, 2]}], 0, "no staging region"),
    ([{"target": [2]}], 2, "decode rank 1: entry target"),
    ([{"target": [2, 2]}], 2, "holds no page"),  # a page of 2 heads is 256 B, a slot 64 B
])  # fmt: skip
def test_a_register_that_does_not_pair_with_prefills_ranks_is_refused(ranks, slots, words):
    from kvtransfer.sender.registration import RegistrationError, check_ranks, check_slots

    reg = register(gqa((0, 2)), ranks, slots, 64 if words == "holds no page" else 1024)
    dst = dst_of(gqa((0, 2)))
    with pytest.raises(RegistrationError) as e:
        check_slots(reg, dst, check_ranks(reg, dst, {"target": dict(enumerate(tp(2)))}))
    assert words in str(e.value)


def test_a_tp_mismatch_of_heads_that_do_not_divide_is_refused():
    """prefill at TP 2 over 4 heads, decode at TP 3 (heads 0-1, 2, 3 as its ranks say)."""
    from kvtransfer.sender.registration import check_ranks

    reg = register(gqa((0, 2)), [{"target": [2, 1]}, {"target": [3, 1]}])
    pieces = check_ranks(reg, dst_of(gqa((0, 2))), {"target": dict(enumerate(tp(2)))})
    assert len(pieces["target"]) == 3


def test_a_draft_on_other_ranks_than_the_target_pairs_by_each_sides_rank_numbers():
    """A TP draft runs in its own worker processes: decode rank 1 holds target heads 2-3, rank
    2 draft heads 1; prefill's agents 1 (target) and 2 (draft) likewise. Pieces name those
    ranks, not positions in each entry's list."""
    from kvtransfer import messages as m
    from kvtransfer.sender.registration import check_ranks

    t0, d0 = gqa((0, 2)), gqa((0, 1), total=2, role="draft")
    entries = [m.EntrySpec(x.role, x.signature(), [0], 4096, 8) for x in (t0, d0)]

    def dest(k, heads):
        return m.RankDest(f"127.0.0.1:{9000 + k}", 64, b"t" * 32, 8192, 2, 1024, heads)

    reg = m.Register(7, "127.0.0.1:8999", entries, 4,
                     ranks=[dest(1, {"target": [2, 2]}), dest(2, {"draft": [1, 1]})])  # fmt: skip
    dst = {x.role: x.with_pool(8, 4096) for x in (t0, d0)}
    prefill = {"target": dict(enumerate(tp(2))),
               "draft": {0: d0, 2: gqa((1, 1), total=2, role="draft")}}  # fmt: skip
    pieces = check_ranks(reg, dst, prefill)
    assert [(p.src, p.dst) for p in pieces["target"]] == [(0, 0), (1, 1)]
    assert [(p.src, p.dst, p.head) for p in pieces["draft"]] == [(0, 0, 0), (2, 2, 1)]
