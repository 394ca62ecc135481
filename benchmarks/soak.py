"""Soak test of a real server: many mixed requests, cancels, injected transfer faults and a
prefill stage process killed mid-run; every request must end well and nothing may leak.

It starts its own server (scripts/serve.sh, two prefill instances, KVTRANSFER_FAULTS fails the
KV writes of --fault-share of the rooms), sends --requests requests with --concurrency clients:
prompts of 8..600 token ids (from a pool of distinct prompts), 4..48 new tokens, greedy,
streaming or not; --cancel-share of them are cancelled by the client at a random moment; when
--kill-at of them were sent, one prefill stage process is killed (SIGKILL).

``--front openai`` (the default) sends them as a user would: through the OpenAI front
(``/v1/completions``, the official ``openai`` SDK, token-id prompts) with an API key on
(``serve.sh --api-key-file``, a fresh random key); a client cancels by closing its connection
(a stream mid-way, or a plain request at its deadline). ``--front grpc`` sends them to the
ensemble over Triton's streaming gRPC and cancels with ``stop_stream(cancel_requests=True)``.

Verdict: every request ended as a success equal to the colocated reference (greedy, the same
runtime: gRPC compares the token ids; the front compares the text and the completion token count
of its usage), as a clear error (its message names the cause; through the front, also in
OpenAI's error shape, a streamed one as an SSE error event), or as cancelled (what it got before
equal to the reference's start); none hung past --timeout; the API key was required (a request
without it, or with a wrong one, got a 401); the killed prefill was reloaded by serve.sh's
supervisor; at the end no KV page is in use or quarantined on either stage, no request is held
anywhere (the front's ``/health`` counts none in flight, both stages' queues and batches are
empty), the server is ready, and one more request equals its reference.

    .venv/bin/python -m benchmarks.soak --out soak.json    # 1,000 requests (about 8 min)
    .venv/bin/python -m benchmarks.soak --requests 80 --max-prompt 250 --max-new 24 --json  # CI

``--shared-prefix N`` prepends one of ``--prefixes`` shared prefixes of about N token ids to
every prompt (the server runs ``prefix_cache=on``; keep N + ``--max-prompt`` + ``--max-new``
under its max_context of 1024): distinct prompts then hit each other's cached pages, on page
boundaries and off. The result's ``prefix_cache`` counts each stage's cached and looked-up
prompt tokens, evicted blocks and cached pages at the end (the cache is on by default:
``auto``; identical prompts hit it in every run).

It drives the server with the end-to-end tests' harness (``tests/helpers/triton_harness.py``),
so it runs from the repository's root.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import secrets
import signal
import statistics
import sys
import tempfile
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from benchmarks.common import command_line, print_result
from tests.helpers import proc_net
from tests.helpers.triton_harness import GrpcStream, grpc_input, launch, metrics, stop

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
    ids: list[int]  # gRPC: the output token ids (the front: empty)
    error: str
    seconds: float
    text: str = ""  # the front: the completion's text (so far, when cancelled)
    tokens: int | None = None  # the front: its usage's completion_tokens
    status: int | None = None  # the front: an error's HTTP status (None: an SSE error event)
    body: dict | None = None  # the front: an error's {"message", "type", "param", "code"}


def reference_outputs(reqs: list[dict]) -> dict[tuple, list[int]]:
    """(prompt ids, max_tokens) -> greedy output of the colocated runtime (the same runtime,
    checked against transformers by the unit tests), for every distinct request."""
    import torch

    from backends.runtime.engine import LLMEngine
    from backends.runtime.loader import load_runner
    from backends.runtime.sampling_params import SamplingParams
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


def openai_shaped(o: Outcome) -> bool:
    """An error the front answered in OpenAI's shape: a message, a type and a code."""
    b = o.body or {}
    return all(isinstance(b.get(k), str) and b[k] for k in ("message", "type", "code"))


