"""EAGLE heads (backends/runtime/eagle.py, spec_eagle.py): greedy speculative decoding with a
head emits exactly the target-only greedy tokens (random heads, full and reduced vocabulary; a
GQA and an MLA target); the target's features are the final-norm hidden states of the very
forward that gives the logits; the head's state survives mixed accepted lengths."""

from __future__ import annotations

import json
import re

import pytest
import runtime_models as rm
import spec_models as sm
import torch
from eagle_heads import add_same_prompt, random_head, trained_head

from backends.runtime.eagle import EagleHead
from backends.runtime.loader import load_runner
from backends.runtime.paged import SeqInput
from backends.runtime.sequence import FinishReason
from backends.runtime.spec import DraftSpec, load_draft
from backends.runtime.spec_eagle import EagleSpecEngine, spec_engine
from backends.stages.fingerprint import draft_identity

PROMPTS = [rm.random_prompt(n, seed=n) for n in (1, 4, 9, 14, 6)]
MAX_TOKENS = [20, 9, 16, 3, 12]


def _engine(target, head_dir: str, k: int = 3, max_batch: int = 0):
    head = load_draft(target, path=head_dir)
    assert isinstance(head, EagleHead)
    dspec = DraftSpec(head, head.make_pool(64, 4, role="draft"), k, max_batch)
    engine = spec_engine(target, target.make_pool(64, 4), dspec)
    assert isinstance(engine, EagleSpecEngine)
    return engine


@pytest.mark.parametrize("kind,vocab", [("llama", None), ("llama", 64), ("deepseek_v3", 64)])
def test_head_greedy_equals_target_only(kind, vocab, llama, mla):
    target = llama if kind == "llama" else mla
    engine = _engine(target, random_head(rm.checkpoint(kind), vocab))
    reqs = [(p, sm.greedy(m)) for p, m in zip(PROMPTS, MAX_TOKENS, strict=True)]
    seqs = engine.generate(reqs)
    for (p, sp), s in zip(reqs, seqs, strict=True):
        assert s.output_ids == sm.reference(target, p, sp), p
        assert s.finish_reason == FinishReason.LENGTH
        assert s.draft_len + len(s.draft_feats) == s.num_tokens - 1  # the head's invariant
    assert engine.stats.proposed > 0 and engine.stats.verify_steps > 0
    assert engine.pool.num_free == 64 and engine.draft.pool.num_free == 64


def test_head_catches_up_the_steps_above_max_batch(llama):
    """DraftSpec.max_batch = 2: the head proposes nothing while more sequences run, its
    pending features pile up (the invariant holds), and it catches them up when two remain."""
    engine = _engine(llama, random_head(rm.checkpoint("llama")), max_batch=2)
    reqs = [(p, sm.greedy(m)) for p, m in zip(PROMPTS, MAX_TOKENS, strict=True)]
    seqs = dict(zip(MAX_TOKENS, engine.generate(reqs), strict=True))
    for (p, sp), s in zip(reqs, seqs.values(), strict=True):
        assert s.output_ids == sm.reference(llama, p, sp), p
        assert s.draft_len + len(s.draft_feats) == s.num_tokens - 1
    assert [seqs[m].num_proposed for m in (3, 9, 12)] == [0, 0, 0]
    assert seqs[20].num_proposed > 0 and seqs[16].num_proposed > 0


