"""Pre- and post-processing cores (no Triton): request validation, tokenization, text deltas.

:class:`Preprocessor` turns one request's raw fields into a :class:`TextRequest` (prompt ids,
sampling parameters, a random 63-bit bootstrap room) or raises ``ValueError`` naming the field.
:func:`text_delta` is stateless incremental detokenization: decode sends each new token batch
with a few earlier tokens, so any postprocess instance can turn it into the new text.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass

from .sampler import SamplingParams
from .stage_params import StageParams
from .tokenizer import Tokenizer


@dataclass
class TextRequest:
    prompt_ids: list[int]
    params: SamplingParams
    room: int
    stream: bool


def new_room() -> int:
    """A random 63-bit bootstrap room (fits INT64, never 0)."""
    return secrets.randbits(63) or 1


class Preprocessor:
    def __init__(self, params: StageParams, tokenizer: Tokenizer | None = None):
        self.params = params
        self.tok = tokenizer or Tokenizer(params.model_path)
        self.vocab = len(self.tok.hf)

    def build(
        self,
        text: str | None,
        max_tokens: int,
        *,
        input_ids: list[int] | None = None,
        temperature: float = 0.0,
        top_p: float = 1.0,
        top_k: int = 0,
        seed: int = -1,
        stream: bool = False,
        ignore_eos: bool = False,
        apply_chat_template: bool = False,
    ) -> TextRequest:
        p = self.params
        if input_ids:
            bad = [t for t in input_ids if not 0 <= t < self.vocab]
            if bad:
                raise ValueError(f"input_ids {bad[:4]} outside the vocabulary [0, {self.vocab})")
            ids = list(input_ids)
        else:
            if text is None or not text.strip():
                raise ValueError("text_input is empty: give a prompt (or input_ids)")
            ids = self.tok.encode(text, chat=apply_chat_template)
        if not 1 <= max_tokens <= p.max_tokens_limit:
            raise ValueError(f"max_tokens must be in [1, {p.max_tokens_limit}], got {max_tokens}")
        if len(ids) + max_tokens > p.max_context:
            raise ValueError(
                f"prompt ({len(ids)} tokens) + max_tokens ({max_tokens}) = "
                f"{len(ids) + max_tokens} exceeds the context limit of {p.max_context} tokens"
            )
        sp = SamplingParams(
            temperature=float(temperature),
            top_p=float(top_p),
            top_k=int(top_k),
            seed=None if seed < 0 else int(seed),
            max_tokens=int(max_tokens),
            ignore_eos=bool(ignore_eos),
        )
        return TextRequest(ids, sp, new_room(), bool(stream))


def _visible(tok: Tokenizer, ids: list[int]) -> str:
    """Text of ``ids`` without a trailing incomplete UTF-8 sequence (shown as U+FFFD)."""
    return tok.decode(ids).rstrip("\ufffd")


def text_delta(tok: Tokenizer, prefix_ids: list[int], new_ids: list[int]) -> str:
    """The text ``new_ids`` add after ``prefix_ids`` (held-back partial characters included
    once they complete; a window prefix is enough)."""
    if not new_ids:
        return ""
    before = _visible(tok, prefix_ids) if prefix_ids else ""
    after = _visible(tok, prefix_ids + new_ids)
    if after.startswith(before):
        return after[len(before) :]
    common = 0  # detokenization is not always prefix-stable (space clean-up): best effort
    for a, b in zip(before, after, strict=False):
        if a != b:
            break
        common += 1
    return after[common:]
