"""Helpers shared by the thin Triton ``model.py`` adapters (the only module besides them that
knows Triton's Python API; ``pb`` is the ``triton_python_backend_utils`` module they pass in).

* tensors: every input of a request as numpy, the ``REQUEST`` struct in and out, ids and text;
* errors: one error response for one request;
* :class:`StageMetrics`: the metric families of :mod:`.metrics` fed from a core's ``stats()``
  snapshot by a small background thread (counters from cumulative totals, gauges as is).
"""

from __future__ import annotations

import gc
import logging
import os
import subprocess
import threading
import time

import numpy as np

from . import errors
from . import request as rq
from .metrics import BY_REASON, HISTOGRAMS, INFO, METRICS, publish
from .params import StageParams, from_triton_config

log = logging.getLogger(__name__)
RETIRE_LIMIT_S = 900.0  # a retired stage process exits after this even if still busy


# Runs beside each stage process: kills it once it is no longer tritonserver's child. Not a
# thread of the stage: one blocked in a call to the dead server can hold the GIL forever.
_WATCHDOG = """
ppid() { read -r _ _ _ pp _ < "/proc/$2/stat" 2>/dev/null && echo "$pp"; }
while [ "$(ppid "$@")" = "$1" ]; do sleep 1; done
if [ -d "/proc/$2" ]; then
  echo "tritonserver (pid $1) is gone: stage process $2 exits" >&2
  kill -KILL "$2"
fi
"""


# Triton's own line shape (glog: level letter, month and day, time, pid, where), so that a stage's
# lines sort and grep with the server's
LOG_FORMAT = "%(levelname).1s%(asctime)s.%(msecs)03d %(process)d %(name)s] %(message)s"


def log_to_stderr() -> None:
    """A stage process's log records (warnings and up) on stderr, which serve.sh appends to the
    server log, each with its time, level and process. Before, Python's last-resort handler
    wrote the bare message: a failover's lines (server marked down, rooms re-dispatched, up
    again) could not be placed in time beside Triton's. Nothing changes where a handler is
    already set."""
    root = logging.getLogger()
    if root.handlers:
        return
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter(LOG_FORMAT, "%m%d %H:%M:%S"))
    root.addHandler(handler)
    root.setLevel(logging.WARNING)


def setup_env() -> None:
    """Environment of a stage process, its log lines (:func:`log_to_stderr`) and its watchdog:
    it exits when its tritonserver is gone (a stage process left behind would hold its memory
    and ports forever)."""
    log_to_stderr()
    os.environ.setdefault("GLOG_minloglevel", "2")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    args = [str(os.getppid()), str(os.getpid())]
    subprocess.Popen(
        ["sh", "-c", _WATCHDOG, "stage-watchdog", *args],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        close_fds=True,
    )


def started() -> None:
    """The last step of a stage's ``initialize``: what it built (modules, the model's Python
    objects, the tokenizer: about 330,000 objects in a decode stage) leaves the garbage
    collector's reach (``gc.freeze``); reference counting still frees them. A full collection,
    which Python may run at any step, then takes about 0 ms instead of 170 ms (measured on
    SmolLM2's decode stage, 2 cores: a pause in the middle of a decode step), and the process
    exits 1.2 s sooner when Triton unloads it (no collection of them on the way out)."""
    gc.freeze()


def stage_params(pb, args: dict, stage: str) -> StageParams:
    """The stage's parameters (validated; a bad config fails the load) with ``device``
    resolved for this instance (its GPU when Triton gave it one); logs the device chosen."""
    params = from_triton_config(args["model_config"], stage)
    if stage in ("prefill", "decode"):
        kind = str(args.get("model_instance_kind", ""))
        device_id = int(args.get("model_instance_device_id") or -1) if kind == "GPU" else -1
        asked, params = params.device, params.on_instance(kind, device_id)
        name = args.get("model_instance_name", stage)
        where = f"instance KIND_{kind} {device_id if kind == 'GPU' else ''}".rstrip()
        pb.Logger.log_info(f"{name}: running on {params.device} (device: {asked}, {where})")
    return params


def inputs(pb, request) -> dict[str, np.ndarray]:
    """Every input tensor of ``request`` by name."""
    return {t.name(): t.as_numpy() for t in request.inputs()}


def get(pb, request, name: str):
    t = pb.get_input_tensor_by_name(request, name)
    return None if t is None else t.as_numpy()


