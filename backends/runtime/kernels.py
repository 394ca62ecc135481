"""How the runtime's hot operations run on each device: linear layers, and the settings.

Three settings, read from the environment when a model loads (``KernelSettings.from_env``):

* ``PD_RUNTIME_LINEAR`` = ``auto`` (default) | ``mkl`` | ``torch``. ``auto``: on a float32,
  bfloat16 or float16 CPU model, up to ``SMALL_ROWS`` rows (decode) run the runtime's C++
  small-row kernel (``linear_small`` in :mod:`backends.runtime.cpu_kernels`: each weight row
  streamed from memory once for all the rows, with prefetch; half weights widened as they are
  loaded); more rows
  (prefill) run torch's ``F.linear`` (MKL's sgemm), in bfloat16 on a CPU without bf16 GEMM
  instructions on the operands widened to float32 (``slow_bf16_gemm``). Elsewhere ``F.linear``.
  Measured on the 2-core AVX2 CI machine (``python -m benchmarks.linear``: SmolLM2's 30
  layers of projections with distinct cold weights, + the LM head up to 64 rows, ms): float32,
  small-row kernel / oneDNN on pre-packed weights (what ``auto`` ran before) / ``F.linear``:
  1 row 20.3 / 25.1 / 41.9; 8 rows 30.4 / 36.8 / 70.4; 32 rows 74.3 / 77.2 / 106.4; 64 rows
  135.2 / 134.6 / 156.8. At prefill sizes MKL beats the packed weights (512 rows 680 / 652 ms
  oneDNN / MKL, 4096 rows 5353 / 4968), so the one plain weight copy serves both. bfloat16,
  small-row kernel / ``F.linear`` in bf16 / widened: 1 row 13.4 / 15.5 / 41.2; 8 rows 28.0 /
  109.6 / 77.1; 32 rows 95.2 / 431.8 / 114.8; 512 rows - / 5439 / 667.
  On a CPU with AVX-512 (``torch.backends.cpu.get_cpu_capability()``), float32 weights also keep
  oneDNN's pre-packed copy (one more copy of the linear weights in memory), which runs from
  ``PACKED_FROM_ROWS`` rows on: measured on the 2-core AVX-512 host (same bench, float32, ms,
  small-row / packed / ``F.linear``): 1 row 23.4 / 28.2 / 47.9; 2 rows 23.4 / 27.2 / 88.6;
  4 rows 31.6 / 24.6 / 65.3; 8 rows 46.2 / 32.9 / 79.8; 64 rows 164.6 / 100.2 / 175.3; 512 rows
  - / 524.2 / 718.1 (the AVX2 host above measured MKL ahead at prefill sizes). Since then the
  small-row kernel runs float32 from 3 rows on 16-float AVX-512 vectors in 3 x 8 tiles there
  (medians of 3 interleaved runs, same host class: 4 rows 26.5 / 32.2 / 43.1; 8 rows 33.9 /
  42.6 / 55.9; 16 rows 61.9 / 55.7 / 75.6; 32 rows 108.4 / 77.0 / 91.5), so it runs up to 8
  rows and the packed copy from 9. Since its x vectors are loaded once a k-step and its sums
  reduced eight at a time (csrc/cpu_linear.cpp), small-row / packed in the same run, three
  runs each, this commit (before): 8 rows 0.74-0.75 (0.79-0.97); 12 rows 0.92-1.04
  (0.93-1.07): the crossover stayed. Since its 3 to 6 rows run 8 x 4 tiles (eight weight rows
  streaming at once; 0.86-0.94 of the 3 x 8 tiles' time, csrc/cpu_linear.cpp), a SmolLM2 target
  forward (30 layers, 40 tokens of context, medians of 15 interleaved runs, ms) measured
  small-row up to 8 rows / packed from 4: 4 rows 30.8 / 33.3; 5 rows 33.2 / 31.7; 6 rows 34.6
  / 31.9; 7 rows 41.3 / 35.2; 8 rows 36.3 / 34.7, so the packed copy runs from 5 rows (a
  speculative verify of 3 drafts is 4 rows).
  bfloat16 weights on a CPU with bf16 GEMM instructions (``not slow_bf16_gemm()``) keep
  oneDNN's pre-packed copy too (AMX's blocked layout, not repacked per call), which runs from
  ``BF16_GEMM_FROM_ROWS`` rows on: SmolLM2's 30 layers of projections, ms, small-row kernel or
  ``F.linear`` (what ran before) / packed: 1 row 6.4 / 6.5; 2 rows 6.6 / 6.9; 4 rows 10.7 / 6.5;
  8 rows 11.0 / 6.5; 32 rows 12.4 / 8.1; 128 rows 19.8 / 14.9; 4096 rows 259 / 252 (the
  Emerald Rapids host, 2 cores).
  A model built with ``KernelSettings(half_weights=True)`` (an EAGLE head; not an environment
  setting) keeps float32 linear weights in bfloat16 where the small-row kernel runs, with
  float32 activations: a head call streams half the bytes (2.3 -> 1.6 ms on SmolLM2's head).
  ``mkl``: ``auto`` without the packed copy (small-row kernel, then ``F.linear``) on every host.
  ``torch``: always ``F.linear``.
* ``PD_RUNTIME_ATTENTION`` = ``auto`` (default) | ``sdpa`` | ``compiled`` | ``triton``: attention.
  ``auto``: on CPU the runtime's C++ kernels (:mod:`backends.runtime.cpu_kernels`): decode
  reads K and V rows in place from the pool (measured at 8 x 512 / 32 x 256 / 1 x 512 on SmolLM2
  shapes: 0.52 / 1.23 / 0.06 ms a layer against 1.08 / 2.78 / 0.17 for gather + SDPA; its
  AVX-512 variant 0.41 / 0.82 at 8 x 512 / 32 x 256 against 0.53 / 1.11 for the AVX2 one,
  fragmented pages, medians of 3 interleaved runs), float32
  prefill runs causal blocks on sgemm (:mod:`backends.runtime.prefill_attn`; 3.3-3.7 ms a layer
  at 1 x 512 against 5.3-6.6 for SDPA; its softmax on 16 lanes on AVX-512 hosts: see
  csrc/cpu_prefill.cpp); SDPA elsewhere or where the kernels cannot be built;
  On CUDA, ``auto`` runs the Triton paged-attention kernel for every kind of forward
  (:mod:`backends.runtime.cuda_attn`, :mod:`backends.runtime.triton_attn`).
  ``sdpa``: always SDPA (decode: gather + SDPA); ``compiled``: the ``torch.compile``'d decode
  kernel (:mod:`backends.runtime.decode_attn`). ``triton``: on CUDA the Triton kernel with no
  SDPA fallback (its errors raise; scripts/gpu_check.sh runs so), SDPA on CPU.
* ``PD_RUNTIME_FUSED`` = ``auto`` (default) | ``torch``: the elementwise work of a layer.
  ``auto``: on CPU the runtime's fused C++ ops (:mod:`backends.runtime.cpu_kernels`): RMSNorm
  and residual add + RMSNorm, SiLU-and-multiply, rotary embedding + KV write, one op each where
  torch runs several (a SmolLM2 decode step at 8 x 512: elementwise 10.7 -> 3.6 ms, Python and
  dispatch 11.0 -> 6.4 ms); torch's ops elsewhere. ``torch``: always torch's ops.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .cpu_kernels import cpu_ops

LINEAR_CHOICES = ("auto", "mkl", "torch")
ATTENTION_CHOICES = ("auto", "sdpa", "compiled", "triton")
FUSED_CHOICES = ("auto", "torch")


@dataclass(frozen=True)
class KernelSettings:
    linear: str = "auto"
    attention: str = "auto"
    fused: str = "auto"
    # float32 linear weights kept in bfloat16 where the small-row kernel runs (activations stay
    # float32): for a model whose few-row calls stream its weights from memory (an EAGLE head)
    half_weights: bool = False

    def __post_init__(self) -> None:
        if self.linear not in LINEAR_CHOICES:
            raise ValueError(
                f"PD_RUNTIME_LINEAR must be one of {LINEAR_CHOICES}, got {self.linear!r}"
            )
        if self.attention not in ATTENTION_CHOICES:
            raise ValueError(
                f"PD_RUNTIME_ATTENTION must be one of {ATTENTION_CHOICES}, got {self.attention!r}"
            )
        if self.fused not in FUSED_CHOICES:
            raise ValueError(f"PD_RUNTIME_FUSED must be one of {FUSED_CHOICES}, got {self.fused!r}")

    @classmethod
    def from_env(cls) -> KernelSettings:
        return cls(
            linear=os.environ.get("PD_RUNTIME_LINEAR", "auto"),
            attention=os.environ.get("PD_RUNTIME_ATTENTION", "auto"),
            fused=os.environ.get("PD_RUNTIME_FUSED", "auto"),
        )


FUSED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def fused_ops(like: torch.Tensor, settings: KernelSettings | None):
    """``torch.ops.pd_runtime`` (the fused C++ ops) for tensors like ``like``, or None where
    torch's own ops run: off CPU, another dtype, ``PD_RUNTIME_FUSED=torch``, no compiler."""
    if settings is None or settings.fused != "auto":
        return None
    if like.device.type != "cpu" or like.dtype not in FUSED_DTYPES:
        return None
    return cpu_ops()


