"""Paged sliding-window KV (``backends/runtime/window.py``): the sliding layers of Gemma 3 and
gpt-oss keep their KV in a pool entry of their own (``pool.window``), of which a sequence holds
only the pages its window (16 keys, pages of 4) still reaches.

* the table's arithmetic: live blocks, recycling, the bound R against every alignment;
* the pool's entries and layouts (Mistral, whose every layer slides, keeps one entry);
* greedy equal to transformers for prompts far longer than the window and generations of
  several windows, with continuous batching, chunked prefill (a table that advances chunk by
  chunk), a sequence prefilled elsewhere (only its last window's pages received) and
  speculative decoding with drafts of the family; after every step each running sequence holds
  exactly its bound of window pages, and at the end every page is back (cancels and failures
  included);
* NaN in every window page no sequence's next forward reads (the placeholder, spares, recycled
  and free pages) changes no token, while NaN in one page it does read is seen.
"""

from __future__ import annotations

import functools

import pytest
import runtime_models as rm
import spec_models as sm
import torch

from backends.runtime.engine import LLMEngine
from backends.runtime.kv_pool import KVPool
from backends.runtime.loader import load_runner
from backends.runtime.paged import SeqInput
from backends.runtime.sampling_params import SamplingParams
from backends.runtime.spec import load_draft, self_draft
from backends.runtime.state_pool import pool_entries
from backends.runtime.window import WindowTable, pages_to_hold, plan_prefilled, window_bound
from kvtransfer import EntryLayout

KINDS = ["gemma3", "gpt_oss"]
W, PS = rm.WINDOW, 4


@functools.cache
def runner_of(kind: str):
    return load_runner(rm.checkpoint(kind))


def window_pool(pages: int = 32, window: int = W) -> KVPool:
    layout = EntryLayout(
        role="target.window", attn="gqa", dtype="float32", page_size=PS, num_layers=1,
        num_pages=pages, kv_heads=1, head_dim=4, window=window,
    )  # fmt: skip
    return KVPool(layout)


# ---- the table alone ---------------------------------------------------------------------------


@pytest.mark.parametrize("step", [1, 4, 7])
def test_bound_is_the_most_live_blocks_of_any_step(step):
    """R = ceil((W + s - 2) / ps) + 1 is the most blocks a forward writing s tokens reaches,
    over every alignment of its first position (and some alignment reaches it)."""
    lay = window_pool().layout
    most = 0
    for p in range(64):
        lo, hi = max(0, p - W + 1) // PS, (p + step - 1) // PS
        most = max(most, hi - lo + 1)
    assert window_bound(lay, step) == most
    assert window_bound(lay, 1) == 5  # 16 keys over pages of 4: 4 pages, 5 when misaligned
    assert pages_to_hold(lay, 9, step) == min(most, 3)  # a short sequence: its 3 blocks


