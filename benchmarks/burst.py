"""A burst of concurrent short requests against one server: every one must succeed (they wait
in the stages' queues; nothing is refused for a count), and no KV page may stay in use after.

    .venv/bin/python -m benchmarks.burst --url 127.0.0.1:8000 \\
        --metrics http://127.0.0.1:8002/metrics --requests 1000 [--json]

Half of the requests stream (``generate_stream``), half do not (``generate``). Prints the number
that succeeded, the errors by text, the wall time and the pages in use at the end; exit status 1
unless every request succeeded and the pages came back.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import sys
import time
import urllib.request

import aiohttp


async def one(session, url: str, i: int, max_tokens: int) -> str | None:
    """None on success, else the error text."""
    stream = i % 2 == 1
    body = {"text_input": f"Count to {i % 50}:", "max_tokens": max_tokens, "ignore_eos": True}
    path = "generate_stream" if stream else "generate"
    if stream:
        body["stream"] = True
    try:
        async with session.post(f"http://{url}/v2/models/ensemble/{path}", json=body) as r:
            text = await r.text()
            if r.status != 200:
                return f"HTTP {r.status}: {text[:200]}"
            if stream:
                events = [json.loads(ln[5:]) for ln in text.splitlines() if ln.startswith("data:")]
                if any("error" in e for e in events):
                    return next(e["error"] for e in events if "error" in e)[:200]
                n = sum(e.get("num_output_tokens", 0) for e in events)
            else:
                n = json.loads(text).get("num_output_tokens", 0)
            return None if n == max_tokens else f"{n} tokens instead of {max_tokens}"
    except Exception as e:  # noqa: BLE001 - reported, counted
        return f"{type(e).__name__}: {e}"[:200]


async def burst(url: str, n: int, max_tokens: int, timeout: float) -> list[str | None]:
    conn = aiohttp.TCPConnector(limit=n)
    tmo = aiohttp.ClientTimeout(total=timeout)
    async with aiohttp.ClientSession(connector=conn, timeout=tmo) as session:
        return await asyncio.gather(*(one(session, url, i, max_tokens) for i in range(n)))


def pages_in_use(metrics_url: str, wait_s: float = 30.0) -> float:
    end = time.time() + wait_s
    while True:
        with urllib.request.urlopen(metrics_url, timeout=10) as r:
            text = r.read().decode()
        used = sum(float(ln.rsplit(" ", 1)[1]) for ln in text.splitlines()
                   if ln.startswith("pd_kv_pages_in_use"))  # fmt: skip
        if used == 0 or time.time() > end:
            return used
        time.sleep(0.5)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", default="127.0.0.1:8000", help="Triton HTTP address")
    ap.add_argument("--metrics", default="http://127.0.0.1:8002/metrics")
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument("--max-tokens", type=int, default=4)
    ap.add_argument("--timeout", type=float, default=900.0, help="per request, s")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    t0 = time.time()
    results = asyncio.run(burst(a.url, a.requests, a.max_tokens, a.timeout))
    wall = time.time() - t0
    errors = collections.Counter(r for r in results if r is not None)
    out = {
        "requests": a.requests, "ok": results.count(None), "errors": dict(errors),
        "wall_s": round(wall, 1), "pages_in_use_after": pages_in_use(a.metrics),
    }  # fmt: skip
    print(json.dumps(out) if a.json else "\n".join(f"{k}: {v}" for k, v in out.items()))
    return 0 if out["ok"] == a.requests and out["pages_in_use_after"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
