"""Hybrid prefill and decode tokens/s of the runtime against transformers on the same CPU: the
very measurement of :mod:`benchmarks.runtime` (both models loaded in one process, taking turns
run by run, the same torch threads), on each random hybrid checkpoint. transformers runs its
pure-torch fallbacks here (chunked gated delta rule, Mamba2's chunk scan; no
flash-linear-attention, causal-conv1d or mamba-ssm on a CPU).
"""

from __future__ import annotations

from types import SimpleNamespace

from backends.stages.params import StageParams


def measure(models: dict[str, str], prefill_lens, batches, context: int, steps: int, runs: int):
    """name -> benchmarks.runtime's result ({"results", "per_run", "ratio"}) of checkpoint."""
    from benchmarks.runtime import HF, Ours, bench

    out = {}
    for name, path in models.items():
        args = SimpleNamespace(
            model=path,
            dtype="float32",
            device="cpu",
            page_size=StageParams.page_size,
            runs=runs,
            prefill_lens=list(prefill_lens),
            batches=list(batches),
            context=context,
            decode_steps=steps,
        )
        out[name] = bench([Ours(args), HF(args)], args)
    return out
