"""Helpers shared by the thin Triton ``model.py`` adapters (the only module besides them that
knows Triton's Python API; ``pb`` is the ``triton_python_backend_utils`` module they pass in).

* tensor access: optional scalar inputs with defaults, int lists, strings;
* :class:`StageMetrics`: custom metric families fed from a worker's ``stats()`` snapshot by a
  small background thread (counters from cumulative totals, gauges as is).
"""

from __future__ import annotations

import logging
import os
import threading

import numpy as np

from .sampler import SamplingParams

log = logging.getLogger(__name__)


def setup_env() -> None:
    os.environ.setdefault("GLOG_minloglevel", "2")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def get(pb, request, name: str):
    t = pb.get_input_tensor_by_name(request, name)
    return None if t is None else t.as_numpy()


def scalar(pb, request, name: str, default, cast):
    """An optional one-element input (any shape with one element); ValueError otherwise."""
    arr = get(pb, request, name)
    if arr is None:
        return default
    if arr.size != 1:
        raise ValueError(f"input {name} must hold exactly one value, got shape {list(arr.shape)}")
    v = arr.reshape(-1)[0]
    if isinstance(v, bytes):
        v = v.decode("utf-8", errors="replace")
    return cast(v)


def sampling_params(pb, request, min_max_tokens: int | None = None) -> SamplingParams:
    """The sampling inputs every stage after preprocess receives (TEMPERATURE, TOP_P, TOP_K,
    SEED (-1 = none), MAX_TOKENS, IGNORE_EOS); ``min_max_tokens`` raises MAX_TOKENS to at least
    that (prefill samples one token whatever the budget; decode validates it)."""
    seed = scalar(pb, request, "SEED", None, int)
    max_tokens = scalar(pb, request, "MAX_TOKENS", None, int)
    if min_max_tokens is not None:
        max_tokens = max(min_max_tokens, max_tokens)
    return SamplingParams(
        temperature=scalar(pb, request, "TEMPERATURE", None, float),
        top_p=scalar(pb, request, "TOP_P", None, float),
        top_k=scalar(pb, request, "TOP_K", None, int),
        seed=None if seed < 0 else seed,
        max_tokens=max_tokens,
        ignore_eos=scalar(pb, request, "IGNORE_EOS", None, bool),
    )


def text(pb, request, name: str) -> str | None:
    arr = get(pb, request, name)
    if arr is None:
        return None
    if arr.size != 1:
        raise ValueError(f"input {name} must hold exactly one string, got shape {list(arr.shape)}")
    v = arr.reshape(-1)[0]
    return v.decode("utf-8") if isinstance(v, bytes) else str(v)


def int_list(pb, request, name: str) -> list[int] | None:
    arr = get(pb, request, name)
    return None if arr is None else [int(x) for x in arr.reshape(-1)]


def out_ids(pb, name: str, ids: list[int]):
    return pb.Tensor(name, np.asarray(ids, dtype=np.int32))


def out_text(pb, name: str, s: str):
    return pb.Tensor(name, np.array([s.encode("utf-8")], dtype=np.object_))


def error_response(pb, message: str, invalid: bool = False):
    """An error for one request; ``invalid``: the request itself is bad (HTTP 400)."""
    code = pb.TritonError.INVALID_ARG if invalid else pb.TritonError.INTERNAL
    return pb.InferenceResponse(output_tensors=[], error=pb.TritonError(message, code))


