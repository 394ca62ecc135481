"""Rotary position embeddings: inverse frequencies for each scaling type, and the rotation.

The cos/sin tables are computed once per model up to ``max_position_embeddings`` (float32) and
indexed by absolute position, so a token's rotation never depends on what else is in the batch.
"""

from __future__ import annotations

import math

import torch

from .config import RopeConfig, yarn_mscale


def inv_freq_and_scale(rope: RopeConfig) -> tuple[torch.Tensor, float]:
    """Returns (inv_freq [dim/2] float32, attention factor that multiplies cos and sin)."""
    dim = rope.dim
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float32) / dim
    inv_freq = 1.0 / (rope.theta**exponents)
    if rope.type == "default":
        return inv_freq, 1.0
    if rope.type == "linear":
        return inv_freq / rope.factor, 1.0
    if rope.type == "llama3":
        return _llama3(inv_freq, rope), 1.0
    if rope.type == "yarn":
        return _yarn(rope)
    raise ValueError(f"unknown rope type {rope.type!r}")


def _llama3(inv_freq: torch.Tensor, rope: RopeConfig) -> torch.Tensor:
    old_len = rope.original_max_position_embeddings
    low_wavelen = old_len / rope.low_freq_factor
    high_wavelen = old_len / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (old_len / wavelen - rope.low_freq_factor) / (
        rope.high_freq_factor - rope.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def _yarn(rope: RopeConfig) -> tuple[torch.Tensor, float]:
    dim, base, factor = rope.dim, rope.theta, rope.factor
    if rope.attention_factor is not None:
        attn_factor = float(rope.attention_factor)
    elif rope.mscale and rope.mscale_all_dim:
        attn_factor = yarn_mscale(factor, rope.mscale) / yarn_mscale(factor, rope.mscale_all_dim)
    else:
        attn_factor = yarn_mscale(factor)

    def correction_dim(rotations: float) -> float:
        orig = rope.original_max_position_embeddings
        return (dim * math.log(orig / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).to(torch.float32) / dim)
    extrapolation = 1.0 / pos_freqs
    interpolation = 1.0 / (factor * pos_freqs)
    keep = 1 - ramp  # share of the extrapolated (unscaled) frequency
    return interpolation * (1 - keep) + extrapolation * keep, attn_factor


class RotaryEmbedding:
    """Precomputed cos/sin tables; ``apply`` rotates q or k at given absolute positions."""

    def __init__(self, rope: RopeConfig, max_positions: int, device, dtype: torch.dtype):
        self.style = rope.style
        inv_freq, scale = inv_freq_and_scale(rope)
        pos = torch.arange(max_positions, dtype=torch.float32)
        freqs = pos[:, None] * inv_freq[None, :]  # [P, dim/2]
        # cos, sin: [P, dim/2], cast to the model dtype as transformers does
        self.cos = (freqs.cos() * scale).to(device=device, dtype=dtype)
        self.sin = (freqs.sin() * scale).to(device=device, dtype=dtype)
        if self.style == "complex":  # DeepSeek-V2 rotates in float32 complex arithmetic
            self.cos32 = (freqs.cos() * scale).to(device)
            self.sin32 = (freqs.sin() * scale).to(device)
        self.max_positions = max_positions
        self._rows: tuple | None = None  # (positions, cos, sin) of the latest forward

    def tables(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The whole cos and sin tables, [max_positions, dim/2] each."""
        return (self.cos32, self.sin32) if self.style == "complex" else (self.cos, self.sin)

    def rows(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin at ``positions``: [T, 1, dim/2]. Looked up once per forward: every layer
        passes the same ``positions`` tensor (the batch metadata's). Keyed by that tensor's
        identity, so a caller that rewrites a positions tensor in place between forwards (CUDA
        graphs' static buffers) passes a new view of it each forward."""
        rows = self._rows
        if rows is None or rows[0] is not positions:
            cos, sin = self.tables()
            rows = (positions, cos[positions][:, None, :], sin[positions][:, None, :])
            self._rows = rows  # one tuple assignment: safe for threads sharing the model
        return rows[1], rows[2]

    def apply(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x: [T, H, dim]; positions: [T] (checked < max_positions by the caller)."""
        cos, sin = self.rows(positions)  # [T, 1, dim/2]
        if self.style == "complex":
            xf = x.float()
            x1, x2 = xf[..., 0::2], xf[..., 1::2]
            out = torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)
            return out.flatten(-2).to(x.dtype)
        if self.style == "interleave":
            x1, x2 = x[..., 0::2], x[..., 1::2]
            return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
        half = x.shape[-1] // 2
        x1, x2 = x[..., :half], x[..., half:]
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
