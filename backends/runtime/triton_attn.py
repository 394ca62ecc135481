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
each K/V row loaded serves all of them — and runs an online softmax over ``BLOCK_N`` keys at a
time (base-2 exponentials, float32 statistics and accumulator). Decode launches with one query
per sequence and ``BLOCK_M`` just above ``G``; prefill with a few tokens per block.

Keys split into a main part and an optional tail (``D_TAIL``), each padded to a power of two on
its own: MLA's latent ``[c_kv | k_pe]`` (``R + dr`` channels, e.g. 512 + 64) then costs 512 + 64
lanes, not 1024. MLA's values are the keys' first ``R`` channels (``V_IS_K``): the loaded block
serves as V as well, as the runtime's absorbed attention does it (:mod:`.attention`).

fp8 KV (``float8_e4m3fn`` pools with one scale per layer and component): rows are widened to
float32, multiplied by the scale and rounded to the query dtype before the matmuls.

float32 models multiply in IEEE float32 (no TF32), so the CUDA path matches the CPU reference.
Under ``TRITON_INTERPRET=1`` (set before the kernels are defined) the same kernels run on CPU
tensors; ``tests/unit/test_triton_attn.py`` checks them so against a float64 reference.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

_INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@triton.jit
def _paged_attn_kernel(
    Q, K, V, Out, PageTable, CuQ, Starts,
    scale, k_scale, v_scale, window,
    stride_qt, stride_qh, stride_ks, stride_kh, stride_vs, stride_vh,
    stride_ot, stride_oh, stride_pb,
    G: tl.constexpr, PAGE_SIZE: tl.constexpr,
    D_MAIN: tl.constexpr, D_TAIL: tl.constexpr, DV: tl.constexpr,
    BLOCK_DM: tl.constexpr, BLOCK_DT: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    V_IS_K: tl.constexpr, FP8: tl.constexpr, F32_DOT: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0)
    blk = tl.program_id(1)
    hkv = tl.program_id(2)
    TOKENS: tl.constexpr = BLOCK_M // G  # query tokens per block
    q0 = tl.load(CuQ + b)
    n = tl.load(CuQ + b + 1) - q0
    if blk * TOKENS >= n:
        return
    start = tl.load(Starts + b)

    rows = tl.arange(0, BLOCK_M)
    t = blk * TOKENS + rows // G  # query token within the sequence
    head = hkv * G + rows % G
    row_ok = (rows < TOKENS * G) & (t < n)
    q_pos = start + t
    dm = tl.arange(0, BLOCK_DM)
    q_rows = Q + (q0 + t)[:, None] * stride_qt + head[:, None] * stride_qh
    q = tl.load(q_rows + dm[None, :], mask=row_ok[:, None] & (dm[None, :] < D_MAIN), other=0.0)
    if D_TAIL > 0:
        dt = tl.arange(0, BLOCK_DT)
        tail_ok = row_ok[:, None] & (dt[None, :] < D_TAIL)
        q_tail = tl.load(q_rows + D_MAIN + dt[None, :], mask=tail_ok, other=0.0)
    if not V_IS_K:
        dv = tl.arange(0, BLOCK_DV)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    qk_scale = scale * 1.4426950408889634  # exp(x) = exp2(x * log2 e)

    hi = start + tl.minimum(n, blk * TOKENS + TOKENS)  # keys past the block's last query: none
    lo = 0
    if window > 0:
        lo = tl.maximum(start + blk * TOKENS - window + 1, 0)
    for k_start in range(lo, hi, BLOCK_N):
        k_pos = k_start + tl.arange(0, BLOCK_N)
        k_ok = k_pos < hi
        page = tl.load(PageTable + b * stride_pb + k_pos // PAGE_SIZE, mask=k_ok, other=0)
        slot = page.to(tl.int64) * PAGE_SIZE + k_pos % PAGE_SIZE
        k_rows = K + slot[:, None] * stride_ks + hkv * stride_kh
        k = tl.load(k_rows + dm[None, :], mask=k_ok[:, None] & (dm[None, :] < D_MAIN), other=0.0)
        if FP8:
            k = (k.to(tl.float32) * k_scale).to(Q.dtype.element_ty)
        if F32_DOT:
            s = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        if D_TAIL > 0:
            kt = tl.load(k_rows + D_MAIN + dt[None, :], mask=k_ok[:, None] & (dt[None, :] < D_TAIL),
                         other=0.0)  # fmt: skip
            if FP8:
                kt = (kt.to(tl.float32) * k_scale).to(Q.dtype.element_ty)
            if F32_DOT:
                s += tl.dot(q_tail.to(tl.float32), tl.trans(kt.to(tl.float32)),
                            input_precision="ieee")  # fmt: skip
            else:
                s += tl.dot(q_tail, tl.trans(kt))
        seen = k_ok[None, :] & (k_pos[None, :] <= q_pos[:, None])
        if window > 0:
            seen = seen & (k_pos[None, :] > q_pos[:, None] - window)
        s = tl.where(seen, s * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that saw nothing yet
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        if V_IS_K:
            v = k  # MLA: the values are the latent's first DV (= D_MAIN) channels
        else:
            v_rows = V + slot[:, None] * stride_vs + hkv * stride_vh
            v = tl.load(v_rows + dv[None, :], mask=k_ok[:, None] & (dv[None, :] < DV), other=0.0)
            if FP8:
                v = (v.to(tl.float32) * v_scale).to(Q.dtype.element_ty)
        if F32_DOT:
            acc += tl.dot(p, v.to(tl.float32), input_precision="ieee")
        else:
            acc += tl.dot(p.to(v.dtype), v)
        m_i = m_new

    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    o_rows = Out + (q0 + t)[:, None] * stride_ot + head[:, None] * stride_oh
    dvo = tl.arange(0, BLOCK_DV)
    tl.store(o_rows + dvo[None, :], out.to(Out.dtype.element_ty),
             mask=row_ok[:, None] & (dvo[None, :] < DV))  # fmt: skip


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
) -> torch.Tensor:
    """Attention of each sequence's new queries over its paged context.

    q: [T, H, Dk] (flat tokens; sequence b's are rows ``cu_q[b]:cu_q[b+1]``); k_cache:
    [S, Hkv, Dk] pool slots (S = pages * page_size); v_cache: [S, Hkv, Dv], or None with
    ``v_dim``: the values are the keys' first ``v_dim`` channels (MLA, Hkv = 1), and the last
    ``rope_dim`` key channels run as a separate tail; page_table: [B, P] int32 pages of each
    sequence; cu_q: [B + 1] int32; starts: [B] int32 position of each sequence's first new
    token; max_q: the most new tokens of a sequence (host int: sizes the grid); window: sliding
    window in keys, or None; k_scale / v_scale: dequantization scales of fp8 caches. -> [T, H, Dv]
    in q's dtype.
    """
    T, H, Dk = q.shape
    Hkv = k_cache.shape[1]
    if H % Hkv:
        raise ValueError(f"{H} query heads do not group over {Hkv} KV heads")
    G = H // Hkv
    v_is_k = v_cache is None
    if v_is_k:
        if v_dim is None:
            raise ValueError("without v_cache the values are the keys' first v_dim channels")
        d_main, d_tail, dv = v_dim, Dk - v_dim, v_dim
        if rope_dim not in (0, d_tail):
            raise ValueError(f"rope_dim {rope_dim} != key channels past the values {d_tail}")
        v_cache = k_cache
    else:
        d_main, d_tail, dv = Dk, 0, v_cache.shape[2]
    fp8 = k_cache.dtype == torch.float8_e4m3fn
    # float32 models: IEEE float32 products (no TF32). The interpreter's bfloat16 dot reads the
    # raw bits as numbers (checked: 1e10 errors on a 16 x 16 product), so there bfloat16 runs
    # through float32 products too; on CUDA bfloat16 and float16 use the tensor cores.
    f32_dot = q.dtype == torch.float32 or (_INTERPRETED and q.dtype == torch.bfloat16)
    out = q.new_empty(T, H, dv)
    if max_q == 1:  # decode: one query token per sequence, its G heads as the rows
        block_m = _pow2(G)
        block_n = 64 if _pow2(d_main) <= 128 else 32
    else:
        block_m = 64 if _pow2(d_main) <= 128 else 16
        block_m = max(block_m, _pow2(G))
        block_n = 64 if _pow2(d_main) <= 128 else 32
    tokens = block_m // G
    B = page_table.shape[0]
    grid = (B, triton.cdiv(max_q, tokens), Hkv)
    _paged_attn_kernel[grid](
        q, k_cache, v_cache, out, page_table, cu_q, starts,
        scale, k_scale, v_scale, window or 0,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1),
        v_cache.stride(0), v_cache.stride(1), out.stride(0), out.stride(1), page_table.stride(0),
        G=G, PAGE_SIZE=page_size, D_MAIN=d_main, D_TAIL=d_tail, DV=dv,
        BLOCK_DM=_pow2(d_main), BLOCK_DT=_pow2(d_tail) if d_tail else 16, BLOCK_DV=_pow2(dv),
        BLOCK_M=block_m, BLOCK_N=block_n,
        V_IS_K=v_is_k, FP8=fp8, F32_DOT=f32_dot,
    )  # fmt: skip
    return out
