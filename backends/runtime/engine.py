"""Colocated LLM engine: continuous batching over one ModelRunner and one KVPool.

Each :meth:`LLMEngine.step`:

1. admits waiting sequences in FIFO order while the batch has room and the pool has the pages
   the sequence can ever need (``prompt + max_tokens - 1`` KV slots, reserved up front so a
   running sequence never runs out of pages). Normal requests are prefilled now, several in one
   forward (up to ``prefill_tokens`` prompt tokens a forward), and sample their first token; a
   sequence added with :meth:`add_prefilled` (prompt KV received from a prefill server) already
   has its first token. Either way that first token is reported by this step.
2. decodes every sequence that was already running, as ONE batched forward (one token each).

Every output token is reported by exactly one step. A sequence finishes on EOS (unless
``ignore_eos``), one of its ``stop_token_ids``, a stop string (engine with a tokenizer: every
sequence then has a :class:`~backends.runtime.detok.TextState`) or ``max_tokens``; its pages
are freed exactly once (also on :meth:`abort`). Sampling applies the request's penalties from
its (prompt, output) history; a request with ``logprobs`` gets one
:class:`~backends.runtime.sampler.TokenLogprob` per output token (``Sequence.logprobs``, and
``StepOutput.logprobs`` aligned with ``new_tokens``).
A sequence whose prefill, forward or sampling fails ends with ``FinishReason.ERROR`` and its
message in ``StepOutput.errors``; the other sequences of the step go on (a failed batched
forward is retried one sequence at a time to find the one that fails).

Context limit policy: a request is rejected (ValueError) unless
``len(prompt) + max_tokens <= max_context``, so an admitted sequence always runs to completion.

Not thread-safe: one thread drives the engine (the serving layer owns the loop).
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass, field

import torch

from .detok import TextState
from .kv_pool import KVPool
from .paged import SeqInput
from .runner import ModelRunner
from .sampler import SamplingParams, TokenLogprob, sample, token_logprobs
from .sequence import FinishReason, SeqStatus, Sequence, check_context

log = logging.getLogger(__name__)


@dataclass
class StepOutput:
    new_tokens: dict[str, list[int]] = field(default_factory=dict)  # seq_id -> tokens this step
    finished: list[Sequence] = field(default_factory=list)
    errors: dict[str, str] = field(default_factory=dict)  # seq_id -> why it failed this step
    # seq_id -> one per token of new_tokens[seq_id] (only sequences whose params.logprobs is set)
    logprobs: dict[str, list[TokenLogprob]] = field(default_factory=dict)


def histories(seqs: list[Sequence]) -> list[tuple[list[int], list[int]]] | None:
    """Per sequence (prompt_ids, output_ids) for the penalties; None when none has any."""
    if not any(s.params.has_penalties for s in seqs):
        return None
    return [(s.prompt_ids, s.output_ids) for s in seqs]


class LLMEngine:
    def __init__(
        self,
        runner: ModelRunner,
        pool: KVPool,
        max_batch: int = 16,
        max_context: int | None = None,
        prefill_tokens: int = 4096,
        tokenizer=None,
    ):
        if not isinstance(max_batch, int) or max_batch <= 0:
            raise ValueError(f"max_batch must be a positive integer, got {max_batch!r}")
        if not isinstance(prefill_tokens, int) or prefill_tokens <= 0:
            raise ValueError(f"prefill_tokens must be a positive integer, got {prefill_tokens!r}")
        limit = runner.config.max_position_embeddings
        max_context = limit if max_context is None else max_context
        if not isinstance(max_context, int) or not 0 < max_context <= limit:
            raise ValueError(
                f"max_context must be an integer in [1, {limit}] (max_position_embeddings), "
                f"got {max_context!r}"
            )
        self.runner, self.pool = runner, pool
        self.max_batch, self.max_context = max_batch, max_context
        self.prefill_tokens = prefill_tokens  # prompt tokens per batched prefill forward
        self.eos_ids = runner.config.eos_token_ids
        self.tokenizer = tokenizer  # backends.runtime.tokenizer.Tokenizer: text + stop strings
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.seqs: dict[str, Sequence] = {}

    # ---- requests ----------------------------------------------------------------------------
    def _validate(self, seq_id: str, prompt_ids: list[int], params: SamplingParams) -> None:
        if seq_id in self.seqs:
            raise ValueError(f"sequence id {seq_id!r} is already in the engine")
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be SamplingParams, got {type(params).__name__}")
        if params.max_tokens <= 0:
            raise ValueError(f"max_tokens must be >= 1, got {params.max_tokens}")
        if not prompt_ids:
            raise ValueError("prompt is empty: at least one token is required")
        vocab = self.runner.config.vocab_size
        if any(not isinstance(t, int) or not 0 <= t < vocab for t in prompt_ids):
            raise ValueError(f"prompt has token ids outside the vocabulary [0, {vocab})")
        if any(t >= vocab for t in params.stop_token_ids):
            raise ValueError(f"stop_token_ids has ids outside the vocabulary [0, {vocab})")
        if params.stop and self.tokenizer is None:
            raise ValueError("stop strings need the engine's tokenizer")
        check_context(len(prompt_ids), params.max_tokens, self.max_context)
        need = self.pool.pages_needed(len(prompt_ids) + params.max_tokens - 1)
        if need > self.pool.num_pages:
            raise ValueError(
                f"request needs {need} KV pages but the pool only has {self.pool.num_pages}"
            )

    def add_request(self, seq_id: str, prompt_ids: list[int], params: SamplingParams) -> Sequence:
        """Queue a request; the engine prefills it when admitted."""
        self._validate(seq_id, prompt_ids, params)
        seq = Sequence(seq_id, list(prompt_ids), params)
        seq.generator = params.make_generator(self.runner.device)
        seq.text = self._text_state(params)
        self.seqs[seq_id] = seq
        self.waiting.append(seq)
        return seq

    def add_prefilled(
        self,
        seq_id: str,
        prompt_ids: list[int],
        pages: list[int],
        first_token: int,
        params: SamplingParams,
        draft_pages: list[int] | None = None,
        first_logprob: TokenLogprob | None = None,
        text: TextState | None = None,
        draft_feature: torch.Tensor | None = None,
    ) -> Sequence:
        """Queue a sequence whose prompt KV is already in ``pages`` of this pool.

        The engine takes ownership of ``pages`` (allocated from this pool by the caller) and
        frees them when the sequence ends. ``first_token`` was sampled by the prefill side, and
        so was ``first_logprob`` (required when ``params.logprobs`` is set). ``text``: the
        sequence's TextState when the caller already fed it the first token (streamed early);
        by default a fresh one (engine with a tokenizer). ``draft_pages``: the prompt's draft
        KV, for an engine with a draft model (SpecEngine); with an EAGLE head also
        ``draft_feature``, the target's feature of the last prompt position [hidden].
        """
        self._validate(seq_id, prompt_ids, params)
        if params.logprobs is not None and first_logprob is None:
            raise ValueError("first_logprob is required when params.logprobs is set")
        self.pool.check_holds(len(prompt_ids), pages)
        self._check_draft_pages(len(prompt_ids), draft_pages)
        if not 0 <= first_token < self.runner.config.vocab_size:
            raise ValueError(f"first_token {first_token} outside the vocabulary")
        seq = Sequence(seq_id, list(prompt_ids), params, pages=list(pages), prefilled=True)
        seq.generator = params.make_generator(self.runner.device)
        seq.output_ids.append(first_token)
        if params.logprobs is not None:
            seq.logprobs.append(first_logprob)  # reported with the first token at admission
        seq.text = text if text is not None else self._text_state(params)
        self._adopt_draft_pages(seq, draft_pages, draft_feature)
        self.seqs[seq_id] = seq
        self.waiting.append(seq)
        return seq

    def _text_state(self, params: SamplingParams) -> TextState | None:
        return None if self.tokenizer is None else TextState(self.tokenizer, params.stop)

    def _check_draft_pages(self, prompt_tokens: int, draft_pages: list[int] | None) -> None:
        if draft_pages is not None:
            raise ValueError("this engine has no draft model: draft_pages must be None")

    def _adopt_draft_pages(self, seq: Sequence, draft_pages, feature=None) -> None:
        pass

    def abort(self, seq_id: str) -> Sequence | None:
        """Stop a sequence now and free its pages; None if it is unknown or already done."""
        seq = self.seqs.get(seq_id)
        if seq is None:
            return None
        if seq in self.waiting:
            self.waiting.remove(seq)
        if seq in self.running:
            self.running.remove(seq)
        seq.finish_reason = FinishReason.ABORT
        self._release(seq)
        return seq

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- scheduling --------------------------------------------------------------------------
    def _release(self, seq: Sequence) -> None:
        seq.status = SeqStatus.FINISHED
        self.seqs.pop(seq.seq_id, None)
        pages, seq.pages = seq.pages, []
        if pages:
            self.pool.free(pages)

    def _fail_seq(self, seq: Sequence, error: str, out: StepOutput) -> None:
        log.warning("sequence %s failed: %s", seq.seq_id, error)
        if seq in self.running:
            self.running.remove(seq)
        seq.finish_reason = FinishReason.ERROR
        self._release(seq)
        out.finished.append(seq)
        out.errors[seq.seq_id] = error

    def _emit(
        self, seq: Sequence, token: int, out: StepOutput, logprob: TokenLogprob | None = None
    ) -> None:
        done = seq.append(token, self.eos_ids)
        out.new_tokens.setdefault(seq.seq_id, []).append(token)
        if logprob is not None:
            seq.logprobs.append(logprob)
            out.logprobs.setdefault(seq.seq_id, []).append(logprob)
        if done:
            if seq in self.running:
                self.running.remove(seq)
            self._release(seq)
            out.finished.append(seq)

    # Hooks a speculative engine (backends.runtime.spec) overrides: reserve pages, prefill, decode.
    def _can_reserve(self, seq: Sequence) -> bool:
        return self.pool.pages_needed(seq.max_kv_tokens) - len(seq.pages) <= self.pool.num_free

    def _reserve(self, seq: Sequence) -> None:
        extra = self.pool.pages_needed(seq.max_kv_tokens) - len(seq.pages)
        if extra > 0:
            seq.pages += self.pool.alloc(extra)

    def _prefill_logits(self, seqs: list[Sequence]) -> torch.Tensor:
        """One forward over the prompts of ``seqs``; the last position's logits, ``[B, vocab]``."""
        inputs = [SeqInput(s.prompt_ids, 0, s.pages) for s in seqs]
        return torch.cat(self.runner.forward(self.pool, inputs, last_only=True))

    def _prefill(self, seqs: list[Sequence], out: StepOutput) -> None:
        """Prefill newly admitted (not prefilled) sequences in one forward and emit their first
        tokens."""
        self._sample_and_emit(seqs, self._prefill_logits(seqs), out)

    def _prefill_chunks(self, seqs: list[Sequence]) -> list[list[Sequence]]:
        """Split in FIFO order into forwards of at most ``prefill_tokens`` prompt tokens (a longer
        prompt gets a forward of its own)."""
        chunks: list[list[Sequence]] = []
        tokens = 0
        for seq in seqs:
            n = len(seq.prompt_ids)
            if not chunks or tokens + n > self.prefill_tokens:
                chunks.append([])
                tokens = 0
            chunks[-1].append(seq)
            tokens += n
        return chunks

    def _decode(self, decoding: list[Sequence], out: StepOutput) -> None:
        """Advance every already-running sequence (one token each here)."""
        logits = self.runner.decode(
            self.pool,
            [s.output_ids[-1] for s in decoding],
            [s.num_tokens - 1 for s in decoding],
            [s.pages for s in decoding],
        )  # [B, vocab]
        self._sample_and_emit(decoding, logits, out)

    def _sample_and_emit(self, seqs: list[Sequence], logits: torch.Tensor, out: StepOutput) -> None:
        """One token per sequence from its logits row; a sequence whose sampling fails ends with
        that error, the others go on."""
        errors: dict[int, str] = {}
        params = [s.params for s in seqs]
        hist = histories(seqs)
        tokens = sample(logits, params, [s.generator for s in seqs], errors, hist)
        lps = token_logprobs(logits, tokens, params)
        for i, (seq, token) in enumerate(zip(seqs, tokens, strict=True)):
            if token is None:
                self._fail_seq(seq, f"sampling failed: {errors[i]}", out)
            else:
                self._emit(seq, token, out, lps[i])

    def _isolated(self, run, what: str, seqs: list[Sequence], out: StepOutput) -> None:
        """``run(seqs, out)``; when the batch fails, run it again one sequence at a time (those
        still running) so only a sequence that fails alone ends with an error."""
        try:
            run(seqs, out)
        except Exception as e:
            if len(seqs) == 1:
                self._fail_seq(seqs[0], f"{what} failed: {type(e).__name__}: {e}", out)
                return
            log.warning("batched %s failed (%s); retrying sequence by sequence", what, e)
            for seq in seqs:
                if seq in self.running:
                    self._isolated(run, what, [seq], out)

    def _admit(self, out: StepOutput) -> None:
        fresh: list[Sequence] = []  # admitted now, prompt KV still to compute
        while self.waiting and len(self.running) < self.max_batch:
            seq = self.waiting[0]
            if not self._can_reserve(seq):
                break  # FIFO: later requests wait too, so big ones are not starved
            self.waiting.popleft()
            self._reserve(seq)
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
            if seq.prefilled:  # the first token came with the KV: report it, check stops
                lp = seq.logprobs.pop() if seq.logprobs else None
                self._emit(seq, seq.output_ids.pop(), out, lp)
                continue
            fresh.append(seq)
        for chunk in self._prefill_chunks(fresh):
            self._isolated(self._prefill, "prefill", chunk, out)

    def step(self) -> StepOutput:
        out = StepOutput()
        decoding = list(self.running)  # sequences admitted before this step
        self._admit(out)
        if decoding:
            self._isolated(self._decode, "decode step", decoding, out)
        return out

    def generate(
        self, requests: list[tuple[list[int], SamplingParams]], prefix: str = "gen"
    ) -> list[Sequence]:
        """Run requests to completion (batched); returns their sequences in request order."""
        seqs = [self.add_request(f"{prefix}-{i}", p, sp) for i, (p, sp) in enumerate(requests)]
        while self.has_unfinished():
            self.step()
        return seqs
