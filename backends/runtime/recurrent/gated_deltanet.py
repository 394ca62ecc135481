"""Gated DeltaNet (Qwen3-Next, Qwen3.5): the linear-attention token mixer and its two forms.

Per value head, with ``q`` and ``k`` L2-normalised (``q`` also scaled by ``dk ** -0.5``), the
decay ``g_t = -exp(A_log) * softplus(a_t + dt_bias)`` (log space) and ``beta_t = sigmoid(b_t)``,
the state ``S [dk, dv]`` follows the delta rule::

    S' = exp(g_t) S_{t-1};   S_t = S' + k_t (beta_t (v_t - S'^T k_t))^T;   o_t = S_t^T q_t

**Chunked form** (prefill, continuations): within a chunk of ``C`` tokens with cumulative decay
``G_i = g_1 + .. + g_i`` and ``D_ij = exp(G_i - G_j)`` for ``j <= i`` (0 above), the updates of
the chunk condense into pseudo-values ``U`` through one unit-lower-triangular solve (the WY /
UT form): with ``L = strict_lower((beta K) K^T * D)``,
``(I + L) [U0 | W] = [beta V | beta K * exp(G)]``; then from the chunk's initial state ``S0``::

    U = U0 - W S0
    O = (Q * exp(G)) S0 + ((Q K^T) * D) U
    S = exp(G_C) S0 + (K * exp(G_C - G))^T U

Everything but the last three lines runs for all chunks of all sequences at once; those run in
a loop over chunks (never over tokens). Padding positions carry ``beta = g = 0`` and zero
``q, k, v``: they leave the state as it was.

**Recurrent form** (decode): the definition, one token per sequence, batched.

State per layer and sequence (float32, as transformers keeps it): the conv state of the
``[q | k | v]`` channels and ``S`` per value head (see :mod:`backends.runtime.state_pool`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..config import DeltaNetConfig
from ..kernels import KernelSettings, Linear
from ..weights import WeightReader
from .batch import RecurrentBatch, project
from .conv1d import causal_conv1d

CHUNK = 64  # tokens per chunk of the chunked form (transformers' and flash-linear-attention's)


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def chunk_gated_delta_rule(q, k, v, g, beta, state, chunk: int = CHUNK):
    """q, k: [B, H, L, dk]; v: [B, H, L, dv]; g, beta: [B, H, L]; state: [B, H, dk, dv]; all
    float32, L a multiple of ``chunk``. -> (o [B, H, L, dv], final state [B, H, dk, dv])."""
    B, H, L, dk = k.shape
    dv, n = v.shape[-1], L // chunk
    q, k, v = (t.reshape(B, H, n, chunk, -1) for t in (q, k, v))  # [B, H, n, C, d]
    g = g.reshape(B, H, n, chunk).cumsum(-1)  # G: cumulative log decay inside each chunk
    beta = beta.reshape(B, H, n, chunk, 1)
    causal = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()
    decay = (g[..., :, None] - g[..., None, :]).masked_fill(~causal, float("-inf")).exp()
    kb = k * beta
    lower = (kb @ k.transpose(-1, -2)) * decay  # [B, H, n, C, C]; its diagonal is not read
    rhs = torch.cat([v * beta, kb * g.exp()[..., None]], dim=-1)
    solved = torch.linalg.solve_triangular(lower, rhs, upper=False, unitriangular=True)
    u0, w = (t.contiguous() for t in solved.split([dv, dk], dim=-1))  # [B, H, n, C, dv | dk]
    scores = (q @ k.transpose(-1, -2)) * decay  # [B, H, n, C, C]
    q_in = q * g.exp()[..., None]  # reads the chunk's initial state
    k_out = k * (g[..., -1:] - g).exp()[..., None]  # writes into its final state
    chunk_decay = g[..., -1].exp()[..., None, None]  # [B, H, n, 1, 1]
    out = torch.empty_like(v)
    for c in range(n):
        u = u0[:, :, c] - w[:, :, c] @ state  # [B, H, C, dv]
        out[:, :, c] = q_in[:, :, c] @ state + scores[:, :, c] @ u
        state = state * chunk_decay[:, :, c] + k_out[:, :, c].transpose(-1, -2) @ u
    return out.reshape(B, H, L, dv), state


def gated_delta_step(q, k, v, g, beta, state):
    """One token per sequence. q, k: [B, H, dk]; v: [B, H, dv]; g, beta: [B, H]; state:
    [B, H, dk, dv] (float32). -> (o [B, H, dv], new state)."""
    state = state * g.exp()[..., None, None]
    recalled = (k[:, :, None, :] @ state)[:, :, 0]  # S'^T k: [B, H, dv]
    delta = (v - recalled) * beta[..., None]
    state = state + k[..., :, None] * delta[..., None, :]
    return (q[:, :, None, :] @ state)[:, :, 0], state


class GatedDeltaNet:
    """The mixer of one linear-attention layer: in projection, causal conv1d (SiLU), the gated
    delta rule, gated RMSNorm, out projection ``o``. The checkpoint packs the input projection
    as Qwen3-Next does (``in_proj_qkvz`` and ``in_proj_ba`` interleaved per key head) or as
    Qwen3.5 does (``in_proj_qkv``, ``in_proj_z``, ``in_proj_b``, ``in_proj_a``); either is
    repacked at load into one ``[q | k | v | z | b | a]`` matmul.

    Called as an attention layer is (``DecoderLayer``), with ``meta.recurrent`` for the state;
    ``layer``: its index among the model's recurrent layers (its slab of the state pool)."""

    def __init__(
        self,
        cfg: DeltaNetConfig,
        w: WeightReader,
        prefix: str,
        kernels: KernelSettings,
        eps: float,
        layer: int,
    ):
        self.cfg, self.eps, self.layer = cfg, eps, layer
        grouped = w.has(f"{prefix}.in_proj_qkvz.weight")
        rows = _grouped_rows(cfg, w, prefix) if grouped else _split_rows(w, prefix)
        self.in_proj = Linear(torch.cat(rows), None, kernels)  # [conv_dim + Vd + 2 Hv, hidden]
        self.conv_w = w.get(f"{prefix}.conv1d.weight")[:, 0, :]  # [C, K]
        self.conv_b = w.opt(f"{prefix}.conv1d.bias")
        self.A = w.get(f"{prefix}.A_log").float().exp()  # [Hv]: the decay rate
        self.dt_bias = w.get(f"{prefix}.dt_bias")  # [Hv]
        self.norm_w = w.get(f"{prefix}.norm.weight")  # [dv]
        self.o = Linear(w.get(f"{prefix}.out_proj.weight"), None, kernels)

    def __call__(self, x: torch.Tensor, meta, kv=None, residual=None, rows=None) -> torch.Tensor:
        """x: [T, hidden] -> [T, hidden] (+ ``residual``; only ``rows`` [R] if given, though
        every token goes into the delta rule). The state comes from and goes back to each
        sequence's slot (``meta.recurrent``); ``kv`` is unused."""
        rb: RecurrentBatch = meta.recurrent
        c, B, T = self.cfg, rb.num_seqs, x.shape[0]
        Hk, Hv, dk, dv = c.num_k_heads, c.num_v_heads, c.k_head_dim, c.v_head_dim
        qkv, z, b, a = self.in_proj(x).split([c.conv_dim, Hv * dv, Hv, Hv], dim=-1)
        conv_state, state = rb.read(self.layer, c.conv_dim, c.conv_kernel - 1)  # float32
        state = state.view(B, Hv, dk, dv)
        qkv, conv_state = causal_conv1d(qkv, self.conv_w, self.conv_b, conv_state, rb)
        q, k, v = F.silu(qkv).split([Hk * dk, Hk * dk, Hv * dv], dim=-1)
        q = l2norm(q.reshape(T, Hk, dk).float()) * dk**-0.5  # [T, Hk, dk]
        k = l2norm(k.reshape(T, Hk, dk).float())
        if Hv != Hk:  # each key head serves Hv / Hk consecutive value heads
            q, k = (t.repeat_interleave(Hv // Hk, dim=1) for t in (q, k))  # [T, Hv, dk]
        v = v.reshape(T, Hv, dv).float()
        beta = b.sigmoid().float()  # [T, Hv]
        g = -self.A * F.softplus(a.float() + self.dt_bias)  # [T, Hv] log decay
        if rb.decode:  # T == B, one token per sequence in order
            o, state = gated_delta_step(q, k, v, g, beta, state)  # o: [B, Hv, dv]
        else:
            Lp = rb.padded_len(CHUNK)
            grid = [rb.to_grid(t, Lp).transpose(1, 2) for t in (q, k, v, g, beta)]  # [B, H, Lp..]
            o, state = chunk_gated_delta_rule(*grid, state)
            o = rb.from_grid(o.transpose(1, 2))  # [T, Hv, dv]
        rb.write(self.layer, conv_state, state)
        o = self._gated_norm(o.to(x.dtype), z.view(T, Hv, dv)).reshape(T, Hv * dv)
        return project(self.o, o, residual, rows)

    def _gated_norm(self, o: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """RMSNorm of each head's output (statistics in float32), times SiLU(z): [T, Hv, dv]."""
        of = o.float()
        of = of * torch.rsqrt(of.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.norm_w * of.to(o.dtype) * F.silu(z.float())).to(o.dtype)


def _grouped_rows(cfg: DeltaNetConfig, w: WeightReader, prefix: str) -> list[torch.Tensor]:
    """Qwen3-Next's projections, per key head ``[q (dk) | k (dk) | v (r dv) | z (r dv)]`` and
    ``[b (r) | a (r)]`` (r = Hv / Hk), regrouped to whole ``q, k, v, z, b, a`` blocks."""
    Hk, dk, dv = cfg.num_k_heads, cfg.k_head_dim, cfg.v_head_dim
    r = cfg.num_v_heads // Hk
    qkvz = w.get(f"{prefix}.in_proj_qkvz.weight")
    hidden = qkvz.shape[-1]
    per_head = qkvz.view(Hk, 2 * dk + 2 * r * dv, hidden).split([dk, dk, r * dv, r * dv], dim=1)
    ba = w.get(f"{prefix}.in_proj_ba.weight").view(Hk, 2 * r, hidden).split([r, r], dim=1)
    return [t.reshape(-1, hidden) for t in (*per_head, *ba)]


def _split_rows(w: WeightReader, prefix: str) -> list[torch.Tensor]:
    """Qwen3.5's projections: already whole blocks."""
    return [w.get(f"{prefix}.in_proj_{n}.weight") for n in ("qkv", "z", "b", "a")]
