"""Load a checkpoint into a runner: the one place that chooses a single-rank or tensor-parallel one.

Every caller (the engine's scripts, the stages, a draft model, the tests) loads through
:func:`load_runner`; :class:`~backends.runtime.runner.ModelRunner` knows no subclass, and the
tensor-parallel package (:mod:`backends.runtime.tp`) imports the runner, never this module, so
the imports run one way.
"""

from __future__ import annotations

import torch

from . import kv_quant
from .config import ModelConfig
from .dtypes import model_dtype
from .model import CausalLM
from .runner import ModelRunner
from .weights import WeightReader, load_weights


def load_runner(
    path: str,
    *,
    dtype: str = "float32",
    device: str | list[str] = "cpu",
    num_layers: int | None = None,
    tensor_parallel_size: int = 1,
    kv_cache_dtype: str = "auto",
) -> ModelRunner:
    """Load ``path``; ``num_layers=K`` keeps the first K layers (a self-draft model);
    ``kv_cache_dtype``: ``auto`` (the model's dtype) or ``float8_e4m3fn`` (calibrated scales,
    :mod:`~backends.runtime.kv_quant`).

    ``tensor_parallel_size`` N > 1 (or a list of N devices, one per rank): this process is
    rank 0 of N and starts ranks 1..N-1 as worker processes it owns
    (:class:`~backends.runtime.tp.runner.TPModelRunner`; call ``close`` to stop them).
    """
    kv_dtype = kv_quant.resolve(kv_cache_dtype, dtype)
    if tensor_parallel_size != 1 or not isinstance(device, str):
        from .tp.runner import TPModelRunner  # torch.distributed, multiprocessing: only for TP

        if kv_dtype != dtype:
            raise ValueError(
                "kv_cache_dtype float8_e4m3fn is not supported with tensor parallelism yet "
                "(use auto)"
            )
        return TPModelRunner.start(
            path, dtype=dtype, device=device, num_layers=num_layers, size=tensor_parallel_size
        )
    torch_dtype = model_dtype(dtype)
    config = ModelConfig.from_pretrained(path)
    if num_layers is not None:
        config = config.truncated(num_layers)
    tensors = load_weights(path, config.num_layers, torch_dtype, device)
    return runner_from_tensors(
        config, tensors, path, dtype=dtype, device=device, kv_cache_dtype=kv_cache_dtype
    )


def runner_from_tensors(
    config: ModelConfig,
    tensors: dict[str, torch.Tensor],
    source: str,
    *,
    dtype: str = "float32",
    device: str = "cpu",
    kv_cache_dtype: str = "auto",
) -> ModelRunner:
    """A single-rank runner over tensors already in memory (``name -> tensor`` as a checkpoint
    names them, in ``dtype`` on ``device``; ``source`` names them in errors): what
    :func:`load_runner` does once it has read the files. ``python -m benchmarks.gpu_roofline``
    builds 8B-shaped models from random tensors made on the GPU this way, with no checkpoint
    written or read (16 GB each)."""
    kv_dtype = kv_quant.resolve(kv_cache_dtype, dtype)
    if kv_dtype != dtype:
        refuse_recurrent(config, f"kv_cache_dtype {kv_dtype}")
    model = CausalLM(config, WeightReader(tensors, source), device, model_dtype(dtype))
    runner = ModelRunner(config, model, dtype, device, graphs=True)
    if kv_dtype != dtype:
        runner.set_kv_cache(kv_dtype, kv_quant.calibrate(runner))
    return runner


def refuse_recurrent(config: ModelConfig, feature: str) -> None:
    """A model with recurrent layers (gated DeltaNet, Mamba2) does not support ``feature`` yet:
    fp8 KV (scales per attention layer only) fails at load, naming the model and the feature.
    (Tensor parallelism shards their mixers by state head group: ``tp.shard.ShardPlan`` refuses
    a size that does not divide the groups.)"""
    if config.has_recurrent_state:
        raise ValueError(
            f"{feature} is not supported for models with recurrent layers yet "
            f"({config.architecture}: {len(config.recurrent_layers)} of {config.num_layers} "
            f"layers keep a per-sequence state)"
        )
