"""Pure logic of the TTFT benchmark: modes -> layer groups, statistics, exposed fraction, summary.

No torch, no processes: unit-tested in tests/unit/test_bench_ttft.py.

Exposed fraction of a mode (share of the serial transfer time that still shows in TTFT)::

    exposed = (TTFT_mode - TTFT_colocated) / (TTFT_serial - TTFT_colocated)

0 = the transfer is fully hidden behind compute, 1 = as bad as sending everything after prefill.
"""

from __future__ import annotations

import statistics

from backends.stages.policy import LayerGroupPolicy

BASE_MODES = ("colocated", "serial", "pipelined")
# fixed group counts for the sweep; None = one group per layer
FIXED_MODES = {"fixed-2": 2, "fixed-4": 4, "fixed-8": 8, "fixed-all": None}
ALL_MODES = BASE_MODES + tuple(FIXED_MODES)
TARGET_SLACK = 0.05  # target: exposed <= 1 / groups + TARGET_SLACK


def even_groups(num_layers: int, k: int | None) -> list[tuple[int, int]]:
    """``k`` contiguous layer ranges of near-equal size tiling [0, num_layers); None = per layer."""
    if num_layers < 1:
        raise ValueError(f"num_layers must be >= 1, got {num_layers}")
    k = num_layers if k is None else max(1, min(k, num_layers))
    bounds = [round(i * num_layers / k) for i in range(k + 1)]
    return [(a, b) for a, b in zip(bounds, bounds[1:], strict=False) if b > a]


def mode_groups(
    mode: str, num_tokens: int, num_layers: int, policy: LayerGroupPolicy | None = None
) -> list[tuple[int, int]] | None:
    """Layer groups prefill streams for ``mode``; None for colocated (no transfer)."""
    if mode == "colocated":
        return None
    if mode == "serial":
        return [(0, num_layers)]
    if mode == "pipelined":
        return (policy or LayerGroupPolicy()).groups(num_tokens, num_layers)
    if mode in FIXED_MODES:
        return even_groups(num_layers, FIXED_MODES[mode])
    raise ValueError(f"unknown mode {mode!r}; choose from {ALL_MODES}")


def exposed_fraction(ttft_mode: float, ttft_colocated: float, ttft_serial: float) -> float | None:
    """(mode - colocated) / (serial - colocated); None when serial is not slower than colocated."""
    denom = ttft_serial - ttft_colocated
    if denom <= 0:
        return None
    return (ttft_mode - ttft_colocated) / denom


def summarize(values: list[float]) -> dict:
    if not values:
        return {"median": None, "min": None, "max": None, "n": 0}
    return {
        "median": statistics.median(values),
        "min": min(values),
        "max": max(values),
        "n": len(values),
    }


def group_key(s: dict) -> tuple:
    return (s["model"], s["prompt_len"], s["concurrency"])


