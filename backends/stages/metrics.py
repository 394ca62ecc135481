"""The stages' custom Triton metrics: ONE table (name, kind, stats key, meaning).

Each stage core's ``stats()`` snapshot holds cumulative totals and current values under the
keys below; the Triton glue exports the ones a stage reports (counters from the totals, gauges as
is) with labels ``stage`` and ``instance``. ``docs/metrics.md`` is generated from this table.
Failures by reason are one more counter family, ``pd_kv_transfer_failures_total{reason}``, and
so are refusals of another deployment's peers, ``pd_incompatible_refusals_total{reason}``;
``pd_deployment_info`` carries the stage's fingerprint (kvtransfer/protocol/identity.py) as labels.
"""

from __future__ import annotations

from typing import NamedTuple


class Metric(NamedTuple):
    name: str
    kind: str  # "counter" | "gauge"
    key: str  # key in the stage's stats() snapshot
    doc: str


C, G = "counter", "gauge"
FAILURES = Metric(
    "pd_kv_transfer_failures_total", C, "failures", "KV transfers that failed, by reason"
)
REFUSALS = Metric(
    "pd_incompatible_refusals_total",
    C,
    "refusals",
    "Peers of another deployment refused (prefill) or refusing (decode, router), by reason:"
    " secret / model / draft / kv / protocol differ",
)
INFO = Metric(
    "pd_deployment_info",
    G,
    "",
    "Always 1; its labels are the stage's deployment fingerprint (protocol, key_id of the"
    " secret, model digest, model_name, draft, kv): what a router compares before routing",
)
BY_REASON = (FAILURES, REFUSALS)

# The tables below keep `fmt: skip`: one row per metric (name, kind, key, then its doc continued
# under it); formatted, each row would spread over six lines and the table would not read as one.
METRICS = [
    Metric("pd_ready", G, "ready",
           "1 when the stage can serve, else 0 (a decode server's router: no compatible"
           " prefill server is up and it may not prefill locally; prefill: KV endpoint down)"),
    Metric("pd_ttft_seconds_total", C, "ttft_sum",
           "Sum of time to first token (decode submit -> first token), s"),
    Metric("pd_ttft_requests_total", C, "ttft_count", "Requests with a first token"),
    Metric("pd_itl_seconds_total", C, "itl_sum", "Sum of inter-token latencies, s"),
    Metric("pd_itl_intervals_total", C, "itl_count", "Inter-token intervals measured"),
    Metric("pd_kv_transfer_bytes_total", C, "bytes", "KV bytes transferred (prefill -> decode)"),
    Metric("pd_kv_transfer_seconds_total", C, "seconds",
           "KV transfer seconds (prefill: first group queued -> last landed;"
           " decode: claim -> complete)"),
    Metric("pd_kv_rooms_ok_total", C, "rooms_ok", "KV transfers (rooms) that succeeded"),
    Metric("pd_kv_pages_in_use", G, "pages_in_use", "KV pages allocated in this stage's pools"),
    Metric("pd_kv_pages_total", G, "num_pages", "KV pages in this stage's pools"),
    Metric("pd_requests_running", G, "running", "Requests in the decode batch"),
    Metric("pd_requests_waiting", G, "waiting",
           "Requests waiting (prefill: queued; decode: pages, KV transfer, admission)"),
    Metric("pd_decode_batch_size", G, "last_batch", "Sequences decoded in the last step"),
    Metric("pd_decode_max_batch_size", G, "max_batch", "Largest decode batch seen"),
    Metric("pd_decode_steps_total", C, "steps", "Decode steps run"),
    Metric("pd_generated_tokens_total", C, "tokens", "Tokens generated"),
    Metric("pd_requests_total", C, "requests", "Requests received by the stage"),
    Metric("pd_requests_failed_total", C, "failed", "Requests that ended in an error"),
    Metric("pd_requests_cancelled_total", C, "cancelled", "Requests cancelled by the client"),
    Metric("pd_requests_overloaded_total", C, "overloaded",
           "Requests refused or ended 'overloaded, retry later' (queue full or queue timeout)"),
    Metric("pd_queued_prompt_tokens", G, "queued_tokens",
           "Prompt tokens of the requests a prefill instance holds (waiting or computing)"),
    Metric("pd_failovers_total", C, "failovers",
           "Requests decode re-dispatched to another prefill server (room failed before its KV"
           " completed: server died, hung or refused)"),
    Metric("pd_local_prefills_total", C, "local_prefills",
           "Requests a decode server prefilled itself (local_prefill_*: no KV transfer)"),
    Metric("pd_kv_pages_quarantined", G, "quarantined_pages",
           "Decode pages of ended rooms a prefill may still write into (held until it drains)"),
    Metric("pd_loop_errors_total", C, "loop_errors",
           "Exceptions caught in a stage's loop threads (the thread went on)"),
    Metric("pd_dropped_frames_total", C, "dropped_total",
           "Control and cancel frames dropped (garbage, unsigned, stale, replay, hostile, flood)"),
    # prefix cache (prefix_cache on: prefill counts what it did not compute, decode what it
    # did not receive)
    Metric("pd_prefix_cached_tokens_total", C, "prefix_cached_tokens",
           "Prompt tokens served from the stage's prefix cache"),
    Metric("pd_prefix_lookup_tokens_total", C, "prefix_lookup_tokens",
           "Prompt tokens looked up in the stage's prefix cache"),
    Metric("pd_prefix_evicted_blocks_total", C, "prefix_evicted_blocks",
           "Cached blocks evicted (pool pressure or the cache's share)"),
    Metric("pd_prefix_cached_pages", G, "prefix_cached_pages", "Pages the prefix cache holds"),
    # speculative decoding (decode with spec_enabled only)
    Metric("pd_spec_proposed_tokens_total", C, "spec_proposed", "Draft tokens proposed"),
    Metric("pd_spec_accepted_tokens_total", C, "spec_accepted", "Draft tokens the target accepted"),
    Metric("pd_spec_verify_steps_total", C, "spec_verify_steps",
           "Target forwards that verified at least one draft (per sequence)"),
    Metric("pd_spec_acceptance_rate", G, "spec_acceptance_rate",
           "Accepted / proposed draft tokens since start"),
    Metric("pd_spec_mean_accepted_length", G, "spec_mean_accepted_length",
           "Tokens per verify step (accepted drafts + 1) since start"),
    Metric("pd_spec_undrafted_steps_total", C, "spec_undrafted_steps",
           "Sequence steps decoded without drafting because drafting did not pay (spec_adaptive)"),
    Metric("pd_spec_switched_off_total", C, "spec_switched_off",
           "Times drafting was switched off for a sequence (or a sequence started without it"
           " while drafting did not pay server-wide)"),
    Metric("pd_spec_branch_kept_total", C, "spec_branch_kept",
           "Verify steps that kept another draft chain than the first (spec_branches)"),
]  # fmt: skip


