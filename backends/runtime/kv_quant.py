"""fp8 KV cache: K and V (MLA: the latent) stored as ``float8_e4m3fn`` with one scale per layer
and component, quantized when written and dequantized where attention reads the pool.

A stored value is ``x / scale`` clamped to e4m3's range (+-448); attention uses ``stored *
scale``. Scales are powers of two, kept as their exponents (``scale_log2``, per (layer,
component) in pool order): they are then exact in every dtype, they compare exactly in the
handshake (part of each entry's layout signature, so a prefill and a decode whose scales differ
refuse the room), and dividing by one changes no mantissa bit.

Calibration (:func:`calibrate`): the model prefills a fixed token sequence into a model-dtype
pool; each (layer, component)'s scale is the smallest power of two that maps ``HEADROOM`` x its
largest magnitude inside 448. Deterministic for a checkpoint, dtype and device type, so both
stages compute the same scales. Attention always sees the stored values, on every device and
kind of forward (a prefill, which attends to its new K/V without reading the pool back, rounds
them as the pool does), so a chunked prompt equals an unchunked one and CPU equals CUDA.
``python -m benchmarks.fp8_kv`` measures the calibrated
scales against a fixed 1.0 on the test models.
"""

from __future__ import annotations

import math

import torch

from .config import MAIN, WINDOW
from .dtypes import KV_CACHE_DTYPES

FP8_MAX = 448.0
HEADROOM = 4.0  # decode-time values may exceed the calibration's largest by this factor
CALIBRATION_TOKENS = 256


def resolve(kv_cache_dtype: str, model_dtype: str) -> str:
    """The pool dtype name of a ``kv_cache_dtype`` choice (``auto``: the model's dtype)."""
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(
            f"kv_cache_dtype must be one of {list(KV_CACHE_DTYPES)}, got {kv_cache_dtype!r}"
        )
    return model_dtype if kv_cache_dtype == "auto" else kv_cache_dtype


def is_fp8(t: torch.Tensor) -> bool:
    return t.dtype == torch.float8_e4m3fn


def quantize(x: torch.Tensor, scale: float) -> torch.Tensor:
    """x (any float dtype) -> float8_e4m3fn values of ``x / scale``, saturated at +-448."""
    return (x.float() / scale).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)


def dequantize(x: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    return (x.to(torch.float32) * scale).to(dtype)


def as_stored(x: torch.Tensor | None, scale: float) -> torch.Tensor | None:
    """x as attention sees it once stored in an fp8 pool (quantized, then dequantized)."""
    return None if x is None else dequantize(quantize(x, scale), scale, x.dtype)


def write_rows(cache: torch.Tensor, slots: torch.Tensor, new: torch.Tensor, scale) -> None:
    """cache[slots] = new, quantized with ``scale`` into an fp8 cache (torch has no fp8
    ``index_copy_`` on CPU: the rows move as bytes)."""
    if not is_fp8(cache):
        cache.index_copy_(0, slots, new.to(cache.dtype))
        return
    cache.view(torch.uint8).index_copy_(0, slots, quantize(new, scale).view(torch.uint8))


def scale_of(amax: float) -> int:
    """log2 of the power-of-two scale that maps ``HEADROOM * amax`` inside +-448."""
    if not math.isfinite(amax) or amax <= 0:
        return 0
    return math.ceil(math.log2(HEADROOM * amax / FP8_MAX))


def calibrate(runner) -> tuple[int, ...]:
    """Per (layer, component) scale exponents of ``runner``'s model (see the module doc); call
    it while the runner's KV cache is still in the model's dtype."""
    vocab = runner.config.vocab_size
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (CALIBRATION_TOKENS,), generator=g).tolist()
    page_size = 16
    pool = runner.make_pool(-(-len(ids) // page_size), page_size)  # the model's dtype
    runner.prefill(pool, ids, list(range(pool.num_pages)))
    lay = pool.layout
    slabs = pool.tensor.view(lay.num_layers * lay.components, -1)
    scales = tuple(scale_of(float(a)) for a in slabs.abs().amax(dim=1).float().cpu())
    if pool.window is None:
        return scales
    # a sliding-window entry of its own: each model layer's scales from its entry, in order
    win = pool.window.tensor.view(pool.window.layout.num_layers * lay.components, -1)
    window = tuple(scale_of(float(a)) for a in win.abs().amax(dim=1).float().cpu())
    of = {MAIN: scales, WINDOW: window}
    comps = lay.components
    return tuple(
        e
        for entry, j in runner.model.kv_slab  # every layer keeps KV here
        for e in of[entry][j * comps : (j + 1) * comps]
    )
