"""EAGLE-style draft heads: one decoder layer that reads the target's own hidden features.

A head at sequence position ``i`` takes the pair (target feature ``f_i``, token ``x_{i+1}``):
``h = fc([embed(x_{i+1}) ; f_i])`` (the target's token embedding, frozen), then one Llama decoder
layer with its own GQA KV (the head's KV pool entry, ``role="draft"``), whose output ``g_i``
predicts the next feature ``f_{i+1}``; the LM head turns ``g_i`` into the distribution of
``x_{i+2}``. The feature is the target's final-norm hidden state (EAGLE-1), which the runtime
returns from the same forward that computes the logits (:meth:`ModelRunner.forward` with
``features=True``). Drafting k tokens is a chain: after the real features run out, the head
feeds its own ``g`` back as the next feature.

The LM head is the target's, or a reduced draft vocabulary (``lm_head.weight`` [D, H] with
``draft_to_target`` [D], each draft id's target id): a 49k-token head costs about a quarter of
a SmolLM2 step, a few thousand frequent tokens almost nothing; its logits are scattered into the
target vocabulary (the rest ``-inf``), so the verify rules see ordinary distributions.

A head checkpoint (``scripts/train_eagle.py`` writes one) is a directory with a ``config.json``
of a one-layer ``LlamaForCausalLM`` (its ``vocab_size`` the target's) carrying an ``eagle``
block (``version``, ``feature``, ``draft_vocab_size``, ``target_hidden_size``), and safetensors
``fc.weight`` [H, 2H], ``model.layers.0.*``, and ``lm_head.weight`` + ``draft_to_target`` where
the vocabulary is reduced. The handshake identifies a head by its ``eagle`` block and the
digest of its config and weights (``backends/stages/fingerprint.draft_identity``).
"""

from __future__ import annotations

import dataclasses
import json
import os

import torch

from .config import ModelConfig
from .dtypes import model_dtype
from .families import llama
from .kernels import KernelSettings, Linear
from .paged import SeqInput
from .rope import RotaryEmbedding
from .runner import ModelRunner
from .weights import WeightReader, load_weights

EAGLE_KEY = "eagle"
FEATURES = ("final_norm",)


def head_config(path: str) -> dict | None:
    """The ``eagle`` block of ``path``'s config.json, or None for an ordinary model."""
    try:
        with open(os.path.join(path, "config.json")) as f:
            return json.load(f).get(EAGLE_KEY)
    except (OSError, ValueError):
        return None


