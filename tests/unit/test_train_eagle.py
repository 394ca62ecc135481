"""scripts/train_eagle.py and its data (benchmarks/eagle_data/): training only the anchors
computes what the full chain computes at them; the one-pass responses and features are the
engine's greedy tokens and a full forward's features; data shards and the training checkpoint
resume an interrupted run to the very weights of an uninterrupted one; the training prompts
stay out of the evaluation sets."""

from __future__ import annotations

import json
import os

import pytest
import runtime_models as rm
import spec_models as sm
import torch
import torch.nn.functional as F

from backends.runtime.loader import load_runner
from backends.runtime.paged import SeqInput
from benchmarks import eagle_data as data
from benchmarks.eagle_data import evalsets, magpie, templates

MODEL = os.path.join(os.path.dirname(__file__), "..", "..", "models", "smollm2-135m-instruct")


def _te():
    from scripts import train_eagle

    return train_eagle


def _module(llama):
    te = _te()
    args = te.parse_args(["--heads", "4", "--kv-heads", "2", "--head-dim", "16",
                          "--intermediate", "96"])  # fmt: skip
    module = te.HeadModule(load_runner(rm.checkpoint("llama"), device="cpu"), args,
                           torch.arange(3, 131))  # fmt: skip
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    return te, module


def test_anchors_compute_what_the_full_chain_computes_at_them(llama):
    """Three chain steps over only some anchors (different per sequence, padded) equal the
    full chain's rows at those anchors: the skipped prompt rows still give their KV."""
    _, module = _module(llama)
    g = torch.Generator().manual_seed(3)
    B, L, H = 2, 12, llama.config.hidden_size
    toks = [torch.randint(3, 200, (B, L), generator=g) for _ in range(3)]
    feats = torch.randn(B, L, H, generator=g)
    idx = torch.tensor([[5, 6, 7, 8, 9, 10, 11], [2, 3, 4, 5, 6, 7, 7]])  # the last: padding
    with torch.no_grad():
        full = module.chain(toks, feats)
        part = module.chain([toks[0]] + [t.gather(1, idx) for t in toks[1:]], feats, idx)
    for (fl, fg), (pl, pg) in zip(full, part, strict=True):
        rows = idx[..., None]
        torch.testing.assert_close(pl, fl.gather(1, rows.expand(-1, -1, fl.shape[-1])))
        torch.testing.assert_close(pg, fg.gather(1, rows.expand(-1, -1, H)))


def test_make_batch_anchors_targets_and_features():
    """One item (prompt of 6, response of 4): its anchors start ``prompt_anchors`` before the
    response, each chain step's input and target tokens shift by one, targets past the end
    are -100, and the regression target is the next position's feature (each step's: its soft
    labels' feature)."""
    te = _te()
    t = torch.arange(10, 20)  # tokens x_0..x_9; prompt x_0..x_5
    f = torch.arange(9.0)[:, None].expand(9, 3)  # f_i = i
    vocab = torch.arange(100)
    b = te.make_batch([(t, f, 6)], vocab, 0.0, steps=3, prompt_anchors=1)
    assert b.idx.tolist() == [[3, 4, 5, 6, 7]]  # anchors from plen - 2 - 1 to T - 3
    assert b.tok0[0].tolist() == list(range(11, 19)) and b.feat[0, :, 0].tolist() == list(
        range(8))  # fmt: skip
    assert b.tgt[0, 0].tolist() == [15, 16, 17, 18, 19]  # x_{i+2}
    assert b.tgt[2, 0].tolist() == [17, 18, 19, -100, -100]  # x_{i+4}
    assert b.tok[1, 0, :3].tolist() == [16, 17, 18]  # x_{i+3}, step 2's input
    assert b.resp[0, 0].tolist() == [False, True, True, True, True]  # x_5 is the prompt's
    assert b.nxt[0, 0, :, 0].tolist() == [4, 5, 6, 7, 8]  # f_{i+1}
    assert b.nxt[2, 0, :3, 0].tolist() == [6, 7, 8]  # f_{i+3}: x_{i+4}'s distribution
    full = te.make_batch([(t, f, 6)], vocab, 0.0, steps=1)
    assert full.idx[0].tolist() == list(range(8))


