"""Per-prefill-server routing metrics of a decode server (:data:`.metrics.ROUTER_METRICS`),
fed from :meth:`PrefillRouter.stats` by a small thread. ``pb`` is passed in, as in
:mod:`.triton_glue`."""

from __future__ import annotations

import logging
import threading

from .metrics import ROUTER_METRICS

log = logging.getLogger(__name__)


class RouterMetrics:
    def __init__(self, pb, stage: str, instance: str, router, interval: float = 0.25):
        mf = pb.MetricFamily
        self.router, self.interval = router, interval
        self.families = []  # must outlive their metrics
        self.metrics = []  # (kind, key, server, metric, [last])
        for mt in ROUTER_METRICS:
            fam = mf(
                name=mt.name,
                description=mt.doc,
                kind=mf.COUNTER if mt.kind == "counter" else mf.GAUGE,
            )
            self.families.append(fam)
            for server in router.stats()["servers"]:  # + "local" with local prefill
                labels = {"stage": stage, "instance": instance, "server": server}
                self.metrics.append((mt.kind, mt.key, server, fam.Metric(labels=labels), [0.0]))
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="router-metrics", daemon=True)
        self._thread.start()

    def update(self) -> None:
        per = self.router.stats()["servers"]
        for kind, key, server, metric, last in self.metrics:
            v = float(per[server][key])
            if kind == "gauge":
                metric.set(v)
            elif v > last[0]:
                metric.increment(v - last[0])
                last[0] = v

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.update()
            except Exception:  # never ends the thread
                log.exception("router metrics update failed")

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)
