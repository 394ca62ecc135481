"""One request's state inside the engine: tokens, pages, sampling RNG, lifecycle."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import IntEnum

import torch

from .detok import TextState
from .sampling_params import SamplingParams, TokenLogprob
from .window import WindowTable


class SeqStatus(IntEnum):
    WAITING = 0  # queued; holds pages only if its prompt KV was prefilled elsewhere
    RUNNING = 1  # holds all pages it will need; decodes one token per step
    FINISHED = 2  # pages returned to the pool


class FinishReason:
    STOP = "stop"  # an EOS token, one of stop_token_ids, or a stop string
    LENGTH = "length"  # reached max_tokens
    ABORT = "abort"
    ERROR = "error"  # this sequence failed (the step's other sequences go on)


@dataclass
class Sequence:
    seq_id: str
    prompt_ids: list[int]
    params: SamplingParams
    output_ids: list[int] = field(default_factory=list)
    pages: list[int] = field(default_factory=list)
    status: SeqStatus = SeqStatus.WAITING
    finish_reason: str | None = None
    prefilled: bool = False  # prompt KV already in ``pages`` (disaggregated decode)
    num_cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache
    slot: int | None = None  # its state slot (a model with recurrent layers: pool.states)
    # its pages in the sliding-window entry (a model with one: pool.window), from admission
    # (or add_prefilled) to its end
    window: WindowTable | None = None
    generator: torch.Generator | None = None
    logprobs: list[TokenLogprob] = field(default_factory=list)  # per output token, if asked
    text: TextState | None = None  # incremental text + stop strings (engine with a tokenizer)
    # speculative decoding (backends.runtime.spec): the draft model's pages and KV progress
    draft_pages: list[int] = field(default_factory=list)
    draft_len: int = 0  # positions [0, draft_len) hold valid draft KV
    # EAGLE head: the target's features of positions [draft_len, draft_len + len) not yet fed
    # to the head (None: this sequence has no head state and does not draft)
    draft_feats: torch.Tensor | None = None
    num_proposed: int = 0  # draft tokens proposed / accepted, target verify steps
    num_accepted: int = 0
    num_verify_steps: int = 0

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def max_kv_tokens(self) -> int:
        """KV slots the sequence can ever need (the last sampled token is never fed back)."""
        return len(self.prompt_ids) + self.params.max_tokens - 1

    @property
    def finished(self) -> bool:
        return self.status == SeqStatus.FINISHED

    def append(self, token: int, eos_ids: tuple[int, ...]) -> bool:
        """Add a sampled token; returns True when the sequence is now done.

        Finish order: EOS (unless ignore_eos), ``stop_token_ids`` (even with ignore_eos), a stop
        string in the text (only then does ``text`` see the token: as in vLLM, a stop token's
        text is not shown), ``max_tokens``."""
        self.output_ids.append(token)
        p = self.params
        if (not p.ignore_eos and token in eos_ids) or token in p.stop_token_ids:
            self.finish_reason = FinishReason.STOP
        elif self.text is not None and self.text.update(self.output_ids):
            self.finish_reason = FinishReason.STOP
        elif len(self.output_ids) >= p.max_tokens:
            self.finish_reason = FinishReason.LENGTH
        return self.finish_reason is not None
