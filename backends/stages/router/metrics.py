"""Per-prefill-server routing metrics of a decode server (:data:`..metrics.ROUTER_METRICS`),
fed from :meth:`PrefillRouter.stats` by a small thread. ``pb`` is passed in, as in
:mod:`..triton_glue`."""

from __future__ import annotations

import logging
import threading

from ..metrics import ROUTER_METRICS, publish

log = logging.getLogger(__name__)


class RouterMetrics:
    def __init__(self, pb, stage: str, instance: str, router, interval: float = 0.25):
        mf = pb.MetricFamily
        self.router, self.interval = router, interval
        self.families = []  # (kind, key, family); they must outlive their metrics
        self.labels = {"stage": stage, "instance": instance}
        self.metrics: dict[tuple[str, str], tuple] = {}  # (key, server) -> (metric, [last])
        for mt in ROUTER_METRICS:
            fam = mf(
                name=mt.name,
                description=mt.doc,
                kind=mf.COUNTER if mt.kind == "counter" else mf.GAUGE,
            )
            self.families.append((mt.kind, mt.key, fam))
        self.update()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="router-metrics", daemon=True)
        self._thread.start()

    def update(self) -> None:
        """Servers (and "local") get their metrics when first seen (DNS may add servers)."""
        for server, st in self.router.stats()["servers"].items():
            for kind, key, fam in self.families:
                got = self.metrics.get((key, server))
                if got is None:
                    metric = fam.Metric(labels={**self.labels, "server": server})
                    got = self.metrics[(key, server)] = (metric, [0.0])
                metric, last = got
                publish(metric, kind, float(st[key]), last)

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.update()
            except Exception:  # never ends the thread
                log.exception("router metrics update failed")

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)
