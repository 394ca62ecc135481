"""Tensor-parallel weight sharding: which slice of each checkpoint tensor a rank holds.

Megatron-style, as vLLM and SGLang shard (written here from the math, not copied):

* attention: query heads split evenly, ``H / N`` per rank, rank ``r`` holds heads
  ``[r H/N, (r+1) H/N)``. GQA: q/k/v are column-parallel (output rows sliced by head), o_proj is
  row-parallel (input columns sliced) and its partial outputs are summed (all_reduce).
  KV heads: with ``Hkv % N == 0`` each rank holds ``Hkv / N`` of them; with ``N % Hkv == 0``
  (more ranks than KV heads) each rank holds the ONE KV head its query heads read, so each KV head
  is replicated on ``N / Hkv`` ranks. Other sizes are refused (a rank's query heads would span
  KV groups unevenly).
  MLA: the latent projection (``kv_a_proj_with_mqa``, its norm) and the latent KV cache are
  replicated; ``q_proj`` / ``q_b_proj`` and ``kv_b_proj`` are sliced by head, o_proj row-parallel.
  Per-head tensors go with their heads: attention sinks (gpt-oss, ``[H]``) are sliced like the
  query heads; q/k norms (Qwen3, Gemma 3: one ``[head_dim]`` weight shared by the heads) are
  replicated. A query projection's rows per head are its rows over ``H`` (Qwen3-Next's
  ``q_proj`` holds ``[q | gate]`` per head).
* recurrent mixers (gated DeltaNet, Mamba2): by state head GROUP (``StateSpec.groups``, the gcd
  of the state's sub-blocks' head counts): ``G / N`` groups per rank, so ``N`` must divide
  ``G`` as well as the attention heads. Input projections and conv channels column-parallel
  (each fused block cut on its own), per-head vectors sliced, out_proj row-parallel
  (:mod:`.mixers`); a rank's state slot then holds exactly its groups of every sub-block.
* MLP and every MoE expert (routed and shared): gate/up column-parallel, down row-parallel over
  the intermediate dimension (``[r I / N, (r+1) I / N)``, uneven sizes allowed); the router is
  replicated, so every rank routes the same tokens to the same experts. Nemotron-H's MLP layers
  (``mixer.up_proj`` / ``mixer.down_proj``) alike; Granite 4.0-H's ``input_linear`` (``[gate |
  up]``, per expert ``[E, 2I, D]`` or shared ``[2I, D]``) and ``output_linear`` alike. gpt-oss
  stores its experts transposed with gate and up interleaved (``gate_up_proj`` [E, D, 2I],
  ``down_proj`` [E, I, D]): a rank's intermediate slice [a, b) is columns [2a, 2b) of
  ``gate_up_proj`` and of its bias, rows [a, b) of ``down_proj``; ``down_proj_bias`` is rank 0's.
* embedding replicated; LM head vocabulary-parallel: rank ``r`` holds rows
  ``[r Vp, (r+1) Vp)`` with ``Vp = ceil(V / N)``, zero rows padding the last shard to ``Vp``.
* biases of row-parallel layers are kept on rank 0 only (added once to the sum).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

import torch

from ..config import ModelConfig
from ..state_pool import StateSpec
from .mixers import mixer_part, mixer_spec


class TensorParallelConfigError(ValueError):
    """The model cannot be split over this many ranks."""


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@dataclass(frozen=True)
class ShardPlan:
    """What rank ``rank`` of ``size`` holds. Ranges are ``[start, end)``."""

    rank: int
    size: int
    heads: tuple[int, int]  # query heads
    kv_heads: tuple[int, int]  # GQA: KV heads held (replicated when size > Hkv); MLA: (0, 1)
    total_kv_heads: int  # GQA: the model's KV heads; MLA: 1 (the latent)
    vocab: tuple[int, int]  # real vocabulary rows of the LM head shard
    vocab_padded: int  # rows of every rank's LM head shard (ceil(V / size))
    groups: tuple[int, int] = (0, 0)  # recurrent state head groups held (a hybrid model)
    total_groups: int = 0  # the state's head groups (StateSpec.groups); 0: no recurrent layers

    @classmethod
    def build(cls, cfg: ModelConfig, size: int, rank: int) -> ShardPlan:
        if not isinstance(size, int) or size < 1:
            raise TensorParallelConfigError(
                f"tensor_parallel_size must be a positive integer, got {size!r}"
            )
        if not 0 <= rank < size:
            raise TensorParallelConfigError(f"rank {rank} outside [0, {size})")
        H = cfg.num_heads
        if H % size:
            raise TensorParallelConfigError(
                f"tensor_parallel_size {size} does not divide num_attention_heads {H} of "
                f"{cfg.architecture}; sizes that work: {_divisors(H)}"
            )
        hl = H // size
        if cfg.attn == "mla":
            kv, total = (0, 1), 1
        else:
            Hkv = cfg.num_kv_heads
            if Hkv % size == 0:
                n = Hkv // size
                kv = (rank * n, (rank + 1) * n)
            elif size % Hkv == 0:  # replicate: each rank holds the KV head of its query heads
                first = rank * hl // (H // Hkv)
                kv = (first, first + 1)
            else:
                raise TensorParallelConfigError(
                    f"tensor_parallel_size {size} neither divides nor is a multiple of "
                    f"num_key_value_heads {Hkv} (num_attention_heads {H}); sizes that work: "
                    f"{[d for d in _divisors(H) if Hkv % d == 0 or d % Hkv == 0]}"
                )
            total = Hkv
        vp = -(-cfg.vocab_size // size)
        vocab = (min(rank * vp, cfg.vocab_size), min((rank + 1) * vp, cfg.vocab_size))
        G = _state_groups(cfg, size)
        groups = (rank * G // size, (rank + 1) * G // size)
        return cls(rank, size, (rank * hl, (rank + 1) * hl), kv, total, vocab, vp, groups, G)

    def split(self, n: int) -> tuple[int, int]:
        """This rank's slice of a dimension of ``n`` split as evenly as possible."""
        return n * self.rank // self.size, n * (self.rank + 1) // self.size

    def local_config(self, cfg: ModelConfig) -> ModelConfig:
        """The config the rank's model is built with: its heads (attention's; a recurrent
        mixer's, ``1/N`` of each kind); the LM head is its own tensor."""
        hl = self.heads[1] - self.heads[0]
        kvl = hl if cfg.attn == "mla" else self.kv_heads[1] - self.kv_heads[0]
        n, mixers = self.size, {}
        if cfg.deltanet is not None:
            d = cfg.deltanet
            mixers["deltanet"] = replace(
                d, num_k_heads=d.num_k_heads // n, num_v_heads=d.num_v_heads // n
            )
        if cfg.mamba is not None:
            m = cfg.mamba
            mixers["mamba"] = replace(m, num_heads=m.num_heads // n, n_groups=m.n_groups // n)
        return replace(cfg, num_heads=hl, num_kv_heads=kvl, tie_word_embeddings=False, **mixers)


def _state_groups(cfg: ModelConfig, size: int) -> int:
    """The state head groups of ``cfg``'s recurrent layers (0: none), which ``size`` must divide."""
    spec = StateSpec.of(cfg)
    if spec is None:
        return 0
    G = spec.groups
    if G % size:
        heads = ", ".join(f"{s.name} {s.heads}" for s in spec.segments)
        raise TensorParallelConfigError(
            f"tensor_parallel_size {size} does not divide the {G} head groups of "
            f"{cfg.architecture}'s {spec.kind} state (the gcd of its sub-blocks' heads: "
            f"{heads}; a rank holds whole groups of each); sizes that work: "
            f"{[d for d in _divisors(G) if cfg.num_heads % d == 0]}"
        )
    return G


# attention: ``self_attn``, or Nemotron-H's ``mixer`` of an attention layer
_ATTN = re.compile(
    r"\.(?:self_attn|mixer)\.(q_proj|q_b_proj|k_proj|v_proj|kv_b_proj|o_proj)\.(weight|bias)$"
)
# an MLP, an expert, a shared expert; Nemotron-H's MLP layer is a ``mixer``
_MLP = re.compile(r"\.(?:mlp|mixer)\.(?:.+\.)?(gate_proj|up_proj|down_proj)\.(weight|bias)$")
# Granite 4.0-H: experts' [E, 2I, D] / [E, D, I], the shared MLP's [2I, D] / [D, I]
_GATE_UP_PACKED = re.compile(r"\.(?:block_sparse_moe|shared_mlp)\.(input|output)_linear\.weight$")
_FUSED_EXPERTS = re.compile(r"\.mlp\.experts\.(gate_up_proj|down_proj)$")
_SINKS = re.compile(r"\.self_attn\.sinks$")
# experts as [E, D, 2I] (gate / up interleaved) and [E, I, D], with biases
_INTERLEAVED_EXPERTS = re.compile(r"\.mlp\.experts\.(gate_up_proj|down_proj)(_bias)?$")
INTERLEAVED_EXPERT_ARCHITECTURES = ("GptOssForCausalLM",)

ALL = "all"  # a replicated tensor: every rank holds all of it
# a slice: (dim, ranges): the ranges [a, b) of dimension `dim`, concatenated along it
Slice = tuple[int, tuple[tuple[int, int], ...]]
LM_HEAD = "lm_head.weight"
EMBED = "model.embed_tokens.weight"


def slice_spec(
    name: str, shape: list[int], cfg: ModelConfig, plan: ShardPlan
) -> Slice | str | None:
    """What rank ``plan.rank`` holds of checkpoint tensor ``name`` of ``shape``: ``ALL``, a
    :data:`Slice`, or None (a row-parallel bias held by rank 0 only). The LM head's slice is
    padded to ``plan.vocab_padded`` rows afterwards (:func:`vocab_shard`)."""
    if name == LM_HEAD:
        return 0, (plan.vocab,)
    part = mixer_part(name, cfg)
    if part is not None:
        return mixer_spec(part, cfg, plan.groups, plan.total_groups)
    if _SINKS.search(name):
        return 0, (plan.heads,)
    m = _INTERLEAVED_EXPERTS.search(name)
    if m and cfg.architecture in INTERLEAVED_EXPERT_ARCHITECTURES:
        return _interleaved_experts_spec(m.group(1), m.group(2) is not None, shape, plan)
    m = _ATTN.search(name)
    if m:
        return _attention_spec(m.group(1), m.group(2), shape, cfg, plan)
    m = _MLP.search(name)
    if m:
        proj, kind = m.groups()
        if proj != "down_proj":
            return 0, (plan.split(shape[0]),)  # [I, D] -> [I/N, D]
        if kind == "bias":
            return ALL if plan.rank == 0 else None
        return 1, (plan.split(shape[1]),)  # [D, I] -> [D, I/N]
    m = _FUSED_EXPERTS.search(name)
    if m:
        if m.group(1) == "down_proj":  # [E, D, I]
            return 2, (plan.split(shape[2]),)
        inter = shape[1] // 2  # [E, 2I, D]: gate rows, then up rows
        a, b = plan.split(inter)
        return 1, ((a, b), (inter + a, inter + b))
    m = _GATE_UP_PACKED.search(name)
    if m:
        if m.group(1) == "output":  # [..., D, I]
            return len(shape) - 1, (plan.split(shape[-1]),)
        dim = len(shape) - 2  # [..., 2I, D]: gate rows, then up rows
        inter = shape[dim] // 2
        a, b = plan.split(inter)
        return dim, ((a, b), (inter + a, inter + b))
    return ALL  # replicated: norms, embedding, router, MLA latent projection


def _interleaved_experts_spec(
    proj: str, bias: bool, shape: list[int], plan: ShardPlan
) -> Slice | str | None:
    """gpt-oss experts (see the module docstring): gate_up_proj [E, D, 2I], its bias [E, 2I],
    down_proj [E, I, D], its bias [E, D]."""
    if proj == "down_proj":
        if bias:
            return ALL if plan.rank == 0 else None
        return 1, (plan.split(shape[1]),)
    a, b = plan.split(shape[-1] // 2)
    return len(shape) - 1, ((2 * a, 2 * b),)


def _attention_spec(
    proj: str, kind: str, shape: list[int], cfg: ModelConfig, plan: ShardPlan
) -> Slice | str | None:
    h0, h1 = plan.heads
    if proj == "o_proj":
        if kind == "bias":
            return ALL if plan.rank == 0 else None
        per = cfg.v_head_dim if cfg.attn == "mla" else cfg.head_dim
        return 1, ((h0 * per, h1 * per),)  # [hidden, H d] -> [hidden, H/N d]
    if proj in ("k_proj", "v_proj"):
        k0, k1 = plan.kv_heads
        return 0, ((k0 * cfg.head_dim, k1 * cfg.head_dim),)
    if proj == "kv_b_proj":
        per = cfg.qk_nope_head_dim + cfg.v_head_dim
    else:  # q_proj, q_b_proj: per head dn + dr (MLA), head_dim (GQA), [q | gate] (Qwen3-Next)
        per = shape[0] // cfg.num_heads
    return 0, ((h0 * per, h1 * per),)


def take(src, spec: Slice) -> torch.Tensor:
    """``src``'s slice: ``src`` is a tensor or a safetensors slice (read only that part)."""
    dim, ranges = spec
    parts = [src[(slice(None),) * dim + (slice(a, b),)] for a, b in ranges]
    return (parts[0] if len(parts) == 1 else torch.cat(parts, dim)).contiguous()


def vocab_shard(rows: torch.Tensor, plan: ShardPlan) -> torch.Tensor:
    """rows: this rank's real LM head rows [b - a, hidden] -> [Vp, hidden], zero rows past V
    (their logits are cut off after the gather)."""
    shard = rows.new_zeros(plan.vocab_padded, rows.shape[1])
    shard[: rows.shape[0]] = rows
    return shard


def shard_tensors(
    tensors: dict[str, torch.Tensor], cfg: ModelConfig, plan: ShardPlan
) -> dict[str, torch.Tensor]:
    """The rank's tensors from a whole in-memory checkpoint (an absent name: a bias not held
    here); ``lm_head.weight`` is the vocabulary shard, of the embedding when tied."""
    out: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        spec = slice_spec(name, list(t.shape), cfg, plan)
        if spec is not None and name != LM_HEAD:
            out[name] = t if spec == ALL else take(t, spec)
    head = tensors.get(LM_HEAD)
    if cfg.tie_word_embeddings or head is None:
        head = tensors[EMBED]
    out[LM_HEAD] = vocab_shard(take(head, slice_spec(LM_HEAD, list(head.shape), cfg, plan)), plan)
    return out
