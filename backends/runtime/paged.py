"""Paged attention over a KV pool, batched across sequences of different lengths.

A forward pass takes ``T`` new tokens flattened over ``B`` sequences ("varlen"). Sequence ``b``
adds ``n_b`` tokens at positions ``[start_b, start_b + n_b)`` and attends to its whole context
``[0, start_b + n_b)``, whose KV lives in its pages. :class:`BatchMeta` is built once per forward
and shared by every layer:

* ``write_slots [T]``: flat pool slot (``page * page_size + offset``) of each new token;
* ``read_slots [B, L]``: flat slots of each sequence's context, padded to the longest ``L``;
* ``mask [B, 1, Q, L]``: causal + padding (+ sliding window) mask, ``Q`` = most new tokens;
* ``q_index [T]``: where each flat token sits in the padded ``[B * Q]`` query grid.

Reads are one ``index_select`` per layer (pages gathered, no Python loop over tokens), and
attention is one SDPA call for the whole batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class BatchMeta:
    positions: torch.Tensor  # [T] absolute position of each new token
    write_slots: torch.Tensor  # [T]
    read_slots: torch.Tensor  # [B, L]
    mask: torch.Tensor  # [B, 1, Q, L] bool, True = attend
    q_index: torch.Tensor  # [T] index into the padded [B * Q] grid
    lengths: list[int]  # new tokens per sequence
    num_seqs: int
    max_q: int
    causal: bool = False  # one sequence from position 0, no window: plain causal attention

    @classmethod
    def build(
        cls,
        seqs: list[tuple[int, int, list[int]]],
        page_size: int,
        num_pages: int,
        device,
        sliding_window: int | None = None,
    ) -> BatchMeta:
        """seqs: (start_pos, num_new_tokens, pages) per sequence."""
        if not seqs:
            raise ValueError("a forward needs at least one sequence")
        max_q = max(n for _, n, _ in seqs)
        max_ctx = max(s + n for s, n, _ in seqs)
        positions, write_slots, q_index = [], [], []
        read_slots = torch.zeros(len(seqs), max_ctx, dtype=torch.long)
        ctx_lens, q_pos = [], torch.zeros(len(seqs), max_q, dtype=torch.long)
        offs = torch.arange(max_ctx)
        for b, (start, n, pages) in enumerate(seqs):
            if n <= 0:
                raise ValueError(f"sequence {b} has no new tokens")
            ctx = start + n
            need = -(-ctx // page_size)
            if len(pages) < need:
                raise ValueError(
                    f"sequence {b}: {ctx} tokens need {need} pages of {page_size}, got {len(pages)}"
                )
            bad = [p for p in pages[:need] if not 0 <= p < num_pages]
            if bad:
                raise IndexError(f"sequence {b}: pages {bad} outside the pool [0, {num_pages})")
            page_t = torch.tensor(pages[:need], dtype=torch.long)
            slots = page_t[offs[:ctx] // page_size] * page_size + offs[:ctx] % page_size
            read_slots[b, :ctx] = slots
            write_slots.append(slots[start:ctx])
            positions.append(offs[start:ctx])
            q_index.append(b * max_q + torch.arange(n))
            q_pos[b, :n] = offs[start:ctx]
            ctx_lens.append(ctx)
        k_pos = offs[None, None, :]  # [1, 1, L]
        qp = q_pos[:, :, None]  # [B, Q, 1]; padding rows sit at position 0 and see key 0
        mask = (k_pos <= qp) & (k_pos < torch.tensor(ctx_lens)[:, None, None])
        if sliding_window is not None:
            mask &= k_pos > qp - sliding_window
        return cls(
            positions=torch.cat(positions).to(device),
            write_slots=torch.cat(write_slots).to(device),
            read_slots=read_slots.to(device),
            mask=mask[:, None].to(device),
            q_index=torch.cat(q_index).to(device),
            lengths=[n for _, n, _ in seqs],
            num_seqs=len(seqs),
            max_q=max_q,
            causal=len(seqs) == 1
            and seqs[0][0] == 0
            and (sliding_window is None or sliding_window >= max_ctx),
        )


def write_kv(cache: torch.Tensor, meta: BatchMeta, new: torch.Tensor) -> None:
    """cache: [S, ...] flat slots of one layer component; new: [T, ...] for meta.write_slots."""
    cache.index_copy_(0, meta.write_slots, new.to(cache.dtype))


def paged_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: BatchMeta, scale: float
) -> torch.Tensor:
    """Attention of new tokens over their sequences' cached context.

    q: [T, H, Dk]; k_cache: [S, Hkv, Dk]; v_cache: [S, Hkv, Dv] (flat slots, may be views)
    -> [T, H, Dv]. H must be a multiple of Hkv (GQA; MLA in latent space has Hkv = 1).
    """
    B, L = meta.read_slots.shape
    T, H, Dk = q.shape
    flat = meta.read_slots.reshape(-1)
    k = k_cache.index_select(0, flat).view(B, L, -1, Dk).transpose(1, 2)  # [B, Hkv, L, Dk]
    v = v_cache.index_select(0, flat)
    v = v.view(B, L, -1, v.shape[-1]).transpose(1, 2)  # [B, Hkv, L, Dv]
    if B == 1 and meta.max_q == T:
        qp = q.transpose(0, 1)[None]  # [1, H, T, Dk]
    else:
        qp = q.new_zeros(B * meta.max_q, H, Dk)
        qp[meta.q_index] = q
        qp = qp.view(B, meta.max_q, H, Dk).transpose(1, 2)  # [B, H, Q, Dk]
    gqa = k.shape[1] != H
    if meta.causal:  # lets SDPA pick a fused causal kernel instead of materialising the mask
        out = F.scaled_dot_product_attention(qp, k, v, is_causal=True, scale=scale, enable_gqa=gqa)
    else:
        out = F.scaled_dot_product_attention(
            qp, k, v, attn_mask=meta.mask, scale=scale, enable_gqa=gqa
        )  # [B, H, Q, Dv]
    out = out.transpose(1, 2).reshape(B * meta.max_q, H, -1)
    if B == 1 and meta.max_q == T:
        return out
    return out[meta.q_index]  # [T, H, Dv]
