"""Soak test of a real server: many mixed requests, cancels, injected transfer faults and a
prefill stage process killed mid-run; every request must end well and nothing may leak.

It starts its own server (scripts/serve.sh, two prefill instances, KVTRANSFER_FAULTS fails the
KV writes of --fault-share of the rooms), sends --requests requests with --concurrency clients:
prompts of 8..600 token ids (from a pool of distinct prompts), 4..48 new tokens, greedy,
streaming or not; --cancel-share of them are cancelled by the client at a random moment; when
--kill-at of them were sent, one prefill stage process is killed (SIGKILL).

Verdict: every request ended as a success whose tokens equal the colocated reference, as a
clear error (its message names the cause), or as cancelled; none hung past --timeout; the
killed prefill was reloaded by serve.sh's supervisor; at the end no KV page is in use on either
stage and the server is ready.

    .venv/bin/python -m benchmarks.soak                    # 1,000 requests (about 15 min)
    .venv/bin/python -m benchmarks.soak --requests 120 --max-prompt 250 --max-new 24 --json  # CI

It drives the server with the end-to-end tests' harness (``tests/helpers/triton_harness.py``),
so it runs from the repository's root.
"""

from __future__ import annotations

import argparse
import os
import random
import re
import signal
import statistics
import sys
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from benchmarks.common import print_result
from tests.helpers import proc_net
from tests.helpers.triton_harness import GrpcStream, grpc_input, launch, stop, wait_pages_free

os.environ.setdefault("GLOG_minloglevel", "2")


# an error a client can act on: its message names the cause
CLEAR_ERRORS = {
    # decode/worker.py: "KV transfer failed: ...", "... after the first token was streamed: ...";
    # decode/failover.py: "KV transfer failed (why); re-dispatching it failed too: ..."
    "transfer": re.compile(
        r"KV transfer failed( after the first token was streamed| \(.+\); re-dispatching it"
        r" failed too)?: \w"
    ),
    "overloaded": re.compile(r"overloaded, retry later"),
    # decode/worker.py: a request decode could not register, take or finish
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
    from backends.runtime.loader import load_runner
    from backends.runtime.sampler import SamplingParams
    from backends.stages.params import StageParams

    torch.set_num_threads(1)
    keys = sorted({(tuple(r["ids"]), r["max_tokens"]) for r in reqs})
    runner = load_runner(StageParams().model_path)
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


def one(server, req: dict, timeout: float) -> Outcome:
    """Send one request; cancel it at req['cancel_after'] when set; how it ended."""
    s = GrpcStream(server.grpc)
    fields = {"input_ids": req["ids"], "max_tokens": req["max_tokens"], "stream": req["stream"]}
    t0 = time.time()
    try:
        s.send([grpc_input(k, v) for k, v in fields.items()])
        ids, end = [], t0 + (req.get("cancel_after") or timeout)
        while True:
            left = end - time.time()
            if left <= 0:
                if req.get("cancel_after"):
                    s.close(cancel=True)
                    s = None
                    return Outcome(req, "cancelled", ids, "", time.time() - t0)
                return Outcome(req, "hang", ids, "no answer in time", time.time() - t0)
            try:
                _, new, final, err = s.next(left)
            except Exception:  # queue.Empty: the deadline passed
                continue
            if err:
                return Outcome(req, "error", ids, err, time.time() - t0)
            ids += new
            if final:
                return Outcome(req, "ok", ids, "", time.time() - t0)
    finally:
        if s is not None:
            s.close()


def plan(args, rng: random.Random) -> list[dict]:
    lengths = [n for n in (8, 16, 40, 100, 250, 600) if n <= args.max_prompt] or [args.max_prompt]
    news = [m for m in (4, 12, 24, 48) if m <= args.max_new] or [args.max_new]
    pool = [(rng.choice(lengths), rng.choice(news), i) for i in range(args.distinct)]
    reqs = []
    for i in range(args.requests):
        n, m, seed = rng.choice(pool)
        ids = random.Random(seed).choices(range(10, 40000), k=n)
        cancel = rng.random() < args.cancel_share
        reqs.append(
            {"i": i, "ids": ids, "max_tokens": m, "stream": rng.random() < 0.5,
             "cancel_after": rng.uniform(0.2, 4.0) if cancel else None}
        )  # fmt: skip
    return reqs


def kill_one_prefill(server) -> int | None:
    for pid in proc_net.group(server.pid):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if b"/prefill/1/model.py" in cmd:
            os.kill(pid, signal.SIGKILL)
            return pid
    return None


def wait_reloads(server, timeout_s: float) -> int:
    """Prefill reloads in the server log, waiting up to ``timeout_s`` for the first one (a
    short run can end while the killed instance's model is still loading again)."""
    end = time.time() + timeout_s
    while True:
        with open(server.log, errors="replace") as f:
            reloads = f.read().count("model prefill reloaded")
        if reloads or time.time() >= end:
            return reloads
        time.sleep(1)


def ready(server) -> bool:
    try:
        with urllib.request.urlopen(f"http://{server.http}/v2/health/ready", timeout=5) as r:
            return r.status == 200
    except OSError:
        return False


def run(args) -> dict:
    rng = random.Random(args.seed)
    reqs = plan(args, rng)
    refs = reference_outputs(reqs)
    tmp = Path(tempfile.mkdtemp(prefix="soak-"))
    sets = ["max_context=1024", "max_tokens_limit=256", "num_pages=512", "bootstrap_timeout_s=10"]
    env = {"KVTRANSFER_FAULTS": f"fail={args.fault_share},seed={args.seed}"}
    server, serve, senv = launch(tmp, sets, ["prefill=2"], env=env)
    killed, t0 = None, time.time()
    try:
        with ThreadPoolExecutor(args.concurrency) as ex:
            futures = []
            for i, req in enumerate(reqs):
                if killed is None and i >= args.kill_at * len(reqs):
                    killed = kill_one_prefill(server)
                futures.append(ex.submit(one, server, req, args.timeout))
                time.sleep(rng.expovariate(args.rate))
            outcomes = [f.result() for f in futures]
        m = wait_pages_free(server, 120)
        pages = [m.get(("pd_kv_pages_in_use", s), -1) for s in ("prefill", "decode")]
        result = summarize(outcomes, refs, pages, ready(server), killed, time.time() - t0)
        reloads = wait_reloads(server, 90 if killed else 0)
        result["checks"]["killed_prefill_reloaded"] = reloads >= 1
        result["ok"] = all(result["checks"].values())
        result["prefill_reloads"] = reloads
    finally:
        stop(server, serve, senv)
    return result


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--rate", type=float, default=4.0, help="mean requests/s sent (Poisson)")
    ap.add_argument("--distinct", type=int, default=40, help="distinct prompts (references)")
    ap.add_argument("--cancel-share", type=float, default=0.10)
    ap.add_argument("--fault-share", type=float, default=0.05)
    ap.add_argument("--kill-at", type=float, default=0.5, help="kill a prefill process here")
    ap.add_argument("--timeout", type=float, default=300.0, help="a request's limit (a hang)")
    ap.add_argument("--max-prompt", type=int, default=600, help="longest prompt, tokens")
    ap.add_argument("--max-new", type=int, default=48, help="most new tokens per request")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    return print_result(run(args), args.json)


if __name__ == "__main__":
    sys.exit(main())
