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

Prefix cache (``prefix_cache``: a :class:`~backends.runtime.prefix_cache.PrefixCache` over the
engine's pool; models that cannot be cached by page are refused): admission takes a
:class:`~backends.runtime.prefix_cache.Lease` per sequence, sharing the prompt's cached leading
blocks (at most ``len(prompt) - 1`` tokens: the last prompt token is always computed, so a full
hit still gives the first token's logits) and allocating the rest; prefill computes only the
tokens after ``Sequence.num_cached_tokens``. Each emitted token declares the KV of positions
``[0, num_tokens - 1)`` final, and every block completed by it is published (the prompt's after
prefill, generated ones as decode fills them, so a chat's next turn hits). The lease is released
exactly once when the sequence ends. Greedy output is the same with the cache on or off.

Recurrent models (``pool.states``: gated DeltaNet, Mamba2 layers): each sequence also holds one
state slot from admission (beside its pages; admission waits for a free one as it waits for
pages) to its end, freed exactly once with its pages. Prefill writes the prompt's final state
into it and each decode step advances it by one token in place, so a batch that fails after its
recurrent layers ran cannot be retried sequence by sequence
(:class:`~backends.runtime.recurrent.batch.RecurrentStateLost`): every sequence of it that
continued a state fails. A prefill from position 0 starts from zeros and retries as before.

Sliding-window entry (``pool.window``: a model mixing sliding-window and full layers, Gemma 3,
gpt-oss): each sequence also holds a :class:`~backends.runtime.window.WindowTable`, only the
pages its window reaches (:mod:`backends.runtime.window`). Admission reserves what it can ever
hold at once (``pages_to_hold``: R pages for a window of W keys, a step writing at most
``_step_tokens`` tokens) and, for a prompt it prefills, a page per prompt block; right after the
prefill the blocks out of the window go back (:meth:`WindowTable.settle`), and each later
forward recycles the blocks its window has passed into the blocks it writes, so a running
sequence holds at most R window pages and never needs a new one. A sequence prefilled elsewhere
comes with the pages :meth:`LLMEngine.window_plan` names (``add_prefilled``'s
``window_pages``). Every window page goes back exactly once with the sequence's other pages.

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
from .prefix_cache import Lease, PrefixCache, check_prefix_cacheable
from .recurrent.batch import RecurrentStateLost
from .runner import ModelRunner
from .sampler import generator, sample, token_logprobs
from .sampling_params import SamplingParams, TokenLogprob, check_context
from .sequence import FinishReason, SeqStatus, Sequence
from .window import WindowPlan, WindowTable, describe, pages_to_hold, plan_prefilled

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
    # why an engine of this kind cannot use a prefix cache (None: it can)
    prefix_cache_refusal: str | None = None

    def __init__(
        self,
        runner: ModelRunner,
        pool: KVPool,
        max_batch: int = 16,
        max_context: int | None = None,
        prefill_tokens: int = 4096,
        tokenizer=None,
        prefix_cache: PrefixCache | None = None,
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
        if prefix_cache is not None:
            if self.prefix_cache_refusal is not None:
                raise ValueError(f"prefix_cache is not supported: {self.prefix_cache_refusal}")
            check_prefix_cacheable(runner.config)
            if prefix_cache.pool is not pool:
                raise ValueError("prefix_cache must be the cache of the engine's own pool")
        self.cache = prefix_cache
        self._leases: dict[str, Lease] = {}  # seq_id -> its pages (engine with a prefix cache)
        if pool.window is not None:
            pool.window.placeholder()  # taken now, not out of a later admission's pages

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
        self._check_window_fits(len(prompt_ids), params.max_tokens, prefilled=False)
        seq = Sequence(seq_id, list(prompt_ids), params)
        seq.generator = generator(params, self.runner.device)
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
        lease: Lease | None = None,
        slot: int | None = None,
        window_pages: list[int] | None = None,
    ) -> Sequence:
        """Queue a sequence whose prompt KV is already in ``pages`` of this pool.

        The engine takes ownership of ``pages`` (allocated from this pool by the caller) and
        frees them when the sequence ends. ``first_token`` was sampled by the prefill side, and
        so was ``first_logprob`` (required when ``params.logprobs`` is set). ``text``: the
        sequence's TextState when the caller already fed it the first token (streamed early);
        by default a fresh one (engine with a tokenizer). ``draft_pages``: the prompt's draft
        KV, for an engine with a draft model (SpecEngine); with an EAGLE head also
        ``draft_feature``, the target's feature of the last prompt position [hidden].
        Engine with a prefix cache: ``lease`` (its ``pages`` are ``pages``) when the caller
        took them with :meth:`~backends.runtime.prefix_cache.PrefixCache.acquire`; without
        one the engine adopts ``pages``. The prompt's KV must be final (no write in flight):
        its blocks are published at admission. A model with recurrent layers: ``slot``, the
        state slot (of ``pool.states``, allocated by the caller) holding the prompt's final
        state; the engine takes it with the pages. A model with a sliding-window entry:
        ``window_pages``, allocated from ``pool.window`` by the caller (see
        :meth:`window_plan`): the first ``count`` hold the prompt's window (blocks
        ``[first, first + count)`` of ``pool.window.layout.pages_for(len(prompt_ids))``), any
        after them are spares; the engine takes them with the pages (and allocates what
        :meth:`window_plan`'s ``reserve`` has more at admission, or gives back what it has
        less). On a ValueError the caller keeps every page it gave.
        """
        self._validate(seq_id, prompt_ids, params)
        self._check_window_fits(len(prompt_ids), params.max_tokens, prefilled=True)
        self._check_prefilled_slot(slot)
        window = self._prefilled_window(len(prompt_ids), window_pages)
        if lease is not None and (self.cache is None or lease.pages != list(pages)):
            raise ValueError("lease needs an engine with a prefix cache and pages == lease.pages")
        if params.logprobs is not None and first_logprob is None:
            raise ValueError("first_logprob is required when params.logprobs is set")
        self.pool.check_holds(len(prompt_ids), pages)
        self._check_draft_pages(len(prompt_ids), draft_pages)
        if not 0 <= first_token < self.runner.config.vocab_size:
            raise ValueError(f"first_token {first_token} outside the vocabulary")
        seq = Sequence(seq_id, list(prompt_ids), params, pages=list(pages), prefilled=True)
        seq.slot, seq.window = slot, window
        seq.generator = generator(params, self.runner.device)
        seq.output_ids.append(first_token)
        if params.logprobs is not None:
            seq.logprobs.append(first_logprob)  # reported with the first token at admission
        seq.text = text if text is not None else self._text_state(params)
        self._adopt_draft_pages(seq, draft_pages, draft_feature)
        if self.cache is not None:
            self._leases[seq_id] = lease if lease is not None else self.cache.adopt(seq.pages)
            seq.num_cached_tokens = self._leases[seq_id].num_cached_tokens
        self.seqs[seq_id] = seq
        self.waiting.append(seq)
        return seq

    def _check_prefilled_slot(self, slot: int | None) -> None:
        states = self.pool.states
        if states is None and slot is not None:
            raise ValueError("this model has no recurrent layers: slot must be None")
        if states is not None and (slot is None or not states.holds(slot)):
            raise ValueError(
                f"a prefilled sequence of a model with recurrent layers needs the state slot "
                f"holding its prompt's state (allocated from pool.states), got {slot!r}"
            )

    def _prefilled_window(self, prompt_tokens: int, pages: list[int] | None):
        window = self.pool.window
        if window is None:
            if pages is not None:
                raise ValueError("the model has no sliding-window entry: window_pages must be None")
            return None
        if pages is None:
            raise ValueError(
                "a prefilled sequence of a model with sliding-window layers needs window_pages "
                "(allocated from pool.window: see LLMEngine.window_plan)"
            )
        return WindowTable.prefilled(window, prompt_tokens, list(pages))

    # ---- sliding-window pages ----------------------------------------------------------------
    def _step_tokens(self) -> int:
        """The most tokens one decode step writes for a sequence (a speculative engine: k + 1)."""
        return 1

    def window_plan(self, prompt_tokens: int, max_tokens: int) -> WindowPlan | None:
        """A sequence to be prefilled elsewhere (None: the model has no sliding-window entry):
        the blocks ``[first, first + count)`` the transfer fills in ``pool.window`` and the
        pages it holds from admission on (``reserve``). The decode side allocates ``reserve``
        pages of ``pool.window``, registers the first ``count`` for those blocks and hands all
        of them to :meth:`add_prefilled` (``window_pages``)."""
        if self.pool.window is None:
            return None
        layout = self.pool.window.layout
        return plan_prefilled(layout, prompt_tokens, max_tokens, self._step_tokens())

    def window_stats(self) -> dict:
        """The sliding-window entry's pages (empty: none): held by sequences now, free, and
        the most a sequence holds (``window.describe``: pages and bytes)."""
        window = self.pool.window
        if window is None:
            return {}
        bound = describe(window.layout, self._step_tokens())
        return {
            "window_pages_in_use": window.pages_in_use,
            "window_pages_free": window.num_free,
            **{f"window_{k}": v for k, v in bound.items()},
        }

    def window_bound(self, seq: Sequence) -> int:
        """The most window pages ``seq`` holds once its prompt is in (after its prefill)."""
        max_kv = len(seq.prompt_ids) + seq.params.max_tokens - 1
        return pages_to_hold(self.pool.window.layout, max_kv, self._step_tokens())

    def _window_need(self, prompt_tokens: int, max_tokens: int, prefilled: bool) -> int:
        """Window pages a sequence holds from admission: what it holds after its prefill, and
        while it prefills here a page per prompt block (the prefill writes every block)."""
        layout = self.pool.window.layout
        keep = pages_to_hold(layout, prompt_tokens + max_tokens - 1, self._step_tokens())
        return keep if prefilled else max(keep, self.pool.window.pages_needed(prompt_tokens))

    def _check_window_fits(self, prompt_tokens: int, max_tokens: int, prefilled: bool) -> None:
        window = self.pool.window
        if window is None:
            return
        need = self._window_need(prompt_tokens, max_tokens, prefilled)
        if need > window.num_pages - window.num_scratch:
            raise ValueError(
                f"request needs {need} sliding-window KV pages but the pool's window entry "
                f"only has {window.num_pages - window.num_scratch}"
            )

    def _window_extra(self, seq: Sequence) -> int:
        """Window pages ``seq`` must still get at admission (< 0: it holds more)."""
        need = self._window_need(len(seq.prompt_ids), seq.params.max_tokens, seq.prefilled)
        return need - (seq.window.held if seq.window is not None else 0)

    def _reserve_window(self, seq: Sequence) -> None:
        window = self.pool.window
        if window is None:
            return
        if seq.window is None:
            seq.window = WindowTable(window)
        extra = self._window_extra(seq)
        if extra > 0:
            seq.window.add(window.alloc(extra))
        elif extra < 0:
            seq.window.trim(seq.window.held + extra)

    def _seq_input(self, seq: Sequence, tokens: list[int], start: int) -> SeqInput:
        """The target's input for ``seq``'s ``tokens`` at positions ``[start, start + n)``: its
        pages, state slot and window table, prepared for them (WindowTable.prepare)."""
        window = seq.window.prepare(start, len(tokens)) if seq.window is not None else None
        return SeqInput(tokens, start, seq.pages, seq.slot, window)

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
        lease = self._leases.pop(seq.seq_id, None)
        if lease is not None:
            lease.release()
        elif pages:
            self.pool.free(pages)
        slot, seq.slot = seq.slot, None
        if slot is not None:
            self.pool.states.free(slot)
        window, seq.window = seq.window, None
        if window is not None:
            window.release()

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
        self._publish(seq)
        out.new_tokens.setdefault(seq.seq_id, []).append(token)
        if logprob is not None:
            seq.logprobs.append(logprob)
            out.logprobs.setdefault(seq.seq_id, []).append(logprob)
        if done:
            if seq in self.running:
                self.running.remove(seq)
            self._release(seq)
            out.finished.append(seq)

    def _publish(self, seq: Sequence) -> None:
        """Prefix cache: publish the blocks of ``seq`` whose KV is now final (positions
        ``[0, num_tokens - 1)``: the last sampled token has none yet)."""
        lease = self._leases.get(seq.seq_id)
        final = seq.num_tokens - 1
        if lease is not None and final >= lease.committed_tokens + self.pool.page_size:
            lease.commit(seq.prompt_ids + seq.output_ids, final)

    # Hooks a speculative engine (backends.runtime.spec) overrides: reserve pages, prefill, decode.
    def _can_reserve(self, seq: Sequence) -> bool:
        window = self.pool.window
        if window is not None and self._window_extra(seq) > window.num_free:
            return False
        need = self.pool.pages_needed(seq.max_kv_tokens)
        if self.cache is not None and seq.seq_id not in self._leases:
            return self.cache.fits(seq.prompt_ids, need)
        return need - len(seq.pages) <= self.pool.num_free

    def _reserve(self, seq: Sequence) -> None:
        self._reserve_pages(seq)
        self._reserve_window(seq)

    def _reserve_pages(self, seq: Sequence) -> None:
        need = self.pool.pages_needed(seq.max_kv_tokens)
        if self.cache is not None:
            lease = self._leases.get(seq.seq_id)
            if lease is None:  # the cached prefix shared, the rest allocated
                lease = self._leases[seq.seq_id] = self.cache.acquire(seq.prompt_ids, need)
                seq.num_cached_tokens = lease.num_cached_tokens
            elif need > len(lease.pages):
                lease.grow(need - len(lease.pages))
            seq.pages = lease.pages
            return
        extra = need - len(seq.pages)
        if extra > 0:
            seq.pages += self.pool.alloc(extra)

    def _prefill_logits(self, seqs: list[Sequence]) -> torch.Tensor:
        """One forward over the prompts of ``seqs`` (from their cached length on); the last
        position's logits, ``[B, vocab]``."""
        inputs = [
            self._seq_input(s, s.prompt_ids[s.num_cached_tokens :], s.num_cached_tokens)
            for s in seqs
        ]
        return torch.cat(self.runner.forward(self.pool, inputs, last_only=True))

    def _prefill(self, seqs: list[Sequence], out: StepOutput) -> None:
        """Prefill newly admitted (not prefilled) sequences in one forward and emit their first
        tokens; then the window pages their prompts no longer need go back."""
        self._sample_and_emit(seqs, self._prefill_logits(seqs), out)
        for seq in seqs:
            if seq.window is not None:  # still running
                seq.window.settle(seq.num_tokens - 1, self.window_bound(seq))

    def _prefill_chunks(self, seqs: list[Sequence]) -> list[list[Sequence]]:
        """Split in FIFO order into forwards of at most ``prefill_tokens`` prompt tokens (a longer
        prompt gets a forward of its own)."""
        chunks: list[list[Sequence]] = []
        tokens = 0
        for seq in seqs:
            n = len(seq.prompt_ids) - seq.num_cached_tokens
            if not chunks or tokens + n > self.prefill_tokens:
                chunks.append([])
                tokens = 0
            chunks[-1].append(seq)
            tokens += n
        return chunks

    def _decode(self, decoding: list[Sequence], out: StepOutput) -> None:
        """Advance every already-running sequence (one token each here)."""
        # a recurrent model's step advances each sequence's state in its slot
        extra = {"slots": [s.slot for s in decoding]} if self.pool.states is not None else {}
        if self.pool.window is not None:
            extra["window_tables"] = [s.window.prepare(s.num_tokens - 1, 1) for s in decoding]
        logits = self.runner.decode(
            self.pool,
            [s.output_ids[-1] for s in decoding],
            [s.num_tokens - 1 for s in decoding],
            [s.pages for s in decoding],
            **extra,
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
            if len(seqs) == 1 or isinstance(e, RecurrentStateLost):  # no retry: state changed
                for seq in seqs:
                    if seq in self.running:
                        self._fail_seq(seq, f"{what} failed: {type(e).__name__}: {e}", out)
                return
            log.warning("batched %s failed (%s); retrying sequence by sequence", what, e)
            for seq in seqs:
                if seq in self.running:
                    self._isolated(run, what, [seq], out)

    def _admit(self, out: StepOutput) -> None:
        fresh: list[Sequence] = []  # admitted now, prompt KV still to compute
        while self.waiting and len(self.running) < self.max_batch:
            seq = self.waiting[0]
            states = self.pool.states
            no_slot = states is not None and seq.slot is None and not states.num_free
            if no_slot or not self._can_reserve(seq):
                break  # FIFO: later requests wait too, so big ones are not starved
            self.waiting.popleft()
            self._reserve(seq)
            if states is not None and seq.slot is None:
                seq.slot = states.alloc()
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
