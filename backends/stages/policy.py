"""Layer-group policy: how many layer groups a prompt's KV is streamed in.

Short prompts go in one group (per-group overhead would dominate). From ``min_tokens`` on, the
number of groups falls linearly from ``max_groups`` to ``min_groups`` at
``sat_multiplier * min_tokens``: long prompts have big groups anyway, and fewer, larger groups
use the wire better, while the exposed last group stays a small share of the prompt's time.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LayerGroupPolicy:
    min_tokens: int = 256
    min_groups: int = 2
    max_groups: int = 8
    sat_multiplier: float = 16.0
    fixed_group_size: int | None = None
    enabled: bool = True

    def __post_init__(self) -> None:
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be >= 0, got {self.min_tokens}")
        if not 1 <= self.min_groups <= self.max_groups:
            raise ValueError(
                f"need 1 <= min_groups ({self.min_groups}) <= max_groups ({self.max_groups})"
            )
        if self.sat_multiplier < 1:
            raise ValueError(f"sat_multiplier must be >= 1, got {self.sat_multiplier}")
        if self.fixed_group_size is not None and self.fixed_group_size < 1:
            raise ValueError(f"fixed_group_size must be >= 1 or None, got {self.fixed_group_size}")

    def num_groups(self, num_tokens: int, num_layers: int) -> int:
        if not self.enabled or num_layers <= 1:
            return 1
        if self.fixed_group_size is not None:
            return -(-num_layers // self.fixed_group_size)
        if num_tokens < self.min_tokens:
            return 1
        hi = self.sat_multiplier * self.min_tokens
        if num_tokens >= hi or hi == self.min_tokens:
            g = self.min_groups
        else:
            frac = (num_tokens - self.min_tokens) / (hi - self.min_tokens)
            g = round(self.max_groups - frac * (self.max_groups - self.min_groups))
        return max(1, min(g, num_layers))

    def groups(self, num_tokens: int, num_layers: int) -> list[tuple[int, int]]:
        """Half-open layer ranges ``[(start, end), ...]`` covering ``0..num_layers``."""
        if num_layers < 1:
            raise ValueError(f"num_layers must be >= 1, got {num_layers}")
        if self.enabled and self.fixed_group_size is not None:
            size = self.fixed_group_size
            return [(a, min(a + size, num_layers)) for a in range(0, num_layers, size)]
        n = self.num_groups(num_tokens, num_layers)
        size = max(1, num_layers // n)
        out = [(i * size, (i + 1) * size) for i in range(n - 1)]
        out.append(((n - 1) * size, num_layers))  # remainder layers join the last group
        return out
