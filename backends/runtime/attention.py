"""Attention layers writing to and reading from a paged KV pool.

* :class:`GQAAttention` (Llama/Mistral/Qwen2, and with a per-layer ``window`` and ``sinks``
  gpt-oss): caches roped K and V per KV head;
* :class:`QKNormAttention` (Qwen3, Gemma 3): the same with a norm over each head's q and k before
  the rotation.
* :class:`MLAAttention` (DeepSeek V2/V3): caches the latent ``[c_kv | k_pe]`` (``c_kv`` after
  ``kv_a_layernorm``, ``k_pe`` roped) and attends in latent space ("weight absorption"):
  ``q_nope`` is projected through the key half of ``kv_b_proj`` so scores are
  ``q_lat . c_kv + q_pe . k_pe``; the attention-weighted ``c_kv`` is projected through the value
  half of ``kv_b_proj``. This equals up-projecting every cached latent to K/V, without doing so.
"""

from __future__ import annotations

import torch

from . import cuda_attn, kv_quant
from .config import ModelConfig
from .decode_attn import cpu_decode_attention, decode_attention
from .kernels import KernelSettings, Linear, fused_ops
from .layers import RMSNorm
from .paged import BatchMeta, copy_slots, paged_attention, write_kv
from .prefill_attn import cpu_prefill_attention
from .rope import RotaryEmbedding
from .weights import WeightReader

# an extend forward of up to this many new tokens per sequence (speculative verify, a head's
# catch-up) runs the in-place decode kernel with every new token as a query of its own
EXTEND_IN_PLACE_MAX_Q = 16


def _linear(w: WeightReader, name: str, kernels: KernelSettings) -> Linear:
    return Linear(w.get(f"{name}.weight"), w.opt(f"{name}.bias"), kernels)


def _project(o: Linear, x: torch.Tensor, residual, rows) -> torch.Tensor:
    """The o projection of x [T, H * Dv] (plus residual [T, hidden] if given), of the rows
    ``rows`` [R] only if given."""
    if rows is not None:
        x, residual = x[rows], None if residual is None else residual[rows]
    return o(x) if residual is None else o.add(x, residual)


def attend(
    q,
    k_new,
    k_cache,
    meta,
    scale,
    kernels,
    v_new=None,
    v_cache=None,
    v_dim=None,
    kv_scales=None,
    sinks=None,
):
    """Paged attention (see :func:`~backends.runtime.paged.paged_attention` for the shapes),
    through the runtime's kernels where one is chosen and available: on CUDA (``auto``) the
    Triton paged kernel for every kind but a lone prompt from position 0 (SDPA's flash kernel,
    see :func:`_flash_prefill`); on CPU the in-place decode kernel and the C++ prefill
    kernel (``auto``). ``kv_scales``: (K, V) scales of an fp8 pool (MLA: one), else None.
    ``meta``: the batch as this layer sees it (its window: ``BatchMeta.for_window``);
    ``sinks``: [H] float32 sink logits (gpt-oss), else None: every path takes them but SDPA's
    flash prefill and the compiled decode kernel, which then do not run. The new KV is in
    the pool already; ``meta.copies`` (SeqInput.root) are copied first."""
    copy_slots(k_cache, meta)  # the KV a root's first tokens share (SeqInput.root)
    if v_cache is not None:
        copy_slots(v_cache, meta)
    ks = kv_scales or (1.0, 1.0)
    on_triton = kernels.attention == "triton" or (
        kernels.attention == "auto" and (sinks is not None or not _flash_prefill(q, meta))
    )
    if q.device.type in cuda_attn.DEVICE_TYPES and on_triton:
        strict = kernels.attention == "triton"
        out = cuda_attn.cuda_attention(
            q, k_cache, v_cache, v_dim, meta, scale, ks, strict, sinks=sinks
        )
        if out is not None:
            return out
    if kv_scales is not None and meta.kind == "prefill":  # as the fp8 pool holds them
        k_new, v_new = kv_quant.as_stored(k_new, ks[0]), kv_quant.as_stored(v_new, ks[-1])
    if meta.kind == "prefill" and kernels.attention == "auto":
        out = cpu_prefill_attention(q, k_new, v_new, v_dim, meta, scale, sinks)
        if out is not None:
            return out
    small_extend = meta.kind == "extend" and meta.max_q <= EXTEND_IN_PLACE_MAX_Q
    if small_extend and kernels.attention == "auto":
        out = cpu_decode_attention(q, k_cache, v_cache, v_dim, meta, scale, ks, sinks)
        if out is not None:
            return out
    if meta.kind == "decode" and kernels.attention == "auto":
        out = cpu_decode_attention(q, k_cache, v_cache, v_dim, meta, scale, ks, sinks)
        if out is not None:
            return out
    if meta.kind == "decode" and kernels.attention == "compiled" and sinks is None:  # no sinks
        out = decode_attention(q, k_cache, v_cache, v_dim, meta, scale)
        if out is not None:
            return out
    return paged_attention(q, k_new, k_cache, meta, scale, v_new, v_cache, v_dim, ks, sinks)


