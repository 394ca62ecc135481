"""A mode's stage cores in this process (no Triton; real Mooncake over loopback): what
``--inproc`` and ``--quick`` (CI's smoke test) run. Every core shares one loaded model (the
runner keeps no per-call state on CPU), so a mode starts in about a second."""

from __future__ import annotations

import secrets
import threading
import time

from .counters import counters_of
from .servers import PREFILL_SERVERS  # the same layout as the real servers
from .workload import Reply

_RUNNERS: dict = {}  # model dir -> its loaded runner, shared by every stage core of the run


class _Answered:
    def __init__(self, routed):
        self.routed = routed

    def answer(self, timeout: float):
        return self.routed


class LocalPrefill:
    """A PrefillRouter client that hands a request to a PrefillWorker of this process, as the
    prefill model does: queued there, answered at once with its bootstrap address."""

    def __init__(self, worker, name: str):
        self.worker, self.name = worker, name
        self.fingerprint, self.remote_fingerprints = "", []

    def forward(self, req, on_end):
        routed = req.with_bootstrap(self.worker.bootstrap_addr)
        self.worker.submit(routed, lambda res: on_end(res.error, False))
        return _Answered(routed)

    def ready(self, timeout: float) -> bool:
        return True

    def queued_tokens(self, timeout: float) -> float:
        return float(self.worker.queued_tokens)

    def close(self) -> None:
        pass


class InProcess:
    """One mode's stage cores: ``pd``: two PrefillWorkers behind a PrefillRouter and a
    DecodeWorker; ``single``: one PrefillWorker and a DecodeWorker (a single server's stages)."""

    settle_s = 0.1

    def __init__(self, layout: str, sets: dict, decode_sets: dict, model: str):
        from backends.stages.decode import DecodeWorker
        from backends.stages.params import StageParams
        from backends.stages.prefill import PrefillWorker
        from backends.stages.router import PrefillRouter
        from backends.stages.tp import load_stage_model

        params = StageParams(model_dir=model, **sets, **decode_sets)
        if model not in _RUNNERS:
            _RUNNERS[model] = load_stage_model(params)
        runner = _RUNNERS[model]
        n = PREFILL_SERVERS if layout == "pd" else 1
        self.prefills = [PrefillWorker(params, runner, name=f"prefill{i}") for i in range(n)]
        self.decode = DecodeWorker(params, runner)
        self.router = None
        if layout == "pd":
            # the router names a server HOST:GRPC_PORT: port i + 1 stands for prefill worker i
            by_port = {
                i + 1: LocalPrefill(w, f"127.0.0.1:{i + 1}") for i, w in enumerate(self.prefills)
            }
            self.router = PrefillRouter(
                [("127.0.0.1", port, 0) for port in by_port],
                client=lambda host, port, _metrics: by_port[port],
                page_size=params.page_size,
                route_policy=params.route_policy,
            )

    def ask(self, ids: list[int], max_tokens: int, timeout: float = 600) -> Reply:
        from backends.runtime.sampling_params import SamplingParams
        from backends.stages.request import StageRequest

        done, rep = threading.Event(), Reply(sent=time.monotonic())

        def emit(ev) -> None:
            if ev.token_ids:
                rep.first = rep.first or time.monotonic()
                rep.ids += list(ev.token_ids)
            rep.cached = ev.cached_tokens or rep.cached
            if ev.final:
                rep.error = ev.error
                done.set()

        sp = SamplingParams(max_tokens=max_tokens)
        req = StageRequest(room=secrets.randbits(63), prompt_ids=ids, sampling=sp, stream=True)
        if self.router is not None:
            routed, _ = self.router.dispatch(req)
        else:
            routed = req.with_bootstrap(self.prefills[0].bootstrap_addr)
            self.prefills[0].submit(routed)
        self.decode.submit(routed, emit)
        if not done.wait(timeout):
            rep.error = f"no answer in {timeout:g}s"
        return rep

    def counters(self) -> dict:
        """The stages' stats as the servers export them (the metrics table's keys)."""
        from backends.stages.metrics import METRICS, ROUTER_METRICS

        snaps = [("prefill", w.stats()) for w in self.prefills] + [("decode", self.decode.stats())]
        samples = [
            (m.name, {"stage": stage}, float(snap[m.key]))
            for stage, snap in snaps
            for m in METRICS
            if isinstance(snap.get(m.key), (int, float))
        ]
        if self.router is not None:
            for server, per in self.router.stats()["servers"].items():
                labels = {"stage": "router", "server": server}
                samples += [(m.name, labels, float(per[m.key])) for m in ROUTER_METRICS]
        return counters_of(samples)

    def stop(self) -> None:
        if self.router is not None:
            self.router.close()
        self.decode.close()
        for w in self.prefills:
            w.close()
