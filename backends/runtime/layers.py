"""Building blocks of the decoder layers: RMSNorm (and its float32-weight form), gated MLP (SiLU
or GeGLU), stacked gated-SiLU experts with the dispatch every MoE shares, DeepSeek's mixture of
experts, and the pre-norm residual block most families' layers are."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .config import ModelConfig
from .kernels import KernelSettings, Linear, fused_ops
from .weights import WeightReader


class RMSNorm:
    def __init__(self, weight: torch.Tensor, eps: float, kernels: KernelSettings | None = None):
        self.weight, self.eps = weight, eps
        self.fused = fused_ops(weight, kernels)  # the C++ ops, or None: torch's

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        # x: [T, D]; statistics in float32 as the reference implementations do
        if self.fused is not None and x.dim() == 2:
            return self.fused.rms_norm(x, self.weight, self.eps)
        if x.dtype == torch.float32:  # one torch op, bitwise equal to the lines below
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)

    def add(self, x: torch.Tensor, delta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Residual add, then the norm: -> (x + delta, norm(x + delta)); x, delta: [T, D]."""
        if self.fused is not None:
            return self.fused.add_rms_norm(x, delta, self.weight, self.eps)
        s = x + delta
        return s, self(s)


class Float32RMSNorm:
    """RMSNorm that multiplies by its weight in float32 and rounds once to the input's dtype:
    ``(normalised(x.float()) * (w + offset)).to(x.dtype)`` (gpt-oss's norms; Gemma's with
    ``offset`` 1). :class:`RMSNorm` rounds the normalised x before the weight (Llama's), so in
    bfloat16 the two differ; in float32 they are one computation, and a float32 model (a float32
    ``weight``) runs the fused C++ op."""

    def __init__(
        self,
        weight: torch.Tensor,
        eps: float,
        kernels: KernelSettings | None,
        offset: float = 0.0,
    ):
        self.weight, self.eps = weight.float() + offset, eps
        f32 = weight.dtype == torch.float32
        self.plain = RMSNorm(self.weight, eps, kernels) if f32 else None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        # x: [..., D]
        if self.plain is not None:
            return self.plain(x)
        return F.rms_norm(x.float(), self.weight.shape, self.weight, self.eps).to(x.dtype)

    def add(self, x: torch.Tensor, delta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.plain is not None:
            return self.plain.add(x, delta)
        s = x + delta
        return s, self(s)


# bfloat16 / float16: the C++ silu_mul below this many rows (a decode step: no temporaries,
# 1.6x torch's two ops at one row), torch's vectorised ops from it on (2.2-2.6x faster at
# 128-4,096 rows on the CI machine). float32 keeps the C++ op at every size: torch's two ops
# made float32 prefill 1-3 % slower (bench_vs_vllm.py, both methods)
HALF_FUSED_MAX_ROWS = 8

# the gated MLP's activations, by their transformers names
GATE_ACTIVATIONS = {
    "silu": F.silu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),  # GeGLU (Gemma)
}


class MLP:
    """down(act(gate(x)) * up(x)): gate and up as one matmul, or (SiLU) on oneDNN-packed
    bfloat16 weights two whose epilogues apply the SiLU and the product (``Linear.gated``)."""

    def __init__(self, w: WeightReader, prefix: str, kernels: KernelSettings, act: str = "silu"):
        gate, up = (w.get(f"{prefix}.{n}_proj.weight") for n in ("gate", "up"))
        gate_b, up_b = (w.opt(f"{prefix}.{n}_proj.bias") for n in ("gate", "up"))
        bias = torch.cat([gate_b, up_b]) if gate_b is not None and up_b is not None else None
        self.inter = gate.shape[0]
        self.gate_up = Linear(torch.cat([gate, up]), bias, kernels)  # [2I, D]
        self.act_fn = GATE_ACTIVATIONS[act]
        silu = act == "silu"
        # many rows: the SiLU and the product in the two GEMMs' epilogues (oneDNN)
        self.gated = silu and self.gate_up.gated(gate, up, (gate_b, up_b), kernels)
        self.down = Linear(
            w.get(f"{prefix}.down_proj.weight"), w.opt(f"{prefix}.down_proj.bias"), kernels
        )
        self.fused = fused_ops(gate, kernels) if silu else None

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        # x: [T, D] -> [T, D]; residual: [T, D] added to it (by the down GEMM), or None
        h = self.act(x)
        return self.down(h) if residual is None else self.down.add(h, residual)

    def act(self, x: torch.Tensor) -> torch.Tensor:
        """act(gate(x)) * up(x): [T, D] -> [T, I]."""
        if self.gated and len(x) > self.gate_up.small_rows and x.dtype == self.gate_up.weight.dtype:
            return self.gate_up.silu_mul(x)
        gate_up = self.gate_up(x)  # [T, 2I]
        if self.fused is not None and (x.dtype == torch.float32 or len(x) < HALF_FUSED_MAX_ROWS):
            return self.fused.silu_mul(gate_up.contiguous())
        gate, up = gate_up.split(self.inter, dim=-1)  # [T, I] each
        return self.act_fn(gate) * up