def _serialized(pb, request, name: str) -> bytes:
    arr = get(pb, request, name)
    if arr is None or arr.size != 1:
        raise ValueError(f"input {name} must hold one serialized struct")
    return bytes(arr.reshape(-1)[0])


def _bytes_tensor(pb, name: str, data: bytes):
    return pb.Tensor(name, np.array([data], dtype=np.object_))


def stage_request(pb, request) -> rq.StageRequest:
    """The ``REQUEST`` input, decoded and validated (ValueError otherwise)."""
    return rq.decode(_serialized(pb, request, rq.REQUEST_TENSOR))


def request_tensor(pb, req: rq.StageRequest):
    return _bytes_tensor(pb, rq.REQUEST_TENSOR, rq.encode(req))


def stage_response(pb, request) -> rq.StageResponse:
    """The ``RESPONSE`` input (decode -> postprocess), decoded (ValueError otherwise)."""
    return rq.decode_response(_serialized(pb, request, rq.RESPONSE_TENSOR))


def response_tensor(pb, res: rq.StageResponse):
    return _bytes_tensor(pb, rq.RESPONSE_TENSOR, rq.encode(res))


def error_response(pb, message: str, kind: str = errors.INTERNAL, **tag):
    """An error for one request, with the code its kind maps to (backends/stages/errors.py):
    invalid -> INVALID_ARG (HTTP 400), overloaded -> UNAVAILABLE (gRPC UNAVAILABLE, HTTP 503),
    else INTERNAL. Its message starts with the kind's tag (``errors.tagged``; ``tag``: its
    param and code), since Triton's streaming gRPC API carries no code."""
    code = {
        errors.INVALID: pb.TritonError.INVALID_ARG,
        errors.OVERLOADED: pb.TritonError.UNAVAILABLE,
    }.get(kind, pb.TritonError.INTERNAL)
    text = errors.tagged(message, kind, **tag)
    return pb.InferenceResponse(output_tensors=[], error=pb.TritonError(text, code))


def exception_response(pb, where: str, exc: BaseException):
    """The error response for an exception a stage core raised for one request."""
    return error_response(pb, f"{where}: {exc}", **errors.tag_of(exc))


def answer_each(pb, requests, where: str, handle) -> None:
    """``handle(request, sender)`` for each request of a decoupled model's batch; an exception
    it raises answers that request alone, with its error as the final response (invalid: 400,
    overloaded: 503, else internal). A request that cannot be answered even so (its response
    sender is closed: the client is gone) is logged, and the rest of the batch goes on."""
    for request in requests:
        try:
            sender = request.get_response_sender()
        except Exception:  # noqa: BLE001 - this request only: no sender, nobody to answer
            log.exception("%s: a request has no response sender; skipped", where)
            continue
        try:
            handle(request, sender)
        except Exception as e:  # this request only
            final = pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL
            try:
                sender.send(exception_response(pb, where, e), flags=final)
            except Exception as gone:  # noqa: BLE001 - its client is gone; the others wait
                log.warning("%s: could not answer a request with its error %r: %s", where, e, gone)


