"""Paged attention in the Triton language: the CUDA path of the runtime's attention.

One kernel serves every kind of forward (prefill, decode, extend): sequence ``b`` brings ``n_b``
new queries at positions ``[start_b, start_b + n_b)`` and attends causally (optionally within a
sliding window of ``W`` keys: key ``j`` is seen by query ``i`` iff ``i - W < j <= i``) to keys
``[0, start_b + n_b)``, read in place from the pool through the page table::

    slot(b, j) = page_table[b, j // page_size] * page_size + j % page_size
    K[b, j]    = k_cache[slot(b, j), kv_head, :]      (k_cache: the pool slab as [S, Hkv, Dk])

The new tokens' K/V must already be in the pool (the layers write before they attend), so a
prefill from position 0, a prefill continuation (chunked prefill, prefix cache hit) and a decode
step are one code path. Nothing is gathered or padded on the host.

Grid: ``(B, query blocks, Hkv)``. A program takes ``BLOCK_M`` rows, each one (query token, query
head of this KV head) pair — the ``G = H / Hkv`` heads sharing a KV head are stacked as rows, so
each K/V row loaded serves all of them (MLA's 16-128 heads on its one latent are cut into
groups of 16 over ``HEAD_SPLIT`` programs: a 128 x 512 float32 accumulator would spill) — and
runs an online softmax over ``BLOCK_N`` keys at a time (base-2 exponentials, float32 statistics
and accumulator). Decode launches with one query per sequence and ``BLOCK_M`` just above ``G``;
prefill with a few tokens per block. A decode batch too small to fill the GPU (``B * Hkv``
programs under the SM count) splits each context's keys over programs (axis 1 becomes the
split: flash-decoding); each writes its normalised partial output and log-sum-exp, and
``_combine_splits_kernel`` merges them.

Keys split into a main part and an optional tail (``D_TAIL``), each padded to a power of two on
its own: MLA's latent ``[c_kv | k_pe]`` (``R + dr`` channels, e.g. 512 + 64) then costs 512 + 64
lanes, not 1024. MLA's values are the keys' first ``R`` channels (``V_IS_K``): the loaded block
serves as V as well, as the runtime's absorbed attention does it (:mod:`.attention`).

A layer's sliding window (Gemma 3 and gpt-oss mix windowed and full layers) starts each
program's key loop at its first query's window: a windowed layer reads only the pages its window
reaches. Decode splits divide the keys a program reads (from that start), not the whole context.
Attention sinks (gpt-oss: ``sinks`` [H], one logit per query head in the softmax's denominator,
with no value) join the running max and sum after the last key block, or in the combine kernel
when the keys were split.

fp8 KV (``float8_e4m3fn`` pools with one scale per layer and component): rows are widened to
float32, multiplied by the scale and rounded to the query dtype before the matmuls.

float32 models multiply in IEEE float32 (no TF32), so the CUDA path matches the CPU reference.
Under ``TRITON_INTERPRET=1`` (set before ``triton`` is first imported) the same kernels run on
CPU tensors; ``tests/unit/test_triton_attn.py`` checks them so against a float64 reference, and
``tests/unit/test_triton_attn_compile.py`` compiles them for sm_90 without a GPU.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

_INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
# 8 warps: compiled for sm_90 without a GPU (tests/unit/test_triton_attn_compile.py), 4 warps
# spilled (fp16 prefill at 128 channels: 255 registers + 424 B of stack; 8 warps: 238, none)
NUM_WARPS = 8


@triton.jit
def _load_rows(rows, cols, n_cols: tl.constexpr, ok, scale, like, FP8: tl.constexpr):
    """[len(rows), len(cols)] from row start pointers ``rows``; fp8 rows dequantized with
    ``scale`` into ``like``'s dtype."""
    x = tl.load(
        rows[:, None] + cols[None, :], mask=ok[:, None] & (cols[None, :] < n_cols), other=0.0
    )
    if FP8:
        x = (x.to(tl.float32) * scale).to(like.dtype)
    return x


