"""What a mode counts on its stages (server metrics or the stage cores' stats, the same keys),
as deltas over the workload."""

from __future__ import annotations

import time

COUNTERS = {  # our key -> (metric, stage), summed over instances (and the router's servers)
    "prefill_bytes": ("pd_kv_transfer_bytes_total", "prefill"),
    "prefill_cached": ("pd_prefix_cached_tokens_total", "prefill"),
    "prefill_lookup": ("pd_prefix_lookup_tokens_total", "prefill"),
    "decode_cached": ("pd_prefix_cached_tokens_total", "decode"),
    "decode_lookup": ("pd_prefix_lookup_tokens_total", "decode"),
    "router_cached": ("pd_router_cached_tokens_total", "router"),
}
ROUTED = "pd_router_requests_total"  # per prefill server (label ``server``)


def counters_of(samples) -> dict:
    """COUNTERS from Prometheus samples (name, labels, value), and the requests routed to each
    prefill server (``routed``)."""
    got = dict.fromkeys(COUNTERS, 0.0)
    routed: dict[str, float] = {}
    for name, labels, value in samples:
        for key, (metric, stage) in COUNTERS.items():
            if name == metric and labels.get("stage") == stage:
                got[key] += value
        if name == ROUTED:
            server = labels.get("server", "?")
            routed[server] = routed.get(server, 0) + value
    return {**got, "routed": routed}


def delta(after: dict, before: dict) -> dict:
    out = {k: after[k] - before[k] for k in COUNTERS}
    out["routed"] = {s: n - before["routed"].get(s, 0) for s, n in after["routed"].items()}
    return out


def settled(backend, tries: int = 20) -> dict:
    """``backend.counters()`` once two reads ``backend.settle_s`` apart agree (a server's
    metrics lag its stages)."""
    last = backend.counters()
    for _ in range(tries):
        time.sleep(backend.settle_s)
        now = backend.counters()
        if now == last:
            return now
        last = now
    return last
