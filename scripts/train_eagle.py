#!/usr/bin/env python
"""Train an EAGLE draft head (``backends/runtime/eagle.py``) for a target checkpoint, on this
machine, from the target's own responses to the project's generated prompts
(``benchmarks/eagle_data.py``), and write a checkpoint that ``--draft DIR`` / ``draft_model_dir``
load.

The head: ``fc([embed(x_{i+1}) ; f_i])`` -> one Llama decoder layer -> ``g_i`` -> LM head over a
reduced draft vocabulary (the ``--draft-vocab`` most frequent response tokens, initialised from
the target's own LM head rows). It is trained the way it drafts (training-time test): for every
anchor ``i`` at once, step 0 reads the real feature ``f_i``, and each of the ``--chain`` - 1
further steps reads the previous step's ``g`` with the next token, at the next position, seeing
the real pairs' KV and its own chain's, as the served chain does (a test checks they are the
same). Loss: cross-entropy of each step's token (``x_{i+2+s}``, the target's own) +
``--feature-weight`` x smooth-L1 of step 0's ``g_i`` against ``f_{i+1}``. Input features get
Gaussian noise (``--noise``). The decoder layer is transformers' Llama layer with the chain's
attention spelled out, the same math the runtime runs (checked by a test).

    .venv/bin/python scripts/train_eagle.py --out models/smollm2-135m-instruct-eagle

(SmolLM2-135M on 2 cores with the defaults: 38 minutes, of which the target's responses (in
bfloat16 on a CPU with native bf16) and features (float32) 14 and training 24 (bf16 autocast);
``--minutes`` caps training; ``--data-cache PREFIX`` keeps the responses and features for another
run.)
Prints one JSON line at the end: data sizes, times, and held-out teacher-forced accuracy on
response tokens (what serving drafts).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import sys
import time

import torch
import torch.nn.functional as F

from backends.runtime.eagle import head_checkpoint_config, save_head
from backends.runtime.loader import load_runner
from backends.runtime.runner import ModelRunner
from benchmarks import eagle_data as data

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class HeadModule(torch.nn.Module):
    """The head for training (the runtime's :class:`EagleHead` serves the same weights)."""

    def __init__(self, target: ModelRunner, args, vocab_ids: torch.Tensor):
        from transformers import LlamaConfig
        from transformers.models.llama import modeling_llama as hf

        super().__init__()
        self.rotate = hf.apply_rotary_pos_emb
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
        self.layer = hf.LlamaDecoderLayer(self.cfg, layer_idx=0)
        with torch.no_grad():  # the residual branches start at zero: the layer is the identity
            self.layer.self_attn.o_proj.weight.zero_()
            self.layer.mlp.down_proj.weight.zero_()
        self.rope = hf.LlamaRotaryEmbedding(self.cfg)
        head = target.model.lm_head.detach().float()
        self.lm_head = torch.nn.Linear(H, len(vocab_ids), bias=False)
        with torch.no_grad():
            self.lm_head.weight.copy_(head[vocab_ids])

    def _step(self, h: torch.Tensor, s: int, cache: list) -> torch.Tensor:
        """The decoder layer at chain step ``s`` for every anchor ``i`` at once (position
        ``i + s``). Its keys are what the served chain sees: the step-0 keys of anchors
        ``<= i`` (the real features' KV) and anchor ``i``'s own keys of steps 1..s. ``cache``
        holds the (k, v) of the earlier steps and gets this step's."""
        a, (B, L, _) = self.layer.self_attn, h.shape
        x = self.layer.input_layernorm(h)
        q, k, v = (p(x).view(B, L, -1, self.cfg.head_dim).transpose(1, 2)
                   for p in (a.q_proj, a.k_proj, a.v_proj))  # fmt: skip
        pos = torch.arange(s, L + s)[None].expand(B, -1)
        q, k = self.rotate(q, k, *self.rope(x, pos))
        cache.append((k, v))
        i = torch.arange(L)
        mask = torch.cat([i[:, None] >= i] + [i[:, None] == i] * s, dim=1)
        o = F.scaled_dot_product_attention(q, torch.cat([c[0] for c in cache], 2),
                                           torch.cat([c[1] for c in cache], 2), attn_mask=mask,
                                           scale=a.scaling, enable_gqa=True)  # fmt: skip
        h = h + a.o_proj(o.transpose(1, 2).reshape(B, L, -1))
        return h + self.layer.mlp(self.layer.post_attention_layernorm(h))

    def chain(self, tokens: list[torch.Tensor], feats: torch.Tensor) -> list[tuple]:
        """Drafting as served, for every anchor ``i`` at once (training-time test): step 0
        reads the pair (``f_i``, ``tokens[0]``), step ``s`` the pair (step ``s - 1``'s output
        ``g``, ``tokens[s]``) (for anchor ``i``: ``x_{i+1+s}``). -> per step (draft logits
        [B, L, D], g [B, L, H])."""
        cache, out = [], []
        for s, tok in enumerate(tokens):
            f = feats if s == 0 else out[-1][1]
            h = self.fc(torch.cat([F.embedding(tok, self.embed), f], dim=-1))
            g = self._step(h, s, cache)
            out.append((self.lm_head(g), g))
        return out

    def forward(self, tokens: torch.Tensor, feats: torch.Tensor):
        """tokens [B, L] (x_{i+1}), feats [B, L, H] (f_i) -> (draft logits [B, L, D], g)."""
        return self.chain([tokens], feats)[0]

    def tensors(self, vocab_ids: torch.Tensor) -> dict[str, torch.Tensor]:
        out = {"fc.weight": self.fc.weight, "lm_head.weight": self.lm_head.weight,
               "draft_to_target": vocab_ids}  # fmt: skip
        out.update({f"model.layers.0.{k}": v for k, v in self.layer.state_dict().items()})
        return {k: v.detach().clone() for k, v in out.items()}


def make_batch(items, vocab_map: torch.Tensor, noise: float, steps: int = 1):
    """items: (tokens [T], feats [T, H], prompt length) -> inputs and targets, right-padded:
    anchors ``i < T - 2`` with their feature ``f_i`` and next feature; per chain step ``s`` the
    input tokens ``x_{i+1+s}`` [steps, B, L], the target ``x_{i+2+s}`` in draft ids (-100 where
    the sequence has none) and whether that target is a response token."""
    L, H = max(len(t) for t, _, _ in items) - 2, items[0][1].shape[1]
    tok = torch.zeros(steps, len(items), L, dtype=torch.long)
    tgt = torch.full((steps, len(items), L), -100, dtype=torch.long)
    resp = torch.zeros(steps, len(items), L, dtype=torch.bool)
    feat, nxt = torch.zeros(len(items), L, H), torch.zeros(len(items), L, H)
    for b, (t, f, plen) in enumerate(items):
        n = len(t) - 2
        feat[b, :n], nxt[b, :n] = f[:n], f[1 : n + 1]
        for s in range(min(steps, n)):
            tok[s, b, : n - s], tgt[s, b, : n - s] = t[1 + s : 1 + n], vocab_map[t[2 + s : 2 + n]]
            resp[s, b, : n - s] = torch.arange(2 + s, 2 + n) >= plen
    if noise:
        feat = feat + noise * torch.randn_like(feat)
    return tok, feat, tgt, nxt, resp


def losses(model, batch, feature_weight: float, prompt_weight: float = 1.0):
    """Cross-entropy summed over the chain steps + the step-0 feature regression, each target
    weighted 1 if a response token (what serving drafts), else ``prompt_weight``. -> (loss,
    each step's accuracy on its response targets)."""
    tok, feat, tgt, nxt, resp = batch
    out = model.chain(list(tok), feat)
    wt = torch.where(resp, 1.0, prompt_weight) * (tgt >= 0)
    reg = F.smooth_l1_loss(out[0][1], nxt, reduction="none").mean(-1)
    loss, hits = feature_weight * (reg * wt[0]).sum() / wt[0].sum().clamp(min=1e-6), []
    for (logits, _), y, w, r in zip(out, tgt, wt, resp, strict=True):
        ce = F.cross_entropy(logits.flatten(0, 1), y.flatten().clamp(min=0), reduction="none")
        loss = loss + (ce * w.flatten()).sum() / w.sum().clamp(min=1e-6)
        r = r & (y >= 0)
        hits.append(float(((logits.argmax(-1) == y) & r).sum() / r.sum().clamp(min=1)))
    return loss, hits


def build_data(target, writer, args, held_out: bool):
    """(tokens, features, prompt length) of each prompt + the target's response: the greedy
    responses of ``writer`` (the target in ``--response-dtype``), the features ``target``'s
    (float32, as served)."""
    from backends.runtime.tokenizer import Tokenizer, has_tokenizer

    n = args.eval_prompts if held_out else args.prompts
    convs = data.prompts(n, args.seed, held_out)
    key = {"target": args.target, "max_tokens": args.max_tokens, "seed": args.seed,
           "templated_sha256": hashlib.sha256(json.dumps(convs).encode()).hexdigest(),
           "response_dtype": writer.dtype}  # fmt: skip
    path = args.data_cache and f"{args.data_cache}.{'held' if held_out else 'train'}.safetensors"
    if path and (items := data.load(path, key)) is not None:
        return items
    if has_tokenizer(args.target):
        ids = data.encode(Tokenizer(args.target), convs)
    else:  # a test model without a tokenizer: random prompts
        rng = random.Random(args.seed + held_out)
        vocab = target.config.vocab_size
        ids = [[rng.randrange(3, vocab) for _ in range(rng.randint(4, 24))] for _ in range(n)]
    outs = data.responses(writer, ids, args.max_tokens)
    seqs = [p + o for p, o in zip(ids, outs, strict=True)]
    feats = data.features(target, seqs)
    items = [(torch.tensor(s), f, len(p)) for s, f, p in zip(seqs, feats, ids, strict=True)]
    if path:
        data.save(path, key, items)
    return items


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", default=os.path.join(ROOT, "models/smollm2-135m-instruct"))
    ap.add_argument("--out", default=os.path.join(ROOT, "models/smollm2-135m-instruct-eagle"))
    ap.add_argument("--prompts", type=int, default=6144, help="training prompts")
    ap.add_argument("--eval-prompts", type=int, default=48, help="held-out prompts")
    ap.add_argument("--max-tokens", type=int, default=96, help="response tokens per prompt")
    ap.add_argument("--response-dtype", choices=("auto", "bfloat16", "float32"), default="auto",
                    help="the target's dtype for its responses (features stay"
                    " float32); auto = bfloat16 where the CPU has native bf16 (2.3x faster)")
    ap.add_argument("--draft-vocab", type=int, default=8192)
    ap.add_argument("--heads", type=int, default=9)
    ap.add_argument("--kv-heads", type=int, default=3)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--intermediate", type=int, default=1536)
    ap.add_argument("--epochs", type=int, default=5)
    ap.add_argument("--minutes", type=float, default=30.0, help="training time cap")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--noise", type=float, default=0.05)
    ap.add_argument("--feature-weight", type=float, default=1.0)
    ap.add_argument("--prompt-weight", type=float, default=0.2,
                    help="loss weight of prompt targets (response targets weigh 1)")  # fmt: skip
    ap.add_argument("--chain", type=int, default=3,
                    help="drafting steps trained as served (the head reads its own output)")
    ap.add_argument("--data-cache", default=None,
                    help="path prefix: keep the target's responses and features there; reuse"
                    " them when the target, max tokens and prompts match")  # fmt: skip
    ap.add_argument("--precision", choices=("auto", "bf16", "fp32"), default="auto",
                    help="training matmuls: bf16 autocast (weights and the optimizer stay"
                    " float32) or fp32; auto = bf16 where oneDNN runs it natively")  # fmt: skip
    ap.add_argument("--seed", type=int, default=0)
    return ap.parse_args(argv)


def use_bf16(precision: str) -> bool:
    """bf16 autocast for training: asked for, or ``auto`` on a CPU with native bf16 matmuls
    (AMX or AVX-512 BF16 in /proc/cpuinfo; elsewhere oneDNN emulates them)."""
    if precision != "auto":
        return precision == "bf16"
    try:
        with open("/proc/cpuinfo") as f:
            flags = set(next((ln for ln in f if ln.startswith("flags")), "").split())
    except OSError:
        return False
    return bool(flags & {"amx_bf16", "avx512_bf16"})


def main(argv=None) -> None:
    from tqdm import tqdm

    args = parse_args(argv)
    torch.manual_seed(args.seed)
    t0 = time.time()
    target = load_runner(args.target, device="cpu")  # training runs on CPU
    rdtype = args.response_dtype
    if rdtype == "auto":
        rdtype = "bfloat16" if use_bf16("auto") else "float32"
    writer = target if rdtype == "float32" else load_runner(args.target, dtype=rdtype)
    train, held = (build_data(target, writer, args, h) for h in (False, True))
    del writer
    t_data = time.time() - t0
    V = target.config.vocab_size
    counts = torch.bincount(torch.cat([t[2:] for t, _, _ in train]), minlength=V)
    D = min(args.draft_vocab, int((counts > 0).sum()))
    vocab_ids = counts.argsort(descending=True)[:D].sort().values
    vocab_map = torch.full((target.config.vocab_size,), -100, dtype=torch.long)
    vocab_map[vocab_ids] = torch.arange(D)
    model = HeadModule(target, args, vocab_ids)
    params = [p for n, p in model.named_parameters()]
    opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0)
    steps = args.epochs * -(-len(train) // args.batch)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, args.lr, total_steps=steps, pct_start=0.05)
    deadline, step, bf16 = time.time() + 60 * args.minutes, 0, use_bf16(args.precision)
    bar = tqdm(total=steps, desc="train_eagle", file=sys.stderr, mininterval=5)
    for _ in range(args.epochs):
        random.Random(step).shuffle(train)
        for i in range(0, len(train), args.batch):
            batch = make_batch(train[i : i + args.batch], vocab_map, args.noise, args.chain)
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                loss, hit = losses(model, batch, args.feature_weight, args.prompt_weight)
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            sched.step()
            step += 1
            bar.update()
            bar.set_postfix(loss=f"{loss.item():.3f}", acc=f"{hit[0]:.2f}", refresh=False)
            if time.time() > deadline:
                break
        if time.time() > deadline:
            break
    bar.close()
    with torch.no_grad():
        evals = [losses(model, make_batch(held[i : i + 16], vocab_map, 0.0, args.chain),
                        args.feature_weight) for i in range(0, len(held), 16)]  # fmt: skip
    cfg = head_checkpoint_config(target.config, args.heads, args.kv_heads, args.head_dim,
                                 args.intermediate, D)  # fmt: skip
    save_head(args.out, cfg, model.tensors(vocab_ids))
    coverage = float(counts[vocab_ids].sum() / counts.sum())
    print(json.dumps({
        "out": args.out, "train_sequences": len(train), "held_out_sequences": len(held),
        "train_tokens": int(sum(len(t) for t, _, _ in train)), "draft_vocab": D,
        "draft_vocab_coverage": coverage, "steps": step, "data_s": t_data,
        "train_s": time.time() - t0 - t_data, "bf16": bf16,
        "held_out_loss": sum(float(e[0]) for e in evals) / len(evals),
        "held_out_response_acc": [sum(e[1][s] for e in evals) / len(evals)
                                  for s in range(args.chain)],
    }))  # fmt: skip


if __name__ == "__main__":
    main()