def test_soft_labels_are_the_targets_own_distribution_of_each_chain_steps_token(llama):
    """--soft-labels 1: each chain step's label is what the target's LM head gives the real
    feature before that token (f_{i+1+s} for x_{i+2+s}), over the draft vocabulary; 0.5
    mixes it half and half with the token's own label."""
    te, module = _module(llama)
    ids = torch.arange(3, 131)
    vocab = torch.full((llama.config.vocab_size,), -100, dtype=torch.long)
    vocab[ids] = torch.arange(len(ids))
    g = torch.Generator().manual_seed(1)
    t = ids[torch.randint(len(ids), (12,), generator=g)]
    f = torch.randn(11, llama.config.hidden_size, generator=g)
    b = te.make_batch([(t, f, 4)], vocab, 0.0, steps=3, prompt_anchors=0)
    with torch.no_grad():
        out = module.chain([b.tok0, *b.tok], b.feat, b.idx)
        head = llama.model.lm_head.detach().float()[ids]  # the target's rows, not the draft's

        def soft_ce(s: int) -> torch.Tensor:  # response anchors only (prompt_weight 0)
            keep = b.resp[s, 0]
            want = (f[b.idx[0][keep] + 1 + s] @ head.T).softmax(-1)
            return F.cross_entropy(out[s][0][0, keep], want)

        def hard_ce(s: int) -> torch.Tensor:
            keep = b.resp[s, 0]
            return F.cross_entropy(out[s][0][0, keep], b.tgt[s, 0, keep])

        soft, _ = te.losses(module, b, 0.0, 0.0, soft=1.0)
        half, _ = te.losses(module, b, 0.0, 0.0, soft=0.5)
    torch.testing.assert_close(soft, sum(soft_ce(s) for s in range(3)))
    mixed = sum(0.5 * soft_ce(s) + 0.5 * hard_ce(s) for s in range(3))
    torch.testing.assert_close(half, mixed)


def test_one_pass_responses_and_features_are_the_engines_and_a_forward(llama):
    """responses_and_features: the plain engine's greedy tokens (continuously batched, pages
    reused), and features equal to a forward over each finished sequence (float16)."""
    prompts = [rm.random_prompt(n, seed=n) for n in (3, 17, 8, 11, 5)]
    items = data.responses_and_features(llama, prompts, 12, batch=2)
    pool = llama.make_pool(16, 4)
    for p, (t, f, plen) in zip(prompts, items, strict=True):
        assert plen == len(p) and t[:plen].tolist() == p
        assert t[plen:].tolist() == sm.reference(llama, p, sm.greedy(12, ignore_eos=False))
        assert f.shape == (len(t) - 1, llama.config.hidden_size) and f.dtype == torch.float16
        _, (want,) = llama.forward(pool, [SeqInput(t.tolist(), 0, list(range(8)))],
                                   features=True)  # fmt: skip
        torch.testing.assert_close(f.float(), want[:-1].cpu().half().float(), atol=2e-2,
                                   rtol=2e-3)  # fmt: skip


def test_served_walk_starts_each_chain_after_the_last_verify():
    """The chains start where decode starts them: after the prefill's token, then after each
    verify's kept drafts and the target's own token; k clamped to max_tokens - emitted - 1 and
    to the response."""
    te = _te()
    matches = [9, 9, 2, 0, 1, 3, 0, 0, 0, 0]  # prompt of 3, response of 9: positions 2..9 draft
    # n = 4: keeps 2 (+1) -> n = 7: keeps 3 (+1) -> n = 11: one draft left in the text, missed
    assert te.served_walk(matches, 3, 12, 3, max_tokens=100) == (3, 8)
    # the response at max_tokens: the last token is decode's own (k = 9 - 8 - 1 = 0), no verify
    assert te.served_walk(matches, 3, 12, 3, max_tokens=9) == (2, 7)
    assert te.served_walk(matches, 3, 12, 1, max_tokens=100) == (6, 8)  # one draft a step