def dispatch_experts(
    x: torch.Tensor, weights, idx, num_experts: int, expert, residual=None
) -> torch.Tensor:
    """Mixture of experts over routed tokens: out[t] = sum_k weights[t, k] * expert(idx[t, k],
    x[t]). x: [T, D]; weights, idx: [T, k]; ``expert(e, xe [n, D]) -> [n, D]``. Tokens are
    sorted by expert once and each expert hit runs on all its tokens (a loop over experts, never
    over tokens); the weighted outputs are summed in x's dtype. -> [T, D], plus ``residual``
    [T, D] if given."""
    out = torch.zeros_like(x)
    flat_idx = idx.reshape(-1)  # [T * k]
    order = torch.argsort(flat_idx, stable=True)
    counts = torch.bincount(flat_idx, minlength=num_experts).tolist()
    token_of = order // idx.shape[1]  # token of each sorted assignment
    flat_w = weights.reshape(-1)
    start = 0
    for e, n in enumerate(counts):
        if n == 0:
            continue
        sel = order[start : start + n]
        tok = token_of[start : start + n]
        start += n
        ye = expert(e, x[tok]) * flat_w[sel, None]  # [n, D]
        out.index_add_(0, tok, ye.to(x.dtype))
    return out if residual is None else residual + out


class Experts:
    """E stacked gated-SiLU experts (DeepSeek, Qwen3-MoE): ``experts(e, xe)`` runs expert e."""

    def __init__(self, w: WeightReader, prefix: str, num_experts: int):
        """prefix: the experts' (``...mlp.experts``): transformers 5's fused tensors
        (``gate_up_proj`` [E, 2I, D], ``down_proj`` [E, D, I]) or one set per expert."""
        if w.has(f"{prefix}.gate_up_proj"):
            self.w_gate, self.w_up = w.get(f"{prefix}.gate_up_proj").chunk(2, dim=1)  # [E, I, D]
            self.w_down = w.get(f"{prefix}.down_proj")  # [E, D, I]
        else:
            E = num_experts
            self.w_gate = torch.stack([w.get(f"{prefix}.{e}.gate_proj.weight") for e in range(E)])
            self.w_up = torch.stack([w.get(f"{prefix}.{e}.up_proj.weight") for e in range(E)])
            self.w_down = torch.stack([w.get(f"{prefix}.{e}.down_proj.weight") for e in range(E)])

    def __call__(self, e: int, xe: torch.Tensor) -> torch.Tensor:
        """Expert e on its tokens: xe [n, D] -> [n, D]."""
        h = F.silu(F.linear(xe, self.w_gate[e])) * F.linear(xe, self.w_up[e])
        return F.linear(h, self.w_down[e])


class RoutedMoE:
    """A mixture of experts from its two parts: ``route(x [T, D]) -> (weights [T, k], ids
    [T, k])`` and ``experts(e, xe [n, D]) -> [n, D]`` (Qwen3-MoE, gpt-oss)."""

    def __init__(self, route, experts, num_experts: int):
        self.route, self.experts, self.num_experts = route, experts, num_experts

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        # x: [T, D] -> [T, D]; residual: [T, D] added to it, or None
        weights, idx = self.route(x)
        return dispatch_experts(x, weights, idx, self.num_experts, self.experts, residual)


