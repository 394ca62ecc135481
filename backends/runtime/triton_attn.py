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

fp8 KV (``float8_e4m3fn`` pools with one scale per layer and component): rows are widened to
float32, multiplied by the scale and rounded to the query dtype before the matmuls.

float32 models multiply in IEEE float32 (no TF32), so the CUDA path matches the CPU reference.
Under ``TRITON_INTERPRET=1`` (set before ``triton`` is first imported) the same kernels run on
CPU tensors; ``tests/unit/test_triton_attn.py`` checks them so against a float64 reference, and
``tests/unit/test_triton_attn_compile.py`` compiles them for sm_90 without a GPU.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

_INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
# 8 warps: compiled for sm_90 without a GPU (tests/unit/test_triton_attn_compile.py), 4 warps
# spilled (fp16 prefill at 128 channels: 255 registers + 424 B of stack; 8 warps: 238, none)
NUM_WARPS = 8


@triton.jit
def _paged_attn_kernel(
    Q, K, V, Out, PageTable, CuQ, Starts, Lse,
    scale, k_scale, v_scale, window, split_len,
    stride_qt, stride_qh, stride_ks, stride_kh, stride_vs, stride_vh,
    stride_os, stride_ot, stride_oh, stride_pb, stride_ls, stride_lt,
    G: tl.constexpr, HEAD_SPLIT: tl.constexpr, PAGE_SIZE: tl.constexpr, SPLIT: tl.constexpr,
    D_MAIN: tl.constexpr, D_TAIL: tl.constexpr, DV: tl.constexpr,
    BLOCK_DM: tl.constexpr, BLOCK_DT: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, TOKENS: tl.constexpr,
    V_IS_K: tl.constexpr, FP8: tl.constexpr, F32_DOT: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0)
    hq = tl.program_id(2)  # a group of G query heads; HEAD_SPLIT groups share a KV head
    hkv = hq // HEAD_SPLIT
    if SPLIT:  # decode, keys split over programs: axis 1 is the key split, one query block
        split = tl.program_id(1)
        blk = 0
    else:
        split = 0
        blk = tl.program_id(1)
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
    # with a window: no key before the first query's window (branch-free: no type merge)
    lo = tl.where(window > 0, tl.maximum(start + blk * TOKENS - window + 1, 0), 0)
    w_lo = tl.where(window > 0, q_pos - window, -1)  # [BLOCK_M] keys must be past this
    if SPLIT:
        lo = tl.maximum(lo, split * split_len)
        hi = tl.minimum(hi, split * split_len + split_len)
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
        seen = k_ok[None, :] & (k_pos[None, :] <= q_pos[:, None]) & (k_pos[None, :] > w_lo[:, None])
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
    o_rows = Out + split * stride_os + (q0 + t)[:, None] * stride_ot + head[:, None] * stride_oh
    if SPLIT:  # this split's log-sum-exp (base 2, scaled scores); -inf where it saw no key
        lse = m_i + tl.log2(l_i)
        tl.store(Lse + split * stride_ls + (q0 + t) * stride_lt + head, lse, mask=row_ok)
    dvo = tl.arange(0, BLOCK_DV)
    tl.store(o_rows + dvo[None, :], out.to(Out.dtype.element_ty),
             mask=row_ok[:, None] & (dvo[None, :] < DV))  # fmt: skip


