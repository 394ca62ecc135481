"""Benchmark the runtime against transformers on the same checkpoint, in the same process.

Measures prefill tokens/s (one prompt of each --prefill-lens length) and decode tokens/s (a
batch of --batches sequences with a --context-token prompt each, --decode-steps steps; the
context's prefill is not timed). Both are loaded at once and take turns run by run, so the
machine's load hits both alike: each rate is the median of --runs runs, and ``ratio`` the median
over runs of each run's runtime / transformers pair. transformers runs its model forward with a
DynamicCache.

The runtime is imported before torch, as the stages do: its OpenMP threads then sleep while they
wait (backends/runtime/__init__.py). Imported after torch, their spinning made decode up to 10x
slower on a shared 2-core machine.

    .venv/bin/python -m benchmarks.runtime                  # table
    .venv/bin/python -m benchmarks.runtime --json --runs 5  # one JSON object
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

from backends.runtime.dtypes import MODEL_DTYPES, model_dtype
from backends.runtime.loader import load_runner
from backends.stages.params import StageParams
from benchmarks.common import command_line, log, run_meta


def prompt(n: int, vocab: int, seed: int) -> list[int]:
    import torch

    g = torch.Generator().manual_seed(seed)
    return torch.randint(10, vocab, (n,), generator=g).tolist()


class Ours:
    name = "runtime"

    def __init__(self, args):
        self.runner = load_runner(args.model, dtype=args.dtype, device=args.device)
        self.ps = args.page_size
        self.vocab = self.runner.config.vocab_size

    def prefill(self, ids: list[int]):
        pool = self.runner.make_pool(-(-len(ids) // self.ps), self.ps)
        pages = pool.alloc(pool.num_pages)
        slot = pool.states.alloc() if pool.states is not None else None  # a hybrid's state
        return lambda: self.runner.prefill(pool, ids, pages, slot=slot)

    def decode(self, prompts: list[list[int]], steps: int):
        """A callable that decodes ``steps`` tokens and returns their seconds."""
        n = max(len(p) for p in prompts) + steps
        per_seq = -(-n // self.ps)
        # + CUDA graphs' scratch page; a hybrid model's state slots (each run goes on from the
        # state the run before left: the same work)
        pool = self.runner.make_pool(per_seq * len(prompts) + 1, self.ps, num_slots=len(prompts))
        tables = [pool.alloc(per_seq) for _ in prompts]
        slots = [pool.states.alloc() for _ in prompts] if pool.states is not None else None
        for i, (p, t) in enumerate(zip(prompts, tables, strict=True)):
            self.runner.prefill(pool, p, t, slot=slots[i] if slots else None)
        lens = [len(p) for p in prompts]

        def run() -> float:
            toks = [p[-1] for p in prompts]
            t = time.perf_counter()
            for s in range(steps):
                logits = self.runner.decode(pool, toks, [n + s for n in lens], tables, slots)
                toks = logits.argmax(-1).tolist()
            return time.perf_counter() - t

        return run


class HF:
    name = "transformers"

    def __init__(self, args):
        from transformers import AutoModelForCausalLM

        dtype = model_dtype(args.dtype)
        self.model = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype)
        self.model = self.model.to(args.device).eval()
        self.device = args.device
        self.vocab = self.model.config.vocab_size

    def _forward(self, ids, cache):
        import torch

        with torch.inference_mode():
            return self.model(
                input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1
            )

    def prefill(self, ids: list[int]):
        import torch
        from transformers import DynamicCache

        x = torch.tensor([ids], device=self.device)
        return lambda: self._forward(x, DynamicCache(config=self.model.config))

    def decode(self, prompts: list[list[int]], steps: int):
        """A callable that prefills the context (untimed), decodes ``steps`` tokens and returns
        their seconds."""
        import torch
        from transformers import DynamicCache

        x = torch.tensor(prompts, device=self.device)  # same lengths: no padding needed

        def run() -> float:
            cache = DynamicCache(config=self.model.config)
            cache = self._forward(x[:, :-1], cache).past_key_values
            toks = x[:, -1:]
            t = time.perf_counter()
            for _ in range(steps):
                out = self._forward(toks, cache)
                toks = out.logits[:, -1].argmax(-1, keepdim=True)
            return time.perf_counter() - t

        return run


def seconds(fn, device: str) -> float:
    """``fn``'s own answer (seconds it measured itself), else its wall time."""
    import torch

    t = time.perf_counter()
    got = fn()
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    return got if isinstance(got, float) else time.perf_counter() - t


def in_turns(fns: dict, runs: int, device: str) -> dict[str, list[float]]:
    """Each callable once to warm up, then ``runs`` rounds in which each runs once, in turn."""
    for fn in fns.values():
        seconds(fn, device)
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(runs):
        for name, fn in fns.items():
            times[name].append(seconds(fn, device))
    return times


def bench(impls: list, args) -> dict:
    """{"results": name -> metric -> tok/s (median), "per_run": the same per run, "ratio":
    metric -> median over runs of runtime / transformers}."""
    vocab = impls[0].vocab
    work: dict[str, tuple[int, dict]] = {}
    for n in args.prefill_lens:
        ids = prompt(n, vocab, n)
        work[f"prefill_{n}_tok_s"] = (n, {i.name: i.prefill(ids) for i in impls})
    for b in args.batches:
        prompts = [prompt(args.context, vocab, 1000 + i) for i in range(b)]
        fns = {i.name: i.decode(prompts, args.decode_steps) for i in impls}
        work[f"decode_b{b}_tok_s"] = (b * args.decode_steps, fns)
    per_run: dict[str, dict[str, list[float]]] = {i.name: {} for i in impls}
    for metric, (tokens, fns) in work.items():
        times = in_turns(fns, args.runs, args.device)
        for name, ts in times.items():
            per_run[name][metric] = [tokens / t for t in ts]
        log(metric + ": " + ", ".join(f"{n} {statistics.median(r[metric]):.1f}"
                                      for n, r in per_run.items()))  # fmt: skip
    results = {n: {m: statistics.median(v) for m, v in r.items()} for n, r in per_run.items()}
    ratio = {}
    if len(impls) == 2:
        ours, hf = (per_run[i.name] for i in impls)
        pairs = {m: zip(ours[m], hf[m], strict=True) for m in ours}
        ratio = {m: statistics.median(a / b for a, b in p) for m, p in pairs.items()}
    return {"results": results, "per_run": per_run, "ratio": ratio}


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

    impls = []
    for cls in [Ours] + ([] if args.skip_hf else [HF]):
        log(f"loading {cls.name}")
        impls.append(cls(args))
    out = bench(impls, args)
    meta = run_meta(args, context=args.context, decode_steps=args.decode_steps)
    meta["command"] = command_line("benchmarks.runtime", argv)
    if args.json:
        print(json.dumps({"meta": meta, **out}))
        return 0
    results, ratio = out["results"], out["ratio"]
    head = f"{'metric (tokens/s, median of ' + str(args.runs) + ')':<36}"
    print(head + "".join(f"{n:>14}" for n in results) + ("         ratio" if ratio else ""))
    for k in results["runtime"]:
        row = f"{k:<36}" + "".join(f"{results[n][k]:>14.1f}" for n in results)
        print(row + (f"{ratio[k]:>14.2f}" if ratio else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
