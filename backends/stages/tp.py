"""Tensor parallelism in the stages: the stage's model over ``tensor_parallel_size`` ranks, and
its worker ranks' KV agents (:mod:`kvtransfer.tp.agent`), through which every rank's KV shard
moves between a prefill and a decode of any TP sizes (the kvtransfer handshake pairs them).

Rank 0 is the stage as with one rank (engine, scheduler, sampling, page allocator, control
plane); ranks 1..N-1 are worker processes it owns (:mod:`backends.runtime.tp.runner`).
"""

from __future__ import annotations

import logging

from kvtransfer import TransferConfig

from ..runtime.device import resolve_device
from ..runtime.kv_pool import KVPool
from ..runtime.loader import load_runner
from ..runtime.runner import ModelRunner
from ..runtime.tp.runner import TPModelRunner
from .params import StageParams

log = logging.getLogger(__name__)


def load_stage_model(params: StageParams) -> ModelRunner:
    """The stage's target model, on ``tensor_parallel_size`` ranks (its draft: draft.py)."""
    return load_runner(
        params.model_path,
        dtype=params.dtype,
        device=resolve_device(params.device),
        tensor_parallel_size=params.tensor_parallel_size,
        kv_cache_dtype=params.kv_cache_dtype,
    )


def make_stage_pool(runner: ModelRunner, params: StageParams, name: str) -> KVPool:
    """The stage's target pool: ``num_pages`` pages and, for a hybrid model, ``state_slots``
    state slots (0: twice ``max_batch``), whose size it logs."""
    slots = params.state_slots or 2 * params.max_batch
    pool = runner.make_pool(params.num_pages, params.page_size, num_slots=slots)
    if pool.states is not None:
        spec = pool.states.spec
        mb = spec.bytes_per_sequence / 1e6
        log.info(
            "%s: %d state slots of %s, %.1f MB a request whatever its length (%d layers x %d B)",
            *(name, slots, spec.kind, mb, spec.num_layers, spec.slot_bytes),
        )
    return pool


def rank_agents(cfg: TransferConfig, slots: int, runners: dict, pools: dict) -> list:
    """The KV agents of ranks 1..N-1 of each entry's runner (role -> runner; ``pools``: role ->
    its pool), target then draft (a TP draft's ranks are processes of their own); [] when every
    runner has one rank."""
    agents: list = []
    for role, runner in runners.items():
        if not isinstance(runner, TPModelRunner):
            continue
        if not cfg.staging_slot_bytes:
            raise ValueError(
                "tensor_parallel_size > 1 moves KV through staging slots:"
                " keep staging_slot_bytes > 0"
            )
        # every entry of that model: its KV (and a window or state entry of a hybrid)
        mine = {r: p for r, p in pools.items() if r == role or r.startswith(role + ".")}
        agents += runner.kv_agents(mine, cfg, slots, cfg.staging_slot_bytes)
    return agents


def close_ranks(runners: list, agents: list) -> None:
    """Stop the agents and every runner's worker ranks (a one-rank runner has none)."""
    for a in agents:
        a.close()
    for runner in runners:
        if isinstance(runner, TPModelRunner):
            runner.close()
