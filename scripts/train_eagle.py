#!/usr/bin/env python
"""Train an EAGLE draft head (``backends/runtime/eagle.py``) for a target checkpoint, on this
machine, from the target's own responses to the project's generated prompts
(``scripts/eagle_data.py``), and write a checkpoint that ``--draft DIR`` / ``draft_model_dir``
load.

The head: ``fc([embed(x_{i+1}) ; f_i])`` -> one Llama decoder layer -> ``g_i`` -> LM head over a
reduced draft vocabulary (the ``--draft-vocab`` most frequent response tokens, initialised from
the target's own LM head rows). Loss at every position: cross-entropy of ``x_{i+2}`` (the target's
own next token) + ``--feature-weight`` x smooth-L1 of ``g_i`` against the next feature
``f_{i+1}`` (so ``g`` can stand in for a feature when drafting chains). Input features get
Gaussian noise (``--noise``) so the head tolerates its own predictions. The decoder layer is
transformers' Llama layer, the same math the runtime runs (checked by a test).

    .venv/bin/python scripts/train_eagle.py --out models/smollm2-135m-instruct-eagle

(SmolLM2-135M on 2 cores with the defaults: 14 minutes, of which the target's responses and
features about 9 and training 4; ``--minutes`` caps training.)
Prints one JSON line at the end: data sizes, times, and held-out teacher-forced accuracy.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time

import torch
import torch.nn.functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import eagle_data as data  # noqa: E402

from backends.runtime.eagle import head_checkpoint_config, save_head  # noqa: E402
from backends.runtime.runner import ModelRunner  # noqa: E402


class HeadModule(torch.nn.Module):
    """The head for training (the runtime's :class:`EagleHead` serves the same weights)."""

    def __init__(self, target: ModelRunner, args, vocab_ids: torch.Tensor):
        from transformers import LlamaConfig
        from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

        super().__init__()
        H = target.config.hidden_size
        self.cfg = LlamaConfig(hidden_size=H, intermediate_size=args.intermediate,
                               num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
                               head_dim=args.head_dim, num_hidden_layers=1, rms_norm_eps=1e-6,
                               rope_theta=10000.0, vocab_size=target.config.vocab_size,
                               max_position_embeddings=target.config.max_position_embeddings,
                               attn_implementation="sdpa")  # fmt: skip
        self.embed = target.model.embed_tokens.detach().float()  # frozen, the target's
        self.fc = torch.nn.Linear(2 * H, H, bias=False)
        with torch.no_grad():  # start as "the feature passes through"
            self.fc.weight.zero_()
            self.fc.weight[:, H:].copy_(torch.eye(H))
        self.layer = LlamaDecoderLayer(self.cfg, layer_idx=0)
        with torch.no_grad():  # the residual branches start at zero: the layer is the identity
            self.layer.self_attn.o_proj.weight.zero_()
            self.layer.mlp.down_proj.weight.zero_()
        self.rope = LlamaRotaryEmbedding(self.cfg)
        head = target.model.lm_head.detach().float()
        self.lm_head = torch.nn.Linear(H, len(vocab_ids), bias=False)
        with torch.no_grad():
            self.lm_head.weight.copy_(head[vocab_ids])

    def forward(self, tokens: torch.Tensor, feats: torch.Tensor):
        """tokens [B, L] (x_{i+1}), feats [B, L, H] (f_i) -> (draft logits [B, L, D], g)."""
        x = torch.cat([F.embedding(tokens, self.embed), feats], dim=-1)
        h = self.fc(x)
        pos = torch.arange(tokens.shape[1])[None].expand(tokens.shape[0], -1)
        g = self.layer(h, position_embeddings=self.rope(h, pos), position_ids=pos)
        g = g[0] if isinstance(g, tuple) else g
        return self.lm_head(g), g

    def tensors(self, vocab_ids: torch.Tensor) -> dict[str, torch.Tensor]:
        out = {"fc.weight": self.fc.weight, "lm_head.weight": self.lm_head.weight,
               "draft_to_target": vocab_ids}  # fmt: skip
        out.update({f"model.layers.0.{k}": v for k, v in self.layer.state_dict().items()})
        return {k: v.detach().clone() for k, v in out.items()}


def make_batch(items, vocab_map: torch.Tensor, noise: float):
    """items: (tokens [T], feats [T, H]) -> inputs and targets, right-padded."""
    L = max(len(t) for t, _ in items) - 2
    H = items[0][1].shape[1]
    tok = torch.zeros(len(items), L, dtype=torch.long)
    feat = torch.zeros(len(items), L, H)
    tgt = torch.full((len(items), L), -100, dtype=torch.long)
    nxt = torch.zeros(len(items), L, H)
    mask = torch.zeros(len(items), L)
    for b, (t, f) in enumerate(items):
        n = len(t) - 2  # pairs (f_i, x_{i+1}) -> x_{i+2}, i < T - 2
        tok[b, :n], feat[b, :n], nxt[b, :n] = t[1 : n + 1], f[:n], f[1 : n + 1]
        tgt[b, :n], mask[b, :n] = vocab_map[t[2 : n + 2]], 1.0
    if noise:
        feat = feat + noise * torch.randn_like(feat)
    return tok, feat, tgt, nxt, mask


def losses(model, batch, feature_weight: float):
    tok, feat, tgt, nxt, mask = batch
    logits, g = model(tok, feat)
    ce = F.cross_entropy(logits.flatten(0, 1), tgt.flatten(), ignore_index=-100)
    reg = (F.smooth_l1_loss(g, nxt, reduction="none").mean(-1) * mask).sum() / mask.sum()
    hit = ((logits.argmax(-1) == tgt) & (tgt >= 0)).sum() / (tgt >= 0).sum().clamp(min=1)
    return ce + feature_weight * reg, float(hit)


def build_data(target, args, held_out: bool):
    from backends.runtime.tokenizer import Tokenizer, has_tokenizer

    n = args.eval_prompts if held_out else args.prompts
    if has_tokenizer(args.target):
        ids = data.encode(Tokenizer(args.target), data.prompts(n, args.seed, held_out))
    else:  # a test model without a tokenizer: random prompts
        rng = random.Random(args.seed + held_out)
        vocab = target.config.vocab_size
        ids = [[rng.randrange(3, vocab) for _ in range(rng.randint(4, 24))] for _ in range(n)]
    outs = data.responses(target, ids, args.max_tokens)
    seqs = [p + o for p, o in zip(ids, outs, strict=True)]
    return [(torch.tensor(s), f) for s, f in zip(seqs, data.features(target, seqs), strict=True)
            if len(s) > 3]  # fmt: skip


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", default=os.path.join(ROOT, "models/smollm2-135m-instruct"))
    ap.add_argument("--out", default=os.path.join(ROOT, "models/smollm2-135m-instruct-eagle"))
    ap.add_argument("--prompts", type=int, default=640, help="training prompts")
    ap.add_argument("--eval-prompts", type=int, default=48, help="held-out prompts")
    ap.add_argument("--max-tokens", type=int, default=96, help="response tokens per prompt")
    ap.add_argument("--draft-vocab", type=int, default=8192)
    ap.add_argument("--heads", type=int, default=9)
    ap.add_argument("--kv-heads", type=int, default=3)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--intermediate", type=int, default=1536)
    ap.add_argument("--epochs", type=int, default=10)
    ap.add_argument("--minutes", type=float, default=25.0, help="training time cap")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--noise", type=float, default=0.05)
    ap.add_argument("--feature-weight", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=0)
    return ap.parse_args(argv)


def main(argv=None) -> None:
    from tqdm import tqdm

    args = parse_args(argv)
    torch.manual_seed(args.seed)
    t0 = time.time()
    target = ModelRunner.load(args.target)
    train, held = build_data(target, args, False), build_data(target, args, True)
    t_data = time.time() - t0
    V = target.config.vocab_size
    counts = torch.bincount(torch.cat([t[2:] for t, _ in train]), minlength=V)
    D = min(args.draft_vocab, int((counts > 0).sum()))
    vocab_ids = counts.argsort(descending=True)[:D].sort().values
    vocab_map = torch.full((target.config.vocab_size,), -100, dtype=torch.long)
    vocab_map[vocab_ids] = torch.arange(D)
    model = HeadModule(target, args, vocab_ids)
    params = [p for n, p in model.named_parameters()]
    opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0)
    steps = args.epochs * -(-len(train) // args.batch)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, args.lr, total_steps=steps, pct_start=0.05)
    deadline, step = time.time() + 60 * args.minutes, 0
    bar = tqdm(total=steps, desc="train_eagle", file=sys.stderr, mininterval=5)
    for _ in range(args.epochs):
        random.Random(step).shuffle(train)
        for i in range(0, len(train), args.batch):
            loss, hit = losses(model, make_batch(train[i : i + args.batch], vocab_map,
                                                 args.noise), args.feature_weight)  # fmt: skip
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            sched.step()
            step += 1
            bar.update()
            bar.set_postfix(loss=f"{loss.item():.3f}", acc=f"{hit:.2f}", refresh=False)
            if time.time() > deadline:
                break
        if time.time() > deadline:
            break
    bar.close()
    with torch.no_grad():
        evals = [losses(model, make_batch(held[i : i + 16], vocab_map, 0.0), args.feature_weight)
                 for i in range(0, len(held), 16)]  # fmt: skip
    cfg = head_checkpoint_config(target.config, args.heads, args.kv_heads, args.head_dim,
                                 args.intermediate, D)  # fmt: skip
    save_head(args.out, cfg, model.tensors(vocab_ids))
    coverage = float(counts[vocab_ids].sum() / counts.sum())
    print(json.dumps({
        "out": args.out, "train_sequences": len(train), "held_out_sequences": len(held),
        "train_tokens": int(sum(len(t) for t, _ in train)), "draft_vocab": D,
        "draft_vocab_coverage": coverage, "steps": step, "data_s": t_data,
        "train_s": time.time() - t0 - t_data,
        "held_out_loss": sum(float(e[0]) for e in evals) / len(evals),
        "held_out_next_token_acc": sum(e[1] for e in evals) / len(evals),
    }))  # fmt: skip


if __name__ == "__main__":
    main()