def build_rows(samples: list[dict]) -> list[dict]:
    """One row per (model, prompt_len, concurrency, mode) with medians and exposed fraction.

    samples: dicts with model, prompt_len, concurrency, mode, groups, ttft_ms and (transfer
    modes) compute_ms, tail_ms, wire_gbps, tokens_match.
    """
    by: dict[tuple, list[dict]] = {}
    for s in samples:
        by.setdefault(group_key(s) + (s["mode"],), []).append(s)
    rows = []
    for (model, plen, conc, mode), ss in by.items():
        row = {
            "model": model,
            "prompt_len": plen,
            "concurrency": conc,
            "mode": mode,
            "groups": ss[0]["groups"],
            "ttft_ms": summarize([s["ttft_ms"] for s in ss]),
            "runs": len({s["run"] for s in ss}),
        }
        for k in (
            "compute_ms", "tail_ms", "wire_gbps", "compute_cpu_ms", "other_cpu_ms",
            "first_token_ms",
        ):  # fmt: skip
            vals = [s[k] for s in ss if s.get(k) is not None]
            row[k] = statistics.median(vals) if vals else None
        row["tokens_match"] = all(s.get("tokens_match", True) for s in ss)
        rows.append(row)
    base = {(r["model"], r["prompt_len"], r["concurrency"], r["mode"]): r for r in rows}
    for r in rows:
        k = (r["model"], r["prompt_len"], r["concurrency"])
        # triton:<mode> rows: the floor is direct colocated (the ensemble has no colocated
        # path), the ceiling the Triton serial mode
        prefix = "triton:" if r["mode"].startswith("triton:") else ""
        col, ser = base.get(k + ("colocated",)), base.get(k + (prefix + "serial",))
        r["exposed_fraction"] = r["serial_overhead"] = r["target"] = r["target_met"] = None
        r["exposed_tail"] = r["compute_ratio"] = None
        if col is None or ser is None:
            continue
        c, s, m = col["ttft_ms"]["median"], ser["ttft_ms"]["median"], r["ttft_ms"]["median"]
        r["exposed_fraction"] = exposed_fraction(m, c, s)
        # noise-robust view: only the time after this request's own compute ended (excludes
        # compute jitter, and also any compute slowdown the overlapping transfer caused)
        st, mt = ser["tail_ms"], r["tail_ms"]
        r["exposed_tail"] = mt / st if st and mt is not None else None
        cc, mc = col["compute_ms"], r["compute_ms"]
        r["compute_ratio"] = mc / cc if cc and mc is not None else None
        r["serial_overhead"] = (s - c) / c if c else None
        if r["mode"].removeprefix("triton:") not in ("colocated", "serial") and r["groups"] > 1:
            r["target"] = 1 / r["groups"] + TARGET_SLACK
            if r["exposed_fraction"] is not None:
                r["target_met"] = r["exposed_fraction"] <= r["target"]
    order = {m: i for i, m in enumerate(ALL_MODES)}
    order.update({f"triton:{m}": len(order) + i for i, m in enumerate(ALL_MODES)})
    rows.sort(key=lambda r: (r["model"], r["concurrency"], r["prompt_len"], order[r["mode"]]))
    return rows


def headline(rows: list[dict], long_len: int, short_len: int | None, model: str) -> dict:
    """The keys --quick promises, for ``model`` at concurrency 1."""

    def pick(plen: int) -> dict[str, dict]:
        return {
            r["mode"]: r
            for r in rows
            if r["model"] == model and r["prompt_len"] == plen and r["concurrency"] == 1
        }

    long = pick(long_len)
    out = {
        "model": model,
        "long_prompt_len": long_len,
        "ttft_ms": {m: r["ttft_ms"]["median"] for m, r in long.items()},
        "ttft_ms_min_max": {m: [r["ttft_ms"]["min"], r["ttft_ms"]["max"]] for m, r in long.items()},
        "groups": long["pipelined"]["groups"] if "pipelined" in long else None,
        "exposed_fraction_pipelined": None,
        "exposed_fraction": {m: r["exposed_fraction"] for m, r in long.items()},
        "exposed_tail": {m: r["exposed_tail"] for m, r in long.items()},
        "compute_ratio": {m: r["compute_ratio"] for m, r in long.items()},
        "serial_overhead": None,
        "target": None,
        "target_met": None,
        "short_prompt_len": short_len,
        "short_prompt_pipelined_over_serial": None,
        # client-visible first token (sent by prefill before the KV landed) vs colocated TTFT
        "first_token_over_colocated": None,
    }
    if "pipelined" in long and "colocated" in long:
        col, ft = long["colocated"]["ttft_ms"]["median"], long["pipelined"].get("first_token_ms")
        if col and ft is not None:
            out["first_token_over_colocated"] = ft / col
    if "pipelined" in long:
        p = long["pipelined"]
        out.update(
            exposed_fraction_pipelined=p["exposed_fraction"],
            serial_overhead=p["serial_overhead"],
            target=p["target"],
            target_met=p["target_met"],
        )
    if short_len is not None:
        short = pick(short_len)
        if "pipelined" in short and "serial" in short:
            ser = short["serial"]["ttft_ms"]["median"]
            out["short_prompt_pipelined_over_serial"] = (
                short["pipelined"]["ttft_ms"]["median"] / ser if ser else None
            )
            out["short_prompt_groups"] = short["pipelined"]["groups"]
    return out
