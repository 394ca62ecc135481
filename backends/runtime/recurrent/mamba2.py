"""Mamba2 (Nemotron-H, Granite 4.0-H): the selective state-space mixer and its two forms.

Per head (``P`` channels of ``x``, state size ``N``, the group's ``B_t``, ``C_t`` [N]), with
``dt_t = softplus(dt_raw + dt_bias)`` and ``A = -exp(A_log)`` (a scalar per head), the state
``S [P, N]`` follows::

    S_t = exp(dt_t A) S_{t-1} + dt_t x_t B_t^T;     y_t = S_t C_t + D x_t

**Chunked form** (SSD; prefill, continuations): within a chunk with cumulative log decay
``G_i = sum_{j<=i} dt_j A`` and ``D_ij = exp(G_i - G_j)`` for ``j <= i`` (0 above), from the
chunk's initial state ``S0``::

    Y = ((C B^T) * D) (x dt) + (C * exp(G)) S0^T
    S = exp(G_C) S0 + (x dt)^T (B * exp(G_C - G))

The intra-chunk term runs for all chunks of all sequences at once; the state passes from chunk
to chunk in a loop over chunks (never over tokens). Padding positions carry ``dt = 0``: no decay
and no input, so they leave the state as it was. As transformers and mamba-ssm do, the chunked
form clamps ``dt`` to the model's lower limit and the single step does not.

**Recurrent form** (decode): the definition, one token per sequence, batched.

State per layer and sequence (float32, ``mamba_ssm_cache_dtype``): the conv state of the
``[x | B | C]`` channels and ``S`` per head (see :mod:`backends.runtime.state_pool`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..config import Mamba2Config
from ..kernels import KernelSettings, Linear
from ..weights import WeightReader
from .batch import RecurrentBatch, project
from .conv1d import causal_conv1d


def ssd_chunk_scan(x, dt, A, Bm, Cm, state, chunk: int):
    """x: [B, H, L, P]; dt: [B, H, L] (0 in the padding); A: [H]; Bm, Cm: [B, G, L, N] (a
    group's ``H / G`` heads share them); state: [B, H, P, N]; all float32, L a multiple of
    ``chunk``. -> (y [B, H, L, P] without the D skip, final state [B, H, P, N]).

    ``C B^T`` is computed once per group, not per head (transformers repeats B and C per head
    first): on Nemotron-H-8B's shapes, 16 heads a group, that product was the largest of the
    intra-chunk terms."""
    B, H, L, P = x.shape
    G, n = Bm.shape[1], L // chunk
    logd = (dt * A[:, None]).reshape(B, H, n, chunk).cumsum(-1)  # cumulative log decay
    xdt = (x * dt[..., None]).reshape(B, H, n, chunk, P)
    Bc, Cc = (t.reshape(B, G, 1, n, chunk, -1) for t in (Bm, Cm))  # [B, G, 1, n, C, N]
    causal = torch.ones(chunk, chunk, dtype=torch.bool, device=x.device).tril()
    decay = (logd[..., :, None] - logd[..., None, :]).masked_fill(~causal, float("-inf")).exp()

    def per_head(group: torch.Tensor, head: torch.Tensor) -> torch.Tensor:
        # [B, G, 1, n, C, *] times [B, H, n, C, *] -> [B, H, n, C, *]
        return (group * head.view(B, G, H // G, *head.shape[2:])).view(*head.shape[:4], -1)

    y = per_head(Cc @ Bc.transpose(-1, -2), decay) @ xdt  # intra-chunk: [B, H, n, C, P]
    c_in = per_head(Cc, logd.exp()[..., None])  # reads the chunk's initial state
    b_out = per_head(Bc, (logd[..., -1:] - logd).exp()[..., None])  # writes its final state
    chunk_decay = logd[..., -1].exp()[..., None, None]  # [B, H, n, 1, 1]
    for c in range(n):
        y[:, :, c] += c_in[:, :, c] @ state.transpose(-1, -2)  # [B, H, C, P]
        state = state * chunk_decay[:, :, c] + xdt[:, :, c].transpose(-1, -2) @ b_out[:, :, c]
    return y.reshape(B, H, L, P), state


def ssd_step(x, dt, A, Bm, Cm, state):
    """One token per sequence. x: [B, H, P]; dt: [B, H]; A: [H]; Bm, Cm: [B, G, N]; state:
    [B, H, P, N] (float32). -> (y [B, H, P] without the D skip, new state)."""
    r = x.shape[1] // Bm.shape[1]  # heads per group
    Bm, Cm = Bm.repeat_interleave(r, dim=1), Cm.repeat_interleave(r, dim=1)  # [B, H, N]
    decay = (dt * A).exp()[..., None, None]  # [B, H, 1, 1]
    state = state * decay + (x * dt[..., None])[..., :, None] * Bm[:, :, None, :]
    return (state @ Cm[..., None])[..., 0], state


class Mamba2Mixer:
    """The mixer of one Mamba2 layer: in projection ``[gate | x B C | dt]``, causal conv1d
    (SiLU) over ``x B C``, the selective scan with the D skip, gated group RMSNorm, out
    projection ``o``. Called as an attention layer is, with ``meta.recurrent`` for the state;
    ``layer``: its index among the model's recurrent layers (its slab of the state pool)."""

    def __init__(
        self, cfg: Mamba2Config, w: WeightReader, prefix: str, kernels: KernelSettings, layer: int
    ):
        self.cfg, self.layer = cfg, layer
        self.in_proj = Linear(
            w.get(f"{prefix}.in_proj.weight"), w.opt(f"{prefix}.in_proj.bias"), kernels
        )
        self.conv_w = w.get(f"{prefix}.conv1d.weight")[:, 0, :]  # [C, K]
        self.conv_b = w.opt(f"{prefix}.conv1d.bias")
        self.A = -w.get(f"{prefix}.A_log").float().exp()  # [H]
        self.D = w.get(f"{prefix}.D")  # [H]
        self.dt_bias = w.get(f"{prefix}.dt_bias")  # [H]
        self.norm_w = w.get(f"{prefix}.norm.weight")  # [H * P]
        self.o = Linear(
            w.get(f"{prefix}.out_proj.weight"), w.opt(f"{prefix}.out_proj.bias"), kernels
        )

    def __call__(self, x: torch.Tensor, meta, kv=None, residual=None, rows=None) -> torch.Tensor:
        """x: [T, hidden] -> [T, hidden] (+ ``residual``), or its ``rows`` [R] only. Every token
        advances its sequence's SSM state, read from and written back to its slot
        (``meta.recurrent``); ``kv`` is unused."""
        rb: RecurrentBatch = meta.recurrent
        c, B, T = self.cfg, rb.num_seqs, x.shape[0]
        H, P, G, N = c.num_heads, c.head_dim, c.n_groups, c.state_size
        gate, xbc, dt = self.in_proj(x).split([H * P, c.conv_dim, H], dim=-1)
        conv_state, state = rb.read(self.layer, c.conv_dim, c.conv_kernel - 1)  # float32
        state = state.view(B, H, P, N)
        xbc, conv_state = causal_conv1d(xbc, self.conv_w, self.conv_b, conv_state, rb)
        xs, Bm, Cm = F.silu(xbc).split([H * P, G * N, G * N], dim=-1)
        xs = xs.reshape(T, H, P).float()
        Bm, Cm = (t.reshape(T, G, N).float() for t in (Bm, Cm))  # per group
        dt = F.softplus(dt + self.dt_bias).float()  # [T, H], in the model dtype first
        if rb.decode:  # T == B, one token per sequence in order
            y, state = ssd_step(xs, dt, self.A, Bm, Cm, state)  # [B, H, P]
        else:
            dt = dt.clamp(min=c.dt_min)
            Lp = rb.padded_len(c.chunk_size)
            gx, gdt, gB, gC = (rb.to_grid(t, Lp).transpose(1, 2) for t in (xs, dt, Bm, Cm))
            y, state = ssd_chunk_scan(gx, gdt, self.A, gB, gC, state, c.chunk_size)
            y = rb.from_grid(y.transpose(1, 2))  # [T, H, P]
        rb.write(self.layer, conv_state, state)
        y = y + xs * self.D[:, None]
        if rb.decode:  # transformers' step returns the model dtype before the norm
            y = y.to(x.dtype)
        y = self._gated_norm(y.reshape(T, H * P), gate).to(x.dtype)
        return project(self.o, y, residual, rows)

    def _gated_norm(self, y: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """y * SiLU(gate), RMS-normalised per group of ``H P / G`` channels (float32)."""
        h = y.float() * F.silu(gate.float())
        h = h.view(len(h), self.cfg.n_groups, -1)
        h = (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.cfg.norm_eps)).view_as(y)
        return self.norm_w * h.to(y.dtype)
