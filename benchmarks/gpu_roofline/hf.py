"""transformers' side: its own ``generate`` on the same weights with its static cache (greedy),
eager and, on CUDA, ``torch.compile``'d as generate does it by itself for a static cache
(``CompileConfig``'s defaults: inductor, ``reduce-overhead``); and its prefill forward.

A decode step is timed inside generate: a logits processor synchronises the device and stamps
the time each time generate hands it a token's scores, so the gaps between stamps are whole
generate steps (forward, processors, argmax, bookkeeping) and the prompt's prefill is not in
them. Every generated token is forced (``min_new_tokens``): random weights must not stop early.
The stamp's synchronisation costs generate about what the runtime's per-step ``tolist()`` costs
it: neither side queues a step ahead of the last one's tokens.
"""

from __future__ import annotations

import time

import torch

from .timing import samples, sync


class StepClock:
    """A logits processor that only stamps the time (after synchronising the device)."""

    def __init__(self, device: torch.device):
        self.device, self.stamps = device, []

    def __call__(self, input_ids, scores):
        sync(self.device)
        self.stamps.append(time.perf_counter())
        return scores


def generate_steps(model, batch: int, context: int, steps: int, compiled: bool) -> dict:
    """Decode-step seconds of generate: ``steps`` gaps over one call after an identical
    warm-up call (which compiles, when ``compiled``: ``warmup_s``)."""
    from transformers import LogitsProcessorList

    device = model.device
    g = torch.Generator().manual_seed(batch)
    ids = torch.randint(10, model.config.vocab_size, (batch, context), generator=g).to(device)
    mask = torch.ones_like(ids)

    def run() -> list[float]:
        clock = StepClock(device)
        model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=steps + 1,
            min_new_tokens=steps + 1,
            do_sample=False,
            cache_implementation="static",
            disable_compile=not compiled,
            logits_processor=LogitsProcessorList([clock]),
            pad_token_id=0,
        )
        return [b - a for a, b in zip(clock.stamps, clock.stamps[1:], strict=False)]

    graphs = compiled_graphs() if compiled else 0
    t0 = time.perf_counter()
    run()
    warmup_s = time.perf_counter() - t0
    out = {"times": run(), "warmup_s": round(warmup_s, 2)}
    if compiled:  # whether generate did compile (it decides by itself)
        out["compiled_graphs"] = compiled_graphs() - graphs
    return out


def compiled_graphs() -> int:
    """Graphs dynamo compiled in this process so far."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def prefill_times(model, batch: int, length: int, runs: int) -> list[float]:
    """Seconds of transformers' forward over ``batch`` prompts of ``length`` tokens, no cache,
    logits of the last position only (what generate's prefill computes, less the cache)."""
    g = torch.Generator().manual_seed(length)
    ids = torch.randint(10, model.config.vocab_size, (batch, length), generator=g).to(model.device)

    @torch.inference_mode()
    def fn():
        return model(input_ids=ids, use_cache=False, logits_to_keep=1)

    return samples(fn, runs, model.device)


def last_logits(model, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        x = torch.tensor([ids], device=model.device)
        return model(input_ids=x, use_cache=False).logits[0, -1].float()
