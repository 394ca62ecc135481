"""The CUDA attention path: the Triton paged-attention kernel (:mod:`.triton_attn`) for every
kind of forward but a lone prompt from position 0 (SDPA's flash kernel, see
:func:`backends.runtime.attention.attend`), reading K/V in place through the batch's page table.

``triton`` is imported on the first CUDA forward only, so CPU hosts and the CPU tests never
import it. If the import fails, or a kernel cannot be built for this GPU
(:func:`kernel_unavailable`: a compilation error, ptxas failing, more shared memory than the GPU
has), the runtime logs one warning and runs gather + SDPA
(:func:`~backends.runtime.paged.paged_attention`) from then on; so does
``PD_RUNTIME_ATTENTION=sdpa`` (see :mod:`.kernels`). Any other exception of a kernel call (a
CUDA error, a bad argument) is raised: that forward fails, the process does not silently change
its attention for good. ``PD_RUNTIME_ATTENTION=triton`` (``strict`` here) raises the
unavailability errors too: the GPU check runs with it, so that a kernel that fails to compile
fails the check rather than passing on SDPA.
"""

from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING

from torch import Tensor

if TYPE_CHECKING:
    from .paged import BatchMeta

log = logging.getLogger(__name__)

# devices whose forwards take this path; the interpreter tests add "cpu" in a process of their
# own (tests/helpers/triton_attn_cases.py), where the kernels run under TRITON_INTERPRET=1
DEVICE_TYPES = ("cuda",)

_lock = threading.Lock()
_module = None  # backends.runtime.triton_attn once imported; False once it failed


def _kernels(strict: bool = False):
    global _module
    with _lock:
        if _module is None or (strict and _module is False):
            try:
                from . import triton_attn

                _module = triton_attn
            except ImportError as e:
                if strict:
                    raise
                log.warning("Triton attention unavailable (pip install triton), using SDPA: %s", e)
                _module = False
        return _module


def kernel_unavailable(e: BaseException) -> bool:
    """``e`` says a Triton kernel cannot be built for this GPU (what the SDPA fallback is for):
    Triton's compilation error (its code generator wraps every error of a kernel's source in
    it, e.g. a dtype this architecture lacks), ptxas failing, or a kernel needing more shared
    memory or registers than the GPU has. Never an error of one call (a CUDA error, a bad
    argument; nor ``InterpreterError``, a kernel failing under ``TRITON_INTERPRET=1``)."""
    try:
        from triton.compiler.errors import CompilationError
        from triton.runtime.errors import OutOfResources, PTXASError
    except ImportError:  # no triton: nothing it raised
        return False
    return isinstance(e, (CompilationError, PTXASError, OutOfResources))


def kernels_ok() -> bool:
    """False once the Triton kernels failed to import or compile (SDPA from then on)."""
    return _module is not False


def cuda_attention(
    q: Tensor,
    k_cache: Tensor,
    v_cache,
    v_dim,
    meta: BatchMeta,
    scale: float,
    kv_scales=(1.0, 1.0),
    strict: bool = False,
    sinks: Tensor | None = None,
):
    """q: [T, H, Dk]; k_cache: [S, Hkv, Dk]; v_cache: [S, Hkv, Dv] or None with ``v_dim`` (MLA:
    the latent's first channels) -> [T, H, Dv], or None off CUDA or where the kernel cannot run
    (the caller goes eager). ``kv_scales``: (K, V) scales of an fp8 pool. ``strict``: a kernel
    that cannot be built here raises too, instead of switching to SDPA. ``sinks``: [H] float32
    sink logits (gpt-oss), or None. ``meta``: the batch as the layer's window sees it."""
    global _module
    if q.device.type not in DEVICE_TYPES or meta.page_table is None:
        return None
    kernels = _kernels(strict)
    if kernels is False:
        return None
    try:
        return kernels.paged_attention(
            q,
            k_cache,
            v_cache,
            meta.page_table,
            meta.cu_q,
            meta.starts,
            meta.max_q,
            meta.page_size,
            scale,
            v_dim=v_dim,
            window=meta.window,
            max_ctx=meta.read_slots.shape[1],
            k_scale=kv_scales[0],
            v_scale=kv_scales[-1],
            sinks=sinks,
        )
    except Exception as e:
        if strict or not kernel_unavailable(e):
            raise
        with _lock:
            first, _module = _module is not False, False
        if first:  # another thread's forward may have failed the same way meanwhile
            log.warning(
                "Triton attention cannot run here (%s), using SDPA from now on: %s",
                type(e).__name__,
                e,
            )
        return None
