"""Address math of kvtransfer.memory.layout checked against numpy's own indexing."""

import numpy as np
import pytest

from kvtransfer.memory.layout import (
    EntryLayout,
    PoolLayout,
    check_compatible,
    group_transfers,
    page_runs,
    paired_runs,
)

NP = {"float32": np.float32, "float16": np.float16}


def gqa(**kw):
    base = dict(
        role="target",
        attn="gqa",
        dtype="float16",
        page_size=4,
        num_layers=3,
        num_pages=10,
        kv_heads=2,
        head_dim=8,
    )
    return EntryLayout(**{**base, **kw})


def mla(**kw):
    base = dict(
        role="target",
        attn="mla",
        dtype="float32",
        page_size=16,
        num_layers=2,
        num_pages=5,
        kv_heads=1,
        head_dim=96,
        kv_lora_rank=64,
        rope_dim=32,
    )
    return EntryLayout(**{**base, **kw})


@pytest.mark.parametrize("make", [gqa, mla])
def test_page_addr_matches_numpy_indexing(make):
    lay0 = make()
    buf = np.zeros(lay0.buffer_shape(), NP[lay0.dtype])
    lay = lay0.with_pool(lay0.num_pages, buf.ctypes.data)
    assert buf.nbytes == lay.nbytes
    for layer in range(lay.num_layers):
        for comp in range(lay.components):
            for page in (0, 3, lay.num_pages - 1):
                idx = (layer, comp, page) if lay.attn == "gqa" else (layer, page)
                assert lay.page_addr(layer, comp, page) == buf[idx].ctypes.data
                assert buf[idx].nbytes == lay.page_bytes


def test_validation_messages():
    with pytest.raises(ValueError, match="role"):
        gqa(role="other")
    with pytest.raises(ValueError, match="page_size"):
        gqa(page_size=0)
    with pytest.raises(ValueError, match="kv_lora_rank"):
        mla(rope_dim=16)
    with pytest.raises(ValueError, match="kv_heads must be 1"):
        mla(kv_heads=2)
    with pytest.raises(IndexError):
        gqa().page_addr(3, 0, 0)
    with pytest.raises(IndexError):
        gqa().page_addr(0, 0, 10)


def test_runs_coalesce_only_where_both_sides_are_consecutive():
    assert page_runs([3, 4, 5, 9, 1, 2]) == [(3, 3), (9, 1), (1, 2)]
    assert paired_runs([0, 1, 2, 7], [5, 6, 9, 10]) == [(0, 5, 2), (2, 9, 1), (7, 10, 1)]
    with pytest.raises(ValueError, match="length"):
        paired_runs([1], [1, 2])


def test_group_transfers_cover_exactly_the_pages():
    src = gqa().with_pool(10, 1 << 20)
    dst = gqa().with_pool(20, 1 << 30)
    ts = group_transfers(src, dst, [0, 1, 2, 8], [4, 5, 6, 0], range(1, 3))
    # 2 layers x 2 components x 2 runs
    assert len(ts) == 8
    assert sum(t.length for t in ts) == 2 * 2 * 4 * src.page_bytes
    first = ts[0]
    assert first.src == src.page_addr(1, 0, 0) and first.dst == dst.page_addr(1, 0, 4)
    assert first.length == 3 * src.page_bytes
    with pytest.raises(IndexError):
        group_transfers(src, dst, [9], [20], range(0, 1))


def test_check_compatible_names_the_field():
    a = gqa()
    assert check_compatible(a, gqa(num_pages=99, base_addr=5).signature()) is None
    msg = check_compatible(a, gqa(head_dim=16).signature())
    assert "head_dim" in msg and "target" in msg
    assert "page_size" in check_compatible(a, gqa(page_size=16).signature())
    assert "attn" in check_compatible(a, mla().signature())
    with pytest.raises(ValueError, match="dtype"):
        group_transfers(a, gqa(dtype="float32"), [0], [0], range(1))


def test_pool_layout_rejects_duplicate_roles():
    pool = PoolLayout()
    pool.add(gqa())
    pool.add(gqa(role="draft", num_layers=1))
    with pytest.raises(ValueError):
        pool.add(gqa())
    assert set(pool.signatures()) == {"target", "draft"}


