"""The runtime's side: decode steps (CUDA graphs where the runtime replays them), batched
prefill, fp8 KV, over random weights shared with transformers' model.

A runner is built for each measured point (:func:`~backends.runtime.loader.runner_from_tensors`
over the same tensors): a fresh runner captures fresh graphs for its pool, and the point's pool
and graphs are freed before the next one (a 32 x 8K pool of an 8B model is 34-39 GB).

Decode runs from position ``context`` on: the pool's KV there is zeros, which costs attention
what real KV costs (a roofline needs the bytes read, not their values), and no prefill of
32 x 8K tokens precedes each point. Each step is timed on the host from the call to the next
tokens' ids on the host (``argmax().tolist()``, as a server needs them).
"""

from __future__ import annotations

import gc
import time

import torch

from backends.runtime.config import ModelConfig
from backends.runtime.cuda_graphs import BUCKETS
from backends.runtime.loader import runner_from_tensors
from backends.runtime.paged import SeqInput

from .timing import samples, summary_ms


def free_memory(device: torch.device) -> None:
    """Free a finished point's pool and graphs (a runner and its graphs hold each other: only
    the cycle collector frees them). Fast while the model's objects are frozen (``gc.freeze``
    in :class:`~benchmarks.gpu_roofline.run.ShapeBench`): it then scans only the point's."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def token_ids(n: int, vocab: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(10, vocab, (n,), generator=g).tolist()


class Runtime:
    """The runtime over ``tensors`` (name -> tensor, on the device) with config ``raw``."""

    def __init__(self, raw: dict, tensors: dict, dtype: str, device: torch.device, page_size: int):
        self.config = ModelConfig.from_dict(raw)  # UnsupportedArchitectureError: not yet here
        self.tensors, self.dtype, self.device, self.ps = tensors, dtype, device, page_size

    def runner(self, kv_cache_dtype: str = "auto"):
        return runner_from_tensors(
            self.config,
            self.tensors,
            "random weights",
            dtype=self.dtype,
            device=str(self.device),
            kv_cache_dtype=kv_cache_dtype,
        )

    def point_bytes(self, batch: int, tokens: int, kv_itemsize: int) -> int:
        """Device bytes a point adds: its pool, and the runner's fused copies of the weights
        (QKV and gate/up: about 9 GB at 8B; the rest it reads in place)."""
        c = self.config
        pages = batch * -(-tokens // self.ps) + 1
        pool = pages * self.ps * 2 * c.num_layers * c.num_kv_heads * c.head_dim * kv_itemsize
        qkv = c.hidden_size * (c.num_heads + 2 * c.num_kv_heads) * c.head_dim
        fused = c.num_layers * (qkv + 2 * c.intermediate_size * c.hidden_size) * 2
        return pool + fused

    def last_logits(self, ids: list[int]) -> torch.Tensor:
        """The last position's logits [vocab] float32 of one prompt."""
        runner = self.runner()
        pool = runner.make_pool(-(-len(ids) // self.ps), self.ps)
        return runner.prefill(pool, ids, pool.alloc(pool.num_pages))

    def decode(
        self, batch: int, context: int, steps: int, warmup: int, kv_cache_dtype: str = "auto"
    ) -> dict:
        """``steps`` timed decode steps of ``batch`` sequences from position ``context`` on:
        ``{"times": [s], "graphs": whether they replayed CUDA graphs}``."""
        return self._decode(batch, context, steps, warmup, kv_cache_dtype)

    def _decode(self, batch, context, steps, warmup, kv_cache_dtype) -> dict:
        runner = self.runner(kv_cache_dtype)
        per_seq = -(-(context + warmup + steps + 1) // self.ps)
        pool = runner.make_pool(batch * per_seq + 1, self.ps)  # + the graphs' scratch page
        tables = [pool.alloc(per_seq) for _ in range(batch)]
        toks = token_ids(batch, self.config.vocab_size, batch)
        times = []
        for s in range(warmup + steps):
            t0 = time.perf_counter()
            logits = runner.decode(pool, toks, [context + s] * batch, tables)
            toks = logits.argmax(-1).tolist()
            if s >= warmup:
                times.append(time.perf_counter() - t0)
        return {"times": times, "graphs": runner.use_graphs and batch <= BUCKETS[-1]}

    def prefill(self, batch: int, length: int, runs: int) -> list[float]:
        """Seconds of ``runs`` batched prefills of ``batch`` prompts of ``length`` tokens."""
        runner = self.runner()
        per_seq = -(-length // self.ps)
        pool = runner.make_pool(batch * per_seq, self.ps)
        vocab = self.config.vocab_size
        seqs = [SeqInput(token_ids(length, vocab, b), 0, pool.alloc(per_seq)) for b in range(batch)]
        return samples(lambda: runner.prefill_batch(pool, seqs), runs, self.device)


def step_figures(times: list[float], batch: int, step_bytes: int, copy_gbps: float) -> dict:
    """tokens/s, step ms (p50, p99, runs) and the fraction of the bandwidth roofline."""
    ms = summary_ms(times)
    step_s = ms["p50"] / 1e3
    return {
        "tok_s": round(batch / step_s, 2),
        "step_ms": ms,
        "bytes_per_step": step_bytes,
        "roofline_fraction": round(step_bytes / step_s / 1e9 / copy_gbps, 4),
    }