@triton.jit
def _combine_splits_kernel(
    PartO, Lse, Out, num_splits,
    stride_ps, stride_pt, stride_ph, stride_ls, stride_lt, stride_ot, stride_oh,
    DV: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_DV: tl.constexpr,
):  # fmt: skip
    """One (token, head): out = sum_s 2^(lse_s - m) o_s / sum_s 2^(lse_s - m)."""
    t = tl.program_id(0)
    h = tl.program_id(1)
    sp = tl.arange(0, BLOCK_S)
    ok = sp < num_splits
    lse = tl.load(Lse + sp * stride_ls + t * stride_lt + h, mask=ok, other=float("-inf"))
    m = tl.max(lse, 0)  # finite: the split holding the query's own key saw it
    w = tl.exp2(lse - m)
    d = tl.arange(0, BLOCK_DV)
    o = tl.load(PartO + sp[:, None] * stride_ps + t * stride_pt + h * stride_ph + d[None, :],
                mask=ok[:, None] & (d[None, :] < DV), other=0.0)  # fmt: skip
    out = tl.sum(w[:, None] * o, 0) / tl.sum(w, 0)
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
) -> torch.Tensor:
    """Attention of each sequence's new queries over its paged context.

    q: [T, H, Dk] (flat tokens; sequence b's are rows ``cu_q[b]:cu_q[b+1]``); k_cache:
    [S, Hkv, Dk] pool slots (S = pages * page_size); v_cache: [S, Hkv, Dv], or None with
    ``v_dim``: the values are the keys' first ``v_dim`` channels (MLA, Hkv = 1), and the last
    ``rope_dim`` key channels run as a separate tail; page_table: [B, P] int32 pages of each
    sequence; cu_q: [B + 1] int32; starts: [B] int32 position of each sequence's first new
    token; max_q: the most new tokens of a sequence (host int: sizes the grid); window: sliding
    window in keys, or None; k_scale / v_scale: dequantization scales of fp8 caches; max_ctx:
    the longest context (host int); num_splits: decode only, split each sequence's keys over
    this many programs, combined by a second kernel (None: :func:`_auto_splits` from
    ``max_ctx`` and the GPU's SM count). -> [T, H, Dv] in q's dtype.
    """
    T, H, Dk = q.shape
    Hkv = k_cache.shape[1]
    if H % Hkv:
        raise ValueError(f"{H} query heads do not group over {Hkv} KV heads")
    G, head_split = H // Hkv, 1
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
    big = _pow2(d_main) > 128  # MLA's 512-channel latent: smaller tiles
    block_n = 32 if big else 64
    while G > (16 if big else 64) and G % 2 == 0:  # MLA's 16-128 heads: over programs
        G, head_split = G // 2, head_split * 2
    if max_q == 1:  # decode: one query token per sequence, its G heads as the rows
        block_m = _pow2(G)
    else:
        block_m = max(16 if big else 64, _pow2(G))
    B = page_table.shape[0]
    if max_q != 1:
        num_splits = 1
    elif num_splits is None:
        num_splits = _auto_splits(q.device, B * Hkv, max_ctx)
    split_len = 0
    if num_splits > 1:  # round the split to whole key blocks; drop splits that would be empty
        split_len = triton.cdiv(triton.cdiv(max_ctx, num_splits), block_n) * block_n
        num_splits = triton.cdiv(max_ctx, split_len)
    out = q.new_empty(T, H, dv)
    if num_splits > 1:
        part = torch.empty(num_splits, T, H, dv, dtype=torch.float32, device=q.device)
        lse = torch.empty(num_splits, T, H, dtype=torch.float32, device=q.device)
        grid = (B, num_splits, Hkv * head_split)
    else:
        part, lse = out, out  # lse unused
        grid = (B, triton.cdiv(max_q, block_m // G), Hkv * head_split)
    _paged_attn_kernel[grid](
        q, k_cache, v_cache, part, page_table, cu_q, starts, lse,
        scale, k_scale, v_scale, window or 0, split_len,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1),
        v_cache.stride(0), v_cache.stride(1),
        part.stride(0) if num_splits > 1 else 0, part.stride(-3), part.stride(-2),
        page_table.stride(0), lse.stride(0), lse.stride(1),
        G=G, HEAD_SPLIT=head_split, PAGE_SIZE=page_size, SPLIT=num_splits > 1,
        D_MAIN=d_main, D_TAIL=d_tail, DV=dv,
        BLOCK_DM=_pow2(d_main), BLOCK_DT=_pow2(d_tail) if d_tail else 16, BLOCK_DV=_pow2(dv),
        BLOCK_M=block_m, BLOCK_N=block_n, TOKENS=block_m // G,
        V_IS_K=v_is_k, FP8=fp8, F32_DOT=f32_dot, num_warps=NUM_WARPS,
    )  # fmt: skip
    if num_splits > 1:
        _combine_splits_kernel[(T, H)](
            part, lse, out, num_splits,
            part.stride(0), part.stride(1), part.stride(2), lse.stride(0), lse.stride(1),
            out.stride(0), out.stride(1),
            DV=dv, BLOCK_S=triton.next_power_of_2(num_splits), BLOCK_DV=_pow2(dv),
        )  # fmt: skip
    return out


SPLIT_MIN_KEYS = 256  # a decode split reads at least this many keys


def _auto_splits(device: torch.device, programs: int, max_ctx: int | None) -> int:
    """Key splits for a decode launch of ``programs`` (sequence, KV head) programs: enough to give
    every SM about two programs, none shorter than ``SPLIT_MIN_KEYS`` keys (flash-decoding)."""
    if max_ctx is None or device.type != "cuda":
        return 1
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    if programs >= sms:
        return 1
    return max(1, min(triton.cdiv(max_ctx, SPLIT_MIN_KEYS), triton.cdiv(2 * sms, programs), 64))