def summarize(outcomes, refs, texts, end: dict, killed, seconds) -> dict:
    """The verdict. ``refs``: (prompt, max_tokens) -> reference ids; ``texts``: -> its text
    (None for gRPC: ids are compared); ``end``: what the server held after the run."""
    counts: dict[str, int] = {}
    errors: dict[str, int] = {}
    statuses: dict[str, int] = {}
    unclear, mismatches, unshaped = [], [], []
    for o in outcomes:
        counts[o.kind] = counts.get(o.kind, 0) + 1
        key = (tuple(o.req["ids"]), o.req["max_tokens"])
        want = refs[key]
        if texts is None:
            got_ok = o.ids == want
            prefix_ok = o.ids == want[: len(o.ids)]
        else:
            got_ok = o.text == texts[key] and o.tokens == len(want)
            prefix_ok = texts[key].startswith(o.text)
        if o.kind == "ok" and not got_ok:
            mismatches.append(o.req["i"])
        if o.kind == "cancelled" and not prefix_ok:
            mismatches.append(o.req["i"])  # what it got before the cancel must be right too
        if o.kind == "error":
            kind = classify(o.error)
            errors[kind or "unclear"] = errors.get(kind or "unclear", 0) + 1
            if kind is None:
                unclear.append(o.error[:200])
            if texts is not None:
                where = str(o.status) if o.status is not None else "stream event"
                statuses[where] = statuses.get(where, 0) + 1
                if not openai_shaped(o):
                    unshaped.append(o.error[:200])
    lat = sorted(o.seconds for o in outcomes if o.kind == "ok")
    checks = {
        "no_hang": counts.get("hang", 0) == 0,
        "outputs_equal_reference": not mismatches,
        "errors_are_clear": not unclear,
        "no_page_in_use_at_end": end["pages_in_use"] == [0, 0],
        "no_page_quarantined_at_end": end["pages_quarantined"] == 0,
        "no_request_held_at_end": not any(end["held"].values()),
        "server_ready_at_end": end["ready"],
        "a_request_after_the_run_equals_its_reference": end["probe_ok"],
        "a_prefill_process_was_killed": killed is not None,
    }
    if texts is not None:
        checks["errors_in_openai_shape"] = not unshaped
        # the front tries again what Triton failed before any token (the killed instance's)
        checks["no_request_lost_to_the_killed_instance"] = "instance died" not in errors
    out = {
        "ok": all(checks.values()),
        "checks": checks,
        "requests": len(outcomes),
        "outcomes": counts,
        "errors_by_kind": errors,
        "unclear_errors": unclear[:10],
        "mismatches": mismatches[:20],
        "pages_in_use_at_end": end["pages_in_use"],
        "held_at_end": end["held"],
        "latency_ok_s": {
            "p50": round(statistics.median(lat), 2) if lat else None,
            "p99": round(lat[min(len(lat) - 1, int(0.99 * len(lat)))], 2) if lat else None,
        },
        "killed_prefill_pid": killed,
        "seconds": round(seconds, 1),
        "probe_attempts": end.get("probe_attempts", []),
    }
    if texts is not None:
        out["errors_by_status"] = statuses
        out["errors_not_in_openai_shape"] = unshaped[:10]
    return out


def one(server, req: dict, timeout: float) -> Outcome:
    """Send one request over gRPC; cancel it at req['cancel_after'] when set; how it ended."""
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


