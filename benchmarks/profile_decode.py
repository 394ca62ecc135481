"""Where a decode step's time goes: a per-category breakdown of one batched decode forward.

For each ``BxC`` configuration (B sequences with C tokens of context each) the script prefills
the context, then times ``--steps`` decode steps (``ModelRunner.decode`` + greedy sampling, as
the engine runs them) and profiles a few more with ``torch.profiler``. Operator self times are
grouped into categories; what no operator accounts for is Python and dispatch overhead.

    .venv/bin/python -m benchmarks.profile_decode               # markdown table, ms per step
    .venv/bin/python -m benchmarks.profile_decode --configs 8x512 --json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

from backends.runtime.loader import load_runner
from backends.runtime.runner import ModelRunner

CATEGORIES = [  # (category, substrings of operator names), first match wins
    ("KV gather (index_select)", ("index_select",)),
    ("attention in place (C++ kernel)", ("pd_runtime::paged_decode",)),
    ("attention kernel (SDPA)", ("scaled_dot_product", "_flash_attention", "_efficient_att")),
    ("compiled kernels", ("graph_", "compiledfunction", "inductor", "cpp_fused", "triton_")),
    ("KV write (index_copy_)", ("index_copy",)),
    ("indexing (index, index_put)", ("aten::index", "index_put")),
    ("GEMM: LM head", ("@lm_head",)),
    (
        "GEMM: layers",
        (
            "aten::mm",
            "aten::addmm",
            "aten::bmm",
            "mkl",
            "linear_pointwise",
            "pd_runtime::linear_small",
        ),
    ),
    ("sampling (argmax)", ("argmax",)),
]
OTHER = "elementwise (norm, rope, act, residual, copies)"


def categorize(name: str, shapes) -> str:
    low = name.lower()
    gemm = ("aten::mm", "aten::addmm", "pd_runtime::linear_small")
    if low in gemm and any(49152 in s for s in shapes if s):
        low = "@lm_head"
    for cat, keys in CATEGORIES:
        if any(k.lower() in low for k in keys):
            return cat
    return OTHER


def setup(runner: ModelRunner, batch: int, context: int, steps: int, page_size: int):
    per_seq = -(-(context + steps + 8) // page_size)
    pool = runner.make_pool(per_seq * batch, page_size)
    pool.shuffle_free_list(seed=0)  # fragmented page tables, as a serving pool has
    tables = [pool.alloc(per_seq) for _ in range(batch)]
    g = torch.Generator().manual_seed(batch)
    for t in tables:
        ids = torch.randint(10, runner.config.vocab_size, (context,), generator=g).tolist()
        runner.prefill(pool, ids, t)
    return pool, tables


def step_fn(runner: ModelRunner, pool, tables, context: int):
    state = {"pos": context, "toks": [7] * len(tables)}

    def step():
        n = len(tables)
        logits = runner.decode(pool, state["toks"], [state["pos"]] * n, tables)
        state["toks"] = logits.argmax(-1).tolist()
        state["pos"] += 1

    return step


def profile_config(runner, batch: int, context: int, args) -> dict:
    extra = args.steps + args.profile_steps + 3
    pool, tables = setup(runner, batch, context, extra, args.page_size)
    step = step_fn(runner, pool, tables, context)
    for _ in range(3):
        step()  # warm-up (and compilation, where a compiled path is on)
    times = []
    for _ in range(args.steps):
        t = time.perf_counter()
        step()
        times.append(time.perf_counter() - t)
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        t = time.perf_counter()
        for _ in range(args.profile_steps):
            step()
        prof_wall = (time.perf_counter() - t) / args.profile_steps
    cats: dict[str, float] = {}
    for ev in prof.key_averages(group_by_input_shape=True):
        cat = categorize(ev.key, ev.input_shapes)
        cats[cat] = cats.get(cat, 0.0) + ev.self_cpu_time_total / 1e3 / args.profile_steps
    accounted = sum(cats.values())
    cats["Python + dispatch (wall - ops)"] = max(prof_wall * 1e3 - accounted, 0.0)
    return {
        "config": f"{batch}x{context}",
        "step_ms_median": statistics.median(times) * 1e3,
        "step_ms_min": min(times) * 1e3,
        "tok_s_median": batch / statistics.median(times),
        "profiled_step_ms": prof_wall * 1e3,
        "categories_ms": cats,
    }


def table(rows: list[dict]) -> str:
    cats = [c for c, _ in CATEGORIES] + [OTHER, "Python + dispatch (wall - ops)"]
    head = "| ms per decode step | " + " | ".join(r["config"] for r in rows) + " |"
    out = [head, "|---" + "|---:" * len(rows) + "|"]
    for c in cats:
        vals = [r["categories_ms"].get(c, 0.0) for r in rows]
        if any(v >= 0.05 for v in vals):
            out.append(f"| {c} | " + " | ".join(f"{v:.1f}" for v in vals) + " |")
    out.append("| **profiled step** | " + " | ".join(f"{r['profiled_step_ms']:.1f}" for r in rows))
    out[-1] += " |"
    out.append(
        "| step, median (min) unprofiled | "
        + " | ".join(f"{r['step_ms_median']:.1f} ({r['step_ms_min']:.1f})" for r in rows)
        + " |"
    )
    out.append("| decode tok/s (median) | " + " | ".join(f"{r['tok_s_median']:.1f}" for r in rows))
    out[-1] += " |"
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="models/smollm2-135m-instruct")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--configs", nargs="+", default=["1x512", "8x512", "32x256"])
    ap.add_argument("--steps", type=int, default=10, help="timed steps (median)")
    ap.add_argument("--profile-steps", type=int, default=5)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    runner = load_runner(args.model, dtype=args.dtype)
    rows = []
    for spec in args.configs:
        b, c = (int(x) for x in spec.lower().split("x"))
        rows.append(profile_config(runner, b, c, args))
        print(f"[profile] {json.dumps(rows[-1])}", file=sys.stderr, flush=True)
    out = {"threads": torch.get_num_threads(), "rows": rows}
    print(json.dumps(out) if args.json else table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