@pytest.mark.parametrize("attn", ["gqa", "mla"])
def test_staging_rows_walk_layers_components_then_the_page_list(attn):
    from kvtransfer.memory.layout import group_units, staging_rows

    kw = (
        dict(kv_heads=2, head_dim=8)
        if attn == "gqa"
        else dict(head_dim=12, kv_lora_rank=8, rope_dim=4)
    )
    lay = EntryLayout(
        role="target", attn=attn, dtype="bfloat16", page_size=4, num_layers=5, num_pages=30,
        base_addr=1 << 20, **kw,
    )  # fmt: skip
    pages, layers = [7, 2, 29, 11], range(1, 4)
    units = group_units(lay, len(pages), layers)
    assert units == 3 * lay.components * 4
    # the reference: (layer, component, page) in that order, as addresses
    expect = [
        (lay.page_addr(layer, c, p) - lay.base_addr) // lay.page_bytes
        for layer in layers
        for c in range(lay.components)
        for p in pages
    ]
    assert staging_rows(lay, pages, layers, 0, units) == expect
    assert staging_rows(lay, pages, layers, 5, 3) == expect[5:8]  # a chunk mid-stream
    for start, count in [(units, 1), (0, units + 1), (-1, 2), (0, 0)]:
        with pytest.raises(IndexError):
            staging_rows(lay, pages, layers, start, count)
    with pytest.raises(IndexError):
        staging_rows(lay, pages, range(4, 6), 0, 1)  # layer 5 does not exist
    with pytest.raises(IndexError):
        staging_rows(lay, [30], layers, 0, 1)  # page outside the pool


def test_mean_copy_bytes_tells_contiguous_from_fragmented():
    from kvtransfer.memory.layout import mean_copy_bytes

    lay = EntryLayout(
        role="target", attn="gqa", dtype="bfloat16", page_size=16, num_layers=2, num_pages=64,
        kv_heads=3, head_dim=64,
    )  # fmt: skip
    assert mean_copy_bytes(lay, list(range(10)), list(range(20, 30))) == 10 * lay.page_bytes
    assert mean_copy_bytes(lay, [1, 5, 9], [2, 3, 4]) == lay.page_bytes


# ---- protocol 9: sliding-window and state entries ----------------------------------------------
def state(**kw):
    base = dict(
        role="target.state",
        attn="state",
        dtype="float32",
        page_size=1,
        num_layers=3,
        num_pages=6,  # slots
        kv_heads=2,  # groups of heads: each sub-block splits in 2
        head_dim=12 + 8,  # a group: 1 conv head of 4 channels x 3 taps, 1 state head of 8
        segments=[(1, 12), (1, 8)],
    )
    return EntryLayout(**{**base, **kw})


def test_a_state_entry_is_one_slot_per_layer_and_sequence_with_numpy_indexing():
    lay0 = state()
    assert lay0.buffer_shape() == (3, 6, 40) and lay0.page_bytes == 160
    assert lay0.pages_for(1) == (0, 1) and lay0.pages_for(10_000) == (0, 1)
    buf = np.arange(np.prod(lay0.buffer_shape()), dtype=np.float32).reshape(3, 6, 40)
    lay = lay0.with_pool(6, buf.ctypes.data)
    for layer in range(3):
        assert lay.page_addr(layer, 0, 4) == buf[layer, 4].ctypes.data
    # a room's slot 4 moves into decode's slot 1: one copy per layer, the whole slot
    dst = lay0.with_pool(6, 1 << 40)
    xs = group_transfers(lay, dst, [4], [1], range(0, 3))
    assert [(t.src, t.length) for t in xs] == [(buf[i, 4].ctypes.data, 160) for i in range(3)]
    assert [t.dst for t in xs] == [dst.page_addr(i, 0, 1) for i in range(3)]


@pytest.mark.parametrize(
    "kw, why",
    [
        (dict(segments=[(1, 12), (1, 7)]), "segments hold 19 elements"),
        (dict(segments=[]), "needs segments"),
        (dict(page_size=2), "page_size 1"),
        (dict(window=8), "window"),
    ],
)
def test_a_malformed_state_entry_is_refused(kw, why):
    with pytest.raises(ValueError, match=why):
        state(**kw)


def test_segments_belong_to_state_entries_only():
    with pytest.raises(ValueError, match="state entry's slot only"):
        gqa(segments=[(2, 8)])


@pytest.mark.parametrize(
    "tokens, window, want",
    [
        (1, 8, (0, 1)),  # page 4: a one-token prompt holds its first block
        (8, 8, (0, 2)),
        (9, 8, (0, 3)),  # tokens 1..8 reach block 0
        (12, 8, (1, 2)),  # tokens 4..11: blocks 1, 2
        (13, 8, (1, 3)),
        (40, 8, (8, 2)),  # tokens 32..39
        (41, 8, (8, 3)),
        (40, 0, (0, 10)),  # no window: every block
    ],
)
def test_a_window_entry_holds_the_blocks_its_last_window_reaches(tokens, window, want):
    lay = gqa(window=window, role="target.window")
    assert lay.pages_for(tokens) == want
    first, n = want
    last_tokens = range(max(0, tokens - window) if window else 0, tokens)
    assert {t // lay.page_size for t in last_tokens} == set(range(first, first + n))


def test_window_and_segments_are_part_of_the_signature():
    a, b = gqa(window=8, role="target.window"), gqa(window=16, role="target.window")
    assert "window differs" in check_compatible(a, b.signature())
    s1, s2 = state(), state(segments=[(2, 6), (1, 8)])
    assert "segments differs" in check_compatible(s1, s2.signature())
