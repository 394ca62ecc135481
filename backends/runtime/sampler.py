"""Sampling parameters (validated once) and token selection from logits.

Order of application (the same as vLLM), per row of ``[B, V]`` logits:

1. **penalties** (:func:`penalize`) on the raw model logits, from the row's history
   ``(prompt_ids, output_ids)``: repetition (a token seen in the prompt or the output has a
   positive logit divided by ``repetition_penalty``, a negative one multiplied), then frequency
   (``- count_in_output * frequency_penalty``) and presence (``- presence_penalty`` once for
   every token in the output);
2. **temperature** (greedy, temperature 0, is the argmax of the penalised logits);
3. **top-k**, 4. **top-p**, 5. the **draw** from the request's generator.

Logprobs (:func:`token_logprobs`) are ``log_softmax`` of the RAW logits in float32, before
penalties and temperature (vLLM's default "raw" mode).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

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

    def make_generator(self, device="cpu") -> torch.Generator | None:
        """A generator seeded from ``seed`` (None: sampling uses torch's global RNG)."""
        if self.seed is None or self.greedy:
            return None
        return torch.Generator(device=device).manual_seed(self.seed)


@dataclass(frozen=True)
class TokenLogprob:
    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # top-N (token id, logprob), best first
    rank: int = 1  # 1 + how many tokens are more likely than the chosen one


History = tuple[list[int], list[int]]  # (prompt_ids, output_ids) of one logits row


def _counts(ids: list[list[int]], vocab: int, device) -> torch.Tensor:
    """Per-row token counts ``[R, V]`` (int64) with ONE bincount over all rows."""
    flat = [r * vocab + t for r, row in enumerate(ids) for t in row]
    idx = torch.tensor(flat, dtype=torch.long, device=device)
    return torch.bincount(idx, minlength=len(ids) * vocab).view(len(ids), vocab)


def penalize(
    logits: torch.Tensor, params: list[SamplingParams], histories: list[History] | None
) -> torch.Tensor:
    """logits [B, V] -> the same logits with the repetition / frequency / presence penalties of
    each row's params applied from its history (see the module docstring). Rows without
    penalties come back bit for bit; ``logits`` itself is never modified (a new tensor is
    returned when any row has penalties)."""
    if histories is None:
        return logits
    rows = [i for i, p in enumerate(params) if p.has_penalties]
    if not rows:
        return logits
    if len(histories) != len(params):
        raise ValueError(f"{len(histories)} histories for {len(params)} logits rows")
    vocab, dev = logits.shape[-1], logits.device
    out = _counts([histories[i][1] for i in rows], vocab, dev)  # [R, V]
    seen = _counts([histories[i][0] for i in rows], vocab, dev) > 0
    seen |= out > 0

    def col(name: str) -> torch.Tensor:  # [R, 1]
        return torch.tensor([getattr(params[i], name) for i in rows], device=dev).view(-1, 1)

    sub = logits[rows].float()  # [R, V]
    rep = col("repetition_penalty")
    sub = torch.where(seen, torch.where(sub > 0, sub / rep, sub * rep), sub)
    sub = sub - col("frequency_penalty") * out - col("presence_penalty") * (out > 0)
    res = logits.clone()
    res[rows] = sub.to(logits.dtype)
    return res


def token_logprobs(
    logits: torch.Tensor, tokens: list[int | None], params: list[SamplingParams]
) -> list[TokenLogprob | None]:
    """logits [B, V] (raw) -> per row the chosen token's logprob and the top-``params.logprobs``
    alternatives; None where ``params.logprobs`` is None (or the row has no token). One
    log_softmax and one topk over the rows that ask."""
    res: list[TokenLogprob | None] = [None] * len(params)
    rows = [i for i, p in enumerate(params) if p.logprobs is not None and tokens[i] is not None]
    if not rows:
        return res
    lp = torch.log_softmax(logits[rows].float(), dim=-1)  # [R, V]
    chosen_ids = [tokens[i] for i in rows]
    idx = torch.tensor(chosen_ids, device=lp.device).view(-1, 1)
    chosen_t = lp.gather(1, idx)  # [R, 1]
    ranks = (lp > chosen_t).sum(-1).add(1).tolist()
    chosen = chosen_t.view(-1).tolist()
    n = max(params[i].logprobs for i in rows)
    top_v, top_i = lp.topk(n, dim=-1) if n else (lp[:, :0], lp[:, :0].long())
    top_v, top_i = top_v.tolist(), top_i.tolist()
    for r, i in enumerate(rows):
        k = params[i].logprobs
        top = tuple(zip(top_i[r][:k], top_v[r][:k], strict=True))
        res[i] = TokenLogprob(chosen_ids[r], chosen[r], top, ranks[r])
    return res


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
    histories: list[History] | None = None,
) -> list[int | None]:
    """logits: [B, V] float32 -> one token id per row.

    ``histories``: per row ``(prompt_ids, output_ids)`` for the penalties (None: none applied).
    A row whose sampling raises gets None, and with ``errors`` its message (row -> text), so
    one bad request never fails the others of its batch."""
    if logits.dim() != 2 or logits.shape[0] != len(params) or len(params) != len(generators):
        raise ValueError(
            f"logits [B, V] must match params and generators: {tuple(logits.shape)}, "
            f"{len(params)} params, {len(generators)} generators"
        )
    logits = penalize(logits, params, histories)
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