SMALL_ROWS = 64  # up to this many rows the C++ small-row kernel; above, F.linear
SMALL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def small_linear_op(weight: torch.Tensor, settings: KernelSettings):
    """``torch.ops.pd_runtime.linear_small`` for ``weight``, or None where F.linear runs: off
    CPU, not float32 / bfloat16 / float16, ``PD_RUNTIME_LINEAR=torch``, no compiler."""
    if settings.linear not in ("auto", "mkl") or weight.device.type != "cpu":
        return None
    if weight.dtype not in SMALL_DTYPES:
        return None
    ops = cpu_ops()
    return None if ops is None else ops.linear_small


def slow_half_gemm(dtype: torch.dtype) -> bool:
    """Whether torch's CPU GEMM in ``dtype`` (bfloat16 / float16) runs emulated here."""
    if dtype == torch.bfloat16:
        return slow_bf16_gemm()
    try:
        return not torch.ops.mkldnn._is_mkldnn_fp16_supported()
    except (AttributeError, RuntimeError):
        return True


def slow_bf16_gemm() -> bool:
    """Whether this CPU lacks bfloat16 GEMM instructions (AVX512-BF16 / AMX), so that torch's
    bfloat16 matmul runs emulated (7x slower than float32 sgemm at 1024 rows on AVX2)."""
    try:
        return not torch.ops.mkldnn._is_mkldnn_bf16_supported()
    except (AttributeError, RuntimeError):
        return True