def head_checkpoint_config(
    target: ModelConfig,
    heads: int,
    kv_heads: int,
    head_dim: int,
    intermediate: int,
    draft_vocab: int | None,
) -> dict:
    """config.json of a head for ``target`` (a one-layer Llama with the ``eagle`` block)."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": target.hidden_size,
        "num_hidden_layers": 1,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "intermediate_size": intermediate,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "vocab_size": target.vocab_size,
        "tie_word_embeddings": False,
        "max_position_embeddings": target.max_position_embeddings,
        EAGLE_KEY: {
            "version": 1,
            "feature": "final_norm",
            "draft_vocab_size": draft_vocab or target.vocab_size,
            "target_hidden_size": target.hidden_size,
        },
    }


def save_head(path: str, config: dict, tensors: dict[str, torch.Tensor]) -> None:
    """Write a head checkpoint: ``config.json`` + ``model.safetensors``."""
    from safetensors.torch import save_file

    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f, indent=1)
    tensors = {k: v.contiguous() for k, v in tensors.items()}
    save_file(tensors, os.path.join(path, "model.safetensors"))


class HeadModel:
    """The head's parts; ``layers`` is its one decoder layer (as a model's, for the runner)."""

    def __init__(self, cfg: ModelConfig, w: WeightReader, target, device, dtype, eagle: dict):
        # a head call streams its weights from memory for one row each: bfloat16 weights halve
        # that (float32 activations; 2.3 -> 1.6 ms a call on SmolLM2's head)
        kernels = dataclasses.replace(KernelSettings.from_env(), half_weights=True)
        self.cfg = cfg
        self.embed_tokens = target.model.embed_tokens  # the target's, shared
        self.embed_rows = target.model.embed_rows  # with its multiplier (Gemma 3)
        self.softcap = target.config.final_logit_softcapping  # the target's logits' (Gemma 3)
        self.fc = Linear(w.get("fc.weight"), w.opt("fc.bias"), kernels)
        rope = RotaryEmbedding(cfg.rope, cfg.max_position_embeddings, device, dtype)
        self.layers = [llama.build_layer(cfg, w, 0, rope, kernels)]
        if w.has("lm_head.weight"):  # a reduced draft vocabulary
            self.lm_head = Linear(w.get("lm_head.weight"), None, kernels)
            self.draft_to_target = w.get("draft_to_target").to(device=device, dtype=torch.long)
        else:
            self.lm_head, self.draft_to_target = target.model.head(), None
        d = int(eagle.get("draft_vocab_size") or target.config.vocab_size)
        rows = self.lm_head.out_features
        if rows != d or (self.draft_to_target is not None and len(self.draft_to_target) != d):
            raise ValueError(f"EAGLE head: draft_vocab_size {d} but an LM head of {rows} rows")


class EagleHead(ModelRunner):
    """A draft head as a runner: its own one-layer KV pool, :meth:`forward_head` to run it."""

    kind = "eagle"

    @classmethod
    def load_head(cls, path: str, target: ModelRunner) -> EagleHead:
        eagle = head_config(path)
        if eagle is None:
            raise ValueError(f"{path!r} is not an EAGLE head (no 'eagle' block in config.json)")
        if eagle.get("feature", "final_norm") not in FEATURES:
            raise ValueError(f"EAGLE head feature {eagle.get('feature')!r} not in {FEATURES}")
        if target.kv_dtype != target.dtype:
            raise ValueError("EAGLE heads do not support kv_cache_dtype float8_e4m3fn yet")
        cfg = ModelConfig.from_pretrained(path)
        t = target.config
        if cfg.vocab_size != t.vocab_size or cfg.hidden_size != t.hidden_size:
            raise ValueError(
                f"EAGLE head for hidden {cfg.hidden_size} / vocabulary {cfg.vocab_size}, target"
                f" has {t.hidden_size} / {t.vocab_size}"
            )
        if cfg.num_layers != 1:
            raise ValueError(f"an EAGLE head has one decoder layer, {path!r} has {cfg.num_layers}")
        dtype = model_dtype(target.dtype)
        tensors = load_weights(path, 1, dtype, target.device)
        model = HeadModel(cfg, WeightReader(tensors, path), target, target.device, dtype, eagle)
        head = cls(cfg, model, target.dtype, str(target.device))
        head.eagle, head.path = dict(eagle), path
        return head

    def _check_head_inputs(self, seqs: list[SeqInput], feats: list[torch.Tensor]) -> None:
        H = self.config.hidden_size
        for s, f in zip(seqs, feats, strict=True):
            if f.shape != (len(s.token_ids), H):
                raise ValueError(
                    f"EAGLE head: features {tuple(f.shape)} for"
                    f" {len(s.token_ids)} tokens of hidden {H}"
                )

    @torch.inference_mode()
    def forward_head(
        self,
        pool,
        seqs: list[SeqInput],
        feats: list[torch.Tensor],
        last_only: bool = True,
        logits: bool = True,
    ) -> tuple[list[torch.Tensor] | None, list[torch.Tensor]]:
        """Sequence b's pairs (``feats[b][j]``, ``seqs[b].token_ids[j]``) at positions
        ``start_pos + j``, KV into its pages. -> (target-vocabulary logits [n, V] float32 per
        sequence, or None without ``logits``; the head outputs ``g`` [n, H], the predicted next
        features), of every position or (``last_only``) the last one of each sequence."""
        self._check_pool(pool)
        self._check_head_inputs(seqs, feats)
        m = self.model
        meta = self._meta(pool, [(s.start_pos, len(s.token_ids), s.pages) for s in seqs])
        ids = self._ids([t for s in seqs for t in s.token_ids])
        x = torch.cat(
            [
                m.embed_rows(ids),
                torch.cat(feats).to(m.embed_tokens.dtype),
            ],
            dim=-1,
        )
        g = m.layers[0](m.fc(x), meta, pool.tensor[0])  # [T, H]
        sizes = meta.lengths
        if last_only:
            g = g[torch.tensor(sizes, device=g.device).cumsum(0) - 1]
            sizes = [1] * len(sizes)
        if not logits:
            return None, list(g.split(sizes))
        out = m.lm_head(g)  # [n, D]
        if m.softcap is not None:
            out = torch.tanh(out / m.softcap) * m.softcap
        out = out.float()
        if m.draft_to_target is not None:  # scatter the draft vocabulary into the target's
            full = out.new_full((out.shape[0], self.config.vocab_size), float("-inf"))
            out = full.index_copy_(1, m.draft_to_target, out)
        return list(out.split(sizes)), list(g.split(sizes))
