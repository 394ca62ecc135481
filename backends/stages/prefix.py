"""A stage's prefix cache (its target pool's, :mod:`backends.runtime.prefix_cache`) and the KV
events it publishes, as the stage parameters say.

``prefix_cache``: ``auto`` turns it on for a model whose context lives whole in full-attention
pages and off (with a log line) for one whose does not (recurrent or sliding-window layers) or
whose draft is an EAGLE head (the head reads the target's features of every prompt position,
which a cached prefix does not recompute); ``on`` refuses such a model at load, naming why.
In a PD pair each side has its own cache: prefill computes only what ITS cache lacks, and decode
registers pages only for what ITS cache lacks, so prefill sends only those blocks.
"""

from __future__ import annotations

import logging

from ..runtime.config import ModelConfig
from ..runtime.eagle import head_config
from ..runtime.kv_pool import KVPool
from ..runtime.prefix_cache import KVEventPublisher, PrefixCache, prefix_cache_refusal
from ..runtime.runner import ModelRunner
from .params import StageParams

log = logging.getLogger(__name__)
# stats key (metrics.py) -> the cache's counter
STATS_KEYS = {
    "prefix_cached_tokens": "hit_tokens",
    "prefix_lookup_tokens": "lookup_tokens",
    "prefix_evicted_blocks": "evicted_blocks",
}


def refusal(params: StageParams, config: ModelConfig) -> str | None:
    """Why a stage of these parameters, serving a model of ``config``, cannot use a prefix cache
    (None: it can)."""
    why = prefix_cache_refusal(config)
    if why is None and params.spec_enabled and params.draft_path and head_config(params.draft_path):
        why = "an EAGLE head reads the target's features of every prompt position"
    return why


def caches(params: StageParams) -> bool:
    """Whether a stage of these parameters keeps a prefix cache, decided as :func:`stage_cache`
    decides it at load, from the parameters and the checkpoint's config alone: for the router,
    another process beside decode, which credits decode with likely hits only then."""
    if params.prefix_cache == "off":
        return False
    return refusal(params, ModelConfig.from_pretrained(params.model_path)) is None


def cache_stats(cache: PrefixCache | None) -> dict:
    """The cache's counters under the stats keys the metrics table names (empty: no cache)."""
    if cache is None:
        return {}
    counters = {key: getattr(cache.stats, name) for key, name in STATS_KEYS.items()}
    return {**counters, "prefix_cached_pages": cache.num_cached}


def stage_cache(
    params: StageParams, runner: ModelRunner, pool: KVPool, name: str
) -> tuple[PrefixCache | None, KVEventPublisher | None]:
    """(the target pool's cache, its KV event publisher), each None when off."""
    if params.prefix_cache == "off":
        return None, None
    why = refusal(params, runner.config)
    if why is not None:
        if params.prefix_cache == "on":
            raise ValueError(f"prefix_cache=on is not supported for this model: {why}")
        log.info("%s: prefix cache off (%s)", name, why)
        return None, None
    publisher = None
    if params.kv_events_endpoint:
        publisher = KVEventPublisher(
            params.kv_events_endpoint,
            topic=params.kv_events_topic,
            replay_endpoint=params.kv_events_replay_endpoint or None,
            bind=not params.kv_events_connect,
        )
    share = max(1, int(pool.num_pages * params.prefix_cache_share))
    cache = PrefixCache(pool, max_pages=share, events=publisher.put if publisher else None)
    if publisher is not None:
        cache.clear()  # subscribers drop what an earlier process of this stage published
    return cache, publisher