class Front:
    """The OpenAI front as a user's client sees it: the official SDK with the API key."""

    def __init__(self, url: str, key: str):
        import openai

        self.openai, self.url, self.key = openai, url, key
        self.client = openai.OpenAI(base_url=url, api_key=key, max_retries=0)
        self.model = self.client.models.list().data[0].id

    def key_enforced(self) -> bool:
        """/v1 answers 401 in OpenAI's shape without a key (plain HTTP: the SDK needs one) and
        with a wrong one (the SDK)."""
        body = json.dumps({"model": self.model, "prompt": [15, 16], "max_tokens": 1}).encode()
        plain = urllib.request.Request(
            self.url + "/completions", body, {"Content-Type": "application/json"}
        )
        try:
            urllib.request.urlopen(plain, timeout=30).close()
            return False
        except urllib.error.HTTPError as e:
            if e.code != 401 or json.load(e)["error"].get("code") != "missing_api_key":
                return False
        wrong = self.openai.OpenAI(base_url=self.url, api_key=secrets.token_hex(32), max_retries=0)
        try:
            wrong.completions.create(model=self.model, prompt=[15, 16], max_tokens=1)
            return False
        except self.openai.AuthenticationError as e:
            return e.status_code == 401 and e.code == "invalid_api_key"

    def in_flight(self) -> int:
        """The requests the front holds (its /health, open to probes)."""
        with urllib.request.urlopen(self.url.removesuffix("/v1") + "/health", timeout=10) as r:
            return int(json.load(r)["requests_in_flight"])

    def one(self, req: dict, timeout: float) -> Outcome:
        """Send one completion; a cancel closes the connection (a stream at its first chunk past
        req['cancel_after'], a plain request at that deadline); how it ended."""
        oa, cancel, t0, text = self.openai, req.get("cancel_after"), time.time(), ""

        def done(kind: str, error: str = "", tokens=None, status=None, body=None) -> Outcome:
            return Outcome(req, kind, [], error, time.time() - t0, text, tokens, status, body)

        kw = {"model": self.model, "prompt": req["ids"], "max_tokens": req["max_tokens"]}
        kw.update(temperature=0, timeout=cancel or timeout)  # a read's limit (a hang)
        try:
            if not req["stream"]:
                r = self.client.completions.create(**kw)
                text = r.choices[0].text
                return done("ok", tokens=r.usage.completion_tokens)
            stream = self.client.completions.create(
                stream=True, stream_options={"include_usage": True}, **kw
            )
            tokens = None
            with stream:  # leaving it closes the connection: the front cancels the request
                for chunk in stream:
                    if chunk.choices:
                        text += chunk.choices[0].text
                    if chunk.usage is not None:
                        tokens = chunk.usage.completion_tokens
                    if cancel and time.time() - t0 >= cancel:
                        return done("cancelled")
            return done("ok", tokens=tokens)
        except oa.APITimeoutError:
            return done("cancelled") if cancel else done("hang", "no answer in time")
        except oa.APIStatusError as e:
            body = e.body if isinstance(e.body, dict) else None
            return done("error", (body or {}).get("message") or str(e), None, e.status_code, body)
        except oa.APIConnectionError as e:
            return done("error", f"connection to the front failed: {e!r}")
        except oa.APIError as e:  # an SSE error event in a stream (then [DONE])
            body = e.body if isinstance(e.body, dict) else None
            return done("error", (body or {}).get("message") or e.message, None, None, body)


def shared_prefixes(tokens: int, n: int) -> list[list[int]]:
    """``n`` prefixes of about ``tokens`` token ids (none for 0); prefix k is ``5 * k`` longer,
    so the pages they fill end at different offsets (cache hits on page boundaries and off)."""
    if tokens <= 0:
        return []
    return [random.Random(-1 - k).choices(range(10, 40000), k=tokens + 5 * k) for k in range(n)]


def plan(args, rng: random.Random) -> list[dict]:
    lengths = [n for n in (8, 16, 40, 100, 250, 600) if n <= args.max_prompt] or [args.max_prompt]
    news = [m for m in (4, 12, 24, 48) if m <= args.max_new] or [args.max_new]
    pool = [(rng.choice(lengths), rng.choice(news), i) for i in range(args.distinct)]
    shared = shared_prefixes(args.shared_prefix, args.prefixes)
    reqs = []
    for i in range(args.requests):
        n, m, seed = rng.choice(pool)
        ids = random.Random(seed).choices(range(10, 40000), k=n)
        if shared:  # distinct prompts share a prefix: partial prefix-cache hits
            ids = shared[seed % len(shared)] + ids
        cancel = rng.random() < args.cancel_share
        reqs.append(
            {"i": i, "ids": ids, "max_tokens": m, "stream": rng.random() < 0.5,
             "cancel_after": rng.uniform(0.2, 4.0) if cancel else None}
        )  # fmt: skip
    return reqs


