"""Generate text with the runtime (no server): all requests go through the engine batched.

    python scripts/generate.py --prompt "What is the capital of France?" --chat --max-tokens 32
    python scripts/generate.py --prompt-ids 1,2,3 --max-tokens 8 --json
    python scripts/generate.py --requests reqs.jsonl --json

A requests file has one JSON object per line: ``prompt`` (text) or ``prompt_ids`` (list of
ints), optional ``chat``, ``max_tokens``, ``temperature``, ``top_p``, ``top_k``, ``seed``,
``ignore_eos``; missing fields take the command-line values. With ``--json`` each request
prints one JSON object: ``prompt_ids``, ``output_ids``, ``text_output``, ``finish_reason``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from backends.runtime.dtypes import MODEL_DTYPES
from backends.runtime.engine import LLMEngine
from backends.runtime.kv_quant import KV_CACHE_DTYPES
from backends.runtime.loader import load_runner
from backends.runtime.sampling_params import SamplingParams
from backends.stages.params import StageParams

DEFAULT_MODEL = "models/smollm2-135m-instruct"
SAMPLING_FIELDS = ("max_tokens", "temperature", "top_p", "top_k", "seed", "ignore_eos")


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=DEFAULT_MODEL)
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text")
    src.add_argument("--prompt-ids", help="comma-separated token ids")
    src.add_argument("--requests", help="JSONL file, one request per line")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--chat", action="store_true", help="wrap text prompts in the chat template")
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--top-k", type=int, default=0)
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--ignore-eos", action="store_true")
    ap.add_argument("--dtype", choices=MODEL_DTYPES, default=StageParams.dtype)
    ap.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default="auto",
                    help="KV cache dtype: auto (--dtype) or float8_e4m3fn (calibrated scales)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument(
        "--tensor-parallel-size",
        type=int,
        default=1,
        help="split the model over N ranks (this process and N-1 workers; cuda: one GPU each)",
    )
    ap.add_argument("--page-size", type=int, default=StageParams.page_size)
    ap.add_argument("--max-batch", type=int, default=StageParams.max_batch)
    ap.add_argument("--json", action="store_true", help="one JSON object per request")
    return ap.parse_args(argv)


def load_requests(args: argparse.Namespace) -> list[dict]:
    defaults = {"chat": args.chat, **{f: getattr(args, f) for f in SAMPLING_FIELDS}}
    if args.prompt is not None:
        return [{**defaults, "prompt": args.prompt}]
    if args.prompt_ids is not None:
        ids = [int(x) for x in args.prompt_ids.split(",") if x.strip()]
        return [{**defaults, "prompt_ids": ids}]
    reqs = []
    with open(args.requests) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            req = json.loads(line)
            if ("prompt" in req) == ("prompt_ids" in req):
                raise SystemExit(f"{args.requests}:{n}: give exactly one of prompt, prompt_ids")
            reqs.append({**defaults, **req})
    return reqs


def main(argv=None) -> int:
    args = parse_args(argv)
    reqs = load_requests(args)
    t0 = time.perf_counter()
    tp = args.tensor_parallel_size
    if tp > 1:  # every rank gets its share of the cores, this one (rank 0) too
        import torch

        torch.set_num_threads(max(1, (os.cpu_count() or 1) // tp))
    runner = load_runner(
        args.model, dtype=args.dtype, device=args.device, tensor_parallel_size=tp,
        kv_cache_dtype=args.kv_cache_dtype,
    )  # fmt: skip
    tokenizer = None
    if any("prompt" in r for r in reqs) or os.path.isfile(
        os.path.join(args.model, "tokenizer.json")
    ):
        from backends.runtime.tokenizer import Tokenizer

        tokenizer = Tokenizer(args.model)
    print(f"[generate] loaded {args.model} in {time.perf_counter() - t0:.1f}s", file=sys.stderr)
    prompts, params = [], []
    for r in reqs:
        ids = tokenizer.encode(r["prompt"], chat=r["chat"]) if "prompt" in r else r["prompt_ids"]
        prompts.append(ids)
        params.append(SamplingParams(**{k: r[k] for k in SAMPLING_FIELDS}))
    longest = max(len(p) + sp.max_tokens for p, sp in zip(prompts, params, strict=True))
    pages = sum(
        -(-(len(p) + sp.max_tokens) // args.page_size)
        for p, sp in zip(prompts, params, strict=True)
    )
    pool = runner.make_pool(max(pages, 1), args.page_size)
    max_context = min(runner.config.max_position_embeddings, max(longest, 1))
    engine = LLMEngine(runner, pool, max_batch=args.max_batch, max_context=max_context)
    t1 = time.perf_counter()
    try:
        seqs = engine.generate(list(zip(prompts, params, strict=True)))
    finally:
        runner.close()
    dt = time.perf_counter() - t1
    n_out = sum(len(s.output_ids) for s in seqs)
    print(f"[generate] {len(seqs)} requests, {n_out} tokens in {dt:.2f}s", file=sys.stderr)
    for prompt, seq in zip(prompts, seqs, strict=True):
        text = tokenizer.decode(seq.output_ids) if tokenizer else ""
        if args.json:
            obj = {
                "prompt_ids": prompt,
                "output_ids": seq.output_ids,
                "text_output": text,
                "finish_reason": seq.finish_reason,
            }
            print(json.dumps(obj))
        else:
            print(text if tokenizer else seq.output_ids)
    return 0


if __name__ == "__main__":
    sys.exit(main())
