"""Byte-exact KV transfer between two OS processes over the real Mooncake engine."""

import math

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]


def run_room(
    prefill,
    decode,
    room,
    tokens,
    groups,
    *,
    fragmented=True,
    decode_first=True,
    extra=None,
    expect="Success",
):
    """Allocate pages on both sides, register, stream ``groups``, finish; decode's end state."""
    page_sizes = {role: decode.page_size(role) for role in tokens}
    need = {role: math.ceil(n / page_sizes[role]) for role, n in tokens.items()}
    prefill.alloc_pages(room, need, fragmented)
    decode.alloc_pages(room, {r: n + 3 for r, n in need.items()}, fragmented)  # + gen budget
    addrs = [prefill.info["bootstrap_addr"]]
    if decode_first:
        decode.register(room, addrs, max(tokens.values()))
    prefill.start_room(room)
    prefill.run_prefill(room, groups, 0.0, 0.0, 1000 + room, extra)
    if not decode_first:  # decode is slower: registration lands after groups were queued
        decode.register(room, addrs, max(tokens.values()))
    st = decode.wait(room, 60)
    assert prefill.wait(room, 30)[0] == expect
    return tuple(st), need


def assert_same_bytes(prefill, decode, room, need):
    for role, n in need.items():
        assert decode.digest(room, role, n) == prefill.digest(room, role, n), role


