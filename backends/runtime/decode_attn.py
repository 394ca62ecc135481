"""Decode attention that reads the KV pages in place: the runtime's C++ CPU kernel
(:func:`cpu_decode_attention`, the default on CPU), or one ``torch.compile``'d kernel.

The eager path (:func:`backends.runtime.paged.paged_attention`) copies every sequence's
context out of the pool (``index_select``) and then runs SDPA over the copy: the context is read
twice and written once per layer. Written as indexing + reductions, the same math compiles
(inductor: C++ loops on CPU, Triton on CUDA) into kernels whose loads go straight to the pool
slots (``k_cache[slots]`` becomes an indirect load inside the reduction), so each K and V row
is read once and nothing is materialised.

The compiled kernel is opt-in with ``PD_RUNTIME_ATTENTION=compiled`` (see
:mod:`backends.runtime.kernels`). Its first call compiles (seconds; shapes are dynamic, so the
batch size and context length do not recompile, apart from torch's own 0/1 size
specialisation). If compiling fails the runtime logs one warning and stays on the eager path.
"""

from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from .cpu_kernels import paged_decode_op

if TYPE_CHECKING:
    from .paged import BatchMeta

log = logging.getLogger(__name__)

_lock = threading.Lock()
_kernel = None  # the compiled function, False once compiling failed


def _attend(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
    valid: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """q: [B, Hkv, G, Dk]; k_cache: [S, Hkv, Dk]; v_cache: [S, Hkv, Dv] (may be a view of
    k_cache); slots, valid: [B, L] -> [B, Hkv, G, Dv] (float32 accumulation)."""
    k = k_cache[slots]  # [B, L, Hkv, Dk]: fused into the reduction, never materialised
    s = (q[:, None].float() * k[:, :, :, None, :].float()).sum(-1) * scale  # [B, L, Hkv, G]
    s = s.masked_fill(~valid[:, :, None, None], float("-inf"))
    p = torch.softmax(s, dim=1)  # over the context
    v = v_cache[slots]  # [B, L, Hkv, Dv]
    out = (p[..., None] * v[:, :, :, None, :].float()).sum(1)  # [B, Hkv, G, Dv]
    return out.to(q.dtype)


def _get_kernel():
    global _kernel
    with _lock:
        if _kernel is None:
            _kernel = torch.compile(_attend, dynamic=True, fullgraph=True)
        return _kernel


def _grouped(q, k_cache, v_cache, v_dim):
    """q [B, H, Dk] -> (q as [B, Hkv, G, Dk]: the G query heads of each KV head, the values:
    v_cache, or the keys' first ``v_dim`` channels)."""
    B, H, Dk = q.shape
    Hkv = k_cache.shape[1]
    v = k_cache[..., :v_dim] if v_cache is None else v_cache
    return q.reshape(B, Hkv, H // Hkv, Dk), v


def decode_attention(q: Tensor, k_cache: Tensor, v_cache, v_dim, meta: BatchMeta, scale: float):
    """One new token per sequence. q: [B, H, Dk]; caches as in ``paged_attention`` ->
    [B, H, Dv], or None when the compiled kernel is unavailable (the caller goes eager)."""
    global _kernel
    if k_cache.dtype == torch.float8_e4m3fn:
        return None  # fp8 pools: the C++ kernel or gather + dequantize + SDPA
    kernel = _get_kernel()
    if kernel is False:
        return None
    qg, v = _grouped(q, k_cache, v_cache, v_dim)
    try:
        out = kernel(qg, k_cache, v, meta.read_slots, meta.key_valid, scale)
    except Exception as e:  # no C++ compiler, an unsupported backend, ...
        log.warning("compiled decode attention unavailable, using SDPA: %s", e)
        _kernel = False
        return None
    return out.reshape(q.shape[0], q.shape[1], -1)


def cpu_decode_attention(
    q, k_cache, v_cache, v_dim, meta: BatchMeta, scale: float, kv_scales=(1.0, 1.0), sinks=None
):
    """As :func:`decode_attention`, through ``torch.ops.pd_runtime.paged_decode``: each K and V
    row is read once, from its slot, for all the query heads of its KV head; an fp8 pool's rows
    are widened as they are read (the K scale folds into the softmax scale, the V scale into
    the output). Each new token reads keys ``meta.key_bounds`` of its row of
    ``meta.token_slots`` (a windowed layer's view: only its window). ``sinks``: [H] float32
    sink logits, or None. -> [B, H, Dv], or None off CPU or where the kernel cannot be built
    (the caller goes eager)."""
    if q.device.type != "cpu":
        return None
    op = paged_decode_op()
    if op is None:
        return None
    qg, v = _grouped(q, k_cache, v_cache, v_dim)
    lo, hi = meta.key_bounds
    out = op(qg.contiguous(), k_cache, v, meta.token_slots, lo, hi, scale * kv_scales[0], sinks)
    if k_cache.dtype == torch.float8_e4m3fn and kv_scales[-1] != 1.0:
        out = out * kv_scales[-1]
    return out.reshape(q.shape[0], q.shape[1], -1)
