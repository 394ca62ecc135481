"""What every rank of a tensor-parallel runner runs: a ModelRunner over its weight shard.

Loading is split in two so the slow part happens before the ranks rendezvous:
:func:`load_shard` reads this rank's slices of the checkpoint (seconds to minutes), then
:meth:`ShardRunner.build` wraps them in a model joined to the process group (fast).

Each rank's KV pool covers its own KV heads: a GQA pool is
``[layers, 2, pages, page_size, kv_heads_local, head_dim]`` with ``EntryLayout.head_start`` the
first of them and ``total_kv_heads`` the model's count, so a transfer can address rank shards
(replicated heads: several ranks report the same ``head_start``). An MLA pool holds the whole
latent on every rank. A hybrid model's state slots (``pool.states``) hold the rank's state head
groups ``ShardPlan.groups`` of every sub-block: a state entry with ``head_start`` its first group,
``kv_heads`` its groups, ``total_kv_heads`` the model's. Page and slot ids are the same on every
rank: rank 0's allocators are the only ones.
"""

from __future__ import annotations

from dataclasses import replace

import torch
from safetensors import safe_open

from kvtransfer import EntryLayout

from ..config import ModelConfig
from ..dtypes import model_dtype
from ..runner import ModelRunner
from ..state_pool import StatePool, StateSpec
from ..weights import WeightReader, beyond_layers, runtime_name, weight_files
from .comm import TPGroup
from .model import TPCausalLM
from .shard import ALL, EMBED, LM_HEAD, ShardPlan, slice_spec, take, vocab_shard


def load_config(path: str, num_layers: int | None) -> ModelConfig:
    config = ModelConfig.from_pretrained(path)
    return config if num_layers is None else config.truncated(num_layers)


def load_shard(
    path: str, config: ModelConfig, plan: ShardPlan, dtype: str, device: str
) -> dict[str, torch.Tensor]:
    """This rank's tensors on ``device``, reading only its slices of each sharded tensor from
    the safetensors files (a rank's memory holds its shard and the replicated tensors)."""
    torch_dtype = model_dtype(dtype)
    out: dict[str, torch.Tensor] = {}
    for file in weight_files(path):
        with safe_open(file, framework="pt", device="cpu") as f:
            for stored in f.keys():
                name = runtime_name(stored)
                if beyond_layers(name, config.num_layers):
                    continue
                part = f.get_slice(stored)
                spec = slice_spec(name, part.get_shape(), config, plan)
                if spec is None:
                    continue
                t = f.get_tensor(stored) if spec == ALL else take(part, spec)
                out[name] = t.to(torch_dtype) if t.is_floating_point() else t
    if config.tie_word_embeddings or LM_HEAD not in out:
        out[LM_HEAD] = take(out[EMBED], slice_spec(LM_HEAD, [], config, plan))
    out[LM_HEAD] = vocab_shard(out[LM_HEAD], plan)
    return {k: v.to(device) for k, v in out.items()}


class ShardRunner(ModelRunner):
    """A ModelRunner whose model is one rank's shard. ``config`` is the whole model's."""

    def __init__(self, config: ModelConfig, model: TPCausalLM, dtype: str, device: str):
        super().__init__(config, model, dtype, device)
        self.plan: ShardPlan = model.plan

    @classmethod
    def build(
        cls,
        path: str,
        config: ModelConfig,
        tensors: dict[str, torch.Tensor],
        plan: ShardPlan,
        group: TPGroup,
        dtype: str,
        device: str,
    ) -> ShardRunner:
        model = TPCausalLM(
            config, WeightReader(tensors, path), device, model_dtype(dtype), plan, group
        )
        return cls(config, model, dtype, device)

    def entry_layout(self, num_pages: int, page_size: int, role: str = "target") -> EntryLayout:
        layout = super().entry_layout(num_pages, page_size, role)
        if self.config.attn != "gqa":
            return layout  # the latent is replicated: every rank's pool is the whole entry
        first, end = self.plan.kv_heads
        return replace(
            layout,
            kv_heads=end - first,
            head_start=first,
            total_kv_heads=self.plan.total_kv_heads,
        )

    def state_spec(self) -> StateSpec | None:
        """A slot of this rank's shard: its state head groups of every sub-block."""
        return StateSpec.of(self.model.cfg)

    def state_pool(self, num_slots: int, role: str = "target") -> StatePool:
        first, _ = self.plan.groups
        spec, total = self.state_spec(), self.plan.total_groups
        return StatePool(spec, num_slots, self.device, role, first, total)