@triton.jit
def _slots(pages, k_pos, k_ok, PAGE_SIZE: tl.constexpr):
    """Pool slots of key positions k_pos through one sequence's page-table row ``pages``."""
    page = tl.load(pages + k_pos // PAGE_SIZE, mask=k_ok, other=0)
    return page.to(tl.int64) * PAGE_SIZE + k_pos % PAGE_SIZE


@triton.jit
def _store_rows(rows, cols, n_cols: tl.constexpr, ok, x):
    tl.store(
        rows[:, None] + cols[None, :],
        x.to(rows.dtype.element_ty),
        mask=ok[:, None] & (cols[None, :] < n_cols),
    )


@triton.jit
def _dot_t(a, b, F32_DOT: tl.constexpr):
    """a @ b^T, float32 out (IEEE products for float32 models)."""
    if F32_DOT:
        r = tl.dot(a.to(tl.float32), tl.trans(b.to(tl.float32)), input_precision="ieee")
    else:
        r = tl.dot(a, tl.trans(b))
    return r


@triton.jit
def _dot_pv(p, v, F32_DOT: tl.constexpr):
    """p (float32 probabilities) @ v, float32 out."""
    if F32_DOT:
        r = tl.dot(p, v.to(tl.float32), input_precision="ieee")
    else:
        r = tl.dot(p.to(v.dtype), v)
    return r


@triton.jit
def _online_softmax(s, seen, m_i, l_i, acc):
    """One key block of scores s (times scale * log2 e: exp(x) = exp2(x log2 e)) into the
    running max, sum and accumulator.
    -> (p, m, l, acc rescaled); rows that saw no key yet keep a max of -inf and weights 0."""
    s = tl.where(seen, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    return p, m_new, l_i * alpha + tl.sum(p, 1), acc * alpha[:, None]


# The kernels' argument lists and their launches stay one row per role (tensors; scalars;
# strides; constexprs) instead of one argument per line, so the formatter skips them: a launch
# reads against its kernel's signature row by row.
@triton.jit
def _paged_attn_kernel(
    Q, K, V, Out, PageTable, CuQ, Starts, Lse, Sinks,
    scale, k_scale, v_scale, window, split_len,
    stride_qt, stride_qh, stride_ks, stride_kh, stride_vs, stride_vh,
    stride_os, stride_ot, stride_oh, stride_pb, stride_ls, stride_lt,
    G: tl.constexpr, HEAD_SPLIT: tl.constexpr, PAGE_SIZE: tl.constexpr, SPLIT: tl.constexpr,
    D_MAIN: tl.constexpr, D_TAIL: tl.constexpr, DV: tl.constexpr,
    BLOCK_DM: tl.constexpr, BLOCK_DT: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, TOKENS: tl.constexpr,
    V_IS_K: tl.constexpr, FP8: tl.constexpr, F32_DOT: tl.constexpr, SINKS: tl.constexpr,
):  # fmt: skip
    b, hq = tl.program_id(0), tl.program_id(2)  # hq: G query heads; HEAD_SPLIT share a KV head
    hkv = hq // HEAD_SPLIT
    split = tl.program_id(1) if SPLIT else 0  # decode split over keys: one query block
    blk = 0 if SPLIT else tl.program_id(1)
    q0 = tl.load(CuQ + b)
    n = tl.load(CuQ + b + 1) - q0
    if blk * TOKENS >= n:
        return
    start = tl.load(Starts + b)
    rows = tl.arange(0, BLOCK_M)
    t = blk * TOKENS + rows // G  # query token within the sequence
    head = hq * G + rows % G
    row_ok = (rows < TOKENS * G) & (t < n)
    q_pos = start + t
    dm, dt, dv = tl.arange(0, BLOCK_DM), tl.arange(0, BLOCK_DT), tl.arange(0, BLOCK_DV)
    q_rows = Q + (q0 + t) * stride_qt + head * stride_qh
    q = _load_rows(q_rows, dm, D_MAIN, row_ok, 1.0, dm, False)
    if D_TAIL > 0:
        q_tail = _load_rows(q_rows + D_MAIN, dt, D_TAIL, row_ok, 1.0, dm, False)
    m_i, l_i = tl.full([BLOCK_M], float("-inf"), tl.float32), tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    hi = start + tl.minimum(n, blk * TOKENS + TOKENS)  # keys past the block's last query: none
    # a window: no key before the block's first window; row r sees keys past w_lo[r]
    lo = tl.where(window > 0, tl.maximum(start + blk * TOKENS - window + 1, 0), 0)
    w_lo = tl.where(window > 0, q_pos - window, -1)  # (branch-free: no type merge)
    if SPLIT:  # this split's share of the keys the program reads
        lo = lo + split * split_len
        hi = tl.minimum(hi, lo + split_len)
    for k_start in range(lo, hi, BLOCK_N):
        k_pos = k_start + tl.arange(0, BLOCK_N)
        k_ok = k_pos < hi
        slot = _slots(PageTable + b * stride_pb, k_pos, k_ok, PAGE_SIZE)
        k_rows = K + slot * stride_ks + hkv * stride_kh
        k = _load_rows(k_rows, dm, D_MAIN, k_ok, k_scale, q, FP8)
        s = _dot_t(q, k, F32_DOT)
        if D_TAIL > 0:
            k_tail = _load_rows(k_rows + D_MAIN, dt, D_TAIL, k_ok, k_scale, q, FP8)
            s += _dot_t(q_tail, k_tail, F32_DOT)
        seen = k_ok[None, :] & (k_pos[None, :] <= q_pos[:, None]) & (k_pos[None, :] > w_lo[:, None])
        p, m_i, l_i, acc = _online_softmax(s * (scale * 1.4426950408889634), seen, m_i, l_i, acc)
        if V_IS_K:
            v = k  # MLA: the values are the latent's first DV (= D_MAIN) channels
        else:
            v = _load_rows(V + slot * stride_vs + hkv * stride_vh, dv, DV, k_ok, v_scale, q, FP8)
        acc += _dot_pv(p, v, F32_DOT)
    if SINKS and not SPLIT:  # base 2, as the scores: the sink adds to the sum, not the values
        sink = tl.load(Sinks + head, mask=row_ok, other=0.0) * 1.4426950408889634
        m_f = tl.maximum(m_i, sink)
        alpha = tl.exp2(m_i - m_f)
        acc = acc * alpha[:, None]
        l_i = l_i * alpha + tl.exp2(sink - m_f)
    o_rows = Out + split * stride_os + (q0 + t) * stride_ot + head * stride_oh
    _store_rows(o_rows, dv, DV, row_ok, acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None])
    if SPLIT:  # this split's log-sum-exp (base 2, scaled scores); -inf where it saw no key
        lse_rows = Lse + split * stride_ls + (q0 + t) * stride_lt + head
        tl.store(lse_rows, m_i + tl.log2(l_i), mask=row_ok)


@triton.jit
def _combine_splits_kernel(  # rows by role, as _paged_attn_kernel's
    PartO, Lse, Out, Sinks, num_splits,
    stride_ps, stride_pt, stride_ph, stride_ls, stride_lt, stride_ot, stride_oh,
    DV: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_DV: tl.constexpr, SINKS: tl.constexpr,
):  # fmt: skip
    """One (token, head): out = sum_s 2^(lse_s - m) o_s / (sum_s 2^(lse_s - m) [+ 2^(sink - m)])."""
    t = tl.program_id(0)
    h = tl.program_id(1)
    sp = tl.arange(0, BLOCK_S)
    ok = sp < num_splits
    lse = tl.load(Lse + sp * stride_ls + t * stride_lt + h, mask=ok, other=float("-inf"))
    m = tl.max(lse, 0)  # finite: the split holding the query's own key saw it
    if SINKS:
        sink = tl.load(Sinks + h) * 1.4426950408889634
        m = tl.maximum(m, sink)
    w = tl.exp2(lse - m)
    d = tl.arange(0, BLOCK_DV)
    o = tl.load(
        PartO + sp[:, None] * stride_ps + t * stride_pt + h * stride_ph + d[None, :],
        mask=ok[:, None] & (d[None, :] < DV),
        other=0.0,
    )
    total = tl.sum(w, 0)
    if SINKS:
        total += tl.exp2(sink - m)
    out = tl.sum(w[:, None] * o, 0) / total
    tl.store(Out + t * stride_ot + h * stride_oh + d, out.to(Out.dtype.element_ty), mask=d < DV)


def _pow2(n: int) -> int:
    return max(16, triton.next_power_of_2(n))


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor | None,
    page_table: torch.Tensor,
    cu_q: torch.Tensor,
    starts: torch.Tensor,
    max_q: int,
    page_size: int,
    scale: float,
    *,
    v_dim: int | None = None,
    rope_dim: int = 0,
    window: int | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    max_ctx: int | None = None,
    num_splits: int | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of each sequence's new queries over its paged context.

    q: [T, H, Dk] (flat tokens; sequence b's are rows ``cu_q[b]:cu_q[b+1]``); k_cache:
    [S, Hkv, Dk] pool slots (S = pages * page_size); v_cache: [S, Hkv, Dv], or None with
    ``v_dim``: the values are the keys' first ``v_dim`` channels (MLA, Hkv = 1), and the last
    ``rope_dim`` key channels run as a separate tail; page_table: [B, P] int32 pages of each
    sequence; cu_q: [B + 1] int32; starts: [B] int32 position of each sequence's first new
    token; max_q: the most new tokens of a sequence (host int: sizes the grid); window: sliding
    window in keys, or None; k_scale / v_scale: dequantization scales of fp8 caches; max_ctx:
    the most keys a sequence's program reads (host int: its context, or with a window at most
    its span); num_splits: decode only, split each sequence's keys over this many programs,
    combined by a second kernel (None: :func:`_auto_splits` from ``max_ctx`` and the GPU's SM
    count); sinks: [H] float32 sink logits, or None. -> [T, H, Dv] in q's dtype.
    """
    T, H, _ = q.shape
    Hkv = k_cache.shape[1]
    if H % Hkv:
        raise ValueError(f"{H} query heads do not group over {Hkv} KV heads")
    d_main, d_tail, dv = _channels(k_cache, v_cache, v_dim, rope_dim)
    G, head_split, block_m, block_n = _tiles(H // Hkv, d_main, max_q)
    B = page_table.shape[0]
    num_splits, split_len = _splits(q.device, max_q, num_splits, B * Hkv, max_ctx, block_n)
    out, part, lse = _outputs(q, dv, num_splits)
    blocks = num_splits if num_splits > 1 else triton.cdiv(max_q, block_m // G)
    grid = (B, blocks, Hkv * head_split)
    v = k_cache if v_cache is None else v_cache
    sink_arg = q if sinks is None else sinks  # any pointer when SINKS is off
    _paged_attn_kernel[grid](
        q, k_cache, v, part, page_table, cu_q, starts, lse, sink_arg,
        scale, k_scale, v_scale, window or 0, split_len,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), v.stride(0), v.stride(1),
        part.stride(0) if num_splits > 1 else 0, part.stride(-3), part.stride(-2),
        page_table.stride(0), lse.stride(0), lse.stride(1),
        G=G, HEAD_SPLIT=head_split, PAGE_SIZE=page_size, SPLIT=num_splits > 1,
        D_MAIN=d_main, D_TAIL=d_tail, DV=dv,
        BLOCK_DM=_pow2(d_main), BLOCK_DT=_pow2(d_tail) if d_tail else 16, BLOCK_DV=_pow2(dv),
        BLOCK_M=block_m, BLOCK_N=block_n, TOKENS=block_m // G, V_IS_K=v_cache is None,
        FP8=k_cache.dtype == torch.float8_e4m3fn, F32_DOT=_f32_dot(q.dtype),
        SINKS=sinks is not None, num_warps=NUM_WARPS,
    )  # fmt: skip
    if num_splits > 1:
        _combine(part, lse, out, sinks)
    return out


def _outputs(q: torch.Tensor, dv: int, num_splits: int):
    """-> (out [T, H, Dv] in q's dtype, what the kernel writes: out itself, or float32 partial
    outputs [S, T, H, Dv] and their log-sum-exps [S, T, H] for S key splits)."""
    T, H, _ = q.shape
    out = q.new_empty(T, H, dv)
    if num_splits <= 1:
        return out, out, out  # no log-sum-exp written
    part = torch.empty(num_splits, T, H, dv, dtype=torch.float32, device=q.device)
    return out, part, torch.empty(num_splits, T, H, dtype=torch.float32, device=q.device)


def _combine(part: torch.Tensor, lse: torch.Tensor, out: torch.Tensor, sinks=None) -> None:
    """part [S, T, H, Dv] float32, lse [S, T, H] (sinks [H] float32 or None) -> out [T, H, Dv]."""
    S, T, H, dv = part.shape
    _combine_splits_kernel[(T, H)](
        part, lse, out, lse if sinks is None else sinks, S,
        part.stride(0), part.stride(1), part.stride(2), lse.stride(0), lse.stride(1),
        out.stride(0), out.stride(1),
        DV=dv, BLOCK_S=triton.next_power_of_2(S), BLOCK_DV=_pow2(dv), SINKS=sinks is not None,
    )  # fmt: skip


def _splits(device, max_q, num_splits, programs, max_ctx, block_n) -> tuple[int, int]:
    """-> (key splits, keys per split): decode only; whole key blocks per split, and no split
    left empty for the longest span of keys (``max_ctx``)."""
    if max_q != 1:
        return 1, 0
    if num_splits is None:
        num_splits = _auto_splits(device, programs, max_ctx)
    if num_splits <= 1:
        return 1, 0
    split_len = triton.cdiv(triton.cdiv(max_ctx, num_splits), block_n) * block_n
    return triton.cdiv(max_ctx, split_len), split_len


def _channels(k_cache, v_cache, v_dim, rope_dim) -> tuple[int, int, int]:
    """-> (key channels in the main part, in the tail, value channels)."""
    Dk = k_cache.shape[2]
    if v_cache is not None:
        return Dk, 0, v_cache.shape[2]
    if v_dim is None:
        raise ValueError("without v_cache the values are the keys' first v_dim channels")
    if rope_dim not in (0, Dk - v_dim):
        raise ValueError(f"rope_dim {rope_dim} != key channels past the values {Dk - v_dim}")
    return v_dim, Dk - v_dim, v_dim


def _tiles(G: int, d_main: int, max_q: int) -> tuple[int, int, int, int]:
    """-> (query heads per program, programs per KV head, BLOCK_M, BLOCK_N)."""
    big = _pow2(d_main) > 128  # MLA's 512-channel latent: smaller tiles
    head_split = 1
    while G > (16 if big else 64) and G % 2 == 0:  # MLA's 16-128 heads: over programs
        G, head_split = G // 2, head_split * 2
    if max_q == 1:  # decode: one query token per sequence, its G heads as the rows
        block_m = _pow2(G)
    else:
        block_m = max(16 if big else 64, _pow2(G))
    return G, head_split, block_m, 32 if big else 64


def _f32_dot(dtype: torch.dtype) -> bool:
    """float32 models: IEEE float32 products (no TF32). The interpreter's bfloat16 dot reads the
    raw bits as numbers (checked: 1e10 errors on a 16 x 16 product), so there bfloat16 runs
    through float32 products too; on CUDA bfloat16 and float16 use the tensor cores."""
    return dtype == torch.float32 or (_INTERPRETED and dtype == torch.bfloat16)


SPLIT_MIN_KEYS = 256  # a decode split reads at least this many keys


@functools.cache
def _sm_count(index: int) -> int:  # asked once per GPU, not per layer
    return torch.cuda.get_device_properties(index).multi_processor_count


def _auto_splits(device: torch.device, programs: int, max_ctx: int | None) -> int:
    """Key splits for a decode launch of ``programs`` (sequence, KV head) programs: enough to give
    every SM about two programs, none shorter than ``SPLIT_MIN_KEYS`` keys (flash-decoding)."""
    if max_ctx is None or device.type != "cuda":
        return 1
    sms = _sm_count(device.index if device.index is not None else torch.cuda.current_device())
    if programs >= sms:
        return 1
    return max(1, min(triton.cdiv(max_ctx, SPLIT_MIN_KEYS), triton.cdiv(2 * sms, programs), 64))