def kill_one_prefill(server) -> int | None:
    pid = proc_net.stage_stub(server.pid, "prefill")
    if pid is not None:
        os.kill(pid, signal.SIGKILL)
    return pid


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


# (metric, stage) gauges that count a request some thread still holds
HELD = [
    ("pd_requests_waiting", "prefill"),
    ("pd_queued_prompt_tokens", "prefill"),
    ("pd_requests_waiting", "decode"),
    ("pd_requests_running", "decode"),
]


def wait_idle(server, front: Front | None, timeout_s: float) -> dict:
    """Poll until no page is in use or quarantined and nothing is held (the stages' queues and
    batches, the front's requests in flight), at most ``timeout_s``; the last reading."""
    end = time.time() + timeout_s
    while True:
        m = metrics(server)
        got = {
            "pages_in_use": [m.get(("pd_kv_pages_in_use", s), -1) for s in ("prefill", "decode")],
            "pages_quarantined": m.get(("pd_kv_pages_quarantined", "decode"), 0),
            "held": {f"{name}{{{stage}}}": m.get((name, stage), 0) for name, stage in HELD},
        }
        if front is not None:
            got["held"]["front_requests_in_flight"] = front.in_flight()
        idle = got["pages_in_use"] == [0, 0] and not got["pages_quarantined"]
        if (idle and not any(got["held"].values())) or time.time() > end:
            return got
        time.sleep(0.5)


def prefix_cache_counters(server) -> dict:
    """What the stages' prefix caches did in the run (cached / looked-up prompt tokens, blocks
    evicted, pages held), per stage."""
    m = metrics(server)
    keys = {
        "cached_tokens": "pd_prefix_cached_tokens_total",
        "lookup_tokens": "pd_prefix_lookup_tokens_total",
        "evicted_blocks": "pd_prefix_evicted_blocks_total",
        "cached_pages": "pd_prefix_cached_pages",
    }
    stages = ("prefill", "decode")
    return {s: {k: int(m.get((name, s), 0)) for k, name in keys.items()} for s in stages}


def reference_texts(refs: dict) -> dict:
    """Reference ids -> the text the front must answer (the stages' tokenizer)."""
    from backends.runtime.tokenizer import Tokenizer
    from backends.stages.params import StageParams

    tok = Tokenizer(StageParams().model_path)
    return {k: tok.decode(ids) for k, ids in refs.items()}


PROBE_ATTEMPTS = 3


def probe_after(send, probe: dict, timeout: float, equal) -> dict:
    """One more request once the run is over: it must succeed and ``equal`` its reference. The
    transfer faults stay injected, so an attempt whose KV writes were failed on purpose (a clear
    "transfer" error, as --fault-share of all requests get) is sent again, up to PROBE_ATTEMPTS
    times; any other error, or a different output, fails at once. -> {"ok", "attempts": what
    each attempt got}."""
    attempts = []
    for _ in range(PROBE_ATTEMPTS):
        o = send(probe, timeout)
        attempts.append("ok" if o.kind == "ok" else f"{o.kind}: {o.error[:300]}")
        if o.kind == "ok":
            return {"ok": bool(equal(o)), "attempts": attempts}
        if o.kind != "error" or classify(o.error) != "transfer":
            break
    return {"ok": False, "attempts": attempts}