def test_head_that_predicts_the_target_accepts_and_stays_lossless(llama):
    """A head whose LM head is the target's argmax at the next position is impossible to build
    from random weights; instead the target itself is the 'head' check: a head whose drafts
    always equal the target's greedy choice (patched proposals) accepts every draft and the
    output is still the target-only output, with the feature invariant kept."""
    engine = _engine(llama, random_head(rm.checkpoint("llama")))
    pairs = zip(PROMPTS, MAX_TOKENS, strict=True)
    ref = {tuple(p): sm.reference(llama, p, sm.greedy(m)) for p, m in pairs}
    propose = engine._propose

    def oracle(seqs, ks):
        drafts, qs = propose(seqs, ks)  # runs the head (its KV and state as usual)
        for s, d in zip(seqs, drafts, strict=True):
            full = ref[tuple(s.prompt_ids)]
            at = len(s.output_ids)
            d[:] = (full[at:] + [0] * len(d))[: len(d)]
        return drafts, qs

    engine._propose = oracle
    seqs = engine.generate([(p, sm.greedy(m)) for p, m in zip(PROMPTS, MAX_TOKENS, strict=True)])
    for p, s in zip(PROMPTS, seqs, strict=True):
        assert s.output_ids == ref[tuple(p)]
        assert s.draft_len + len(s.draft_feats) == s.num_tokens - 1
    assert engine.stats.acceptance_rate == 1.0


def test_features_are_the_final_norm_hidden_states(llama):
    prompt = rm.random_prompt(11, seed=3)
    pool = llama.make_pool(8, 4)
    pages = pool.alloc(3)
    (logits,), (feats,) = llama.forward(pool, [SeqInput(prompt, 0, pages)], features=True)
    h = llama.model.embed(torch.tensor(prompt, device=llama.device))
    meta = llama._meta(pool, [(0, len(prompt), pages)])
    pool2 = llama.make_pool(8, 4)
    h = llama.model.run_layers(h, meta, pool2.tensor, 0, llama.config.num_layers)
    assert torch.equal(feats, llama.model.norm(h))  # bit for bit, float32
    assert torch.equal(logits, llama.model.logits(h))


def test_head_identity_and_bad_heads(llama, tmp_path):
    import json
    import shutil

    a, b = random_head(rm.checkpoint("llama"), 64), random_head(rm.checkpoint("llama"), 64, 1)
    assert draft_identity(a) == draft_identity(a) != draft_identity(b)
    cases = {"hidden_size": (72, "EAGLE head for hidden 72"),
             "num_hidden_layers": (2, "one decoder layer")}  # fmt: skip
    for i, (field, (value, words)) in enumerate(cases.items()):
        bad = shutil.copytree(a, tmp_path / str(i))
        cfg = json.loads((bad / "config.json").read_text())
        cfg[field] = value
        (bad / "config.json").write_text(json.dumps(cfg))
        with pytest.raises(ValueError, match=words):
            load_draft(llama, path=str(bad))
    cfg = json.loads((tmp_path / "0" / "config.json").read_text())
    cfg["hidden_size"], cfg["eagle"]["draft_vocab_size"] = llama.config.hidden_size, 65
    (tmp_path / "0" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="draft_vocab_size 65 but an LM head of 64 rows"):
        load_draft(llama, path=str(tmp_path / "0"))


def _train_eagle():
    from scripts import train_eagle

    return train_eagle


def _module_and_head(llama, path):
    """train_eagle.py's training module, moved away from its identity start so every weight
    matters, and the same weights loaded as the runtime serves them (on ``llama``'s device; the
    module trains on CPU)."""
    from backends.runtime.eagle import head_checkpoint_config, save_head

    te = _train_eagle()
    args = te.parse_args(["--heads", "4", "--kv-heads", "2", "--head-dim", "16",
                          "--intermediate", "96"])  # fmt: skip
    vocab_ids = torch.arange(3, 131)
    cpu = load_runner(rm.checkpoint("llama"), device="cpu")
    module = te.HeadModule(cpu, args, vocab_ids)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    cfg = head_checkpoint_config(llama.config, 4, 2, 16, 96, len(vocab_ids))
    save_head(str(path), cfg, module.tensors(vocab_ids))
    head = load_draft(llama, path=str(path))
    # on CPU a float32 head is served from bfloat16 copies of its linear weights (half the bytes
    # a call streams); the module's get the same rounding, so the rest must agree to float32
    half = llama.device.type == "cpu"
    want = torch.bfloat16 if half else torch.float32
    assert head.model.fc.weight.dtype == head.model.lm_head.weight.dtype == want
    with torch.no_grad():
        for p in module.parameters():
            if p.dim() == 2 and half:
                p.copy_(p.bfloat16().float())
    return module, head, vocab_ids