def _flash_prefill(q, meta) -> bool:
    """One prompt from position 0 on CUDA: its keys are the new tokens themselves (no pool
    reads), plain causal, so SDPA runs its flash kernel on them. On an H100 that was 1.3-1.6x
    the Triton kernel's prefill tokens/s (SmolLM2 bfloat16, 512 and 2,048 tokens), and 2-4x at
    the kernel alone (docs/benchmarks.md); batched prefill and everything else stays on Triton
    (in place, no padding)."""
    return q.device.type == "cuda" and meta.kind == "prefill" and meta.causal and meta.num_seqs == 1


class GQAAttention:
    """``window``: this layer's sliding window (None: full attention); ``sinks``: [H] sink
    logits (gpt-oss's ``self_attn.sinks``), or None."""

    def __init__(
        self,
        cfg: ModelConfig,
        w: WeightReader,
        prefix: str,
        rope: RotaryEmbedding,
        kernels: KernelSettings,
        window: int | None = None,
        sinks: torch.Tensor | None = None,
    ):
        self.H, self.Hkv, self.D = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.window = window
        self.sinks = None if sinks is None else sinks.float().contiguous()  # [H]
        q, k, v = (w.get(f"{prefix}.{n}_proj.weight") for n in ("q", "k", "v"))
        biases = [w.opt(f"{prefix}.{n}_proj.bias") for n in ("q", "k", "v")]
        qkv_b = torch.cat(biases) if all(b is not None for b in biases) else None
        # [(H + 2 Hkv) D, hidden]: one matmul for q, k, v
        self.qkv = Linear(torch.cat([q, k, v]), qkv_b, kernels)
        self.o = _linear(w, f"{prefix}.o_proj", kernels)
        self.rope = rope
        self.scale = cfg.softmax_scale
        self.kernels = kernels
        self.kv_scales: tuple[float, float] | None = None  # fp8 pools: (K, V) scales
        # rotary embedding + KV write as one C++ op (rotate-half style, the usual one)
        self.fused = fused_ops(q, kernels) if rope.style == "half" else None

    def __call__(
        self, x: torch.Tensor, meta: BatchMeta, kv: torch.Tensor, residual=None, rows=None
    ) -> torch.Tensor:
        """x: [T, hidden]; kv: this layer's pool slab [2, pages, page_size, Hkv, D];
        residual: [T, hidden] added to the output (by the o projection), or None; rows: [R]
        the only rows of the output wanted, or None (every row's KV is written either way)."""
        T = x.shape[0]
        H, Hkv, D = self.H, self.Hkv, self.D
        qkv = self.qk_normed(self.qkv(x))  # [T, (H + 2 Hkv) D]
        k_cache = kv[0].view(-1, Hkv, D)  # [S, Hkv, D]
        v_cache = kv[1].view(-1, Hkv, D)
        v = qkv.view(T, H + 2 * Hkv, D)[:, H + Hkv :]  # [T, Hkv, D]
        if self.fused is not None and k_cache.dtype == qkv.dtype:
            cos, sin = self.rope.tables()
            q, k = self.fused.rope_write_kv(
                qkv, cos, sin, meta.positions, meta.write_slots, k_cache, v_cache, H, Hkv
            )  # q: [T, H, D]; k: [T, Hkv, D]; k and v written to the pool
        else:
            qk = self.rope.apply(qkv.view(T, H + 2 * Hkv, D)[:, : H + Hkv], meta.positions)
            q, k = qk.split([H, Hkv], dim=1)  # q and k heads in one rotation
            ks, vs = self.kv_scales or (None, None)
            write_kv(k_cache, meta, k, ks)
            write_kv(v_cache, meta, v, vs)
        seen = meta.for_window(self.window)  # the batch as this layer's window sees it
        ks = self.kv_scales
        out = attend(
            q, k, k_cache, seen, self.scale, self.kernels, v, v_cache, None, ks, self.sinks
        )  # [T, H, D]
        return _project(self.o, out.reshape(T, H * D), residual, rows)

    def qk_normed(self, qkv: torch.Tensor) -> torch.Tensor:
        """The projections before the rotation: here as they are ([T, (H + 2 Hkv) D])."""
        return qkv