class Histogram(NamedTuple):
    name: str
    key: str  # key of the stage's observations (backends/stages/latency.py)
    buckets: list[float]
    doc: str


_S = [0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0]
_ITL = [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5]
_BYTES = [float(1 << (16 + 2 * i)) for i in range(9)]  # 64 KiB .. 4 GiB, x4
# Prometheus histograms (Triton 2.51 python backend: MetricFamily.HISTOGRAM), per stage instance
# (a table, `fmt: skip` as METRICS)
HISTOGRAMS = [
    Histogram("pd_request_ttft_seconds", "ttft", _S,
              "Time to first token per request (decode submit -> first token), s"),
    Histogram("pd_request_itl_seconds", "itl", _ITL, "Inter-token latency (each interval), s"),
    Histogram("pd_request_e2e_seconds", "e2e", _S,
              "End-to-end latency per request (decode submit -> final response), s"),
    Histogram("pd_request_queue_seconds", "queue", _S,
              "Queue time per request (decode: submit -> pages registered with prefill;"
              " prefill: queued -> compute start), s"),
    Histogram("pd_kv_transfer_request_seconds", "kv_transfer", _S,
              "KV transfer time per request (prefill: first group queued -> last landed;"
              " decode: claim -> Complete), s"),
    Histogram("pd_kv_transfer_request_bytes", "kv_bytes", _BYTES,
              "KV bytes per request (target and draft entries)"),
]  # fmt: skip


# A decode server's router, per prefill server (label ``server`` = HOST:GRPC_PORT); keys of
# PrefillRouter.stats()["servers"][server] (a table, `fmt: skip` as METRICS).
ROUTER_METRICS = [
    Metric("pd_router_requests_total", C, "dispatched", "Requests routed to the prefill server"),
    Metric("pd_router_prompt_tokens_total", C, "tokens", "Prompt tokens routed to it"),
    Metric("pd_router_refused_total", C, "refused",
           "Forwards it did not take (error answer, unreachable, no answer in time)"),
    Metric("pd_router_lost_total", C, "lost",
           "Forwards whose connection broke after its answer (the server died or went away)"),
    Metric("pd_router_server_up", G, "up", "1 while the server is routed to, 0 while down"),
    Metric("pd_router_server_incompatible", G, "incompatible",
           "1 while the server is of another deployment (secret, model, draft, KV layout or"
           " protocol differs; the reason is in the log and the client's error), else 0"),
    Metric("pd_router_load_tokens", G, "load",
           "Queued prompt tokens the router sees there (its metric + this router's since)"),
    Metric("pd_router_cached_tokens_total", C, "hit_tokens",
           "Prompt tokens of the requests routed there that the router expected its prefix cache"
           " to hold (prompts it routed there before; `local`: decode's own cache)"),
]  # fmt: skip


def reference_table() -> str:
    """The metrics reference (markdown), generated from :data:`METRICS`."""
    rows = ["| metric | kind | meaning |", "|---|---|---|"]
    for mt in [*METRICS, *BY_REASON, INFO]:
        label = "{stage, instance, reason}" if mt in BY_REASON else "{stage, instance}"
        label = "{stage, instance, protocol, key_id, model, ...}" if mt is INFO else label
        rows.append(f"| `{mt.name}{label}` | {mt.kind} | {mt.doc} |")
    for mt in ROUTER_METRICS:
        rows.append(f"| `{mt.name}{{stage, instance, server}}` | {mt.kind} | {mt.doc} |")
    for h in HISTOGRAMS:
        rows.append(f"| `{h.name}{{stage, instance}}` | histogram | {h.doc} |")
    return "\n".join(rows) + "\n"


def publish(metric, kind: str, value: float, last: list[float]) -> None:
    """Set a Triton gauge, or advance a counter by what the stage's running total grew since
    ``last[0]`` (a one-item list the caller keeps per metric)."""
    if kind == "gauge":
        metric.set(value)
    elif value > last[0]:
        metric.increment(value - last[0])
        last[0] = value