def test_shards_redo_only_the_chunks_a_stopped_run_left(tmp_path):
    calls = []

    def make(chunk):
        calls.append(list(chunk))
        if len(calls) == 2 and chunk[0] == 4:
            raise KeyboardInterrupt  # stopped in its second chunk
        return [(torch.tensor([x, x]), torch.zeros(1, 2), 1) for x in chunk]

    shards = data.Shards(str(tmp_path), "d", {"k": 1}, size=4)
    with pytest.raises(KeyboardInterrupt):
        shards.run(list(range(10)), make)
    got = shards.run(list(range(10)), make)
    assert calls == [[0, 1, 2, 3], [4, 5, 6, 7], [4, 5, 6, 7], [8, 9]]
    assert [int(t[0]) for t, _, _ in got] == list(range(10))
    calls.clear()
    data.Shards(str(tmp_path), "d", {"k": 1}, size=4).run(list(range(10)), make)
    assert calls == []  # all kept
    data.Shards(str(tmp_path), "d", {"k": 1}, size=4).run([0, 1, 2, 3, 9, 9], make)
    assert calls == [[9, 9]]  # a changed chunk is made again


def _train(work: str, out: str, *extra: str) -> dict:
    """train_eagle on the tiny Llama (random prompts, float32), its JSON line."""
    import contextlib
    import io

    te = _te()
    argv = ["--target", rm.checkpoint("llama"), "--out", out, "--work", work, "--prompts", "24",
            "--eval-prompts", "4", "--max-tokens", "10", "--draft-vocab", "64", "--heads", "4",
            "--kv-heads", "2", "--head-dim", "16", "--intermediate", "64", "--epochs", "3",
            "--batch", "4", "--lr", "3e-3", "--precision", "fp32", *extra]  # fmt: skip
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        te.main(argv)
    return json.loads(buf.getvalue().strip().splitlines()[-1])


def test_an_interrupted_training_resumes_to_the_uninterrupted_weights(tmp_path, monkeypatch):
    """Stopped twice (--stop-after, then Ctrl-C in a step), the same command resumes from the
    checkpoint and the data shards, without making data again, and ends with the very head an
    uninterrupted run writes; the checkpoint is gone after."""
    from safetensors.torch import load_file

    te = _te()
    whole = _train(str(tmp_path / "w1"), str(tmp_path / "h1"))
    assert whole["done"] and whole["resumed_at"] == 0 and whole["steps"] == 18
    work, out = str(tmp_path / "w2"), str(tmp_path / "h2")
    part = _train(work, out, "--stop-after", "5")
    assert part == part | {"out": None, "steps": 5, "done": False}
    assert os.path.exists(os.path.join(work, te.CHECKPOINT))

    def no_data(*a, **k):
        raise AssertionError("data made again")

    monkeypatch.setattr(data, "responses_and_features", no_data)
    clip, calls = torch.nn.utils.clip_grad_norm_, []

    def interrupt(*a, **k):
        calls.append(1)
        if len(calls) == 4:
            raise KeyboardInterrupt  # Ctrl-C in the 9th step: it is not taken
        return clip(*a, **k)

    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", interrupt)
    with pytest.raises(KeyboardInterrupt):
        _train(work, out)
    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", clip)
    last = _train(work, out)
    assert last["done"] and last["resumed_at"] == 8 and last["steps"] == 18
    assert not os.path.exists(os.path.join(work, te.CHECKPOINT))
    a, b = load_file(str(tmp_path / "h1" / "model.safetensors")), load_file(
        os.path.join(out, "model.safetensors"))  # fmt: skip
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert last["response_acc"] == whole["response_acc"]
    est = last["served_tokens_per_step"]["held-out"]
    assert est == whole["served_tokens_per_step"]["held-out"] and 1.0 <= est <= 4.0


