#!/usr/bin/env python
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

    .venv/bin/python scripts/soak.py                       # 1,000 requests (about 15 min)
    .venv/bin/python scripts/soak.py --requests 120 --max-prompt 250 --max-new 24 --json  # CI
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import sys
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests", "helpers")]
os.environ.setdefault("GLOG_minloglevel", "2")

import proc_net  # noqa: E402
from soak_lib import Outcome, print_result, reference_outputs, summarize  # noqa: E402
from triton_harness import GrpcStream, grpc_input, launch, stop, wait_pages_free  # noqa: E402


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
