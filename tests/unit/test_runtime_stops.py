"""Stop strings (TextState: incremental text, holdback, cut) and stop_token_ids in the engine."""

from __future__ import annotations

import os
import random

import pytest
import runtime_models as rm
from fake_text import ByteTokenizer

from backends.runtime.detok import TextState
from backends.runtime.engine import LLMEngine
from backends.runtime.loader import load_runner
from backends.runtime.paged import SeqInput
from backends.runtime.sampling_params import SamplingParams
from backends.runtime.sequence import FinishReason

MODEL = os.path.join(os.path.dirname(__file__), "..", "..", "models", "smollm2-135m-instruct")
FFFD = "\ufffd"


def expected(tok, ids: list[int], stops) -> tuple[str, int | None]:
    """Reference from full decodes of every prefix: (text cut at the first stop string that
    appears, tokens consumed when it appeared or None). A prefix whose text ends in an
    incomplete character is not checked (its text is not shown yet)."""
    for k in range(1, len(ids) + 1):
        text = tok.decode(ids[:k])
        if text.endswith(FFFD):
            continue
        hits = [i for i in (text.find(s) for s in stops) if i >= 0]
        if hits:
            return text[: min(hits)], k
    return tok.decode(ids), None


def stream(state: TextState, ids: list[int], final: bool = True) -> tuple[str, list[str]]:
    """Feed ids one at a time as the engine does; (all taken text, the takes)."""
    takes = []
    for k in range(1, len(ids) + 1):
        state.update(ids[:k])
        takes.append(state.take())
    if final:
        takes.append(state.take(final=True))
    return "".join(takes), takes


# ids of the fake tokenizer: 14 "the", 15 " cat", 16 " sat", 10 " ", 17 "on", 18 " a", 20 "."
SENTENCE = [14, 15, 16, 10, 17, 18, 19, 20]  # "the cat sat on a mat."


def test_stop_string_spanning_tokens_starting_mid_token():
    tok = ByteTokenizer()
    assert tok.decode(SENTENCE) == "the cat sat on a mat."
    st = TextState(tok, ("t sat o",))
    text, takes = stream(st, SENTENCE, final=False)
    assert st.stopped and st.stop_str == "t sat o" and st.text == "the ca"
    assert text == "the ca" and takes[:2] == ["the", " ca"]  # "t" held back at once
    assert st.consumed == 5  # stopped at "on"; later tokens are ignored
    assert st.update(SENTENCE + [15]) and st.consumed == 5 and st.take(final=True) == ""


def test_leftmost_of_several_stops_and_holdback_released_when_no_match():
    tok = ByteTokenizer()
    st = TextState(tok, ("mat!", "cat sat", "at on"))
    text, _ = stream(st, SENTENCE)
    assert st.stop_str == "cat sat" and text == "the "
    st = TextState(tok, ("sat!", "a mat!"))  # prefixes appear, never the whole
    text, takes = stream(st, SENTENCE, final=False)
    assert not st.stopped  # "sat" and "a mat" wait until the next character rules them out
    assert takes == ["the", " cat", " ", "sat ", "on", " ", "", "a mat."]
    assert text + st.take(final=True) == tok.decode(SENTENCE)


def test_update_is_idempotent_by_length_and_windowed():
    tok = ByteTokenizer()
    st = TextState(tok, ("zzz",))
    ids = [random.Random(0).randrange(3, 200) for _ in range(400)]
    st.update(ids[:1])
    calls = tok.calls
    st.update(ids[:1])
    assert tok.calls == calls and st.consumed == 1
    stream(st, ids)
    assert tok.decoded < 10 * len(ids)  # a few ids per call, not the whole output each time


def test_incomplete_utf8_is_held_then_released():
    tok = ByteTokenizer()
    st = TextState(tok)
    st.update([14, 200])  # "the" + a UTF-8 lead byte
    assert st.take() == "the"
    st.update([14, 200, 201])  # + continuation: "Á"
    assert st.take() == "Á"
    st.update([14, 200, 201, 200])
    assert st.take() == "" and st.take(final=True) == FFFD  # as the full decode shows it


@pytest.mark.parametrize("seed", range(40))
def test_random_streams_fake_tokenizer(seed):
    _check_random_stream(ByteTokenizer(), seed, vocab=256, n=60)


def _check_random_stream(tok, seed: int, vocab: int, n: int, pool=None) -> None:
    r = random.Random(seed)
    ids = [r.choice(pool) if pool and r.random() < 0.7 else r.randrange(vocab) for _ in range(n)]
    full = tok.decode(ids)
    stops = []
    for _ in range(r.randrange(0, 4)):  # substrings of the text, so they usually match
        a = r.randrange(len(full)) if full else 0
        s = full[a : a + r.randrange(1, 8)].replace(FFFD, "")
        stops.append(s or "zq")
    stops = tuple(stops)
    want, k = expected(tok, ids, stops)
    st = TextState(tok, stops)
    shown = ""
    for j in range(1, len(ids) + 1):
        st.update(ids[:j])
        shown += st.take()
        assert want.startswith(shown), (shown, want)  # nothing shown is ever taken back
        for s in stops:  # no stop string shown; nor a prefix of one that later matches
            assert s not in shown
    shown += st.take(final=True)
    assert shown == want == st.text
    assert st.stopped == (k is not None) and (k is None or st.consumed == k)


@pytest.fixture(scope="module")
def real_tok():
    from backends.runtime.tokenizer import Tokenizer

    return Tokenizer(MODEL)


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(30))
def test_random_streams_real_tokenizer(real_tok, seed):
    text = "Héllo wörld! The café costs 3€; naïve 日本語 emojis 🙂🎉 and\n  spaces.  End."
    pool = real_tok.encode(text) + real_tok.encode_text("🙂 日本", special=False)
    _check_random_stream(real_tok, seed, vocab=real_tok.vocab_size, n=50, pool=pool)