def test_minutes_shortens_the_schedule_to_fit(tmp_path):
    """--minutes: after 20 steps the schedule is cut to what the budget affords, and the run
    ends it (done) instead of stopping in the middle."""
    got = _train(str(tmp_path / "w"), str(tmp_path / "h"), "--epochs", "400", "--minutes",
                 "0.05")  # fmt: skip
    assert got["done"] and 20 <= got["steps"] == got["total_steps"] < 400 * 6


def test_lr_schedule_warms_up_then_decays_to_zero():
    te = _te()
    lrs = [te.lr_at(s, 100, 1.0) for s in range(100)]
    assert lrs[0] == 0.2 and lrs[4] == 1.0 and lrs[5] == 1.0
    assert all(a >= b for a, b in zip(lrs[4:], lrs[5:], strict=False)) and lrs[-1] < 1e-3


def test_epoch_batches_cover_every_item_once_in_length_windows():
    te = _te()
    lengths = [(7 * i) % 23 for i in range(50)]
    b = te.epoch_batches(lengths, 4, 0, 1)
    assert sorted(i for x in b for i in x) == list(range(50))
    assert b == te.epoch_batches(lengths, 4, 0, 1) != te.epoch_batches(lengths, 4, 0, 2)
    assert all(max(lengths[i] for i in x) - min(lengths[i] for i in x) <= 3 for x in b)


def test_training_prompts_stay_out_of_the_evaluation_sets():
    """The filter drops a written prompt that repeats a chat or independent prompt or names a
    held-out topic; none of the templates' training prompts repeats an independent one; the
    independent set has 30-50 prompts of several kinds, multi-turn chats among them."""
    keep = magpie.TurnFilter(evalsets.eval_overlap())
    for text in ("Why is the sky so blue?", "Who wrote Pride and Prejudice and when?",
                 "Tell me three facts about elephants.", "<|im_start|>hi there"):  # fmt: skip
        assert not keep(text), text
    assert keep("How do I bake sourdough bread at home?")
    assert not keep("How do I bake sourdough bread at home?")  # a repeat
    indep = evalsets.independent()
    assert 30 <= len(indep) <= 50 and sum(len(c) > 1 for c in indep) >= 3
    assert all(c[-1]["role"] == "user" for c in indep)
    overlap = evalsets.Overlap([m["content"] for c in indep for m in c if m["role"] == "user"])
    train = [c[-1]["content"] for c in templates.prompts(1500, 0, False)]
    assert not [t for t in train if overlap(t)]


def test_package_text_prompts_are_code_functions_and_prose():
    from benchmarks.eagle_data import package_text

    ps = package_text.prompts(30, 0, packages=("networkx",))  # sympy: the same code, 12 s more
    assert len(ps) == 30 and len({p[0]["content"] for p in ps}) == 30
    texts = [p[0]["content"] for p in ps]
    assert sum("```python" in t for t in texts) >= 8
    assert sum("def " in t for t in texts) >= 5


@pytest.mark.skipif(not os.path.exists(os.path.join(MODEL, "tokenizer.json")),
                    reason="needs the default model's tokenizer")  # fmt: skip
def test_a_written_turn_starts_where_the_template_puts_a_user_turn():
    from backends.runtime.tokenizer import Tokenizer

    tok = Tokenizer(MODEL)
    conv = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}]
    ids = magpie.turn_prefix(tok, conv, "Can you")
    full = tok.encode_chat(conv + [{"role": "user", "content": "Can you help?"}])
    assert full[: len(ids)] == ids
    assert tok.decode(ids, skip_special_tokens=False).endswith("<|im_start|>user\nCan you")