def run(args) -> dict:
    rng = random.Random(args.seed)
    reqs = plan(args, rng)
    probe = {**reqs[0], "i": -1, "cancel_after": None, "stream": True}  # after the run
    refs = reference_outputs(reqs)
    texts = reference_texts(refs) if args.front == "openai" else None
    tmp = Path(tempfile.mkdtemp(prefix="soak-"))
    sets = ["max_context=1024", "max_tokens_limit=256", "num_pages=512", "bootstrap_timeout_s=10"]
    if args.shared_prefix:
        sets.append("prefix_cache=on")  # a model that cannot cache by page fails here, loudly
    env = {"KVTRANSFER_FAULTS": f"fail={args.fault_share},seed={args.seed}"}
    serve_args, key = [], secrets.token_hex(32)
    if args.front == "openai":
        key_file = tmp / "api-keys"
        key_file.write_text(key + "\n")
        key_file.chmod(0o600)
        serve_args = ["--api-key-file", str(key_file)]
    load0 = os.getloadavg()
    server, serve, senv = launch(tmp, sets, ["prefill=2"], env=env, serve_args=serve_args)
    killed, t0 = None, time.time()
    try:
        front = Front(server.openai, key) if args.front == "openai" else None
        send = front.one if front is not None else (lambda req, t: one(server, req, t))
        key_enforced = front.key_enforced() if front is not None else None
        with ThreadPoolExecutor(args.concurrency) as ex:
            futures = []
            for i, req in enumerate(reqs):
                if killed is None and i >= args.kill_at * len(reqs):
                    killed = kill_one_prefill(server)
                futures.append(ex.submit(send, req, args.timeout))
                time.sleep(rng.expovariate(args.rate))
            outcomes = [f.result() for f in futures]
        seconds = time.time() - t0
        end = wait_idle(server, front, 120)
        end["ready"] = ready(server)
        cache = prefix_cache_counters(server)
        # the killed stub's instance fails every request it gets ("instance died") until the
        # supervisor's reload swaps it out: probe the server it recovered to, not that window
        reloads = wait_reloads(server, 90 if killed else 0)
        key = (tuple(probe["ids"]), probe["max_tokens"])
        after = probe_after(
            send,
            probe,
            args.timeout,
            lambda o: o.ids == refs[key] if texts is None else o.text == texts[key],
        )
        end["probe_ok"], end["probe_attempts"] = after["ok"], after["attempts"]
        result = summarize(outcomes, refs, texts, end, killed, seconds)
        if key_enforced is not None:
            result["checks"]["api_key_required"] = key_enforced
        result["checks"]["killed_prefill_reloaded"] = reloads >= 1
        result["ok"] = all(result["checks"].values())
        result["prefill_reloads"] = reloads
        result["prefix_cache"] = cache
    finally:
        stop(server, serve, senv)
    load1 = os.getloadavg()
    return {
        **result,
        "front": args.front,
        "command": command_line("benchmarks.soak"),
        "date": time.strftime("%Y-%m-%d %H:%M", time.gmtime(t0)) + " UTC",
        "host": {"cpus": os.cpu_count(), "load_avg_start": load0[:2], "load_avg_end": load1[:2]},
        "settings": {k: v for k, v in vars(args).items() if k not in ("json", "out")},
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--front",
        choices=("openai", "grpc"),
        default="openai",
        help="the OpenAI front with an API key (default), or the ensemble over gRPC",
    )
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
    ap.add_argument(
        "--shared-prefix",
        type=int,
        default=0,
        help="every prompt starts with one of --prefixes shared prefixes of this many token ids"
        " (and the server runs prefix_cache=on); 0 = off",
    )
    ap.add_argument("--prefixes", type=int, default=4, help="shared prefixes (--shared-prefix)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--out", default=None, help="also write the result (JSON) to this file")
    args = ap.parse_args(argv)
    result = run(args)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
            f.write("\n")
    return print_result(result, args.json)


if __name__ == "__main__":
    sys.exit(main())
