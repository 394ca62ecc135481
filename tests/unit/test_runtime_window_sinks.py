"""Per-layer sliding windows and attention sinks on every CPU attention path, against a float64
dense reference: the torch path (gather + SDPA, or the written-out softmax with sinks), the C++
in-place decode kernel (decode and small extends) and the C++ prefill kernel.

A layer's window reaches attention as a view of the batch (``BatchMeta.for_window``); the keys
outside every window are poisoned with NaN in the pool, so a path that read one would return
NaN: each windowed layer reads only its window's slots.
"""

from __future__ import annotations

import random

import pytest
import torch

from backends.runtime.decode_attn import cpu_decode_attention
from backends.runtime.paged import BatchMeta, paged_attention, write_kv
from backends.runtime.prefill_attn import cpu_prefill_attention

PS, HKV, H, D, PAGES = 4, 2, 6, 8, 96
SCALE = D**-0.5

CASES = {  # (start, new tokens) per sequence
    "decode": [(30, 1), (5, 1), (41, 1), (0, 1)],
    "extend": [(25, 3), (0, 4), (38, 1), (9, 6)],
    "prefill": [(0, 29), (0, 3), (0, 17)],
}


def reference(q, k_ctx, v_ctx, seqs, window, sinks=None):
    """Per token, float64: softmax over the keys it sees (+ its head's sink in the sum)."""
    out, t = [], 0
    for b, (start, n) in enumerate(seqs):
        k = k_ctx[b].double().repeat_interleave(H // HKV, dim=1)  # [ctx, H, D]
        v = v_ctx[b].double().repeat_interleave(H // HKV, dim=1)
        for i in range(n):
            pos = start + i
            keys = [j for j in range(pos + 1) if window is None or j > pos - window]
            s = torch.einsum("hd,khd->hk", q[t].double(), k[keys]) * SCALE  # [H, keys]
            if sinks is None:
                p = s.softmax(-1)
            else:
                m = torch.maximum(s.max(-1).values, sinks.double())[:, None]
                e = (s - m).exp()
                p = e / (e.sum(-1, keepdim=True) + (sinks.double()[:, None] - m).exp())
            out.append(torch.einsum("hk,khd->hd", p, v[keys]))
            t += 1
    return torch.stack(out).float()


def batch(case, window, seed=0):
    """-> (seqs, the batch's meta (built without a window, as the runner does), q, k_new,
    v_new, k_cache, v_cache, the reference's contexts). With a window, keys no query of its
    sequence sees are NaN in the pool (and every slot of no sequence)."""
    rng = random.Random(seed)
    torch.manual_seed(seed)
    free = list(range(PAGES))
    rng.shuffle(free)
    shape = CASES[case]
    seqs = [(s, n, [free.pop() for _ in range(-(-(s + n) // PS))]) for s, n in shape]
    meta = BatchMeta.build(seqs, PS, PAGES, "cpu")
    fill = float("nan") if window else 0.0  # full attention pads its gather with other slots
    k_cache = torch.full((PAGES * PS, HKV, D), fill)
    v_cache = torch.full((PAGES * PS, HKV, D), fill)
    k_ctx, v_ctx = [], []
    for s, n, pages in seqs:
        slots = torch.tensor([pages[j // PS] * PS + j % PS for j in range(s + n)])
        kc, vc = torch.randn(s + n, HKV, D), torch.randn(s + n, HKV, D)
        k_ctx.append(kc)
        v_ctx.append(vc)
        seen = torch.arange(s + n) > s - window if window else torch.ones(s + n, dtype=torch.bool)
        k_cache[slots[seen]], v_cache[slots[seen]] = kc[seen], vc[seen]
    k_new = torch.cat([kc[s:] for kc, (s, _, _) in zip(k_ctx, seqs, strict=True)])
    v_new = torch.cat([vc[s:] for vc, (s, _, _) in zip(v_ctx, seqs, strict=True)])
    write_kv(k_cache, meta, k_new)
    write_kv(v_cache, meta, v_new)
    q = torch.randn(len(k_new), H, D)
    return shape, meta, q, k_new, v_new, k_cache, v_cache, (k_ctx, v_ctx)


def sinks_for(with_sinks: bool):
    return torch.tensor([2.0, -1.0, 0.5, 4.0, -3.0, 0.0]) if with_sinks else None


@pytest.mark.parametrize("sinks", [False, True], ids=["nosink", "sinks"])
@pytest.mark.parametrize("window", [None, 7], ids=["full", "window7"])
@pytest.mark.parametrize("case", list(CASES))
def test_torch_path_reads_only_the_window(case, window, sinks):
    shape, meta, q, k_new, v_new, k_cache, v_cache, ctx = batch(case, window)
    view = meta.for_window(window)
    assert view is meta.for_window(window)  # built once per batch and window
    if window is not None and case != "prefill":  # the view's columns start at the window
        assert view.read_slots.shape[1] < meta.read_slots.shape[1]
    s = sinks_for(sinks)
    out = paged_attention(q, k_new, k_cache, view, SCALE, v_new, v_cache, sinks=s)
    ref = reference(q, *ctx, shape, window, s)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("sinks", [False, True], ids=["nosink", "sinks"])
@pytest.mark.parametrize("window", [None, 7], ids=["full", "window7"])
@pytest.mark.parametrize("case", ["decode", "extend"])
def test_cpu_decode_kernel_reads_only_the_window(case, window, sinks, dtype):
    """Decode and small extends (every new token a query of its own) in place."""
    shape, meta, q, _, _, k_cache, v_cache, ctx = batch(case, window, seed=1)
    s = sinks_for(sinks)
    view = meta.for_window(window)
    out = cpu_decode_attention(
        q.to(dtype), k_cache.to(dtype), v_cache.to(dtype), None, view, SCALE, sinks=s
    )
    assert out is not None, "the C++ kernel did not build"
    ref = reference(q, *ctx, shape, window, s)
    tol = 2e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(out.float(), ref, atol=tol, rtol=tol)


@pytest.mark.parametrize("sinks", [False, True], ids=["nosink", "sinks"])
@pytest.mark.parametrize("window", [None, 7], ids=["full", "window7"])
def test_cpu_prefill_kernel_windows_and_sinks(window, sinks):
    shape, meta, q, k_new, v_new, _, _, ctx = batch("prefill", window, seed=2)
    s = sinks_for(sinks)
    out = cpu_prefill_attention(q, k_new, v_new, None, meta.for_window(window), SCALE, s)
    if out is None:
        pytest.skip("torch exports no sgemm here: the kernel does not run")
    torch.testing.assert_close(out, reference(q, *ctx, shape, window, s), atol=2e-5, rtol=2e-5)


def test_window_view_of_a_decode_batch():
    """key_base: each sequence's first key in the window; key_bounds relative to it."""
    seqs = [(30, 1, list(range(8))), (3, 1, [8])]
    meta = BatchMeta.build(seqs, PS, 16, "cpu")
    view = meta.for_window(5)
    assert view.key_base.tolist() == [26, 0]  # position 30 sees 26..30; position 3 sees 0..3
    assert view.read_slots.shape == (2, 5)
    assert view.read_slots[0].tolist() == [26, 27, 28, 29, 30]  # pages 0..7 in order
    assert view.read_slots[1].tolist() == [32, 33, 34, 35, 35]  # past its context: repeated
    lo, hi = view.key_bounds
    assert (lo.tolist(), hi.tolist()) == ([0, 0], [5, 4])
    assert view.mask[1, 0, 0].tolist() == [True] * 4 + [False]
    assert meta.for_window(None) is meta