PACKED_FROM_ROWS = 5  # AVX-512 hosts: oneDNN's packed GEMM from this many rows (crossover: 5)
# bfloat16 weights on a CPU with bf16 GEMM instructions (AVX512-BF16 / AMX): oneDNN's packed
# copy from this many rows (see the module docstring; before it, F.linear from 5 rows:
# benchmarks.linear --dtype bfloat16 on the AMX host, ms, small-row kernel / F.linear: 2 rows
# 13.5 / 16.9; 4 rows 13.8 / 15.6; 5 rows 19.7 / 16.5; 32 rows 81.6 / 26.7)
BF16_GEMM_FROM_ROWS = 3


def packed_weight(weight: torch.Tensor, settings: KernelSettings) -> torch.Tensor | None:
    """oneDNN's pre-packed copy of ``weight`` where ``auto`` runs it (float32 on a CPU with
    AVX-512, where it is the fastest GEMM from ``PACKED_FROM_ROWS`` rows; bfloat16 on a CPU with
    bf16 GEMM instructions, from ``BF16_GEMM_FROM_ROWS``), else None."""
    if settings.linear != "auto" or weight.device.type != "cpu" or settings.half_weights:
        return None
    if not torch.backends.mkldnn.is_available():
        return None
    if weight.dtype == torch.bfloat16:
        ok = not slow_bf16_gemm()
    else:
        cpu = torch.backends.cpu.get_cpu_capability()
        ok = weight.dtype == torch.float32 and cpu in ("AVX512", "AMX")
    return torch.ops.mkldnn._reorder_linear_weight(weight.contiguous()) if ok else None