# (metric name, kind, stats key, description); kind "c" = counter from a cumulative total
METRICS = [
    (
        "pd_ttft_seconds_total",
        "c",
        "ttft_sum",
        "Sum of time to first token (decode submit->first token), s",
    ),
    ("pd_ttft_requests_total", "c", "ttft_count", "Requests with a first token"),
    ("pd_itl_seconds_total", "c", "itl_sum", "Sum of inter-token latencies, s"),
    ("pd_itl_intervals_total", "c", "itl_count", "Inter-token intervals measured"),
    ("pd_kv_transfer_bytes_total", "c", "bytes", "KV bytes transferred (prefill->decode)"),
    (
        "pd_kv_transfer_seconds_total",
        "c",
        "seconds",
        "KV transfer seconds (prefill: first group queued->last landed; decode: claim->complete)",
    ),
    ("pd_kv_rooms_ok_total", "c", "rooms_ok", "KV transfers (rooms) that succeeded"),
    ("pd_kv_pages_in_use", "g", "pages_in_use", "KV pages allocated in this stage's pool"),
    ("pd_kv_pages_total", "g", "num_pages", "KV pages in this stage's pool"),
    ("pd_requests_running", "g", "running", "Requests in the decode batch"),
    (
        "pd_requests_waiting",
        "g",
        "waiting",
        "Requests waiting (prefill: queued; decode: pages, KV transfer, admission)",
    ),
    ("pd_decode_batch_size", "g", "last_batch", "Sequences decoded in the last step"),
    ("pd_decode_max_batch_size", "g", "max_batch", "Largest decode batch seen"),
    ("pd_decode_steps_total", "c", "steps", "Decode steps run"),
    ("pd_generated_tokens_total", "c", "tokens", "Tokens generated"),
    ("pd_requests_total", "c", "requests", "Requests received by the stage"),
    ("pd_requests_failed_total", "c", "failed", "Requests that ended in an error"),
    ("pd_requests_cancelled_total", "c", "cancelled", "Requests cancelled by the client"),
    # speculative decoding (decode with spec_enabled only)
    ("pd_spec_proposed_tokens_total", "c", "spec_proposed", "Draft tokens proposed"),
    ("pd_spec_accepted_tokens_total", "c", "spec_accepted", "Draft tokens the target accepted"),
    ("pd_spec_verify_steps_total", "c", "spec_verify_steps", "Target verify forwards (per seq)"),
    (
        "pd_spec_acceptance_rate",
        "g",
        "spec_acceptance_rate",
        "Accepted / proposed draft tokens since start",
    ),
    (
        "pd_spec_mean_accepted_length",
        "g",
        "spec_mean_accepted_length",
        "Tokens per verify step (accepted drafts + 1) since start",
    ),
]


class StageMetrics:
    def __init__(self, pb, stage: str, instance: str, stats_fn, interval: float = 0.25):
        self.pb, self.stats_fn, self.interval = pb, stats_fn, interval
        self.labels = {"stage": stage, "instance": instance}
        mf = pb.MetricFamily
        self.metrics, self.families = [], []  # families must outlive their metrics
        have = stats_fn()  # only the metrics this stage reports
        for name, kind, key, desc in METRICS:
            if key not in have:
                continue
            fam = mf(name=name, description=desc, kind=mf.COUNTER if kind == "c" else mf.GAUGE)
            self.families.append(fam)
            self.metrics.append((kind, key, fam.Metric(labels=self.labels), [0.0]))
        self.fail_family = mf(
            name="pd_kv_transfer_failures_total",
            description="KV transfers that failed, by reason",
            kind=mf.COUNTER,
        )
        self.fail_metrics: dict[str, list] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="metrics", daemon=True)
        self._thread.start()

    def update(self) -> None:
        st = self.stats_fn()
        for kind, key, metric, last in self.metrics:
            if key not in st:
                continue
            v = float(st[key])
            if kind == "g":
                metric.set(v)
            elif v > last[0]:
                metric.increment(v - last[0])
                last[0] = v
        for reason, n in st.get("failures", {}).items():
            if reason not in self.fail_metrics:
                m = self.fail_family.Metric(labels={**self.labels, "reason": reason})
                self.fail_metrics[reason] = [m, 0]
            m, last = self.fail_metrics[reason]
            if n > last:
                m.increment(n - last)
                self.fail_metrics[reason][1] = n

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.update()
            except Exception:
                log.exception("metrics update failed")
                return

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)
