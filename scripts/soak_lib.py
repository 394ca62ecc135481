"""Pieces of scripts/soak.py (and fuzz_control.py): the colocated references, how a request
ended, the verdict and its report."""

from __future__ import annotations

import json
import re
import statistics
from dataclasses import dataclass

# an error a client can act on: its message names the cause
CLEAR_ERRORS = {
    # decode.py: "KV transfer failed: ...", "... failed after the first token was streamed: ...";
    # decode_failover.py: "KV transfer failed (why); re-dispatching it failed too: ..."
    "transfer": re.compile(
        r"KV transfer failed( after the first token was streamed| \(.+\); re-dispatching it"
        r" failed too)?: \w"
    ),
    "overloaded": re.compile(r"overloaded, retry later"),
    # decode.py / decode_failover.py: a request decode could not register, take or finish
    "decode": re.compile(
        r"(registering KV pages with prefill failed|decode could not take the( prefilled)?"
        r" request|decode failed for this request): \w"
    ),
    # after "decode": its "registering ... with prefill failed: ..." contains this one
    "prefill": re.compile(r"prefill (failed|did not run): \w"),
    "instance died": re.compile(
        r"Stub process .* is not healthy|stub process .* (died|exited)", re.I
    ),
    "shutdown": re.compile(r"shutting down"),
}


@dataclass
class Outcome:
    req: dict
    kind: str  # ok / error / cancelled / hang
    ids: list[int]
    error: str
    seconds: float


def reference_outputs(reqs: list[dict]) -> dict[tuple, list[int]]:
    """(prompt ids, max_tokens) -> greedy output of the colocated runtime (the same runtime,
    checked against transformers by the unit tests), for every distinct request."""
    import torch

    from backends.runtime.engine import LLMEngine
    from backends.runtime.runner import ModelRunner
    from backends.runtime.sampler import SamplingParams
    from backends.stages.params import StageParams

    torch.set_num_threads(1)
    keys = sorted({(tuple(r["ids"]), r["max_tokens"]) for r in reqs})
    runner = ModelRunner.load(StageParams().model_path)
    pages = sum(-(-(len(k) + m) // 16) for k, m in keys)
    engine = LLMEngine(runner, runner.make_pool(pages, 16), max_batch=16)
    outs = engine.generate([(list(k), SamplingParams(max_tokens=m)) for k, m in keys])
    return {k: s.output_ids for k, s in zip(keys, outs, strict=True)}


def classify(error: str) -> str | None:
    return next((kind for kind, pat in CLEAR_ERRORS.items() if pat.search(error)), None)


def summarize(outcomes, refs, pages, server_ready, killed, seconds) -> dict:
    counts: dict[str, int] = {}
    errors: dict[str, int] = {}
    unclear, mismatches = [], []
    for o in outcomes:
        counts[o.kind] = counts.get(o.kind, 0) + 1
        want = refs[(tuple(o.req["ids"]), o.req["max_tokens"])]
        if o.kind == "ok" and o.ids != want:
            mismatches.append(o.req["i"])
        if o.kind == "cancelled" and o.ids and o.ids != want[: len(o.ids)]:
            mismatches.append(o.req["i"])  # what it got before the cancel must be right too
        if o.kind == "error":
            kind = classify(o.error)
            errors[kind or "unclear"] = errors.get(kind or "unclear", 0) + 1
            if kind is None:
                unclear.append(o.error[:200])
    lat = sorted(o.seconds for o in outcomes if o.kind == "ok")
    checks = {
        "no_hang": counts.get("hang", 0) == 0,
        "outputs_equal_reference": not mismatches,
        "errors_are_clear": not unclear,
        "no_page_in_use_at_end": pages == [0, 0],
        "server_ready_at_end": server_ready,
        "a_prefill_process_was_killed": killed is not None,
    }
    return {
        "ok": all(checks.values()),
        "checks": checks,
        "requests": len(outcomes),
        "outcomes": counts,
        "errors_by_kind": errors,
        "unclear_errors": unclear[:10],
        "mismatches": mismatches[:20],
        "pages_in_use_at_end": pages,
        "latency_ok_s": {
            "p50": round(statistics.median(lat), 2) if lat else None,
            "p99": round(lat[min(len(lat) - 1, int(0.99 * len(lat)))], 2) if lat else None,
        },
        "killed_prefill_pid": killed,
        "seconds": round(seconds, 1),
    }


def print_result(result: dict, as_json: bool) -> int:
    """Print a run's verdict (one JSON object, or a line per field); the exit status."""
    if as_json:
        print(json.dumps(result))
    else:
        for k, v in result.items():
            print(f"{k}: {v}")
    return 0 if result["ok"] else 1