class QKNormAttention(GQAAttention):
    """GQA attention with a norm over each head's q and each head's k before the rotation
    (Qwen3: ``RMSNorm``; Gemma 3: its ``(1 + w)`` form), one weight [D] shared by the heads."""

    def __init__(self, cfg, w, prefix, rope, kernels, q_norm, k_norm, window=None, sinks=None):
        super().__init__(cfg, w, prefix, rope, kernels, window, sinks)
        self.q_norm, self.k_norm = q_norm, k_norm

    def qk_normed(self, qkv: torch.Tensor) -> torch.Tensor:
        T, H, Hkv, D = qkv.shape[0], self.H, self.Hkv, self.D
        heads = qkv.view(T, H + 2 * Hkv, D)
        q = self.q_norm(heads[:, :H].reshape(T * H, D)).view(T, H, D)
        k = self.k_norm(heads[:, H : H + Hkv].reshape(T * Hkv, D)).view(T, Hkv, D)
        return torch.cat([q, k, heads[:, H + Hkv :]], dim=1).view(T, -1)  # [T, (H + 2 Hkv) D]


class MLAAttention:
    def __init__(
        self,
        cfg: ModelConfig,
        w: WeightReader,
        prefix: str,
        rope: RotaryEmbedding,
        kernels: KernelSettings,
    ):
        self.H = cfg.num_heads
        self.dn, self.dr, self.dv = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        self.R = cfg.kv_lora_rank
        if cfg.q_lora_rank is None:
            self.q_proj = Linear(w.get(f"{prefix}.q_proj.weight"), None, kernels)
        else:
            self.q_a = _linear(w, f"{prefix}.q_a_proj", kernels)
            self.q_a_norm = RMSNorm(w.get(f"{prefix}.q_a_layernorm.weight"), 1e-6, kernels)
            self.q_b = Linear(w.get(f"{prefix}.q_b_proj.weight"), None, kernels)
        self.q_lora = cfg.q_lora_rank is not None
        self.kv_a = _linear(w, f"{prefix}.kv_a_proj_with_mqa", kernels)  # [R + dr, hidden]
        self.kv_norm = RMSNorm(w.get(f"{prefix}.kv_a_layernorm.weight"), 1e-6, kernels)
        kv_b = w.get(f"{prefix}.kv_b_proj.weight").view(self.H, self.dn + self.dv, self.R)
        self.w_uk = kv_b[:, : self.dn, :]  # [H, dn, R]
        self.w_uv = kv_b[:, self.dn :, :]  # [H, dv, R]
        self.o = _linear(w, f"{prefix}.o_proj", kernels)
        self.rope = rope
        self.scale = cfg.softmax_scale
        self.kernels = kernels
        self.kv_scales: tuple[float] | None = None  # an fp8 pool: the latent's scale

    def __call__(
        self, x: torch.Tensor, meta: BatchMeta, latent: torch.Tensor, residual=None, rows=None
    ) -> torch.Tensor:
        """x: [T, hidden]; latent: this layer's pool slab [pages, page_size, R + dr];
        residual and rows as for :class:`GQAAttention`."""
        T, H, R = x.shape[0], self.H, self.R
        if self.q_lora:
            q = self.q_b(self.q_a_norm(self.q_a(x)))
        else:
            q = self.q_proj(x)
        q = q.view(T, H, self.dn + self.dr)  # q: [T, H, dn + dr]
        q_nope, q_pe = q.split([self.dn, self.dr], dim=-1)
        q_pe = self.rope.apply(q_pe, meta.positions)  # [T, H, dr]
        ckv = self.kv_a(x)  # [T, R + dr]
        c_kv, k_pe = ckv.split([R, self.dr], dim=-1)
        c_kv = self.kv_norm(c_kv)  # [T, R]
        k_pe = self.rope.apply(k_pe[:, None, :], meta.positions)[:, 0]  # [T, dr]
        cache = latent.view(-1, 1, R + self.dr)  # [S, 1, R + dr]
        new = torch.cat([c_kv, k_pe], dim=-1)[:, None, :]  # [T, 1, R + dr]
        write_kv(cache, meta, new, self.kv_scales and self.kv_scales[0])
        q_lat = torch.einsum("thd,hdr->thr", q_nope, self.w_uk)  # [T, H, R]
        q_full = torch.cat([q_lat, q_pe], dim=-1)  # [T, H, R + dr]
        # values are the latent's first R channels: [T, H, R]
        out_lat = attend(
            q_full, new, cache, meta, self.scale, self.kernels, v_dim=R, kv_scales=self.kv_scales
        )
        out = torch.einsum("thr,hvr->thv", out_lat, self.w_uv)  # [T, H, dv]
        return _project(self.o, out.reshape(T, H * self.dv), residual, rows)