class StageMetrics:
    def __init__(
        self,
        pb,
        stage: str,
        instance: str,
        stats_fn,
        interval: float = 0.25,
        info=None,
        observations=None,  # backends/stages/latency.Observations -> the HISTOGRAMS
    ):
        self.pb, self.stats_fn, self.interval = pb, stats_fn, interval
        self.labels = {"stage": stage, "instance": instance}
        mf = pb.MetricFamily
        self.metrics, self.families = [], []  # families must outlive their metrics
        have = stats_fn()  # only the metrics this stage reports
        for mt in METRICS:
            if mt.key not in have:
                continue
            kind = mf.COUNTER if mt.kind == "counter" else mf.GAUGE
            fam = mf(name=mt.name, description=mt.doc, kind=kind)
            self.families.append(fam)
            self.metrics.append((mt.kind, mt.key, fam.Metric(labels=self.labels), [0.0]))
        # (key, family, {reason: [metric, last]}) per by-reason counter family
        self.by_reason = [
            (mt.key, mf(name=mt.name, description=mt.doc, kind=mf.COUNTER), {}) for mt in BY_REASON
        ]
        if info:  # the deployment fingerprint as labels, value 1
            fam = mf(name=INFO.name, description=INFO.doc, kind=mf.GAUGE)
            self.families.append(fam)
            self.info_metric = fam.Metric(labels={**self.labels, **info})
            self.info_metric.set(1.0)
        self.observations, self.histograms = observations, {}
        if observations is not None and hasattr(mf, "HISTOGRAM"):
            for h in HISTOGRAMS:
                fam = mf(name=h.name, description=h.doc, kind=mf.HISTOGRAM)
                self.families.append(fam)
                self.histograms[h.key] = fam.Metric(labels=self.labels, buckets=h.buckets)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="metrics", daemon=True)
        self._thread.start()

    def update(self) -> None:
        if self.observations is not None:
            for key, values in self.observations.drain().items():
                metric = self.histograms.get(key)
                for v in values if metric is not None else ():
                    metric.observe(v)
        st = self.stats_fn()
        for kind, key, metric, last in self.metrics:
            if key not in st:
                continue
            publish(metric, kind, float(st[key]), last)
        for key, family, per in self.by_reason:
            for reason, n in st.get(key, {}).items():
                if reason not in per:
                    per[reason] = [family.Metric(labels={**self.labels, "reason": reason}), 0]
                m, last = per[reason]
                if n > last:
                    m.increment(n - last)
                    per[reason][1] = n

    def _run(self) -> None:
        failures = 0
        while not self._stop.wait(self.interval):
            try:
                self.update()
            except Exception:  # never ends the thread: log the first few, then rarely
                failures += 1
                if failures <= 3 or failures % 1000 == 0:
                    log.exception("metrics update failed (%d so far)", failures)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)


class Retirement:
    """Exits this stage process once scripts/supervise.py replaced its model version and the
    process is idle. Triton never unloads a version one of whose stage processes died holding
    requests, so its live processes would hold their memory forever; the supervisor asks them
    to go by creating ``$PD_RETIRE_DIR/<pid>``. ``idle()`` says the stage has no work left; wrap
    ``execute`` in ``with retirement:`` so a batch in progress is never cut."""

    def __init__(self, name: str, idle=lambda: True, limit_s: float = RETIRE_LIMIT_S):
        folder = os.environ.get("PD_RETIRE_DIR", "")
        self.path = os.path.join(folder, str(os.getpid())) if folder else ""
        self.name, self.idle, self.limit_s = name, idle, limit_s
        self._busy = 0
        self._lock = threading.Lock()
        if self.path:
            threading.Thread(target=self._run, name="retirement", daemon=True).start()

    def __enter__(self):
        with self._lock:
            self._busy += 1

    def __exit__(self, *exc):
        with self._lock:
            self._busy -= 1

    def _quiet(self) -> bool:
        with self._lock:
            return self._busy == 0 and self.idle()

    def _run(self) -> None:
        while not os.path.exists(self.path):
            time.sleep(1.0)
        _say(f"{self.name}: a newer version serves; this process exits once idle")
        end = time.monotonic() + self.limit_s
        while time.monotonic() < end:
            try:
                if self._quiet():
                    break
            except Exception:  # noqa: BLE001 - a broken idle() must not keep the process forever
                break
            time.sleep(0.5)
        _say(f"{self.name}: retired (pid {os.getpid()})")
        os._exit(0)


def exit_when_a_rank_dies(name: str, *runners, grace_s: float = 2.0) -> None:
    """A tensor-parallel stage whose worker rank died cannot serve again (its ranks are out of
    step): once one of its ``runners`` (target, draft) says so and the requests in flight got
    their error (``grace_s``), this process exits, so scripts/supervise.py loads the stage
    again with new ranks. Their workers exit with it (they watch rank 0). One rank: nothing."""
    checks = [r.failure for r in runners if hasattr(r, "failure")]
    if not checks:
        return

    def failure() -> str | None:
        try:
            return next((w for w in (c() for c in checks) if w), None)
        except Exception:  # a check that raises never ends the watch: asked again
            log.exception("%s: checking the tensor-parallel ranks failed", name)
            return None

    def watch() -> None:
        while not (why := failure()):
            time.sleep(0.5)
        _say(f"{name}: {why}: this stage process exits so that it is loaded again")
        time.sleep(grace_s)
        os._exit(1)

    threading.Thread(target=watch, name="rank-watch", daemon=True).start()


def _say(msg: str) -> None:
    """A line on stderr (the server log), not through logging (it may forward to Triton)."""
    try:
        os.write(2, (msg + "\n").encode())
    except OSError:
        pass
