"""One rank's shard of the causal LM: the plain model on sharded weights plus the collectives.

The model code (:mod:`~backends.runtime.model`, attention, layers) runs unchanged on a shard: it
only sees fewer heads (``ShardPlan.local_config``) and narrower weights. Three points differ:

* a token mixer's out projection is row-parallel: its partial output is summed over the ranks
  before the residual add (``RowParallel``). The mixer is a layer's ``attn`` or ``mixer``
  (attention's o_proj, a gated DeltaNet's or Mamba2's out_proj, Nemotron-H's MLP layer's
  down_proj), its out projection ``.o``;
* the MLP / MoE output is a partial sum over the intermediate slice: summed likewise
  (``Reduced``; one all_reduce covers MoE's routed and shared experts together; Granite
  4.0-H's ``moe`` and ``shared`` one each);
* the LM head holds a vocabulary slice: logits ``[T, Vp]`` are gathered to rank 0 and cut to the
  real vocabulary ``[T, V]``. Other ranks get their own slice back (never used).

Two all_reduces of ``[T, hidden]`` per layer, one gather of the logits per forward.
"""

from __future__ import annotations

import torch

from ..config import ModelConfig
from ..model import CausalLM
from ..weights import WeightReader
from .comm import TPGroup
from .shard import ShardPlan


class RowParallel:
    """A row-parallel linear: ``x_shard @ W_shard.T`` summed over the ranks (+ bias on rank 0)."""

    def __init__(self, linear, group: TPGroup):
        self.linear, self.group = linear, group

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.group.all_reduce(self.linear(x))  # [T, hidden]

    def fuses_add(self, x: torch.Tensor) -> bool:
        return False  # the residual adds after the sum over the ranks

    def add(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """``residual + sum over the ranks`` (a mixer that always passes its residual)."""
        return residual + self(x)


class Reduced:
    """An MLP or MoE over an intermediate slice: its partial output summed over the ranks."""

    def __init__(self, mlp, group: TPGroup):
        self.mlp, self.group = mlp, group

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        out = self.group.all_reduce(self.mlp(x))  # [T, hidden]
        return out if residual is None else residual + out


class TPCausalLM(CausalLM):
    def __init__(
        self,
        cfg: ModelConfig,
        w: WeightReader,
        device,
        dtype: torch.dtype,
        plan: ShardPlan,
        group: TPGroup,
    ):
        """cfg: the whole model's config; w: this rank's tensors (``shard_tensors``)."""
        super().__init__(plan.local_config(cfg), w, device, dtype)
        self.full_config, self.plan, self.group = cfg, plan, group
        for layer in self.layers:
            _sum_partials(layer, group)

    def normed_logits(self, normed: torch.Tensor) -> torch.Tensor:
        # normed: [T, hidden] -> rank 0: [T, V] float32; other ranks: their slice [T, Vp]
        local = super().normed_logits(normed)  # [T, Vp]
        parts = self.group.gather(local)
        if parts is None:
            return local
        return torch.cat(parts, dim=-1)[:, : self.full_config.vocab_size]


FFN_PARTS = ("mlp", "moe", "shared")  # a layer's feed-forward parts, each a partial sum


def _sum_partials(layer, group: TPGroup) -> None:
    """Sum each partial output of ``layer`` over the ranks: its token mixer's (``attn``, or
    ``mixer`` in Nemotron-H and Granite 4.0-H) out projection, and each feed-forward part it
    has (absent in Nemotron-H, whose MLP layers are mixers)."""
    mixer = layer.attn if hasattr(layer, "attn") else layer.mixer
    mixer.o = RowParallel(mixer.o, group)
    for name in FFN_PARTS:
        part = getattr(layer, name, None)
        if part is not None:
            setattr(layer, name, Reduced(part, group))
