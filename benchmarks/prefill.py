"""Prefill stage throughput: concurrent prompts batched into one forward (up to
``prefill_batch_tokens``) against one forward per prompt, with the KV going to a decode stage.

Each run starts a prefill stage and a decode stage as separate processes (real Mooncake),
submits every room to prefill at once, then has decode register every room (max_tokens 1), as
the ensemble does, and times from the first submit until decode holds every room's KV and first
token. "serial" sets
``prefill_batch_tokens`` to one prompt's length (one room a forward: the stage before batching);
"batched" keeps the given budget (default: the stage default, 512). Neither chunks a prompt.
Each run's stages first take one untimed round of the same load (fresh processes touch their
KV pages and connect to each other then, as a serving stage did long before).

    .venv/bin/python -m benchmarks.prefill --json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics

import torch

from backends.stages.params import StageParams
from benchmarks.common import log, run_meta
from benchmarks.ttft.workers import Stage


def _round(prefill: Stage, decode: Stage, rooms: range, length: int) -> dict:
    """Every room of ``rooms`` at once (random prompts seeded by the first room); timed."""
    g = torch.Generator().manual_seed(rooms[0])
    ids = torch.randint(10, 40000, (len(rooms), length), generator=g).tolist()
    reqs = [{"room": room, "ids": p} for room, p in zip(rooms, ids, strict=True)]
    prefill.call("submit", reqs)  # as in serving: prefill holds the requests, then decode
    rooms_ids = [(r["room"], r["ids"]) for r in reqs]  # registers each room
    decode.send("register", {"rooms": rooms_ids, "bootstrap_addr": prefill.info["bootstrap_addr"]})
    got, sub = decode.recv(), prefill.call("wait")
    bad = sub["errors"] + [r["reason"] for r in got.values() if r["status"] != "Success"]
    if bad:
        raise RuntimeError(f"{len(bad)} rooms failed: {bad[:3]}")
    secs = max(r["t_done"] for r in got.values()) - sub["t_start"]
    return {"seconds": secs, "batches": sub["batches"], "tok_s": len(rooms) * length / secs}


def one_run(args, n: int, length: int, budget: int, room0: int) -> dict:
    chunk = max(budget, StageParams.max_prefill_tokens)  # batching only: nothing is chunked
    extra = {"prefill_batch_tokens": budget, "max_prefill_tokens": chunk, "dtype": args.dtype}
    pages = 2 * n * (length // args.page_size + 2) + 8  # both rounds: no wait for a free
    prefill = Stage("prefill", args.model, args.page_size, pages, args.threads, extra=extra)
    decode = Stage("decode", args.model, args.page_size, pages, 1, extra=extra)
    try:
        for rooms in (range(room0 + n, room0 + 2 * n), range(room0, room0 + n)):  # warm-up, timed
            res = _round(prefill, decode, rooms, length)
        return res
    finally:
        decode.stop()
        prefill.stop()


def measure(args, n: int, length: int) -> dict:
    out = {"prompts": n, "prompt_tokens": length}
    modes = {"serial": length, "batched": args.budget}
    runs: dict[str, list[dict]] = {m: [] for m in modes}
    for r in range(args.runs):  # the modes in turn: the same noise for both
        for mode, budget in modes.items():
            res = one_run(args, n, length, budget, 1000 + 100 * r)
            runs[mode].append(res)
            log(f"{n} x {length} {mode} (budget {budget}) run {r + 1}: "
                f"{res['tok_s']:.0f} prompt tok/s, {res['batches']} batches")  # fmt: skip
    for mode, budget in modes.items():
        tok_s = statistics.median(x["tok_s"] for x in runs[mode])
        out[mode] = {"budget": budget, "tok_s": tok_s, "runs": runs[mode]}
    out["batched_over_serial"] = out["batched"]["tok_s"] / out["serial"]["tok_s"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default="models/smollm2-135m-instruct")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--loads", default="32x128,4x2048", help="PROMPTSxTOKENS,...")
    ap.add_argument("--budget", type=int, default=StageParams.prefill_batch_tokens)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="prefill's torch")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    args.device = "cpu"
    loads = []
    for item in args.loads.split(","):
        n, length = (int(x) for x in item.split("x"))
        loads.append(measure(args, n, length))
    print("| prompts x tokens | serial tok/s | batched tok/s (budget) | batched / serial |")
    print("|---|---:|---:|---:|")
    for r in loads:
        print(f"| {r['prompts']} x {r['prompt_tokens']} | {r['serial']['tok_s']:.0f} | "
              f"{r['batched']['tok_s']:.0f} ({r['batched']['budget']}) | "
              f"{r['batched_over_serial']:.2f} |")  # fmt: skip
    if args.json:
        print(json.dumps({"meta": run_meta(args), "loads": loads}))


if __name__ == "__main__":
    main()
