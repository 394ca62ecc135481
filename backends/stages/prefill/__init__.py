"""The prefill stage: :class:`PrefillWorker` queues requests, computes each room once decode holds
its pages, batched with the other registered rooms (:mod:`.batch`), and streams the KV layer
group by layer group."""

from .worker import PrefillResult, PrefillWorker

__all__ = ["PrefillResult", "PrefillWorker"]
