#!/usr/bin/env python
"""Train an EAGLE draft head (``backends/runtime/eagle.py``) for a target checkpoint, on this
machine, from the target's own responses to prompts made here (``benchmarks/eagle_data/``:
prompts the target writes itself, the template generator, requests around text shipped in
networkx and sympy, and follow-up turns), and write a checkpoint that ``--draft DIR`` /
``draft_model_dir`` load.

The head: ``fc([embed(x_{i+1}) ; f_i])`` -> one Llama decoder layer -> ``g_i`` -> LM head over a
reduced draft vocabulary (the ``--draft-vocab`` most frequent response tokens, initialised from
the target's own LM head rows). It is trained the way it drafts (training-time test): for every
anchor ``i`` at once, step 0 reads the real feature ``f_i``, and each of the ``--chain`` - 1
further steps reads the previous step's ``g`` with the next token, at the next position, seeing
the real pairs' KV and its own chain's, as the served chain does (a test checks they are the
same). Anchors are the response positions and the last ``--prompt-anchors`` prompt positions;
the other prompt positions only give the KV the anchors attend to (their queries, MLP and LM
head are not computed). Loss: cross-entropy of each step's token (``x_{i+2+s}``, the target's
own; with ``--soft-labels`` W, W of the label is the target's own distribution of that token,
its LM head on ``f_{i+1+s}``, as EAGLE trains: W = 1 by default), prompt targets weighted
``--prompt-weight``, + ``--feature-weight`` x smooth-L1 of step 0's ``g_i`` against
``f_{i+1}``. Input features get Gaussian noise (``--noise``). The decoder layer is transformers'
Llama layer with the chain's attention spelled out, the same math the runtime runs (checked by
a test).

    .venv/bin/python scripts/train_eagle.py --out models/smollm2-135m-instruct-eagle

Resumable: the prompts, responses and features are kept in ``--work`` (default ``OUT.work``)
in shards as they are made, and training saves a checkpoint there every
``--checkpoint-minutes`` and when stopped (Ctrl-C, SIGTERM); the same command then resumes
where it stopped (``--fresh``: retrain from scratch, reusing the data). The epochs run to their
end unless ``--minutes`` caps training, which then shortens the learning-rate schedule to fit
(measured on the first steps), so a capped run still finishes its schedule.

Time with the defaults, SmolLM2-135M on 2 cores: see the README (measured on a CPU without
native bfloat16: responses and features in float32, training in float32).
Prints one JSON line at the end: data sizes, times, and teacher-forced accuracy on response
tokens (what serving drafts) of each evaluation set.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import signal
import sys
import time
from typing import NamedTuple

import torch
import torch.nn.functional as F

from backends.runtime.eagle import head_checkpoint_config, save_head
from backends.runtime.loader import load_runner
from backends.runtime.runner import ModelRunner
from benchmarks import eagle_data as data

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CHECKPOINT = "train.pt"


def _rope(t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    from transformers.models.llama.modeling_llama import rotate_half

    return t * cos[:, None] + rotate_half(t) * sin[:, None]  # t: [B, heads, n, d]


class HeadModule(torch.nn.Module):
    """The head for training (the runtime's :class:`EagleHead` serves the same weights)."""

    def __init__(self, target: ModelRunner, args, vocab_ids: torch.Tensor):
        from transformers import LlamaConfig
        from transformers.models.llama import modeling_llama as hf

        super().__init__()
        H = target.config.hidden_size
        self.cfg = LlamaConfig(hidden_size=H, intermediate_size=args.intermediate,
                               num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
                               head_dim=args.head_dim, num_hidden_layers=1, rms_norm_eps=1e-6,
                               rope_theta=10000.0, vocab_size=target.config.vocab_size,
                               max_position_embeddings=target.config.max_position_embeddings,
                               attn_implementation="sdpa")  # fmt: skip
        self.embed = target.model.embed_tokens.detach().float()  # frozen, the target's
        if target.model.embed_scale is not None:  # as the runtime embeds (Gemma 3's multiplier)
            self.embed = self.embed * target.model.embed_scale.float()
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
        self.teacher = head[vocab_ids]  # frozen: the target's logits of a feature (soft labels)

    def _step(self, h: torch.Tensor, s: int, cache: list, idx: torch.Tensor) -> torch.Tensor:
        """The decoder layer at chain step ``s`` for the anchors ``idx`` [B, A] at once (anchor
        position ``i`` is at position ``i + s``). Step 0 reads every position's input ``h`` [B,
        L, H] (each gives its KV; only the anchors' rows go on), a later step its anchors' [B,
        A, H]. The keys are what the served chain sees: the step-0 keys of positions ``<= i``
        (the real features' KV) and anchor ``i``'s own keys of steps 1..s. ``cache`` holds the
        (k, v) of the earlier steps and gets this step's. -> [B, A, H]."""
        a, (B, n, _), hd = self.layer.self_attn, h.shape, self.cfg.head_dim
        A = idx.shape[1]
        x = self.layer.input_layernorm(h)
        k, v = (p(x).view(B, n, -1, hd).transpose(1, 2) for p in (a.k_proj, a.v_proj))
        if s == 0:  # queries of the anchors only
            kpos = torch.arange(n)[None].expand(B, -1)
            rows = idx[..., None].expand(-1, -1, h.shape[-1])
            xq, h = x.gather(1, rows), h.gather(1, rows)
        else:
            kpos, xq = idx + s, x
        q = a.q_proj(xq).view(B, A, -1, hd).transpose(1, 2)
        q, k = _rope(q, *self.rope(x, idx + s)), _rope(k, *self.rope(x, kpos))
        cache.append((k, v))
        L = cache[0][0].shape[2]
        first = torch.arange(L)[None, None] <= idx[..., None]  # [B, A, L]
        own = torch.eye(A, dtype=torch.bool)[None].expand(B, -1, -1)
        mask = torch.cat([first] + [own] * s, dim=2)[:, None]  # [B, 1, A, L + s A]
        o = F.scaled_dot_product_attention(q, torch.cat([c[0] for c in cache], 2),
                                           torch.cat([c[1] for c in cache], 2), attn_mask=mask,
                                           scale=a.scaling, enable_gqa=True)  # fmt: skip
        h = h + a.o_proj(o.transpose(1, 2).reshape(B, A, -1))
        return h + self.layer.mlp(self.layer.post_attention_layernorm(h))

    def chain(self, tokens: list[torch.Tensor], feats: torch.Tensor,
              idx: torch.Tensor | None = None) -> list[tuple]:  # fmt: skip
        """Drafting as served, for the anchors ``idx`` [B, A] (default: every position) at
        once (training-time test): step 0 reads the pairs (``f_i``, ``tokens[0]``) of every
        position (``tokens[0]`` [B, L] = x_{i+1}, ``feats`` [B, L, H]); step ``s`` an anchor's
        pair (step ``s - 1``'s output ``g``, ``tokens[s]``) (``tokens[s]`` [B, A]: x_{i+1+s}).
        -> per step (draft logits [B, A, D], g [B, A, H])."""
        if idx is None:
            idx = torch.arange(feats.shape[1])[None].expand(feats.shape[0], -1)
        cache, out = [], []
        for s, tok in enumerate(tokens):
            f = feats if s == 0 else out[-1][1]
            h = self.fc(torch.cat([F.embedding(tok, self.embed), f], dim=-1))
            g = self._step(h, s, cache, idx)
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


class Batch(NamedTuple):
    tok0: torch.Tensor  # [B, L] x_{i+1} of every position
    feat: torch.Tensor  # [B, L, H] f_i (+ noise)
    idx: torch.Tensor  # [B, A] the anchors' positions (padding repeats the last)
    tok: torch.Tensor  # [steps - 1, B, A] x_{i+1+s} of chain steps 1..
    tgt: torch.Tensor  # [steps, B, A] x_{i+2+s} in draft ids, -100 where none
    resp: torch.Tensor  # [steps, B, A] whether that target is a response token
    nxt: torch.Tensor  # [steps, B, A, H] f_{i+1+s}: the target's distribution of x_{i+2+s}


def make_batch(items, vocab_map: torch.Tensor, noise: float, steps: int = 1,
               prompt_anchors: int | None = None) -> Batch:  # fmt: skip
    """items: (tokens [T], feats [>= T - 1, H], prompt length) -> a right-padded batch over
    positions ``i < T - 2``; anchors from ``plen - 2 - prompt_anchors`` on (None: all)."""
    ns = [len(t) - 2 for t, _, _ in items]
    firsts = [0 if prompt_anchors is None else min(max(p - 2 - prompt_anchors, 0), n - 1)
              for (_, _, p), n in zip(items, ns, strict=True)]  # fmt: skip
    B, L, H = len(items), max(ns), items[0][1].shape[1]
    A = max(n - f for n, f in zip(ns, firsts, strict=True))
    tok0, feat = torch.zeros(B, L, dtype=torch.long), torch.zeros(B, L, H)
    idx = torch.zeros(B, A, dtype=torch.long)
    tok = torch.zeros(max(steps - 1, 0), B, A, dtype=torch.long)
    tgt = torch.full((steps, B, A), -100, dtype=torch.long)
    resp = torch.zeros(steps, B, A, dtype=torch.bool)
    nxt = torch.zeros(steps, B, A, H)
    for b, ((t, f, plen), n, first) in enumerate(zip(items, ns, firsts, strict=True)):
        m, f = n - first, f.float()
        tok0[b, :n], feat[b, :n] = t[1 : n + 1], f[:n]
        i = torch.arange(first, n)
        idx[b, :m], idx[b, m:] = i, n - 1
        for s in range(min(steps, m)):
            j = i[: m - s]
            if s:
                tok[s - 1, b, : m - s] = t[j + 1 + s]
            tgt[s, b, : m - s] = vocab_map[t[j + 2 + s]]
            nxt[s, b, : m - s] = f[j + 1 + s]
            resp[s, b, : m - s] = j + 2 + s >= plen
    if noise:
        feat = feat + noise * torch.randn_like(feat)
    return Batch(tok0, feat, idx, tok, tgt, resp, nxt)


def losses(model, batch: Batch, feature_weight: float, prompt_weight: float = 1.0,
           soft: float = 0.0):  # fmt: skip
    """Cross-entropy summed over the chain steps + the step-0 feature regression, each target
    weighted 1 if a response token (what serving drafts), else ``prompt_weight``. A step's
    labels are ``soft`` x the target's own distribution of the token (its LM head on the real
    feature, restricted to the draft vocabulary: EAGLE's soft labels) + (1 - ``soft``) x the
    token itself. -> (loss, per step (correct response targets, response targets))."""
    out = model.chain([batch.tok0, *batch.tok], batch.feat, batch.idx)
    wt = torch.where(batch.resp, 1.0, prompt_weight) * (batch.tgt >= 0)
    reg = F.smooth_l1_loss(out[0][1], batch.nxt[0], reduction="none").mean(-1)
    loss = feature_weight * (reg * wt[0]).sum() / wt[0].sum().clamp(min=1e-6)
    for (logits, _), y, w, f in zip(out, batch.tgt, wt, batch.nxt, strict=True):
        ce = F.cross_entropy(logits.flatten(0, 1), y.flatten().clamp(min=0), reduction="none")
        if soft:  # cross-entropy against the target's distribution (probability targets)
            with torch.no_grad():
                p = (f.float() @ model.teacher.T).softmax(-1).flatten(0, 1)
            soft_ce = F.cross_entropy(logits.float().flatten(0, 1), p, reduction="none")
            ce = soft * soft_ce + (1 - soft) * ce
        loss = loss + (ce * w.flatten()).sum() / w.sum().clamp(min=1e-6)
    return loss, [(int((ok & r).sum()), int(r.sum())) for ok, r in step_hits(out, batch)]


def step_hits(out, batch: Batch) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per chain step of ``out`` (``HeadModule.chain``'s): (the head's top-1 is the target's
    token, the target is a response token in the draft vocabulary), each [B, A]."""
    return [((logits.argmax(-1) == y) & (y >= 0), r & (y >= 0))
            for (logits, _), y, r in zip(out, batch.tgt, batch.resp, strict=True)]  # fmt: skip


def epoch_batches(lengths: list[int], batch: int, seed: int, epoch: int) -> list[list[int]]:
    """An epoch's batches of item indices: shuffled, then sorted by length within windows of
    64 batches (less padding), the batches in random order; the same for the same arguments."""
    rng = random.Random(seed * 7919 + epoch)
    order = list(range(len(lengths)))
    rng.shuffle(order)
    out = []
    for w in range(0, len(order), 64 * batch):
        window = sorted(order[w : w + 64 * batch], key=lambda i: lengths[i])
        out += [window[i : i + batch] for i in range(0, len(window), batch)]
    rng.shuffle(out)
    return out


def lr_at(step: int, total: int, peak: float, warmup: float = 0.05) -> float:
    """Linear warm-up over ``warmup`` of the steps, then cosine to 0 at ``total``."""
    warm = max(1, int(total * warmup))
    if step < warm:
        return peak * (step + 1) / warm
    return peak * 0.5 * (1 + math.cos(math.pi * min(1.0, (step - warm) / max(1, total - warm))))


def served_walk(matches: list[int], plen: int, length: int, k: int,
                max_tokens: int) -> tuple[int, int]:  # fmt: skip
    """Where serving starts its chains in one response, and what they keep: the first chain
    drafts after the prefill's token, each verify keeps ``m`` drafts and the target's next
    token, and the next chain starts after them. ``matches[i]``: how many leading drafts of the
    chain read at position ``i`` (drafting ``x_{i+2}``, ...) are right; ``length``: the tokens
    of prompt + response. k is clamped as decode clamps it (``max_tokens`` - emitted - 1) and to
    the response (past its EOS nothing is known). -> (verify steps, tokens they gave)."""
    steps = tokens = 0
    n = plen + 1  # tokens so far: the prompt and the prefill's first token
    while n < length:
        kk = min(k, max_tokens - (n - plen) - 1, length - n)
        if kk <= 0:  # a plain step
            n += 1
            continue
        m = min(matches[n - 2], kk)
        steps, tokens, n = steps + 1, tokens + m + 1, n + m + 1
    return steps, tokens


def evaluate(model, items, vocab_map: torch.Tensor, chain: int, max_tokens: int) -> dict:
    """On the response tokens: teacher-forced accuracy per chain step (``acc``: every position
    a chain could start at), and the tokens per verify step of chains of ``chain`` drafts that
    start where serving starts them (``served_tokens_per_step``: after each verify, so mostly
    right after a draft the target did not take, which are harder positions than the average)."""
    hits = [[0, 0] for _ in range(chain)]
    steps = tokens = 0
    with torch.no_grad():
        for i in range(0, len(items), 16):
            part = items[i : i + 16]
            batch = make_batch(part, vocab_map, 0.0, chain, prompt_anchors=0)
            out = model.chain([batch.tok0, *batch.tok], batch.feat, batch.idx)
            right = torch.ones_like(batch.idx, dtype=torch.bool)
            run = torch.zeros_like(batch.idx)  # per anchor: its leading right drafts
            for (ok, r), acc in zip(step_hits(out, batch), hits, strict=True):
                acc[0], acc[1] = acc[0] + int((ok & r).sum()), acc[1] + int(r.sum())
                right = right & ok
                run += right.long()
            for b, (t, _, plen) in enumerate(part):
                first = int(batch.idx[b, 0])  # the anchors start at plen - 2
                matches = [0] * first + run[b].tolist()
                walked = served_walk(matches, plen, len(t), chain, max_tokens)
                steps, tokens = steps + walked[0], tokens + walked[1]
    return {"acc": [h / max(1, n) for h, n in hits],
            "served_tokens_per_step": tokens / steps if steps else None}  # fmt: skip


def build_data(target, args) -> tuple[list, dict[str, list], dict]:
    """-> (training items, evaluation items per set, what the mix gave)."""
    from backends.runtime.tokenizer import Tokenizer, has_tokenizer

    work = args.work or None
    key = {"target": os.path.abspath(args.target), "dtype": str(target.dtype)}
    if not has_tokenizer(args.target):  # a test model without a tokenizer: random prompts
        rng = random.Random(args.seed)
        vocab = target.config.vocab_size

        def rand(n):
            return [[rng.randrange(3, vocab) for _ in range(rng.randint(4, 24))] for _ in range(n)]

        def make(name, ids):
            shards = data.Shards(work, name, key | {"max_tokens": args.max_tokens})
            return shards.run(ids, lambda c: data.responses_and_features(target, c, mt))

        mt = args.max_tokens

        train = make("random", rand(args.prompts))
        return train, {"held-out": make("eval-random", rand(args.eval_prompts))}, {}
    tok = Tokenizer(args.target)
    mix = data.Mix(args.prompts, args.magpie, args.templates, args.package, args.multi_turn)
    train, counts = data.training_items(target, tok, mix, args.max_tokens, args.seed, work, key,
                                        args.gen_batch)  # fmt: skip
    evals = {name: data.eval_items(target, tok, name, args.eval_prompts if name == "held-out"
                                   else 0, args.max_tokens, args.seed, work, key, args.gen_batch)
             for name in data.evalsets.SETS}  # fmt: skip
    return train, evals, counts


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", default=os.path.join(ROOT, "models/smollm2-135m-instruct"))
    ap.add_argument("--out", default=os.path.join(ROOT, "models/smollm2-135m-instruct-eagle"))
    ap.add_argument("--work", default=None,
                    help="where prompts, responses, features and the training checkpoint are"
                    " kept (default OUT.work; '' keeps nothing, so nothing resumes)")  # fmt: skip
    ap.add_argument(
        "--fresh",
        action="store_true",
        help="ignore a training checkpoint in --work (the data is reused)",
    )
    ap.add_argument("--prompts", type=int, default=6144, help="training conversations")
    ap.add_argument("--magpie", type=float, default=0.45,
                    help="share of prompts the target writes itself")  # fmt: skip
    ap.add_argument("--templates", type=float, default=0.25, help="share of templated prompts")
    ap.add_argument("--package", type=float, default=0.15,
                    help="share of requests around networkx / sympy text")  # fmt: skip
    ap.add_argument("--multi-turn", type=float, default=0.15,
                    help="share of conversations with a follow-up turn")  # fmt: skip
    ap.add_argument("--eval-prompts", type=int, default=48, help="held-out prompts")
    ap.add_argument("--max-tokens", type=int, default=80, help="response tokens per prompt")
    ap.add_argument("--gen-batch", type=int, default=128,
                    help="sequences per step while the target writes")  # fmt: skip
    ap.add_argument("--draft-vocab", type=int, default=8192)
    ap.add_argument("--heads", type=int, default=9)
    ap.add_argument("--kv-heads", type=int, default=3)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--intermediate", type=int, default=1536)
    ap.add_argument("--epochs", type=int, default=4)
    ap.add_argument(
        "--minutes",
        type=float,
        default=None,
        help="cap training at this many minutes: the learning-rate schedule is"
        " shortened to fit, as measured on the first steps (default: no cap)",
    )
    ap.add_argument("--checkpoint-minutes", type=float, default=5.0)
    ap.add_argument(
        "--stop-after",
        type=int,
        default=None,
        help="stop (checkpointed) after this many optimizer steps in this run",
    )
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--noise", type=float, default=0.05)
    ap.add_argument("--feature-weight", type=float, default=1.0)
    ap.add_argument("--prompt-weight", type=float, default=0.2,
                    help="loss weight of prompt targets (response targets weigh 1)")  # fmt: skip
    ap.add_argument("--soft-labels", type=float, default=1.0,
                    help="weight of the target's own distribution in each label (0: the token"
                    " only; 1, the default: the distribution only, as EAGLE trains)")  # fmt: skip
    ap.add_argument("--prompt-anchors", type=int, default=16,
                    help="prompt positions before the response trained as anchors")  # fmt: skip
    chain = "drafting steps trained as served (the head reads its own output)"
    ap.add_argument("--chain", type=int, default=3, help=chain)
    ap.add_argument("--precision", choices=("auto", "bf16", "fp32"), default="auto",
                    help="training matmuls: bf16 autocast (weights and the optimizer stay"
                    " float32) or fp32; auto = bf16 where oneDNN runs it natively")  # fmt: skip
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if args.work is None:
        args.work = args.out.rstrip("/") + ".work"
    return args


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


class Checkpoint:
    """The training state in ``work``: saved atomically, loaded only under the same ``key`` (the
    data, vocabulary and every setting that changes what the steps compute)."""

    def __init__(self, work: str | None, key: dict):
        self.path = work and os.path.join(work, CHECKPOINT)
        self.key = key

    def load(self) -> dict | None:
        if not self.path or not os.path.exists(self.path):
            return None
        state = torch.load(self.path, weights_only=True)
        return state if state.get("key") == self.key else None

    def save(self, **state) -> None:
        if self.path:
            torch.save({"key": self.key, **state}, self.path + ".tmp")
            os.replace(self.path + ".tmp", self.path)

    def remove(self) -> None:
        if self.path and os.path.exists(self.path):
            os.remove(self.path)


def _sigterm(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def train(model, train_items, vocab_map, args, ckpt: Checkpoint) -> dict:
    """Run (or resume) the epochs -> what happened (steps, times, where it resumed)."""
    params = list(model.parameters())
    opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0)
    lengths = [len(t) for t, _, _ in train_items]
    per_epoch = -(-len(train_items) // args.batch)
    state = {"step": 0, "total": args.epochs * per_epoch, "train_s": 0.0}
    saved = None if args.fresh else ckpt.load()
    if saved is not None:
        model.load_state_dict(saved["model"])
        opt.load_state_dict(saved["opt"])
        torch.set_rng_state(saved["rng"])
        state = {k: saved[k] for k in state}
        data.log(f"resuming at step {state['step']}/{state['total']}")
    resumed, bf16 = state["step"], use_bf16(args.precision)
    t_run = time.time() - state["train_s"]  # training seconds, over every run
    last_save, fitted = time.time(), args.minutes is None or saved is not None
    this_run, rng = 0, torch.get_rng_state()  # the RNG as the next step starts (its noise)

    def checkpoint():
        ckpt.save(model=model.state_dict(), opt=opt.state_dict(), rng=rng,
                  **state | {"train_s": time.time() - t_run})  # fmt: skip

    from tqdm import tqdm

    bar = tqdm(total=state["total"], initial=state["step"], desc="train_eagle", file=sys.stderr,
               mininterval=5)  # fmt: skip
    old = signal.signal(signal.SIGTERM, _sigterm)
    try:
        while state["step"] < state["total"]:
            epoch, at = divmod(state["step"], per_epoch)
            ids = epoch_batches(lengths, args.batch, args.seed, epoch)[at]
            batch = make_batch([train_items[i] for i in ids], vocab_map, args.noise, args.chain,
                               args.prompt_anchors)  # fmt: skip
            for g in opt.param_groups:
                g["lr"] = lr_at(state["step"], state["total"], args.lr)
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                loss, hit = losses(model, batch, args.feature_weight, args.prompt_weight,
                                   args.soft_labels)  # fmt: skip
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            state["step"] += 1
            this_run, rng = this_run + 1, torch.get_rng_state()
            bar.update()
            bar.set_postfix(loss=f"{loss.item():.3f}", acc=f"{hit[0][0] / max(1, hit[0][1]):.2f}",
                            refresh=False)  # fmt: skip
            if not fitted and this_run == 20:  # --minutes: fit the schedule to the budget
                fitted = True
                per = (time.time() - t_run) / this_run
                fit = state["step"] + int((60 * args.minutes - (time.time() - t_run)) / per)
                if fit < state["total"]:
                    data.log(f"--minutes {args.minutes}: {per:.2f} s a step, the schedule"
                             f" shortened to {fit} of {state['total']} steps")  # fmt: skip
                    state["total"] = max(fit, state["step"] + 1)
                    bar.total = state["total"]
            if time.time() - last_save > 60 * args.checkpoint_minutes:
                checkpoint()
                last_save = time.time()
            if args.stop_after is not None and this_run >= args.stop_after:
                break
    except KeyboardInterrupt:
        checkpoint()
        data.log(f"stopped at step {state['step']}: checkpoint saved; the same command resumes")
        raise
    finally:
        signal.signal(signal.SIGTERM, old)
        bar.close()
    done = state["step"] >= state["total"]
    if not done:
        checkpoint()
    return {"steps": state["step"], "total_steps": state["total"], "done": done,
            "resumed_at": resumed, "train_s": time.time() - t_run, "bf16": bf16}  # fmt: skip


def main(argv=None) -> None:
    args = parse_args(argv)
    torch.manual_seed(args.seed)
    if args.work:
        os.makedirs(args.work, exist_ok=True)
    t0 = time.time()
    target = load_runner(args.target, device="cpu")  # training runs on CPU, float32
    train_items, evals, counts = build_data(target, args)
    train_items = [x for x in train_items if len(x[0]) >= 3]
    t_data = time.time() - t0
    V = target.config.vocab_size
    counts_v = torch.bincount(torch.cat([t[2:] for t, _, _ in train_items]), minlength=V)
    D = min(args.draft_vocab, int((counts_v > 0).sum()))
    vocab_ids = counts_v.argsort(descending=True, stable=True)[:D].sort().values
    vocab_map = torch.full((V,), -100, dtype=torch.long)
    vocab_map[vocab_ids] = torch.arange(D)
    model = HeadModule(target, args, vocab_ids)
    keys = ("target", "prompts", "magpie", "templates", "package", "multi_turn", "max_tokens",
            "draft_vocab", "heads", "kv_heads", "head_dim", "intermediate", "epochs", "batch",
            "lr", "noise", "feature_weight", "prompt_weight", "soft_labels", "prompt_anchors",
            "chain", "precision", "seed")  # fmt: skip
    ckpt = Checkpoint(args.work, {k: getattr(args, k) for k in keys} | {
        "items": len(train_items), "vocab": vocab_ids.tolist()[:16] + [D]})  # fmt: skip
    result = train(model, train_items, vocab_map, args, ckpt)
    if not result["done"]:
        data.log(f"stopped after step {result['steps']} of {result['total_steps']}"
                 " (--stop-after): the same command resumes")  # fmt: skip
        print(json.dumps({"out": None, **result}))
        return
    scores = {name: evaluate(model, items, vocab_map, args.chain, args.max_tokens)
              for name, items in evals.items()}  # fmt: skip
    acc = {name: x["acc"] for name, x in scores.items()}
    cfg = head_checkpoint_config(target.config, args.heads, args.kv_heads, args.head_dim,
                                 args.intermediate, D)  # fmt: skip
    save_head(args.out, cfg, model.tensors(vocab_ids))
    ckpt.remove()
    print(json.dumps({
        "out": args.out, "train_sequences": len(train_items), "sources": counts,
        "eval_sequences": {k: len(v) for k, v in evals.items()},
        "train_tokens": int(sum(len(t) for t, _, _ in train_items)), "draft_vocab": D,
        "draft_vocab_coverage": float(counts_v[vocab_ids].sum() / counts_v.sum()),
        "data_s": t_data, **result, "total_s": time.time() - t0,
        "response_acc": acc, "held_out_response_acc": acc.get("held-out"),
        "served_tokens_per_step": {k: x["served_tokens_per_step"] for k, x in scores.items()},
    }))  # fmt: skip


if __name__ == "__main__":
    main()
