"""Load a checkpoint into a runner: the one place that chooses a single-rank or tensor-parallel one.

Every caller (the engine's scripts, the stages, a draft model, the tests) loads through
:func:`load_runner`; :class:`~backends.runtime.runner.ModelRunner` knows no subclass, and the
tensor-parallel package (:mod:`backends.runtime.tp`) imports the runner, never this module, so
the imports run one way.
"""

from __future__ import annotations

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
    model = CausalLM(config, WeightReader(tensors, path), device, torch_dtype)
    runner = ModelRunner(config, model, dtype, device, graphs=True)
    if kv_dtype != dtype:
        runner.set_kv_cache(kv_dtype, kv_quant.calibrate(runner))
    return runner
