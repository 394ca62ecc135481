"""Sampling parameters (validated once) and token selection from logits."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = no top-k filter
    seed: int | None = None
    max_tokens: int = 16
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        t = self.temperature
        if not isinstance(t, (int, float)) or isinstance(t, bool) or not math.isfinite(t) or t < 0:
            raise ValueError(f"temperature must be a finite number >= 0, got {t!r}")
        p = self.top_p
        if not isinstance(p, (int, float)) or isinstance(p, bool) or not 0 < p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {p!r}")
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0 disables it), got {self.top_k!r}")
        if self.seed is not None and (not isinstance(self.seed, int) or self.seed < 0):
            raise ValueError(f"seed must be None or an integer >= 0, got {self.seed!r}")
        m = self.max_tokens
        if not isinstance(m, int) or isinstance(m, bool) or m <= 0:
            raise ValueError(f"max_tokens must be an integer >= 1, got {m!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def make_generator(self, device="cpu") -> torch.Generator | None:
        """A generator seeded from ``seed`` (None: sampling uses torch's global RNG)."""
        if self.seed is None or self.greedy:
            return None
        return torch.Generator(device=device).manual_seed(self.seed)


def scaled(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """logits / temperature, safe at any temperature > 0: the row maximum is subtracted first,
    so a tiny temperature gives 0 for the best token and -inf (not inf - inf = nan) for the
    others, i.e. the greedy limit, and a huge one gives the uniform limit."""
    row = logits.float()
    return (row - row.max(dim=-1, keepdim=True).values) / temperature


def _filter(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """logits: [V] -> logits with tokens outside top-k / nucleus set to -inf."""
    if top_k > 0 and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        drop = cum - sorted_logits.softmax(-1) >= top_p  # keep the token that crosses top_p
        mask = torch.zeros_like(drop).scatter(0, order, drop)  # back to vocab order
        logits = logits.masked_fill(mask, float("-inf"))
    return logits


def sample(
    logits: torch.Tensor,
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
    errors: dict[int, str] | None = None,
) -> list[int | None]:
    """logits: [B, V] float32 -> one token id per row.

    A row whose sampling raises gets None, and with ``errors`` its message (row -> text), so
    one bad request never fails the others of its batch."""
    if logits.dim() != 2 or logits.shape[0] != len(params) or len(params) != len(generators):
        raise ValueError(
            f"logits [B, V] must match params and generators: {tuple(logits.shape)}, "
            f"{len(params)} params, {len(generators)} generators"
        )
    out: list[int | None] = logits.argmax(-1).tolist()  # greedy for all, replaced where sampling
    for i, (p, g) in enumerate(zip(params, generators, strict=True)):
        if p.greedy:
            continue
        try:
            probs = _filter(scaled(logits[i], p.temperature), p.top_k, p.top_p).softmax(-1)
            out[i] = int(torch.multinomial(probs, 1, generator=g))
        except Exception as e:  # noqa: BLE001 - contained to this row, reported by the caller
            if errors is None:
                raise
            out[i], errors[i] = None, f"{type(e).__name__}: {e}"
    return out
