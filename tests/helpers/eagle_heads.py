"""EAGLE heads for the tests: random ones (losslessness must not depend on head quality)."""

from __future__ import annotations

import atexit
import shutil
import tempfile

import torch

from backends.runtime.config import ModelConfig
from backends.runtime.eagle import head_checkpoint_config, save_head

_HEADS: dict = {}  # key -> head directory, removed when this process exits


def _head_dir(prefix: str) -> str:
    path = tempfile.mkdtemp(prefix=prefix)
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    return path


def random_head(target_ckpt: str, draft_vocab: int | None = None, seed: int = 0) -> str:
    """A head directory with random weights for ``target_ckpt`` (4 heads of 16, 2 KV heads);
    ``draft_vocab`` D: a reduced vocabulary of D target ids (every other id from 3 on)."""
    key = (target_ckpt, draft_vocab, seed)
    if key in _HEADS:
        return _HEADS[key]
    cfg = ModelConfig.from_pretrained(target_ckpt)
    H, heads, kv, hd, inter = cfg.hidden_size, 4, 2, 16, 2 * cfg.hidden_size
    g = torch.Generator().manual_seed(seed)

    def w(*shape, scale=0.1):
        return scale * torch.randn(*shape, generator=g)

    p = "model.layers.0."
    t = {
        "fc.weight": w(H, 2 * H, scale=0.5 / H**0.5),
        p + "input_layernorm.weight": torch.ones(H),
        p + "post_attention_layernorm.weight": torch.ones(H),
        p + "self_attn.q_proj.weight": w(heads * hd, H),
        p + "self_attn.k_proj.weight": w(kv * hd, H),
        p + "self_attn.v_proj.weight": w(kv * hd, H),
        p + "self_attn.o_proj.weight": w(H, heads * hd),
        p + "mlp.gate_proj.weight": w(inter, H), p + "mlp.up_proj.weight": w(inter, H),
        p + "mlp.down_proj.weight": w(H, inter),
    }  # fmt: skip
    if draft_vocab:
        t["lm_head.weight"] = w(draft_vocab, H, scale=1.0)
        t["draft_to_target"] = torch.arange(3, 3 + 2 * draft_vocab, 2)
    path = _head_dir("eagle_head_")
    save_head(path, head_checkpoint_config(cfg, heads, kv, hd, inter, draft_vocab), t)
    _HEADS[key] = path
    return path


def trained_head(target_ckpt: str, draft_vocab: int = 96) -> str:
    """A head trained by scripts/train_eagle.py for a few seconds on ``target_ckpt`` (a tiny
    model: random prompts, its own greedy responses); cached per process."""
    from scripts import train_eagle as te

    key = ("trained", target_ckpt, draft_vocab)
    if key not in _HEADS:
        path = _head_dir("eagle_trained_")
        te.main(["--target", target_ckpt, "--out", path, "--prompts", "48", "--eval-prompts",
                 "8", "--max-tokens", "16", "--draft-vocab", str(draft_vocab), "--heads", "4",
                 "--kv-heads", "2", "--head-dim", "16", "--intermediate", "96", "--epochs", "8",
                 "--lr", "3e-3", "--minutes", "0.5", "--work", ""])  # fmt: skip
        _HEADS[key] = path
    return _HEADS[key]


def add_same_prompt(engine, prompt: list[int], first: int, params: list) -> torch.Tensor:
    """One prefilled request per ``params`` to an EAGLE engine (page i of both pools each),
    all with ``prompt`` and first token ``first``, as PD hands them over: the target's KV and
    the head's KV of the prompt pairs computed once into page 0 and copied to every page,
    and the last prompt position's feature. -> the target's logits after ``first`` [V]."""
    from backends.runtime.paged import SeqInput

    target, head, dpool = engine.runner, engine.draft.runner, engine.draft.pool
    (t_logits,), (f,) = target.forward(engine.pool, [SeqInput(prompt + [first], 0, [0])],
                                       features=True)  # fmt: skip
    n = len(prompt) - 1
    head.forward_head(dpool, [SeqInput(prompt[1:], 0, [0])], [f[:n]], logits=False)
    engine.pool.tensor[:, :, 1:] = engine.pool.tensor[:, :, :1]  # the same prompt KV per page
    dpool.tensor[:, :, 1:] = dpool.tensor[:, :, :1]
    pages, dpages = engine.pool.alloc(len(params)), dpool.alloc(len(params))
    for i, sp in enumerate(params):
        engine.add_prefilled(f"s{i}", prompt, [pages[i]], first, sp, draft_pages=[dpages[i]],
                             draft_feature=f[n])  # fmt: skip
    return t_logits[-1]
