"""Tensor parallelism in the stages: the stage's model over ``tensor_parallel_size`` ranks, and
its worker ranks' KV agents (:mod:`kvtransfer.rank_agent`), through which every rank's KV shard
moves between a prefill and a decode of any TP sizes (the kvtransfer handshake pairs them).

Rank 0 is the stage as with one rank (engine, scheduler, sampling, page allocator, control
plane); ranks 1..N-1 are worker processes it owns (:mod:`backends.runtime.tp_runner`).
"""

from __future__ import annotations

from kvtransfer import TransferConfig

from ..runtime.device import resolve_device
from ..runtime.runner import ModelRunner
from ..runtime.tp_runner import TPModelRunner
from .params import StageParams


def load_stage_model(params: StageParams) -> ModelRunner:
    """The stage's target model, on ``tensor_parallel_size`` ranks."""
    if params.tensor_parallel_size > 1 and params.spec_enabled:
        raise ValueError(
            "parameter tensor_parallel_size > 1 with spec_enabled: speculative decoding on"
            " tensor-parallel stages is not supported yet; use tensor_parallel_size 1 or"
            " spec_enabled false"
        )
    return ModelRunner.load(params.model_path, dtype=params.dtype,
                            device=resolve_device(params.device),
                            tensor_parallel_size=params.tensor_parallel_size)  # fmt: skip


def rank_agents(runner: ModelRunner, pools: dict, cfg: TransferConfig, slots: int) -> list:
    """Ranks 1..N-1's KV agents over their shards of ``pools`` (role -> pool); [] with one."""
    if not isinstance(runner, TPModelRunner):
        return []
    if not cfg.staging_slot_bytes:
        raise ValueError("tensor_parallel_size > 1 moves KV through staging slots: keep"
                         " staging_slot_bytes > 0")  # fmt: skip
    return runner.kv_agents(pools, cfg, slots, cfg.staging_slot_bytes)


def close_ranks(runner: ModelRunner, agents: list) -> None:
    """Stop the agents and the worker ranks (a one-rank runner has none)."""
    for a in agents:
        a.close()
    if isinstance(runner, TPModelRunner):
        runner.close()