def test_table_recycles_out_of_window_blocks_and_frees_once():
    pool = window_pool()
    table = WindowTable(pool)
    ph = table.placeholder
    table.add(pool.alloc(10))  # a 37-token prompt: 10 blocks
    table.prepare(0, 37)
    assert ph not in table.table and len(table.table) == 10
    table.settle(37, window_bound(pool.layout, 1))  # next: position 37 sees 22..37
    assert table.table[:5] == [ph] * 5 and table.live_from == 5  # blocks 5..9 live
    assert table.held == 5 and pool.pages_in_use == 5
    for p in range(37, 200):  # 163 decode steps: never a new page
        pages = table.prepare(p, 1)
        assert table.held == 5 and len(table.live) <= 5 and pool.pages_in_use == 5
        lo = max(0, p - W + 1) // PS
        assert all(x != ph for x in pages[lo : p // PS + 1]) and set(pages[:lo]) == {ph}
    with pytest.raises(ValueError, match="went back"):
        table.prepare(150, 1)  # its window's pages were recycled
    table.release()
    table.release()  # once
    assert pool.pages_in_use == 0 and pool.num_free == pool.num_pages - 1  # the placeholder


def test_prefilled_table_and_its_plan():
    """A sequence prefilled elsewhere: blocks [first, first + count) of pages_for arrive; the
    plan reserves its bound (the engine tops up or trims to it)."""
    pool = window_pool()
    plan = plan_prefilled(pool.layout, 37, 100)
    assert (plan.first, plan.count, plan.reserve) == (5, 5, 5)  # 21..36: blocks 5..9
    assert plan_prefilled(pool.layout, 6, 3, step_tokens=1).reserve == 2  # 8 positions
    pages = pool.alloc(plan.reserve + 1)
    table = WindowTable.prefilled(pool, 37, pages)
    assert table.live == pages[:5] and table.spares == pages[5:]
    with pytest.raises(ValueError, match="need 5 distinct"):
        WindowTable.prefilled(pool, 37, pages[:4])
    table.release()
    assert pool.pages_in_use == 0


# ---- pools -------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_pool_has_a_window_entry_of_the_sliding_layers(kind):
    runner = runner_of(kind)
    pool = runner.make_pool(16, PS, window_pages=6)
    entries = pool_entries(pool)
    assert list(entries) == ["target", "target.window"]
    sliding = {"gemma3": (0, 1, 2), "gpt_oss": (0, 2)}[kind]
    assert runner.config.window_kv_layers == sliding
    assert pool.window.layout.num_layers == len(sliding) and pool.window.num_pages == 6
    assert pool.layout.num_layers == 4 - len(sliding)
    assert (pool.layout.window, pool.window.layout.window) == (0, W)
    slabs = runner.model.kv_slab
    assert [e for e, _ in slabs] == ["window" if i in sliding else "main" for i in range(4)]
    draft = runner.make_pool(16, PS, role="draft")
    assert list(pool_entries(draft)) == ["draft", "draft.window"]
    other = runner_of("gpt_oss" if kind == "gemma3" else "gemma3").make_pool(16, PS)
    with pytest.raises(ValueError, match="does not fit"):
        runner.forward(other, [SeqInput([5, 6], 0, [0])])


def test_a_model_whose_every_layer_slides_keeps_one_entry():
    runner = load_runner(rm.checkpoint("mistral"))
    pool = runner.make_pool(16, PS)
    assert pool.window is None and list(pool_entries(pool)) == ["target"]
    assert pool.layout.num_layers == 4 and pool.layout.window == 0
    with pytest.raises(ValueError, match="no sliding-window entry"):
        runner.make_pool(16, PS, window_pages=4)


# ---- generation --------------------------------------------------------------------------------


def poison_unread(engine, live_too: bool = False) -> None:
    """NaN into every window page that no running sequence's next forward reads (from position
    ``num_tokens - 1``: keys from ``num_tokens - W`` on); ``live_too``: also one page it reads."""
    window = engine.pool.window
    keep: set[int] = set()
    for seq in engine.running:
        lo = max(0, seq.num_tokens - W) // PS
        keep.update(seq.window.table[lo:])
    if live_too and engine.running:
        seq = engine.running[0]
        keep.discard(seq.window.table[max(0, seq.num_tokens - W) // PS])
    dead = [p for p in range(window.num_pages) if p not in keep]
    window.tensor[:, :, dead] = float("nan")


def generate_checked(engine, reqs, poison: bool = False, live_too: bool = False):
    """Run ``reqs`` to the end; after each step every running sequence holds exactly its bound
    of window pages (all of them counted in the pool), and with ``poison`` the unread pages are
    NaN. -> (sequences, the most window pages a sequence held, the most target pages)."""
    seqs = [engine.add_request(f"r{i}", p, sp) for i, (p, sp) in enumerate(reqs)]
    most_window = most_target = 0
    while engine.has_unfinished():
        engine.step()
        held = 0
        for s in engine.running:
            assert s.window.held == engine.window_bound(s), (s.seq_id, s.window.held)
            held += s.window.held
            most_window = max(most_window, s.window.held)
            most_target = max(most_target, len(s.pages))
        assert engine.pool.window.pages_in_use == held
        if poison:
            poison_unread(engine, live_too)
    return seqs, most_window, most_target


def assert_all_back(engine) -> None:
    window = engine.pool.window
    assert engine.pool.num_free == engine.pool.num_pages - engine.pool.num_scratch
    assert window.pages_in_use == 0 and window.num_free == window.num_pages - window.num_scratch


@pytest.mark.parametrize("kind", KINDS)
def test_long_generations_match_transformers_in_bounded_window_pages(kind):
    """Prompts of 70, 9 and 45 tokens (past the window of 16) and 60, 50 and 40 new tokens
    (several windows) through two slots (the third joins when one ends): transformers' greedy
    tokens, each sequence holding 5 window pages (R) however long it grows, and every page back
    at the end."""
    runner = runner_of(kind)
    engine = LLMEngine(runner, runner.make_pool(96, PS), max_batch=2)
    engine.pool.shuffle_free_list(seed=3)
    engine.pool.window.shuffle_free_list(seed=4)
    prompts = [rm.random_prompt(n, seed=n) for n in (70, 9, 45)]
    steps = [60, 50, 40]
    reqs = [(p, SamplingParams(max_tokens=n)) for p, n in zip(prompts, steps, strict=True)]
    seqs, most_window, most_target = generate_checked(engine, reqs)
    for p, n, seq in zip(prompts, steps, seqs, strict=True):
        assert seq.output_ids == rm.hf_greedy(kind, p, n), seq.seq_id
    assert len({t for s in seqs for t in s.output_ids}) > 20
    assert most_window == window_bound(engine.pool.window.layout, 1) == 5
    assert most_target == 33  # 70 + 60 - 1 positions: 33 pages of the full layers
    stats, window = engine.window_stats(), engine.pool.window
    assert stats["window_pages_per_sequence"] == 5 and stats["window_pages_in_use"] == 0
    assert stats["window_bytes_per_sequence"] == 5 * window.layout.nbytes // window.num_pages
    assert_all_back(engine)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("kind", KINDS)
def test_cuda_graphs_replay_the_window_tables(kind):
    """On a GPU, decode steps from CUDA graphs (the window entry's table and slots in their
    own static buffers, padding rows on the placeholder) equal eager steps and transformers,
    over bucket changes and sequences far past the window."""
    runner = load_runner(rm.checkpoint(kind), device="cuda")
    assert runner.use_graphs
    prompts = [rm.random_prompt(n, seed=n) for n in (70, 9, 45, 30, 2)]
    steps = [60, 12, 40, 25, 50]
    reqs = [(p, SamplingParams(max_tokens=n)) for p, n in zip(prompts, steps, strict=True)]
    outs = []
    for graphs in (False, True):
        runner.use_graphs = graphs
        engine = LLMEngine(runner, runner.make_pool(160, PS), max_batch=4)
        seqs, most_window, _ = generate_checked(engine, reqs)
        outs.append([s.output_ids for s in seqs])
        assert most_window == 5
        assert_all_back(engine)
    captured = runner._graphs[id(engine.pool)]
    assert captured is not None and not captured.failed and len(captured.graphs) >= 2
    assert outs[0] == outs[1]
    assert outs[1] == [rm.hf_greedy(kind, p, n) for p, n in zip(prompts, steps, strict=True)]


@pytest.mark.parametrize("kind", KINDS)
def test_unread_window_pages_poisoned_change_nothing(kind):
    """After every step NaN goes into the placeholder, the spares, the recycled blocks' pages
    and the free pages: the tokens stay transformers'. NaN in one page a sequence still reads
    changes its output (the poison is seen where it lands)."""
    runner = runner_of(kind)
    prompts = [rm.random_prompt(n, seed=n + 1) for n in (41, 23)]
    reqs = [(p, SamplingParams(max_tokens=36)) for p in prompts]
    engine = LLMEngine(runner, runner.make_pool(64, PS), max_batch=2)
    seqs, _, _ = generate_checked(engine, reqs, poison=True)
    for p, seq in zip(prompts, seqs, strict=True):
        assert seq.output_ids == rm.hf_greedy(kind, p, 36)
    assert_all_back(engine)
    engine = LLMEngine(runner, runner.make_pool(64, PS), max_batch=2)
    seqs, _, _ = generate_checked(engine, reqs, poison=True, live_too=True)
    assert seqs[0].output_ids != rm.hf_greedy(kind, prompts[0], 36)
    assert_all_back(engine)


@pytest.mark.parametrize("kind", KINDS)
def test_chunked_prefill_through_an_advancing_table(kind):
    """A 70-token prompt in chunks of 23, 7, 9, 20 and 11 tokens, then 12 decode steps, on a
    table holding 11 window pages (R of a 23-token step) for 18 blocks; the pages its window
    passed are NaN before each forward: every logit as transformers' whole-sequence one."""
    runner = runner_of(kind)
    prompt = rm.random_prompt(82, seed=9)
    with torch.no_grad():
        ref = rm.hf_model(kind)(torch.tensor([prompt])).logits[0].float()  # [82, V]
    pool = runner.make_pool(32, PS)
    pool.shuffle_free_list(seed=1)
    pages = pool.alloc(pool.pages_needed(len(prompt)))
    table = WindowTable(pool.window)
    table.add(pool.window.alloc(window_bound(pool.window.layout, 23)))
    assert table.held == 11
    cuts = [0, 23, 30, 39, 59, 70]
    spans = list(zip(cuts, cuts[1:], strict=False)) + [(p, p + 1) for p in range(70, 82)]
    got = []
    for a, b in spans:
        window_pages = table.prepare(a, b - a)
        read = set(window_pages[max(0, a - W + 1) // PS :])
        pool.window.tensor[:, :, [p for p in range(32) if p not in read]] = float("nan")
        seq = SeqInput(prompt[a:b], a, pages, window_pages=window_pages)
        got += runner.forward(pool, [seq])
        assert table.held == 11
    rm.assert_close_to_reference(torch.cat(got), ref)
    table.release()
    assert pool.window.pages_in_use == 0


def transfer(src: KVPool, dst: KVPool, src_pages: list[int], dst_pages: list[int]) -> None:
    """The pages' bytes of every layer and component, as a KV transfer moves them."""
    dst.tensor[:, :, dst_pages] = src.tensor[:, :, src_pages]


@pytest.mark.parametrize("kind", KINDS)
def test_prefilled_sequences_receive_only_their_last_window(kind):
    """Disaggregated, in one process: the prefill side writes every prompt block of the
    window entry; the decode side's engine plans each sequence's window pages
    (``window_plan``), receives only blocks [first, first + count) into the first ``count``,
    and decodes from a window entry of 11 pages (two sequences of R = 5, and the placeholder)
    while its other pages are NaN. One sequence comes with a spare too many, one with none."""
    runner = runner_of(kind)
    prefill_pool = runner.make_pool(64, PS)
    decode_pool = runner.make_pool(64, PS, window_pages=11)
    engine = LLMEngine(runner, decode_pool, max_batch=2)
    prompts = [rm.random_prompt(n, seed=n + 2) for n in (58, 32)]
    seqs = []
    for i, prompt in enumerate(prompts):
        n = len(prompt)
        pages = prefill_pool.alloc(prefill_pool.pages_needed(n))
        window_pages = prefill_pool.window.alloc(prefill_pool.window.pages_needed(n))
        seq = SeqInput(prompt, 0, pages, window_pages=window_pages)
        first_token = int(runner.prefill_batch(prefill_pool, [seq])[0].argmax())
        plan = engine.window_plan(n, 30)
        assert (plan.count, plan.reserve) == ((5, 5) if i == 0 else (4, 5))
        dpages = decode_pool.alloc(decode_pool.pages_needed(n))
        # one spare too many (given back at admission), and none (one more taken then)
        dwindow = decode_pool.window.alloc(plan.reserve + 1 if i == 0 else plan.count)
        transfer(prefill_pool, decode_pool, pages, dpages)
        sent = window_pages[plan.first : plan.first + plan.count]
        transfer(prefill_pool.window, decode_pool.window, sent, dwindow[: plan.count])
        params = SamplingParams(max_tokens=30)
        seqs.append(
            engine.add_prefilled(f"p{i}", prompt, dpages, first_token, params, window_pages=dwindow)
        )
        prefill_pool.free(pages)
        prefill_pool.window.free(window_pages)
    received = {p for s in seqs for p in s.window.live}
    decode_pool.window.tensor[:, :, [p for p in range(11) if p not in received]] = float("nan")
    while engine.has_unfinished():
        assert not engine.step().errors
        for s in engine.running:
            assert s.window.held == 5
    for prompt, seq in zip(prompts, seqs, strict=True):
        assert seq.output_ids == rm.hf_greedy(kind, prompt, 30)
    assert_all_back(engine)


def test_prefilled_window_pages_are_checked(llama):
    runner = runner_of("gemma3")
    pool = runner.make_pool(64, PS)
    engine = LLMEngine(runner, pool)
    prompt = rm.random_prompt(30, seed=5)
    pages = pool.alloc(pool.pages_needed(30))
    params = SamplingParams(max_tokens=4)
    with pytest.raises(ValueError, match="needs window_pages"):
        engine.add_prefilled("a", prompt, pages, 7, params)
    few = pool.window.alloc(3)
    with pytest.raises(ValueError, match="need 5 distinct"):
        engine.add_prefilled("a", prompt, pages, 7, params, window_pages=few)
    assert pool.window.pages_in_use == 3 and not engine.seqs  # still the caller's
    pool.free(pages)
    pool.window.free(few)
    plain = LLMEngine(llama, llama.make_pool(16, PS))
    with pytest.raises(ValueError, match="no sliding-window entry"):
        plain.add_prefilled("a", prompt, list(range(8)), 7, params, window_pages=[1])
    small = LLMEngine(runner, runner.make_pool(64, PS, window_pages=4))
    with pytest.raises(ValueError, match="sliding-window KV pages"):
        small.add_request("b", prompt, SamplingParams(max_tokens=20))  # 5 pages held


@pytest.mark.parametrize("kind", KINDS)
def test_cancels_and_failures_give_every_window_page_back(kind, monkeypatch):
    """A sequence aborted while running, one aborted while it waits, a prefilled one aborted
    before admission, and one whose decode steps fail (the batch is retried sequence by
    sequence: the other goes on to transformers' tokens): every page back, once."""
    runner = runner_of(kind)
    engine = LLMEngine(runner, runner.make_pool(64, PS), max_batch=2)
    prompts = [rm.random_prompt(n, seed=n + 7) for n in (40, 27, 19)]
    a = engine.add_request("a", prompts[0], SamplingParams(max_tokens=30))
    b = engine.add_request("b", prompts[1], SamplingParams(max_tokens=30))
    c = engine.add_request("c", prompts[2], SamplingParams(max_tokens=30))
    for _ in range(6):
        engine.step()
    assert engine.abort("a") is a and engine.abort("c") is c  # running, waiting
    pool = engine.pool
    wpages = pool.window.alloc(5)
    engine.add_prefilled(
        "d", prompts[2], pool.alloc(5), 9, SamplingParams(max_tokens=9), window_pages=wpages
    )
    assert engine.abort("d").finish_reason == "abort"
    fails = len(prompts[1]) + 12  # b's 13th decode step fails, whatever its batch
    decode = runner.decode

    def failing(pool, tokens, positions, *args, **kw):
        if fails in positions:
            raise RuntimeError("injected")
        return decode(pool, tokens, positions, *args, **kw)

    monkeypatch.setattr(runner, "decode", failing)
    e = engine.add_request("e", prompts[0], SamplingParams(max_tokens=25))
    out = {}
    while engine.has_unfinished():
        out.update(engine.step().errors)
    assert "injected" in out["b"] and b.finish_reason == "error"
    assert e.output_ids == rm.hf_greedy(kind, prompts[0], 25)
    assert_all_back(engine)


@pytest.mark.parametrize("kind", KINDS)
def test_speculative_decoding_with_drafts_of_the_family(kind):
    """A self-draft (the target's first two layers: Gemma 3's slide, one entry; gpt-oss's mix,
    a window entry whose pages are the draft's own) and a whole-model draft of the family with
    k = 3: transformers' greedy tokens for prompts past the window, each sequence holding its
    bound of window pages for steps of k + 1 = 4 tokens (6: a verify writes 4)."""
    runner = runner_of(kind)
    prompts = [rm.random_prompt(n, seed=n + 11) for n in (47, 21, 6)]
    steps = [40, 33, 30]
    reqs = [(p, sm.greedy(n)) for p, n in zip(prompts, steps, strict=True)]
    want = [rm.hf_greedy(kind, p, n) for p, n in zip(prompts, steps, strict=True)]
    for draft in (self_draft(runner, 2), load_draft(runner, rm.checkpoint(kind))):
        engine = sm.spec_engine(runner, draft, k=3, pages=96, max_batch=2)
        seqs, most_window, _ = generate_checked(engine, reqs)
        assert [s.output_ids for s in seqs] == want
        assert engine.stats.proposed > 0
        assert most_window == window_bound(engine.pool.window.layout, 4) == 6
        assert_all_back(engine)
        assert engine.draft.pool.num_free == engine.draft.pool.num_pages


def test_tensor_parallel_commands_carry_window_pages():
    """A rank's FORWARD / PREFILL carries each sequence's window pages (none: as before), and
    MAKE_POOL the window entry's size and the id it goes by."""
    from backends.runtime.tp.wire import FORWARD, MAKE_POOL, Command, decode, encode

    seqs = [([5, 6], 0, [7]), ([9], 21, [1, 4, 2, 8, 3, 6], [0, 0, 5, 9, 11, 12])]
    got = decode(encode(Command(FORWARD, 3, seqs=seqs)))
    assert got.seqs == seqs
    mk = decode(encode(Command(MAKE_POOL, 2, 16, 4, "target", window_pages=6, window_id=3)))
    assert (mk.window_pages, mk.window_id) == (6, 3)
    assert decode(encode(Command(MAKE_POOL, 2, 16, 4))).window_pages is None