class Linear:
    """``y = x @ weight.T + bias`` for x: [T, K] -> [T, N], on the fastest path for its device."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, settings: KernelSettings):
        self.out_features, self.in_features = weight.shape
        self.small = small_linear_op(weight, settings)
        if self.small is not None and settings.half_weights and weight.dtype == torch.float32:
            weight = weight.to(torch.bfloat16)  # the kernel widens it as it streams it
        self.weight = weight.contiguous() if self.small is not None else weight
        self.bias = bias.contiguous() if bias is not None and self.small is not None else bias
        # bfloat16 / float16 on a CPU without such GEMM instructions: the many-row case widens
        # to float32 (exact for half inputs; float32 sums as torch's half kernels keep them; one
        # rounding of y)
        self.widen = (
            self.small is not None
            and weight.dtype in (torch.bfloat16, torch.float16)
            and slow_half_gemm(weight.dtype)
        )
        self.packed = packed_weight(weight, settings)
        # float32 on packed weights: the residual add in the GEMM's epilogue (fuses_add)
        self.add_epilogue = (
            self.packed is not None and settings.fused == "auto" and weight.dtype == torch.float32
        )
        self.small_rows = SMALL_ROWS if self.packed is None else PACKED_FROM_ROWS - 1
        if weight.dtype == torch.bfloat16 and not settings.half_weights and not self.widen:
            self.small_rows = BF16_GEMM_FROM_ROWS - 1  # this CPU has bf16 GEMM instructions

    def gated(self, gate: torch.Tensor, up: torch.Tensor, biases, settings: KernelSettings):
        """For ``self`` = [gate; up] stacked (an MLP's): move the packed copy to the two halves,
        each packed apart, for :meth:`silu_mul`. False (nothing changed) where none is packed,
        for float32 (one GEMM and the C++ ``silu_mul`` on 16-float vectors were 0.3-2 % faster
        at 128-2,048 rows) or with ``PD_RUNTIME_FUSED=torch``."""
        if (
            self.packed is None
            or settings.fused != "auto"
            or (biases[0] is None) != (biases[1] is None)
            or gate.dtype == torch.float32
        ):
            return False
        self.packed = None  # one packed copy of the weights in memory, not two
        pairs = zip((gate, up), biases, strict=True)
        self.halves = [(packed_weight(w, settings), b) for w, b in pairs]
        return True

    def silu_mul(self, x: torch.Tensor) -> torch.Tensor:
        """``silu(x @ gate.T + b_gate) * (x @ up.T + b_up)`` as two oneDNN GEMMs whose epilogues
        apply the SiLU and the product: no [T, 2I] temporary and no elementwise pass (each
        output rounded once). Many rows of a model after :meth:`gated`."""
        (pg, bg), (pu, bu) = self.halves
        g = torch.ops.mkldnn._linear_pointwise(x, pg, bg, "swish", [], "")
        return torch.ops.mkldnn._linear_pointwise.binary(x, g, pu, bu, "mul")

    def fuses_add(self, x: torch.Tensor) -> bool:
        """Whether :meth:`add` runs the residual add in the GEMM's epilogue for these rows:
        float32 on oneDNN-packed weights, where it gives the separate add's bits (a float32
        accumulator plus the residual, rounded once either way); not with
        ``PD_RUNTIME_FUSED=torch``."""
        return self.add_epilogue and x.shape[0] > self.small_rows and x.dtype == torch.float32

    def add(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """``residual + x @ weight.T + bias`` (a decoder layer's residual connection)."""
        if self.fuses_add(x):
            return torch.ops.mkldnn._linear_pointwise.binary(
                x, residual, self.packed, self.bias, "add"
            )
        return residual + self(x)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.small is not None and x.dim() == 2 and x.shape[0] <= self.small_rows:
            return self.small(x, self.weight, self.bias)
        if self.packed is not None and x.dim() == 2 and x.dtype == self.weight.dtype:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        if self.widen or x.dtype != self.weight.dtype:
            bias = None if self.bias is None else self.bias.float()
            return F.linear(x.float(), self.weight.float(), bias).to(x.dtype)
        return F.linear(x, self.weight, self.bias)
