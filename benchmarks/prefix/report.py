"""A mode's summary (TTFT, KV bytes, prefill tokens computed, hit rates, usage's cached tokens),
the headline ratios against issue 47's targets, the table and the plot."""

from __future__ import annotations

import numpy as np

from .counters import COUNTERS
from .workload import reuse

TARGETS = {  # issue 47, item 6
    "ttft_p50_cached_over_uncached": "<= 0.33 at reuse_fraction >= 0.80",
    "bytes_over_uncached_share": "within 10 % of 1.0",
    "prefill_hit_rate_cache_aware_over_least_queue": ">= 2.0",
}


def pct(xs, q) -> float | None:
    return float(np.percentile(xs, q)) if len(xs) else None


def summarize(records: list[dict], d: dict, seconds: float) -> dict:
    """One mode: ``records`` (workload.run_chats), ``d`` its counters' deltas."""
    ok = [r for r in records if not r["reply"].error and r["reply"].first]
    ttft = [r["reply"].first - r["reply"].sent for r in ok]
    prompt = sum(len(r["prompt"]) for r in ok)
    seen = reuse(records)
    n = max(len(ok), 1)

    def rate(cached, lookup):
        return d[cached] / d[lookup] if d[lookup] else 0.0

    def record(r: dict, seen_tokens: int) -> dict:
        rep = r["reply"]
        return {
            "chat": r["chat"],
            "turn": r["turn"],
            "prompt_tokens": len(r["prompt"]),
            "seen_tokens": seen_tokens,
            "ttft_s": rep.first - rep.sent if rep.first else None,
            "cached_tokens": rep.cached,
            "output_ids": rep.ids,
            "error": rep.error,
        }

    return {
        "requests": len(records),
        "errors": len(records) - len(ok),
        "seconds": round(seconds, 1),
        "ttft_p50_s": pct(ttft, 50),
        "ttft_p99_s": pct(ttft, 99),
        "prompt_tokens": prompt,
        "prompt_tokens_mean": prompt / n,
        "reuse_fraction": sum(seen) / max(sum(len(r["prompt"]) for r in records), 1),
        "kv_bytes": d["prefill_bytes"],
        "kv_bytes_per_request": d["prefill_bytes"] / n,
        "kv_bytes_per_prompt_token": d["prefill_bytes"] / max(prompt, 1),
        "prefill_tokens_computed": prompt - d["prefill_cached"],
        "prefill_tokens_computed_per_request": (prompt - d["prefill_cached"]) / n,
        "prefill_hit_rate": rate("prefill_cached", "prefill_lookup"),
        "decode_hit_rate": rate("decode_cached", "decode_lookup"),
        "usage_cached_tokens": sum(r["reply"].cached for r in ok),
        "router_cached_tokens": d["router_cached"],
        "routed": d["routed"],
        "counters": {k: d[k] for k in COUNTERS},
        "records": [record(r, s) for r, s in zip(records, seen, strict=True)],
    }


def ratio(a, b):
    return a / b if a is not None and b else None


def same_answers(res: dict, base: str, other: str) -> list[int] | None:
    """[equal, compared] answers of two modes, turn by turn (None: a mode did not run)."""
    if base not in res or other not in res:
        return None
    ref = {(r["chat"], r["turn"]): r["output_ids"] for r in res[base]["records"]}
    got = [(r["chat"], r["turn"], r["output_ids"]) for r in res[other]["records"]]
    pairs = [(ids, ref[(c, t)]) for c, t, ids in got if (c, t) in ref]
    return [sum(a == b for a, b in pairs), len(pairs)]


