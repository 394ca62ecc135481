"""What a request asks of sampling (validated once, where the preprocess stage or a caller of
the engine builds it), the context-limit rule, and what a logprob answer carries. Torch-free:
the text stages import it without torch. The selection from logits is
:mod:`backends.runtime.sampler`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


def check_context(prompt_tokens: int, max_tokens: int, max_context: int) -> None:
    """The context-limit rule, checked here only: ``prompt + max_tokens <= max_context``, so an
    admitted request always runs to completion. ValueError otherwise."""
    total = prompt_tokens + max_tokens
    if total > max_context:
        raise ValueError(
            f"prompt ({prompt_tokens} tokens) + max_tokens ({max_tokens}) = {total}"
            f" exceeds the context limit of {max_context} tokens"
        )


MAX_STOP_STRINGS, MAX_STOP_CHARS, MAX_STOP_TOKEN_IDS, MAX_LOGPROBS = 16, 256, 64, 20


def _number(name: str, v, lo: float, hi: float, lo_open: bool = False) -> None:
    ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
    if not ok or not (lo < v if lo_open else lo <= v) or v > hi:
        interval = f"({lo}, {hi}]" if lo_open else f"[{lo}, {hi}]"
        raise ValueError(f"{name} must be a number in {interval}, got {v!r}")


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = no top-k filter
    seed: int | None = None
    max_tokens: int = 16
    ignore_eos: bool = False
    presence_penalty: float = 0.0  # [-2, 2]: minus this once for every token in the output
    frequency_penalty: float = 0.0  # [-2, 2]: minus count_in_output * this
    repetition_penalty: float = 1.0  # (0, 10]: tokens of prompt or output, 1 = off
    stop: tuple[str, ...] = ()  # stop strings (never part of the returned text)
    stop_token_ids: tuple[int, ...] = ()  # finish on these ids (even with ignore_eos)
    logprobs: int | None = None  # None = off; N = the chosen token's logprob + top-N

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
        _number("presence_penalty", self.presence_penalty, -2.0, 2.0)
        _number("frequency_penalty", self.frequency_penalty, -2.0, 2.0)
        _number("repetition_penalty", self.repetition_penalty, 0.0, 10.0, lo_open=True)
        self._check_stops()
        n = self.logprobs
        if n is not None and (
            not isinstance(n, int) or isinstance(n, bool) or not 0 <= n <= MAX_LOGPROBS
        ):
            raise ValueError(
                f"logprobs must be None or an integer in [0, {MAX_LOGPROBS}], got {n!r}"
            )

    def _check_stops(self) -> None:
        for name in ("stop", "stop_token_ids"):  # callers pass lists: store tuples
            v = getattr(self, name)
            if isinstance(v, (str, int)) or not isinstance(v, (list, tuple)):
                raise ValueError(f"{name} must be a list, got {type(v).__name__}")
            object.__setattr__(self, name, tuple(v))
        if len(self.stop) > MAX_STOP_STRINGS:
            raise ValueError(f"stop takes at most {MAX_STOP_STRINGS} strings, got {len(self.stop)}")
        for s in self.stop:
            if not isinstance(s, str) or not 0 < len(s) <= MAX_STOP_CHARS:
                raise ValueError(
                    f"stop strings must be non-empty strings of at most {MAX_STOP_CHARS} "
                    f"characters, got {s!r:.80}"
                )
        ids = self.stop_token_ids
        if len(ids) > MAX_STOP_TOKEN_IDS:
            raise ValueError(
                f"stop_token_ids takes at most {MAX_STOP_TOKEN_IDS} ids, got {len(ids)}"
            )
        if any(not isinstance(t, int) or isinstance(t, bool) or t < 0 for t in ids):
            raise ValueError(f"stop_token_ids must be integers >= 0, got {list(ids)[:8]}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def has_penalties(self) -> bool:
        return (
            self.presence_penalty != 0
            or self.frequency_penalty != 0
            or self.repetition_penalty != 1
        )


@dataclass(frozen=True)
class TokenLogprob:
    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # top-N (token id, logprob), best first
    rank: int = 1  # 1 + how many tokens are more likely than the chosen one
