"""Paged attention and its batch metadata against a per-token dense reference.

Every kind of forward (fresh prefill, decode, extend), GQA and MLA-style values (V = the keys'
first channels), sliding windows, fragmented page tables and mixed lengths in one batch.
"""

from __future__ import annotations

import random

import pytest
import torch

from backends.runtime import cpu_kernels
from backends.runtime.cpu_kernels import paged_decode_op
from backends.runtime.decode_attn import cpu_decode_attention, decode_attention
from backends.runtime.paged import BatchMeta, paged_attention, write_kv

PS, HKV, H, D = 4, 2, 6, 8


def reference(q, k_ctx, v_ctx, seqs, window):
    """q: [T, H, Dk]; k_ctx / v_ctx: per sequence its context [ctx, Hkv, D] -> [T, H, Dv]."""
    out = []
    t = 0
    for b, (start, n, _) in enumerate(seqs):
        k = k_ctx[b].repeat_interleave(q.shape[1] // k_ctx[b].shape[1], dim=1)  # [ctx, H, Dk]
        v = v_ctx[b].repeat_interleave(q.shape[1] // v_ctx[b].shape[1], dim=1)
        for i in range(n):
            pos = start + i
            keys = [j for j in range(pos + 1) if window is None or j > pos - window]
            s = torch.einsum("hd,khd->hk", q[t].double(), k[keys].double()) * D**-0.5
            out.append(torch.einsum("hk,khd->hd", s.softmax(-1), v[keys].double()))
            t += 1
    return torch.stack(out).float()


def make_batch(shape, num_pages=64, seed=0):
    """shape: (start, n) per sequence -> seqs with fragmented page tables."""
    rng = random.Random(seed)
    free = list(range(num_pages))
    rng.shuffle(free)
    seqs = []
    for start, n in shape:
        need = -(-(start + n) // PS)
        seqs.append((start, n, [free.pop() for _ in range(need + rng.randint(0, 2))]))
    return seqs


def run(shape, window=None, mla=False, seed=0, in_place=False):
    """-> (meta, paged attention's output (``in_place``: the C++ in-place kernel's, every new
    token a query of its own), the float64 reference)."""
    torch.manual_seed(seed)
    seqs = make_batch(shape, seed=seed)
    meta = BatchMeta.build(seqs, PS, 64, "cpu", window)
    hkv, dk = (1, D + 4) if mla else (HKV, D)
    k_cache = torch.randn(64 * PS, hkv, dk)  # old context: random, as earlier forwards left it
    v_cache = None if mla else torch.randn(64 * PS, hkv, D)
    T = sum(n for _, n, _ in seqs)
    k_new = torch.randn(T, hkv, dk)
    write_kv(k_cache, meta, k_new)
    v_new = None
    if not mla:
        v_new = torch.randn(T, hkv, D)
        write_kv(v_cache, meta, v_new)
    q = torch.randn(T, H, dk)
    if in_place:
        out = cpu_decode_attention(q, k_cache, v_cache, D if mla else None, meta, D**-0.5)
        assert out is not None, "the C++ kernel did not build"
    else:
        out = paged_attention(q, k_new, k_cache, meta, D**-0.5, v_new, v_cache, D if mla else None)
    slots = [
        [p[j // PS] * PS + j % PS for j in range(s + n)] for s, n, p in seqs
    ]  # each sequence's context slots
    k_ctx = [k_cache[s] for s in slots]
    v_ctx = [k_cache[s][..., :D] for s in slots] if mla else [v_cache[s] for s in slots]
    return meta, out, reference(q, k_ctx, v_ctx, seqs, window)


CASES = {  # name: (start, new tokens) per sequence; the name's first word is the kind
    "prefill one": [(0, 11)],
    "prefill mixed": [(0, 5), (0, 13), (0, 1)],
    "decode mixed": [(6, 1), (17, 1), (0, 1), (9, 1)],
    "decode equal": [(9, 1), (9, 1)],
    "extend mixed": [(7, 3), (0, 4), (12, 1), (3, 5)],
    "extend one": [(10, 6)],
}


@pytest.mark.parametrize("mla", [False, True], ids=["gqa", "mla"])
@pytest.mark.parametrize("window", [None, 3], ids=["full", "window3"])
@pytest.mark.parametrize("case", list(CASES))
def test_paged_attention_matches_reference(case, window, mla):
    meta, out, ref = run(CASES[case], window, mla)
    assert meta.kind == case.split()[0]
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)


def test_meta_positions_and_slots():
    seqs = [(5, 2, [9, 3, 7]), (0, 3, [4]), (2, 1, [1])]
    meta = BatchMeta.build(seqs, PS, 16, "cpu")
    assert meta.kind == "extend" and meta.lengths == [2, 3, 1] and meta.max_q == 3
    assert meta.positions.tolist() == [5, 6, 0, 1, 2, 2]
    assert meta.write_slots.tolist() == [3 * PS + 1, 3 * PS + 2, 16, 17, 18, 4 + 2]
    assert meta.ctx_lens.tolist() == [7, 3, 3]
    assert meta.q_index.tolist() == [0, 1, 3, 4, 5, 6]
    assert meta.read_slots[0].tolist() == [36, 37, 38, 39, 12, 13, 14]
    assert meta.read_slots.shape == (3, 7) and meta.read_slots.is_contiguous()
    assert meta.read_slots[1, :3].tolist() == [16, 17, 18]
    assert meta.read_slots[2, :3].tolist() == [4, 5, 6]
    other = meta.with_pages([(5, 2, [2, 5, 8]), (0, 3, [6]), (2, 1, [0])], 16)
    assert other.write_slots.tolist() == [5 * PS + 1, 5 * PS + 2, 24, 25, 26, 2]
    assert other.read_slots[0].tolist() == [8, 9, 10, 11, 20, 21, 22]
    assert other.positions is meta.positions and other.page_table[2, 0] == 0


def test_meta_refuses_missing_and_foreign_pages():
    with pytest.raises(ValueError, match="need 2 pages"):
        BatchMeta.build([(3, 2, [1])], PS, 16, "cpu")
    with pytest.raises(IndexError, match=r"pages \[16\] outside"):
        BatchMeta.build([(0, 1, [2]), (0, 5, [3, 16])], PS, 16, "cpu")
    with pytest.raises(ValueError, match="no new tokens"):
        BatchMeta.build([(0, 0, [1])], PS, 16, "cpu")


@pytest.mark.parametrize("mla", [False, True], ids=["gqa", "mla"])
def test_compiled_decode_kernel_matches_reference(mla):
    """The opt-in compiled kernel (PD_RUNTIME_ATTENTION=compiled) on a fragmented, mixed-length
    decode batch with a sliding window; compiles once per head layout (seconds)."""
    torch.manual_seed(3)
    seqs = make_batch(CASES["decode mixed"], seed=3)
    meta = BatchMeta.build(seqs, PS, 64, "cpu", 5)
    hkv, dk = (1, D + 4) if mla else (HKV, D)
    k_cache = torch.randn(64 * PS, hkv, dk)
    v_cache = None if mla else torch.randn(64 * PS, hkv, D)
    q = torch.randn(len(seqs), H, dk)
    out = decode_attention(q, k_cache, v_cache, D if mla else None, meta, D**-0.5)
    assert out is not None, "the compiled kernel did not build"
    ref = paged_attention(q, None, k_cache, meta, D**-0.5, None, v_cache, D if mla else None)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)


def cpu_kernel_batch(case, window, mla, dtype=torch.float32, seed=5):
    torch.manual_seed(seed)
    seqs = make_batch(CASES[case], seed=seed)
    meta = BatchMeta.build(seqs, PS, 64, "cpu", window)
    hkv, dk = (1, D + 4) if mla else (HKV, D)
    k_cache = torch.randn(64 * PS, hkv, dk).to(dtype)
    v_cache = None if mla else torch.randn(64 * PS, hkv, D).to(dtype)
    q = torch.randn(len(seqs), H, dk).to(dtype)
    return meta, q, k_cache, v_cache, D if mla else None


@pytest.mark.parametrize("mla", [False, True], ids=["gqa", "mla"])
@pytest.mark.parametrize("window", [None, 5], ids=["full", "window5"])
@pytest.mark.parametrize("case", ["decode mixed", "decode equal"])
def test_cpu_decode_kernel_matches_reference(case, window, mla):
    """The C++ kernel (the CPU default) on fragmented, mixed-length decode batches: each
    sequence reads only its own slots, inside its window."""
    meta, q, k_cache, v_cache, v_dim = cpu_kernel_batch(case, window, mla)
    out = cpu_decode_attention(q, k_cache, v_cache, v_dim, meta, D**-0.5)
    assert out is not None, "the C++ kernel did not build"
    ref = paged_attention(q, None, k_cache, meta, D**-0.5, None, v_cache, v_dim)
    torch.testing.assert_close(out, ref, atol=2e-6, rtol=2e-6)


@pytest.mark.parametrize("mla", [False, True], ids=["gqa", "mla"])
@pytest.mark.parametrize("window", [None, 3], ids=["full", "window3"])
@pytest.mark.parametrize("case", ["extend mixed", "extend one"])
def test_cpu_decode_kernel_runs_small_extends(case, window, mla):
    """A small extend (speculative verify) through the in-place kernel: each new token sees its
    own sequence's keys up to its position (causal inside the new tokens), inside its window."""
    meta, out, ref = run(CASES[case], window, mla, in_place=True)
    assert meta.kind == "extend"
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cpu_decode_kernel_half_precision_accumulates_in_float32(dtype):
    meta, q, k_cache, v_cache, _ = cpu_kernel_batch("decode mixed", None, False, dtype)
    out = cpu_decode_attention(q, k_cache, v_cache, None, meta, D**-0.5)
    assert out.dtype == dtype
    ref = paged_attention(q.float(), None, k_cache.float(), meta, D**-0.5, None, v_cache.float())
    torch.testing.assert_close(out.float(), ref, atol=1e-2, rtol=1e-2)


def test_cpu_decode_kernel_long_rows_many_heads():
    """Channel counts off the vector width (67 keys, 40 values), 4 query heads per KV head,
    contexts of hundreds of keys with a window."""
    g = torch.Generator().manual_seed(0)
    S, hkv, G = 2048, 2, 4
    k = torch.randn(S, hkv, 67, generator=g)
    v = torch.randn(S, hkv, 40, generator=g)
    slots = torch.randperm(S, generator=g)[: 3 * 600].view(3, 600)
    hi = torch.tensor([600, 350, 1])
    lo = (hi - 400).clamp(min=0)
    q = torch.randn(3, hkv, G, 67, generator=g)
    op = paged_decode_op()
    out = op(q, k, v, slots, lo, hi, 0.1)
    for b in range(3):
        rows = slots[b, lo[b] : hi[b]]
        kb, vb = k[rows].transpose(0, 1), v[rows].transpose(0, 1)  # [Hkv, n, D]
        p = (q[b].double() @ kb.double().transpose(1, 2) * 0.1).softmax(-1)
        torch.testing.assert_close(out[b], (p @ vb.double()).float(), atol=2e-6, rtol=2e-6)


def test_cpu_decode_kernel_refuses_slots_outside_the_pool():
    op = paged_decode_op()
    k = torch.zeros(16, 1, 8)
    q = torch.zeros(1, 1, 2, 8)
    one = torch.ones(1, dtype=torch.long)
    with pytest.raises(RuntimeError, match="slot 16 outside"):
        op(q, k, k, torch.tensor([[16]]), one * 0, one, 1.0)
    with pytest.raises(RuntimeError, match="not inside"):
        op(q, k, k, torch.tensor([[3]]), one * 0, one * 2, 1.0)
    with pytest.raises(RuntimeError, match="must be in q's dtype or both float8"):
        op(q.double(), k, k, torch.tensor([[3]]), one * 0, one, 1.0)
    with pytest.raises(RuntimeError, match="must be in q's dtype or both float8"):
        op(q, k.to(torch.float8_e4m3fn), k, torch.tensor([[3]]), one * 0, one, 1.0)


def test_cpu_kernel_build_failure_falls_back_to_sdpa(monkeypatch, tmp_path, caplog):
    monkeypatch.setattr(cpu_kernels, "_state", {})
    monkeypatch.setenv("PD_RUNTIME_KERNEL_DIR", str(tmp_path))
    monkeypatch.setenv("CXX", "false")  # a "compiler" that always fails
    meta, q, k_cache, v_cache, _ = cpu_kernel_batch("decode equal", None, False)
    assert cpu_decode_attention(q, k_cache, v_cache, None, meta, D**-0.5) is None
    assert "C++ CPU kernels unavailable" in caplog.text
    assert list(tmp_path.iterdir()) == []  # no half-written library left behind