@pytest.mark.slow
def test_real_tokenizer_stop_inside_a_word(real_tok):
    ids = real_tok.encode_text("The answer is 42. Next question", special=False)
    st = TextState(real_tok, ("swer is 4", "Next"))
    text, _ = stream(st, ids)
    assert text == "The an" and st.stop_str == "swer is 4"


# ---- the engine --------------------------------------------------------------------------------


def _reference(llama, prompt, n=16):
    return rm.hf_greedy("llama", prompt, n)


def _engine(llama, tok=None):
    return LLMEngine(llama, llama.make_pool(32, 4), max_batch=4, tokenizer=tok)


def test_engine_stop_string(llama):
    tok = ByteTokenizer()
    prompt = rm.random_prompt(6, seed=11)
    out = _reference(llama, prompt)
    full = tok.decode(out)
    a = len(tok.decode(out[:4])) - 1  # from the last char of token 3 into the next tokens
    stop = full[a : a + 4]
    assert FFFD not in stop and len(stop) == 4
    want, k = expected(tok, out, (stop,))
    engine = _engine(llama, tok)
    seqs = [
        engine.add_request("s", prompt, SamplingParams(max_tokens=16, stop=[stop])),
        engine.add_request("plain", prompt, SamplingParams(max_tokens=16)),
    ]
    shown = ""
    while engine.has_unfinished():
        engine.step()
        shown += seqs[0].text.take()
        assert stop not in shown
    s = seqs[0]
    assert s.finish_reason == FinishReason.STOP and s.text.stop_str == stop
    assert s.output_ids == out[:k] and k < 16
    assert shown + s.text.take(final=True) == want == s.text.text and stop not in want
    assert seqs[1].output_ids == out and seqs[1].text.take(final=True) == full  # no stops
    assert engine.pool.num_free == 32


def test_engine_stop_token_ids_even_with_ignore_eos(llama):
    tok = ByteTokenizer()
    prompt = rm.random_prompt(6, seed=12)
    out = _reference(llama, prompt)
    stop_id = out[5]
    i = out.index(stop_id)
    engine = _engine(llama, tok)
    p = SamplingParams(max_tokens=16, ignore_eos=True, stop_token_ids=[stop_id, 255])
    s = engine.generate([(prompt, p)])[0]
    assert s.output_ids == out[: i + 1] and s.finish_reason == FinishReason.STOP
    assert s.text.take(final=True) == tok.decode(out[:i])  # the stop token's text is not shown
    assert engine.pool.num_free == 32
    s = _engine(llama).generate([(prompt, SamplingParams(max_tokens=16, ignore_eos=True))])[0]
    assert s.output_ids == out and s.finish_reason == FinishReason.LENGTH


def test_engine_validates_stops(llama):
    engine = _engine(llama)
    with pytest.raises(ValueError, match="stop strings need the engine's tokenizer"):
        engine.add_request("a", [5, 6], SamplingParams(stop=["x"]))
    with pytest.raises(ValueError, match="stop_token_ids"):
        engine.add_request("b", [5, 6], SamplingParams(stop_token_ids=[256]))
    assert not engine.has_unfinished()


def test_add_prefilled_with_a_text_state_that_saw_the_first_token(llama):
    tok = ByteTokenizer()
    prompt = rm.random_prompt(5, seed=13)
    out = _reference(llama, prompt, 8)
    engine = _engine(llama, tok)
    pages = engine.pool.alloc(3)
    llama.forward(engine.pool, [SeqInput(prompt, 0, pages)], last_only=True)
    text = TextState(tok, ("\x00never",))
    text.update(out[:1])
    early = text.take()  # streamed with the first token
    seq = engine.add_prefilled("a", prompt, pages, out[0], SamplingParams(max_tokens=8), text=text)
    assert seq.text is text
    while engine.has_unfinished():
        engine.step()
    assert seq.output_ids == out
    assert early + text.take(final=True) == tok.decode(out)  # the first token's text once
    assert engine.pool.num_free == 32


def test_endless_incomplete_characters_are_shown_after_a_bounded_wait():
    tok = ByteTokenizer()
    st = TextState(tok)
    ids = [200] * 100  # lead bytes only: never a complete character
    for k in range(1, len(ids) + 1):
        st.update(ids[:k])
    assert st.take() and tok.decoded < 100 * 40  # windows stay bounded, not 100 * 100 / 2
    text, _ = stream(TextState(tok), ids)
    assert text == tok.decode(ids)  # still the full decode in the end


@pytest.mark.slow
def test_smollm2_engine_stop_string_streamed(real_tok):

    runner = load_runner(MODEL)
    prompt = real_tok.encode("Write a short story about a cat.", chat=True)
    plain = SamplingParams(max_tokens=24, ignore_eos=True)
    engine = LLMEngine(runner, runner.make_pool(64, 16), max_batch=2, tokenizer=real_tok)
    out = engine.generate([(prompt, plain)])[0].output_ids
    full = real_tok.decode(out)
    a = len(real_tok.decode(out[:10])) - 2  # inside / across the 10th token
    stop = full[a : a + 5]
    want, k = expected(real_tok, out, (stop,))
    seq = engine.add_request("s", prompt, SamplingParams(max_tokens=24, stop=[stop]))
    shown = ""
    while engine.has_unfinished():
        engine.step()
        shown += seq.text.take()
        assert stop not in shown and want.startswith(shown)
    assert seq.finish_reason == FinishReason.STOP and seq.output_ids == out[:k]
    assert shown + seq.text.take(final=True) == want and engine.pool.num_free == 64
