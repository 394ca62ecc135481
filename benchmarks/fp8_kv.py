"""fp8 KV cache quality: calibrated per-layer scales against a fixed 1.0, with the model-dtype
KV as the reference, on the same prompts in one run.

For each model (SmolLM2 and the tests' tiny models) and each scale choice:

* ``kv_rel_rms``: the KV of the prompts stored as fp8 and read back, against the model-dtype
  KV of the same prefill: RMS error / RMS value, over every layer and component;
* ``equal_tokens``: greedy tokens equal to the model-dtype KV's before the first difference,
  mean over the prompts; ``until_near_tie``: the share of prompts whose first difference comes
  at or after the reference's first step with a top-2 logit margin under 0.5 (must be 1.0).

    .venv/bin/python -m benchmarks.fp8_kv --json
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

import torch

from backends.runtime import kv_quant
from backends.runtime.engine import LLMEngine
from backends.runtime.loader import load_runner
from backends.runtime.paged import SeqInput
from backends.runtime.sampling_params import SamplingParams
from benchmarks.common import command_line, emit

SMOL = "models/smollm2-135m-instruct"
TOPICS = ["the moon", "tax law", "sourdough bread", "graph theory", "jazz", "volcanoes",
          "the printing press", "honeybees", "compilers", "marathon training", "glaciers",
          "chess openings"]  # fmt: skip
ASKS = ["Explain {} to a child.", "Write three facts about {}.", "What is surprising about {}?"]


def prompts_for(path: str, n: int) -> list[list[int]]:
    if Path(path, "tokenizer.json").is_file():
        from backends.runtime.tokenizer import Tokenizer

        tok = Tokenizer(path)
        texts = [ASKS[i % len(ASKS)].format(TOPICS[i % len(TOPICS)]) for i in range(n)]
        return [tok.encode(t, chat=True) for t in texts]
    g = torch.Generator().manual_seed(5)
    return [torch.randint(3, 256, (8 + 3 * i,), generator=g).tolist() for i in range(n)]


def greedy(runner, prompts, max_tokens):
    pool = runner.make_pool(sum(-(-(len(p) + max_tokens) // 16) for p in prompts), 16)
    engine = LLMEngine(runner, pool, max_batch=8)
    return [s.output_ids for s in engine.generate(
        [(p, SamplingParams(max_tokens=max_tokens)) for p in prompts])]  # fmt: skip


def prompt_kv(runner, prompt):
    pool = runner.make_pool(-(-len(prompt) // 16), 16)
    runner.prefill(pool, prompt, list(range(pool.num_pages)))
    return pool


def kv_error(ref_runner, runner, prompts) -> float:
    num = den = 0.0
    for p in prompts:
        ref, got = prompt_kv(ref_runner, p), prompt_kv(runner, p)
        lay = got.layout
        scales = torch.tensor([2.0**e for e in lay.scale_log2])
        a = ref.tensor.view(len(scales), -1).float()
        b = got.tensor.view(len(scales), -1).float() * scales[:, None]
        num += float(((a - b) ** 2).sum())
        den += float((a**2).sum())
    return (num / den) ** 0.5


def equal_prefix(a: list[int], b: list[int]) -> int:
    """Tokens before the first difference (one of them stopping earlier is a difference)."""
    diff = [i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y]
    return diff[0] if diff else min(len(a), len(b))


def first_low_margin(runner, prompt, out, margin=0.5) -> int:
    pool = runner.make_pool(-(-(len(prompt) + len(out)) // 16), 16)
    full = prompt + out
    (lg,) = runner.forward(pool, [SeqInput(full, 0, list(range(pool.num_pages)))])
    top = lg[len(prompt) - 1 : -1].topk(2, dim=-1).values
    low = ((top[:, 0] - top[:, 1]) < margin).nonzero()
    return int(low[0]) if len(low) else len(out)


def bench_model(path: str, n_prompts: int, max_tokens: int) -> dict:
    ref = load_runner(path)
    prompts = prompts_for(path, n_prompts)
    want = greedy(ref, prompts, max_tokens)
    lows = [first_low_margin(ref, p, w) for p, w in zip(prompts, want, strict=True)]
    row = {"model": Path(path).name, "prompts": n_prompts, "max_tokens": max_tokens}
    for name in ("calibrated", "scale_1.0"):
        runner = load_runner(path, kv_cache_dtype=kv_quant.FP8)
        if name == "scale_1.0":
            runner.set_kv_cache(kv_quant.FP8, (0,) * len(runner.kv_scale_log2))
        got = greedy(runner, prompts, max_tokens)
        equal = [equal_prefix(w, g) for w, g in zip(want, got, strict=True)]
        row[name] = {
            "kv_rel_rms": kv_error(ref, runner, prompts[:4]),
            "equal_tokens": statistics.mean(equal),
            "until_near_tie": statistics.mean(
                e >= min(low, len(w)) for e, low, w in zip(equal, lows, want, strict=True)
            ),
            "scale_log2_range": [min(runner.kv_scale_log2), max(runner.kv_scale_log2)],
        }
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompts", type=int, default=12)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--tiny", nargs="*", default=["llama", "qwen2", "deepseek_v3"],
                    help="tiny test models (random weights) to include")  # fmt: skip
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    from tests.helpers import runtime_models as rm  # the tests' tiny models

    paths = [SMOL, *(rm.checkpoint(k) for k in args.tiny)]
    rows = [bench_model(p, args.prompts, args.max_tokens) for p in paths]
    out = {"command": command_line("benchmarks.fp8_kv"), "models": rows}
    header = ["model", "scales", "KV rel. RMS error", "equal tokens (mean)", "equal until near-tie"]
    emit(out, args.json, header, [
        [r["model"], name, f"{r[name]['kv_rel_rms']:.4f}",
         f"{r[name]['equal_tokens']:.1f} of {r['max_tokens']}", f"{r[name]['until_near_tie']:.0%}"]
        for r in rows for name in ("calibrated", "scale_1.0")
    ])  # fmt: skip

if __name__ == "__main__":
    main()
