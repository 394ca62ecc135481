#!/usr/bin/env python3
"""Readiness that tells the truth: exit 0 only when the server can serve a request.

Triton's ``/v2/health/ready`` says every model loaded; a Python-backend model (Triton 2.51)
cannot make it say anything else afterwards (the backend has no readiness hook). So the stages
export ``pd_ready`` (a decode server's router: 0 while no compatible prefill server is up and it
may not prefill locally; prefill: 0 while its KV endpoint is down), and this probe requires both:
``/v2/health/ready`` 200 AND every ``pd_ready`` sample 1. Not ready: exit 1 and one line saying
why (each prefill server's state from ``pd_router_server_up`` / ``_incompatible``). The
Kubernetes manifests run it as the readiness probe (deploy/kubernetes/).

    scripts/health.py [--host 127.0.0.1] [--http-port 8000] [--metrics-port 8002]
"""

from __future__ import annotations

import argparse
import re
import sys
import urllib.error
import urllib.request

_SAMPLE = re.compile(r"^(\w+)\{([^}]*)\} (\S+)$")


def _get(url: str, timeout: float) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, ""
    except OSError as e:
        return 0, str(e)


def samples(text: str, name: str) -> list[tuple[dict[str, str], float]]:
    out = []
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if m and m.group(1) == name:
            labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group(2)))
            out.append((labels, float(m.group(3))))
    return out


def check(host: str, http_port: int, metrics_port: int, timeout: float = 2.0) -> str | None:
    """None when ready, else why not."""
    code, _ = _get(f"http://{host}:{http_port}/v2/health/ready", timeout)
    if code != 200:
        return f"tritonserver not ready (/v2/health/ready: {code or 'unreachable'})"
    code, text = _get(f"http://{host}:{metrics_port}/metrics", timeout)
    if code != 200:
        return f"metrics unreachable ({code or text})"
    return verdict(text)


def verdict(text: str) -> str | None:
    """None when every ``pd_ready`` sample of a metrics page is 1, else why not."""
    down_samples = [lab for lab, v in samples(text, "pd_ready") if v != 1]
    if not down_samples:
        return None
    down = [lab.get("instance", "?") for lab in down_samples]
    if all(lab.get("stage") == "prefill" for lab in down_samples):  # its KV endpoint is down
        return f"not ready: {', '.join(down)}: the prefill stage's KV transfer endpoint is down"
    states = []
    for lab, v in samples(text, "pd_router_server_incompatible"):
        if v == 1:
            states.append(f"{lab.get('server')}: incompatible deployment")
    for lab, v in samples(text, "pd_router_server_up"):
        if v == 0 and lab.get("server") not in " ".join(states):
            states.append(f"{lab.get('server')}: down")
    detail = f" ({'; '.join(states)})" if states else ""
    return f"not ready: {', '.join(down)}: no compatible prefill server is up{detail}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--http-port", type=int, default=8000)
    ap.add_argument("--metrics-port", type=int, default=8002)
    ap.add_argument("--timeout", type=float, default=2.0)
    a = ap.parse_args(argv)
    why = check(a.host, a.http_port, a.metrics_port, a.timeout)
    print(why or "ready")
    return 0 if why is None else 1


if __name__ == "__main__":
    sys.exit(main())
