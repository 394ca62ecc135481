"""Prefill attention on CPU through the runtime's C++ kernel (``pd_runtime.prefill_attention``).

A prefill batch's sequences all start at position 0, so each attends causally over its own new
tokens. The kernel takes them flat (``[T, H, D]``, no padding to the longest prompt) with the
sequence boundaries, stacks the query heads that share a KV head, and runs the causal blocks as
sgemm calls with an online softmax (see ``csrc/cpu_prefill.cpp``). Measured on the 2-core CI
machine at SmolLM2 shapes (9 heads, 3 KV heads, 64 channels), one layer: 1 x 512 tokens
3.3-3.7 ms against 5.3-6.6 ms for SDPA's flash kernel, 8 x 512 26-30 ms against 42-51 ms.

It runs for float32 on CPU where the kernels are built and torch exports BLAS's sgemm;
everywhere else :func:`cpu_prefill_attention` returns None and the caller runs SDPA.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from .cpu_kernels import cpu_ops

if TYPE_CHECKING:
    from .paged import BatchMeta

_available: dict[str, bool] = {}


def _ops():
    ops = cpu_ops()
    if ops is None:
        return None
    if "sgemm" not in _available:
        _available["sgemm"] = bool(ops.prefill_attention_available())
    return ops if _available["sgemm"] else None


def cpu_prefill_attention(
    q: torch.Tensor,
    k_new: torch.Tensor,
    v_new: torch.Tensor | None,
    v_dim: int | None,
    meta: BatchMeta,
    scale: float,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """q: [T, H, Dk]; k_new: [T, Hkv, Dk]; values v_new [T, Hkv, Dv], or the keys' first
    ``v_dim`` channels (MLA) -> [T, H, Dv], or None where the kernel does not apply. The
    layer's window is ``meta.window``; ``sinks``: [H] float32 sink logits, or None."""
    if q.device.type != "cpu" or q.dtype != torch.float32 or k_new.dtype != torch.float32:
        return None
    ops = _ops()
    if ops is None:
        return None
    v = k_new[..., :v_dim] if v_new is None else v_new
    window = meta.window if meta.window is not None else 0
    return ops.prefill_attention(q.contiguous(), k_new, v, meta.cu_seqlens, scale, window, sinks)
