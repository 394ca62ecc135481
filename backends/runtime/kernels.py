"""How the runtime's hot operations run on each device: linear layers, and the settings.

Three settings, read from the environment when a model loads (``KernelSettings.from_env``):

* ``PD_RUNTIME_LINEAR`` = ``auto`` (default) | ``torch``. ``auto`` pre-packs each float32
  weight of a CPU model once for oneDNN (``torch.ops.mkldnn``: the weight in oneDNN's blocked
  layout) and runs ``mkldnn._linear_pointwise``; everywhere else (CUDA, bfloat16 on CPUs
  without bf16 instructions, a torch without mkldnn) it is ``F.linear``. Measured on the 2-core
  AVX2 CI machine (SmolLM2 shapes, float32, min of 30): the LM head ``[49152, 576]`` 10.6 ms ->
  5.7 ms at 1 row and 26 -> 9 ms at 8 rows; gate/up ``[3072, 576]`` 1.18 -> 0.82 ms at 8 rows;
  equal at 512 rows (prefill). ``torch`` turns packing off.
* ``PD_RUNTIME_ATTENTION`` = ``auto`` (default) | ``sdpa`` | ``compiled``: attention.
  ``auto``: on CPU the runtime's C++ kernels (:mod:`backends.runtime.cpu_kernels`): decode
  reads K and V rows in place from the pool (measured at 8 x 512 / 32 x 256 / 1 x 512 on SmolLM2
  shapes: 0.52 / 1.23 / 0.06 ms a layer against 1.08 / 2.78 / 0.17 for gather + SDPA), float32
  prefill runs causal blocks on sgemm (:mod:`backends.runtime.prefill_attn`; 3.3-3.7 ms a layer
  at 1 x 512 against 5.3-6.6 for SDPA); SDPA elsewhere or where the kernels cannot be built;
  ``sdpa``: always SDPA (decode: gather + SDPA); ``compiled``: the ``torch.compile``'d decode
  kernel (:mod:`backends.runtime.decode_attn`).
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

LINEAR_CHOICES = ("auto", "torch")
ATTENTION_CHOICES = ("auto", "sdpa", "compiled")
FUSED_CHOICES = ("auto", "torch")


@dataclass(frozen=True)
class KernelSettings:
    linear: str = "auto"
    attention: str = "auto"
    fused: str = "auto"

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


def pack_for_onednn(weight: torch.Tensor) -> torch.Tensor | None:
    """weight [N, K] -> the same weight packed for oneDNN, or None where that does not apply."""
    if weight.device.type != "cpu" or weight.dtype != torch.float32:
        return None
    if not torch.backends.mkldnn.is_available():
        return None
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(weight)
        probe = torch.linspace(-1, 1, 2 * weight.shape[1]).view(2, -1)
        got = torch.ops.mkldnn._linear_pointwise(probe, packed, None, "none", [], "")
    except (RuntimeError, AttributeError):  # op missing, or the CPU lacks the instructions
        return None
    if not torch.allclose(got, F.linear(probe, weight), rtol=1e-4, atol=1e-4):
        return None
    return packed


class Linear:
    """``y = x @ weight.T + bias`` for x: [T, K] -> [T, N], on the fastest path for its device."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, settings: KernelSettings):
        self.out_features, self.in_features = weight.shape
        self.bias = bias
        self.packed = pack_for_onednn(weight) if settings.linear == "auto" else None
        self.weight = weight if self.packed is None else None  # the packed copy replaces it

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is None:
            return F.linear(x, self.weight, self.bias)
        return torch.ops.mkldnn._linear_pointwise(
            x.contiguous(), self.packed, self.bias, "none", [], ""
        )