def test_training_module_equals_the_served_head(llama, tmp_path):
    """The head train_eagle.py trains (transformers' Llama layer) and the head the runtime
    serves from its checkpoint compute the same outputs and logits."""
    module, head, vocab_ids = _module_and_head(llama, tmp_path)
    g = torch.Generator().manual_seed(1)
    tokens = torch.tensor([rm.random_prompt(10, seed=4)])
    feats = torch.randn(1, 10, llama.config.hidden_size, generator=g)
    with torch.no_grad():
        want_logits, want_g = module(tokens, feats)
    pool = head.make_pool(8, 4)
    (got_logits,), (got_g,) = head.forward_head(
        pool,
        [SeqInput(tokens[0].tolist(), 0, pool.alloc(3))],
        [feats[0].to(llama.device)],
        last_only=False,
    )
    got_g, got_logits = got_g.cpu(), got_logits.cpu()
    torch.testing.assert_close(got_g, want_g[0], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(got_logits[:, vocab_ids], want_logits[0], atol=1e-4, rtol=1e-4)
    assert bool(torch.isinf(got_logits[:, 0]).all())  # outside the draft vocabulary


def test_training_chain_equals_the_served_chain(llama, tmp_path):
    """The chain steps train_eagle.py trains for every anchor at once (its masks) are what the
    served chain computes: anchor i's real pairs in the head's KV, then the head's own output
    fed back at positions i + 1, i + 2 with the next tokens."""
    module, head, vocab_ids = _module_and_head(llama, tmp_path)
    g = torch.Generator().manual_seed(2)
    x = rm.random_prompt(14, seed=6)
    L = len(x) - 4  # anchors with tokens for all three steps
    feats = torch.randn(L, llama.config.hidden_size, generator=g)
    steps = [torch.tensor([x[1 + s : 1 + s + L]]) for s in range(3)]  # anchor i: x_{i+1+s}
    with torch.no_grad():
        want = module.chain(steps, feats[None])
    for i in (0, 3, L - 3):
        pool = head.make_pool(8, 4)
        pages = pool.alloc(4)
        real = SeqInput(x[1 : i + 2], 0, pages)  # the pairs (f_j, x_{j+1}), j <= i
        (lg,), (out,) = head.forward_head(pool, [real], [feats[: i + 1].to(llama.device)])
        got = [lg[-1]]
        for s in (1, 2):
            (lg,), (out,) = head.forward_head(pool, [SeqInput([x[i + 1 + s]], i + s, pages)], [out])
            got.append(lg[-1])
        for s in range(3):
            torch.testing.assert_close(got[s].cpu()[vocab_ids], want[s][0][0, i], atol=1e-4,
                                       rtol=1e-4)  # fmt: skip


def test_train_eagle_end_to_end_on_a_tiny_target(llama):
    """train_eagle.py for a few seconds on the tiny Llama: a checkpoint the engine loads, whose
    speculative output equals target-only greedy, and whose drafts the target accepts."""
    engine = _engine(llama, trained_head(rm.checkpoint("llama")))
    reqs = [(p, sm.greedy(m)) for p, m in zip(PROMPTS, MAX_TOKENS, strict=True)]
    for (p, sp), s in zip(reqs, engine.generate(reqs), strict=True):
        assert s.output_ids == sm.reference(llama, p, sp)
    print(f"trained tiny head: {engine.stats.as_dict()}")
    assert engine.stats.accepted > 0


def test_sampling_with_a_head_follows_the_target_distribution(llama):
    """Temperature > 0 through the head engine (prefilled prompt KV + the last feature, as PD
    hands them over): the first token a speculative step emits follows the target's softmax,
    not the head's. The head's logits are the target's next-position logits plus noise (a
    random head would hardly ever overlap the target's top 5), through the real head call."""
    from test_spec_sampling import CHI2_999, _chi2, _tv

    from backends.runtime.sampling_params import SamplingParams
    from backends.runtime.spec import probs

    n, prompt, first = 1500, rm.random_prompt(6, seed=5), 7
    head = load_draft(llama, path=random_head(rm.checkpoint("llama")))
    dspec = DraftSpec(head, head.make_pool(n, 8, role="draft"), 2)
    engine = spec_engine(llama, llama.make_pool(n, 8), dspec, max_batch=n)
    params = [SamplingParams(temperature=1.0, top_k=5, seed=i, max_tokens=3, ignore_eos=True)
              for i in range(n)]  # fmt: skip
    t = add_same_prompt(engine, prompt, first, params)
    g = torch.Generator().manual_seed(1)
    noisy = t + 0.6 * t.std() * torch.randn(t.shape[-1], generator=g).to(t.device)
    real = head.forward_head

    def noisy_head(pool, seqs, feats, last_only=True, logits=True):
        out, outs = real(pool, seqs, feats, last_only, logits)
        return [noisy[None].expand(len(o), -1) for o in out], outs

    head.forward_head = noisy_head
    engine.step()  # admission: reports `first`
    out = engine.step()  # one speculative step (k clamped to 1 by max_tokens = 3)
    counts = torch.bincount(torch.tensor([t[0] for t in out.new_tokens.values()]), minlength=256)
    p, q = probs(t[None], params[0])[0].cpu(), probs(noisy[None], params[0])[0].cpu()
    assert _tv(p, q) > 0.3  # the draft is far from the target, so a wrong rule shows
    assert 0.2 < engine.stats.acceptance_rate < 0.8  # both accept and reject paths ran
    assert _chi2(counts.float(), p) < CHI2_999[4]
    assert _tv(counts.float() / counts.sum(), q) > 0.25


def test_train_data_cache_round_trip_and_key(tmp_path):
    """train_eagle.py's data shards (--work): what was saved comes back bit for bit under the
    same key, and a different key (another target, prompt count, ...) reads as absent."""
    from benchmarks import eagle_data

    items = [(torch.tensor(t), torch.randn(len(t), 3), p)
             for t, p in (([5, 6, 7, 8], 3), ([9, 2], 1))]  # fmt: skip
    path = str(tmp_path / "d.safetensors")
    eagle_data.save(path, {"prompts": 2, "seed": 0}, items)
    got = eagle_data.load(path, {"seed": 0, "prompts": 2})
    for (t, f, p), (t2, f2, p2) in zip(got, items, strict=True):
        assert torch.equal(t, t2) and torch.equal(f, f2) and p == p2
    assert eagle_data.load(path, {"prompts": 3, "seed": 0}) is None
    assert eagle_data.load(str(tmp_path / "none.safetensors"), {}) is None


def test_held_out_prompts_share_no_topic_or_code_task_with_training():
    """eagle_data's split: no held-out prompt (bench or training's evaluation) appears in or
    mentions a topic or code task of the training prompts, and the training prompts are
    distinct (a repeated prompt is a repeated greedy response: no new data)."""
    from benchmarks import eagle_data as d

    train = [json.dumps(c) for c in d.prompts(2560, 0, False)]
    held = [json.dumps(c) for s in (0, 1) for c in d.prompts(48, s, True)]
    assert len(set(train)) == len(train) and not set(train) & set(held)
    for names in (d.TOPICS, d.CODE_TASKS):
        cut = len(names) * 4 // 5

        def used(ns):
            return [n for n in ns if any(re.search(rf"\b{re.escape(n)}\b", h) for h in held)]

        assert not used(names[:cut]) and used(names[cut:])