@pytest.mark.parametrize("page_size", [1, 16, 64])
def test_gqa_pool_byte_exact(spawn, page_size):
    entries = {"target": ("gqa", page_size, 2048 // page_size + 16)}
    prefill = spawn("prefill", entries, seed=page_size)
    decode = spawn("decode", entries, seed=page_size)
    free0 = (prefill.free_counts(), decode.free_counts())
    cases = [(300, True, True), (129, False, False), (1, True, True), (700, True, False)]
    for room, (tokens, frag, decode_first) in enumerate(cases, start=1):
        groups = [("target", 0, 1), ("target", 1, 3), ("target", 3, 4)]
        st, need = run_room(
            prefill,
            decode,
            room,
            {"target": tokens},
            groups,
            fragmented=frag,
            decode_first=decode_first,
        )
        assert st == ("Success", "")
        assert_same_bytes(prefill, decode, room, need)
        assert tuple(decode.result(room)) == (1000 + room, {})
        decode.free_room(room)
    assert (prefill.free_counts(), decode.free_counts()) == free0
    assert prefill.released_counts() == {str(r): 1 for r in range(1, 5)}
    assert decode.released_counts() == {str(r): 1 for r in range(1, 5)}


@pytest.mark.parametrize("page_size", [1, 64])
def test_mla_pool_byte_exact(spawn, page_size):
    entries = {"target": ("mla", page_size, 4096 // page_size + 16)}
    prefill = spawn("prefill", entries, seed=7)
    decode = spawn("decode", entries, seed=7)
    free0 = (prefill.free_counts(), decode.free_counts())
    groups = [("target", 0, 2), ("target", 2, 4)]
    for room, tokens in [(11, 1000), (12, 65)]:
        st, need = run_room(prefill, decode, room, {"target": tokens}, groups)
        assert st == ("Success", "")
        assert_same_bytes(prefill, decode, room, need)
        decode.free_room(room)
    assert (prefill.free_counts(), decode.free_counts()) == free0


def test_mla_target_with_gqa_draft(spawn):
    entries = {"target": ("mla", 16, 200), "draft": ("draft_gqa", 16, 200)}
    prefill = spawn("prefill", entries, seed=3)
    decode = spawn("decode", entries, seed=3)
    free0 = (prefill.free_counts(), decode.free_counts())
    groups = [("target", 0, 1), ("target", 1, 4), ("draft", 0, 2)]
    extra = {"draft_hidden_len": 3, "accept_rate": 0.5, "note": "x", "draft_tokens": [1, 2, 3]}
    st, need = run_room(prefill, decode, 21, {"target": 777, "draft": 777}, groups, extra=extra)
    assert st == ("Success", "")
    assert_same_bytes(prefill, decode, 21, need)
    first_token, got_extra = decode.result(21)
    assert first_token == 1021 and got_extra == extra
    decode.free_room(21)
    assert (prefill.free_counts(), decode.free_counts()) == free0


@pytest.mark.parametrize("inflight", [16, 40])
def test_groups_larger_than_one_batch(spawn, inflight):
    """A group of many copies is split into several Mooncake batches (one or several in
    flight): Complete must still wait for the last one, so decode holds every byte at Success."""
    entries = {"target": ("gqa", 1, 1200), "draft": ("draft_gqa", 1, 1200)}
    cfg = dict(max_batch_entries=16, max_inflight_entries=inflight)
    prefill = spawn("prefill", entries, seed=4, **cfg)
    decode = spawn("decode", entries, seed=4, **cfg)
    free0 = (prefill.free_counts(), decode.free_counts())
    groups = [("target", 0, 3), ("target", 3, 4), ("draft", 0, 2)]
    for room in (31, 32):
        # page size 1, fragmented: ~1000 pages -> thousands of copies per group
        st, need = run_room(prefill, decode, room, {"target": 1000, "draft": 1000}, groups)
        assert st == ("Success", "")
        assert decode.saw_all_bytes_at_complete(room) is True
        assert_same_bytes(prefill, decode, room, need)
        decode.free_room(room)
    assert (prefill.free_counts(), decode.free_counts()) == free0
    assert prefill.released_counts() == {"31": 1, "32": 1}


def test_fp8_pools_byte_exact_and_half_of_bfloat16(spawn):
    """fp8 entries (GQA target, MLA draft) move as their own bytes: one per element, half of
    the bfloat16 entries of the same shape, and land exactly."""
    from kvpeer import LAYOUTS

    from kvtransfer.memory.layout import EntryLayout

    entries = {"target": ("fp8_gqa", 16, 80), "draft": ("fp8_mla", 16, 80)}
    prefill = spawn("prefill", entries, seed=8)
    decode = spawn("decode", entries, seed=8)
    free0 = (prefill.free_counts(), decode.free_counts())
    groups = [("target", 0, 2), ("target", 2, 4), ("draft", 0, 4)]
    st, need = run_room(prefill, decode, 21, {"target": 700, "draft": 700}, groups)
    assert st == ("Success", "")
    assert_same_bytes(prefill, decode, 21, need)
    decode.free_room(21)
    assert (prefill.free_counts(), decode.free_counts()) == free0
    for fp8, bf16 in (("fp8_gqa", "gqa"), ("fp8_mla", "mla")):
        a, b = (EntryLayout(role="target", page_size=16, num_pages=1, **LAYOUTS[k])
                for k in (fp8, bf16))  # fmt: skip
        assert 2 * a.bytes_per_token_all_layers() == b.bytes_per_token_all_layers()


@pytest.mark.parametrize("tokens, cached", [(300, 12), (320, 20)])  # a prefix hit; a full hit
def test_only_the_blocks_after_decode_s_cached_prefix_move(spawn, tokens, cached):
    """Decode holds the first ``cached`` blocks (its prefix cache) and registers pages for the
    rest only (protocol 9 ``first``): prefill sends exactly those blocks, byte-exact, and not one
    byte lands in the pages of the cached blocks; a full hit moves no KV byte at all."""
    entries = {"target": ("gqa", 16, 64)}
    prefill, decode = spawn("prefill", entries, seed=3), spawn("decode", entries, seed=3)
    need = {"target": math.ceil(tokens / 16)}
    prefill.alloc_pages(21, need, True)
    decode.alloc_pages(21, need, True)
    decode.register(21, [prefill.info["bootstrap_addr"]], tokens, first={"target": cached})
    prefill.start_room(21)
    prefill.run_prefill(21, [("target", 0, 2), ("target", 2, 4)], 0.0, 0.0, 77, None)
    assert tuple(decode.wait(21, 60)) == ("Success", "")
    assert tuple(decode.result(21)) == (77, {})
    n = need["target"]
    assert decode.digest(21, "target", n, cached) == prefill.digest(21, "target", n, cached)
    assert decode.pages_zero(21, "target", 0, cached)  # the cached blocks' pages: untouched
    sent = prefill.stats()["bytes"]
    lay_bytes = 4 * 2 * 16 * 2 * 32 * 2  # layers x (K, V) x tokens x heads x dim x bfloat16
    assert sent == (n - cached) * lay_bytes
