"""Benchmark the runtime against transformers on the same checkpoint, in the same process.

Measures prefill tokens/s (one prompt of each --prefill-lens length) and decode tokens/s (batch
of --batches sequences with a --context-token prompt each, --decode-steps steps). Each number is
the median of --runs runs. transformers runs its model forward with a DynamicCache.

    .venv/bin/python -m benchmarks.runtime                  # table
    .venv/bin/python -m benchmarks.runtime --json --runs 5  # one JSON object
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

from backends.runtime.dtypes import MODEL_DTYPES, model_dtype
from backends.runtime.loader import load_runner
from backends.stages.params import StageParams
from benchmarks.common import log, run_meta


def median_time(fn, runs: int) -> float:
    times = []
    for _ in range(runs):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def prompt(n: int, vocab: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(10, vocab, (n,), generator=g).tolist()


class Ours:
    name = "runtime"

    def __init__(self, args):
        self.runner = load_runner(args.model, dtype=args.dtype, device=args.device)
        self.ps = args.page_size

    def prefill(self, ids: list[int]):
        pool = self.runner.make_pool(-(-len(ids) // self.ps), self.ps)
        pages = pool.alloc(pool.num_pages)
        return lambda: self.runner.prefill(pool, ids, pages)

    def decode(self, prompts: list[list[int]], steps: int):
        n = max(len(p) for p in prompts) + steps
        per_seq = -(-n // self.ps)
        pool = self.runner.make_pool(per_seq * len(prompts) + 1, self.ps)  # + CUDA graphs' scratch
        tables = [pool.alloc(per_seq) for _ in prompts]
        for p, t in zip(prompts, tables, strict=True):
            self.runner.prefill(pool, p, t)
        lens = [len(p) for p in prompts]

        def run():
            toks = [p[-1] for p in prompts]
            for s in range(steps):
                logits = self.runner.decode(pool, toks, [n + s for n in lens], tables)
                toks = logits.argmax(-1).tolist()

        return run


class HF:
    name = "transformers"

    def __init__(self, args):
        from transformers import AutoModelForCausalLM

        dtype = model_dtype(args.dtype)
        self.model = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype)
        self.model = self.model.to(args.device).eval()
        self.device = args.device

    @torch.inference_mode()
    def _forward(self, ids: torch.Tensor, cache):
        return self.model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1)

    def prefill(self, ids: list[int]):
        from transformers import DynamicCache

        x = torch.tensor([ids], device=self.device)
        return lambda: self._forward(x, DynamicCache(config=self.model.config))

    def decode(self, prompts: list[list[int]], steps: int):
        from transformers import DynamicCache

        x = torch.tensor(prompts, device=self.device)  # same lengths: no padding needed

        def run():
            cache = DynamicCache(config=self.model.config)
            cache = self._forward(x[:, :-1], cache).past_key_values  # context, not timed below
            toks = x[:, -1:]
            t = time.perf_counter()
            for _ in range(steps):
                out = self._forward(toks, cache)
                toks = out.logits[:, -1].argmax(-1, keepdim=True)
            run.decode_time = time.perf_counter() - t

        return run


def bench(impl, args, vocab: int) -> dict:
    res = {}
    for n in args.prefill_lens:
        fn = impl.prefill(prompt(n, vocab, n))
        fn()  # warm up
        res[f"prefill_{n}_tok_s"] = n / median_time(fn, args.runs)
        log(f"{impl.name} prefill {n}: {res[f'prefill_{n}_tok_s']:.0f} tok/s")
    for b in args.batches:
        prompts = [prompt(args.context, vocab, 1000 + i) for i in range(b)]
        fn = impl.decode(prompts, args.decode_steps)
        if isinstance(impl, HF):  # time the decode steps only, not the context prefill
            times = []
            for _ in range(args.runs):
                fn()
                times.append(fn.decode_time)
            dt = statistics.median(times)
        else:
            dt = median_time(fn, args.runs)
        res[f"decode_b{b}_tok_s"] = b * args.decode_steps / dt
        log(f"{impl.name} decode batch {b}: {res[f'decode_b{b}_tok_s']:.1f} tok/s")
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="models/smollm2-135m-instruct")
    ap.add_argument("--dtype", choices=MODEL_DTYPES, default=StageParams.dtype)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--prefill-lens", type=int, nargs="+", default=[512, 2048])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 16])
    ap.add_argument("--context", type=int, default=128, help="prompt tokens before decoding")
    ap.add_argument("--decode-steps", type=int, default=16)
    ap.add_argument("--page-size", type=int, default=StageParams.page_size)
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)

    results = {}
    impls = [Ours] + ([] if args.skip_hf else [HF])
    for cls in impls:
        log(f"loading {cls.name}")
        impl = cls(args)
        vocab = (
            impl.runner.config.vocab_size
            if isinstance(impl, Ours)
            else impl.model.config.vocab_size
        )
        results[cls.name] = bench(impl, args, vocab)
        del impl
    meta = run_meta(args, context=args.context, decode_steps=args.decode_steps)
    if args.json:
        print(json.dumps({"meta": meta, "results": results}))
        return 0
    keys = list(results["runtime"])
    print(
        f"{'metric (tokens/s, median of ' + str(args.runs) + ')':<36}"
        + "".join(f"{n:>14}" for n in results)
    )
    for k in keys:
        print(f"{k:<36}" + "".join(f"{results[n][k]:>14.1f}" for n in results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