def headline(res: dict) -> dict:
    """The ratios issue 47 sets targets for (None where a mode they need did not run)."""

    def get(mode, key):
        return res[mode][key] if mode in res else None

    reuse_fraction = get("pd-cache", "reuse_fraction")
    bytes_ratio = ratio(
        get("pd-cache", "kv_bytes_per_prompt_token"), get("pd-off", "kv_bytes_per_prompt_token")
    )
    hit_rate = get("pd-cache", "decode_hit_rate")
    uncached = None if hit_rate is None else 1 - hit_rate
    unseen = None if reuse_fraction is None else 1 - reuse_fraction
    out = {
        "ttft_p50_cached_over_uncached": ratio(
            get("pd-cache", "ttft_p50_s"), get("pd-off", "ttft_p50_s")
        ),
        "ttft_p50_cached_over_uncached_single": ratio(
            get("single-cache", "ttft_p50_s"), get("single-off", "ttft_p50_s")
        ),
        "reuse_fraction": reuse_fraction,
        "bytes_over_uncached_share": ratio(bytes_ratio, uncached),
        "bytes_with_over_without": bytes_ratio,
        "uncached_share_decode": uncached,
        "bytes_over_unseen_share": ratio(bytes_ratio, unseen),
        "prefill_hit_rate_cache_aware_over_least_queue": ratio(
            get("pd-cache", "prefill_hit_rate"), get("pd-queue", "prefill_hit_rate")
        ),
        "answers_equal_cache_off": {
            "pd-cache": same_answers(res, "pd-off", "pd-cache"),
            "pd-queue": same_answers(res, "pd-off", "pd-queue"),
            "single-cache": same_answers(res, "single-off", "single-cache"),
        },
    }
    out["targets"] = verdicts(out)
    return out


def verdicts(h: dict) -> dict:
    """Each target: its text, the value, met (None: not measured)."""
    ttft, b, hit = (h[k] for k in TARGETS)
    met = {
        "ttft_p50_cached_over_uncached": None
        if ttft is None
        else ttft <= 0.33 and h["reuse_fraction"] >= 0.80,
        "bytes_over_uncached_share": None if b is None else abs(b - 1) <= 0.10,
        "prefill_hit_rate_cache_aware_over_least_queue": None if hit is None else hit >= 2.0,
    }
    return {k: {"target": t, "value": h[k], "met": met[k]} for k, t in TARGETS.items()}


def table(res: dict) -> str:
    rows = [
        "| mode | requests (errors) | TTFT p50 / p99 s | KV MB / request | prefill tokens "
        "computed / request | prefill hit rate | decode hit rate | usage cached tokens / "
        "request | reuse |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for mode, r in res.items():
        n = max(r["requests"] - r["errors"], 1)
        p50, p99 = (("-" if x is None else f"{x:.2f}") for x in (r["ttft_p50_s"], r["ttft_p99_s"]))
        rows.append(
            f"| {mode} | {r['requests']} ({r['errors']}) | {p50} / {p99} | "
            f"{r['kv_bytes_per_request'] / 1e6:.1f} | "
            f"{r['prefill_tokens_computed_per_request']:.0f} | {r['prefill_hit_rate']:.2f} | "
            f"{r['decode_hit_rate']:.2f} | {r['usage_cached_tokens'] / n:.0f} | "
            f"{r['reuse_fraction']:.2f} |"
        )
    return "\n".join(rows) + "\n"


def plot(res: dict, path: str) -> None:
    """TTFT p50 / p99 per mode (log scale) beside the work per request: KV MB moved and prefill
    tokens computed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = list(res)
    x = np.arange(len(modes))
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    for off, key, label in ((-0.2, "ttft_p50_s", "p50"), (0.2, "ttft_p99_s", "p99")):
        a.bar(x + off, [res[m][key] or 0 for m in modes], 0.4, label=label)
    a.set_yscale("log")
    a.set_xticks(x, modes, rotation=20)
    a.set_ylabel("TTFT, s (log)")
    a.set_title("Time to first token")
    a.legend()
    kv = [res[m]["kv_bytes_per_request"] / 1e6 for m in modes]
    comp = [res[m]["prefill_tokens_computed_per_request"] for m in modes]
    bars = [b.bar(x - 0.2, kv, 0.4, label="KV MB moved", color="tab:green")]
    b2 = b.twinx()
    bars.append(b2.bar(x + 0.2, comp, 0.4, label="prefill tokens computed", color="tab:purple"))
    b.set_xticks(x, modes, rotation=20)
    b.set_ylabel("KV MB / request")
    b2.set_ylabel("prefill tokens computed / request")
    b.set_title("Work per request")
    b.legend(handles=bars, loc="upper left", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