class MoE:
    """DeepSeek MoE: routed experts (top-k of a gate) plus always-on shared experts.

    Routing: V2 scores with softmax (``greedy`` or ``group_limited_greedy``); V3 scores with a
    sigmoid, picks groups and experts on ``score + e_score_correction_bias`` but weights by the
    raw score, optionally normalised; both scale by ``routed_scaling_factor``.
    """

    def __init__(self, cfg: ModelConfig, w: WeightReader, prefix: str, kernels: KernelSettings):
        self.cfg = cfg
        self.gate_w = w.get(f"{prefix}.gate.weight")  # [E, D]
        self.bias = w.opt(f"{prefix}.gate.e_score_correction_bias")  # [E]
        self.experts = Experts(w, f"{prefix}.experts", cfg.n_routed_experts)
        self.shared = MLP(w, f"{prefix}.shared_experts", kernels) if cfg.n_shared_experts else None

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x: [T, D] -> (weights [T, k] float32, expert ids [T, k])."""
        cfg, E, k = self.cfg, self.cfg.n_routed_experts, self.cfg.num_experts_per_tok
        logits = F.linear(x.float(), self.gate_w.float())  # [T, E]
        if cfg.scoring == "sigmoid":
            scores = logits.sigmoid()
            choice = scores + (self.bias.float() if self.bias is not None else 0.0)
            grouped = choice.view(-1, cfg.n_group, E // cfg.n_group)
            group_scores = grouped.topk(2, dim=-1)[0].sum(-1)  # [T, G]
            choice = self._mask_groups(choice, group_scores, float("-inf"))
            idx = torch.topk(choice, k=k, dim=-1, sorted=False)[1]
            weights = scores.gather(1, idx)
            if cfg.norm_topk_prob:
                weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
            return weights * cfg.routed_scaling_factor, idx
        scores = logits.softmax(-1, dtype=torch.float32)
        if cfg.topk_method == "group_limited_greedy":
            group_scores = scores.view(-1, cfg.n_group, E // cfg.n_group).max(-1).values
            scores = self._mask_groups(scores, group_scores, 0.0)
        weights, idx = torch.topk(scores, k=k, dim=-1, sorted=False)
        if k > 1 and cfg.norm_topk_prob:  # original DeepSeek-V2: normalise instead of scaling
            return weights / (weights.sum(-1, keepdim=True) + 1e-20), idx
        return weights * cfg.routed_scaling_factor, idx

    def _mask_groups(self, scores: torch.Tensor, group_scores: torch.Tensor, fill: float):
        cfg = self.cfg
        top_groups = torch.topk(group_scores, k=cfg.topk_group, dim=-1, sorted=False)[1]
        keep = torch.zeros_like(group_scores).scatter_(1, top_groups, 1).bool()  # [T, G]
        keep = keep[:, :, None].expand(-1, -1, cfg.n_routed_experts // cfg.n_group)
        return scores.masked_fill(~keep.reshape(scores.shape), fill)

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        # x: [T, D] -> [T, D]; residual: [T, D] added to it, or None
        weights, idx = self.route(x)  # [T, k] (float32 weights: the sum in float32)
        out = dispatch_experts(x, weights, idx, self.cfg.n_routed_experts, self.experts)
        if self.shared is not None:
            out = out + self.shared(x)
        return out if residual is None else residual + out


class DecoderLayer:
    """The pre-norm residual block: ``h += attn(input_norm(h))``, then
    ``h += mlp(post_norm(h))`` (Llama, Mistral, Qwen2/3, DeepSeek, gpt-oss; the families give its
    blocks). ``attn(x, meta, kv, residual=, rows=)``; ``mlp(x, residual=)``; the norms have
    ``add`` (residual add + norm)."""

    def __init__(self, attn, mlp, input_norm, post_norm):
        self.attn, self.mlp = attn, mlp
        self.input_norm, self.post_norm = input_norm, post_norm

    def __call__(self, h: torch.Tensor, meta, kv: torch.Tensor, rows=None):
        """h: [T, hidden] -> [T, hidden]; with ``rows`` ([R] indices) only those rows' outputs,
        [R, hidden]: the o projection and the MLP run on them alone (every row's KV is
        written)."""
        x = self.input_norm(h)
        if self.attn.o.fuses_add(x):  # the residual adds in the o and down GEMMs' epilogues
            h = self.attn(x, meta, kv, residual=h, rows=rows)
            x = self.post_norm(h)
        else:
            out = self.attn(x, meta, kv, rows=rows)
            h, x = self.post_norm.add(h if rows is None else h[rows], out)
        return self.mlp(x, residual=h)
