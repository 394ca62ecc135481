"""Benchmark speculative decoding: decode tokens/s with and without a draft model.

Each batch runs the same chat prompts through the plain engine (target only) and through the
speculative engine (self-draft of the target's first K layers, a draft checkpoint or an EAGLE
head), greedy, up to ``--max-tokens`` tokens per sequence, ending at EOS as served
(``--ignore-eos``: always ``--max-tokens``); greedy speculation is lossless, so both engines
produce the same tokens either way. The engines of a batch size take turns, run by run, so
that a drift of the machine's speed hits them alike. Decode tokens/s counts every token after
the first (the first comes from prefill) over the time of the steps after admission. Each
number is the median of --runs runs; the greedy outputs of both engines are compared token for
token (column ``same``).

    .venv/bin/python -m benchmarks.spec                                  # table
    .venv/bin/python -m benchmarks.spec --draft-layers 24 28 --spec-tokens 1 2 4 --batches 1
    .venv/bin/python -m benchmarks.spec --json                           # one JSON object

``--pd`` also runs the largest batch's prompts through a prefill stage in its own process and a
decode stage in this one (real Mooncake over loopback, :func:`pd_spec_stats`).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

from backends.runtime.dtypes import MODEL_DTYPES
from backends.runtime.engine import LLMEngine
from backends.runtime.loader import load_runner
from backends.runtime.sampler import SamplingParams
from backends.runtime.spec import DraftSpec, SpecEngine, load_draft
from backends.runtime.spec_eagle import spec_engine
from backends.runtime.tokenizer import Tokenizer
from backends.stages.params import StageParams
from benchmarks.common import log, run_meta

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain photosynthesis in two sentences.",
    "List three uses of a paperclip.",
    "What is 12 times 7?",
    "Give me a tip for learning a new language.",
    "Describe a cat to someone who has never seen one.",
    "Why is the sky blue?",
]


def run_once(engine, groups: list[list[list[int]]], max_tokens: int,
             ignore_eos: bool = False) -> tuple[float, list, dict]:  # fmt: skip
    """Each group of prompts as one batch, the groups one after the other. -> (decode
    tokens/s over all groups, outputs, spec stats of this run)."""
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=ignore_eos)
    if isinstance(engine, SpecEngine):
        engine.stats = type(engine.stats)()
    dt, outputs, n = 0.0, [], 0
    for g, prompts in enumerate(groups):
        seqs = [engine.add_request(f"g{g}-{i}", p, params) for i, p in enumerate(prompts)]
        engine.step()  # admission: prefill + first token, not timed
        t = time.perf_counter()
        while engine.has_unfinished():
            engine.step()
        dt += time.perf_counter() - t
        outputs += [s.output_ids for s in seqs]
        n += sum(len(s.output_ids) - 1 for s in seqs)
    stats = engine.stats.as_dict() if isinstance(engine, SpecEngine) else {}
    return n / dt, outputs, stats


def measure(makers: dict, prompts, args) -> dict[str, dict]:
    """Each engine ``makers`` builds, warmed up, then run in turn ``--runs`` times (a drift of
    the machine's speed hits them alike) -> per name the median decode tokens/s, the spec stats
    and the outputs."""
    engines = {name: make() for name, make in makers.items()}
    for engine in engines.values():
        run_once(engine, [prompts[0][:1]], 4)  # warm up
    rates: dict[str, list] = {name: [] for name in engines}
    last: dict[str, tuple] = {}
    for _ in range(args.runs):
        for name, engine in engines.items():
            rate, outputs, st = run_once(engine, prompts, args.max_tokens, args.ignore_eos)
            rates[name].append(rate)
            last[name] = (outputs, st)
    out = {}
    for name, (outputs, st) in last.items():
        res = {"decode_tok_s": statistics.median(rates[name])}
        if st:  # greedy: the same every run
            res |= {k: st[k] for k in ("acceptance_rate", "mean_accepted_length")}
        out[name] = res | {"outputs": outputs}
    return out


def batches_of(texts: list[list[int]], b: int, held_out: int) -> list[list[list[int]]]:
    """The batches of a batch size: every held-out prompt b at a time, else the first b
    prompts (cycled) once."""
    if held_out:
        return [texts[i : i + b] for i in range(0, len(texts), b)]
    return [[texts[i % len(texts)] for i in range(b)]]


def pd_spec_stats(model: str, draft: str, k: int, prompts: list[list[int]], max_tokens: int,
                  page_size: int, ignore_eos: bool = False) -> dict:  # fmt: skip
    """Speculative decoding through PD: a prefill stage in its own process and a decode stage in
    this one, real Mooncake over loopback, the same prompts as the colocated runs, greedy; ->
    the decode stage's acceptance counters (the ones ``/metrics`` exports)."""
    from backends.runtime.config import ModelConfig
    from backends.stages.decode import DecodeWorker
    from backends.stages.request import StageRequest
    from tests.helpers.stagepeer import Collector, PrefillProcess

    per = -(-(max(map(len, prompts)) + max_tokens) // page_size) + 1
    limit = ModelConfig.from_pretrained(model).max_position_embeddings
    params = dict(model_dir=model, page_size=page_size, num_pages=per * len(prompts) + 8,
                  spec_enabled=True, draft_model_dir=draft, spec_tokens=k, spec_max_batch=0,
                  max_batch=len(prompts), bootstrap_timeout_s=60.0,
                  max_context=min(limit, 2048), max_tokens_limit=min(limit, 2048) - 1)  # fmt: skip
    prefill = PrefillProcess(**params)
    decode = DecodeWorker(StageParams(**params))
    try:
        outs = []
        sp = SamplingParams(max_tokens=max_tokens, ignore_eos=ignore_eos)
        for i, ids in enumerate(prompts):  # decode registers first, as in the ensemble
            c = Collector()
            decode.submit(StageRequest(room=7000 + i, prompt_ids=ids, sampling=sp,
                                       bootstrap_addr=prefill.addr, stream=True), c)  # fmt: skip
            outs.append(c)
        for i, ids in enumerate(prompts):
            err = prefill.prefill(7000 + i, ids)[1]
            if err:
                raise RuntimeError(f"prefill failed: {err}")
        for c in outs:
            if not c.done.wait(600) or c.events[-1].error:
                raise RuntimeError(f"PD request failed: {c.events[-1].error}")
        st = decode.stats()
        return {"outputs": [c.ids for c in outs], "proposed": st["spec_proposed"],
                "accepted": st["spec_accepted"],
                "acceptance_rate": st["spec_accepted"] / max(1, st["spec_proposed"]),
                "mean_accepted_length": st["spec_mean_accepted_length"]}  # fmt: skip
    finally:
        decode.close()
        prefill.stop()


def pd_row(args, rows: list[dict], texts: list[list[int]]) -> dict:
    """PD acceptance on the largest batch's prompts against the colocated run of the same
    prompts, draft and k (greedy: both must also give the same tokens)."""
    if not args.draft:
        raise SystemExit("--pd needs --draft (a draft checkpoint or an EAGLE head)")
    b, k = max(args.batches), max(args.spec_tokens)
    colo = next(r for r in rows if r["batch"] == b and r["config"].endswith(f"k={k}"))
    prompts = [p for group in batches_of(texts, b, args.held_out) for p in group]
    pd = pd_spec_stats(args.model, args.draft, k, prompts, args.max_tokens, args.page_size,
                       args.ignore_eos)  # fmt: skip
    log(f"PD batch {b} k={k}: acceptance {pd['acceptance_rate']:.3f}"
        f" (colocated {colo['acceptance_rate']:.3f})")  # fmt: skip
    return {"acceptance_pd": pd["acceptance_rate"],
            "acceptance_pd_over_colocated": pd["acceptance_rate"] / colo["acceptance_rate"]
            if colo["acceptance_rate"] else None,
            "pd_same_tokens_as_colocated": pd["outputs"] == colo["outputs"]}  # fmt: skip


def summary(rows: list[dict]) -> dict:
    """The headline of the first draft configuration with the most spec tokens: tokens per
    verify step, acceptance rate and speedup at batch 1 and 8 (where measured)."""
    spec = [r for r in rows if "speedup" in r]
    if not spec:
        return {}
    name = max(spec, key=lambda r: int(r["config"].rsplit("k=", 1)[1]))["config"]
    pick = {r["batch"]: r for r in spec if r["config"] == name}
    first = pick[min(pick)]
    out = {"config": name, "tokens_per_step": first["mean_accepted_length"],
           "acceptance_rate": first["acceptance_rate"]}  # fmt: skip
    for b in (1, 8):
        if b in pick:
            out[f"speedup_batch{b}"] = pick[b]["speedup"]
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="models/smollm2-135m-instruct")
    ap.add_argument("--draft", default=None,
                    help="draft checkpoint or EAGLE head directory (else self-draft)")  # fmt: skip
    ap.add_argument("--held-out", type=int, default=0,
                    help="N held-out prompts of benchmarks/eagle_data.py (the heads' evaluation"
                    " split) instead of the 8 fixed ones")  # fmt: skip
    ap.add_argument("--draft-layers", type=int, nargs="+", default=[28], help="self-draft K")
    ap.add_argument("--spec-tokens", type=int, nargs="+", default=[1, 2], help="k per step")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--ignore-eos", action="store_true", help="always --max-tokens tokens")
    ap.add_argument("--spec-max-batch", type=int, default=0,
                    help="steps of more sequences draft nothing (the spec_max_batch parameter)")
    ap.add_argument("--dtype", choices=MODEL_DTYPES, default=StageParams.dtype)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--page-size", type=int, default=StageParams.page_size)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: default)")
    ap.add_argument(
        "--random-prompts", type=int, default=0, help="N random token ids per prompt (no tokenizer)"
    )
    ap.add_argument("--pd", action="store_true", help="also run the largest batch's prompts"
                    " through a prefill and a decode stage (real Mooncake) with --draft and the"
                    " largest k: acceptance_pd_over_colocated")  # fmt: skip
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    target = load_runner(args.model, dtype=args.dtype, device=args.device)
    drafts = (
        {f"draft {os.path.basename(args.draft.rstrip('/'))}": load_draft(target, path=args.draft)}
        if args.draft
        else {f"self-draft K={k}": load_draft(target, num_layers=k) for k in args.draft_layers}
    )
    rows = []
    if args.random_prompts:
        g = torch.Generator().manual_seed(0)
        vocab = target.config.vocab_size
        texts = [
            torch.randint(3, vocab, (args.random_prompts,), generator=g).tolist() for _ in range(8)
        ]
    elif args.held_out:
        from benchmarks import eagle_data

        convs = eagle_data.prompts(args.held_out, seed=1, held_out=True)
        texts = eagle_data.encode(Tokenizer(args.model), convs)
    else:
        tok = Tokenizer(args.model)
        texts = [tok.encode(t, chat=True) for t in PROMPTS]
    per_seq = -(-(max(map(len, texts)) + args.max_tokens) // args.page_size)
    for b in args.batches:
        prompts = batches_of(texts, b, args.held_out)
        pages = per_seq * b

        def plain(pages=pages, b=b):
            return LLMEngine(target, target.make_pool(pages, args.page_size), max_batch=b)

        def spec(draft, k, pages=pages, b=b):
            dpool = draft.make_pool(pages, args.page_size, role="draft")
            pool = target.make_pool(pages, args.page_size)
            dspec = DraftSpec(draft, dpool, k, args.spec_max_batch)
            return spec_engine(target, pool, dspec, max_batch=b)

        makers = {"target only": plain} | {
            f"{name} k={k}": (lambda d=draft, k=k: spec(d, k))
            for name, draft in drafts.items() for k in args.spec_tokens
        }  # fmt: skip
        results = measure(makers, prompts, args)
        base = results["target only"]
        for config, res in results.items():
            if config != "target only":
                res["speedup"] = res["decode_tok_s"] / base["decode_tok_s"]
                res["same"] = res["outputs"] == base["outputs"]
            log(f"batch {b} {config}: {res['decode_tok_s']:.1f} tok/s")
            rows.append({"config": config, "batch": b} | res)
    pd = pd_row(args, rows, texts) if args.pd else {}
    for r in rows:
        r.pop("outputs")
    meta = run_meta(args, max_tokens=args.max_tokens, target_layers=target.config.num_layers)
    if args.json:
        print(json.dumps({"meta": meta, **summary(rows), **pd, "results": rows}))
        return 0
    print(
        f"decode tokens/s, median of {args.runs} runs ({args.device}, {args.dtype}, "
        f"{meta['threads']} threads, up to {args.max_tokens} tokens/seq, greedy)"
    )
    head = ["config", "batch", "tok/s", "speedup", "accept", "mean len", "same"]
    print(f"{head[0]:<24}" + "".join(f"{h:>10}" for h in head[1:]))
    for r in rows:
        cells = [
            str(r["batch"]),
            f"{r['decode_tok_s']:.1f}",
            f"{r.get('speedup', 1.0):.2f}x",
            f"{r['acceptance_rate']:.2f}" if "acceptance_rate" in r else "-",
            f"{r['mean_accepted_length']:.2f}" if "mean_accepted_length" in r else "-",
            {True: "yes", False: "NO"}.get(r.get("same"), "-"),
        ]
        print(f"{r['config']:<24}" + "".join(f"{c:>10}" for c in cells))
    return 0


if __name__ == "__main__":
    sys.exit(main())
