"""Presence / frequency / repetition penalties: the batched sampler math against per-row
reference loops, greedy on a real tiny model against transformers token by token, seeding."""

from __future__ import annotations

import dataclasses
from collections import Counter

import pytest
import runtime_models as rm
import torch

from backends.runtime.engine import LLMEngine
from backends.runtime.sampler import generator, penalize, sample
from backends.runtime.sampling_params import SamplingParams

TOL = 1e-5


def ref_penalize(row: list[float], p: SamplingParams, prompt: list[int], output: list[int]):
    """The formulas written out for one row: repetition on prompt + output tokens, then
    frequency (per occurrence in the output) and presence (once per output token)."""
    row = list(row)
    for t in set(prompt) | set(output):
        row[t] = row[t] / p.repetition_penalty if row[t] > 0 else row[t] * p.repetition_penalty
    for t, c in Counter(output).items():
        row[t] -= c * p.frequency_penalty + p.presence_penalty
    return row


def _random_case(seed: int, rows: int = 6, vocab: int = 40):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, vocab, generator=g) * 3
    params, hist = [], []
    for i in range(rows):
        n_prompt, n_out = int(torch.randint(1, 12, (1,), generator=g)), i * 3
        hist.append(
            (
                torch.randint(0, vocab, (n_prompt,), generator=g).tolist(),
                torch.randint(0, vocab // 3, (n_out,), generator=g).tolist(),  # repeats
            )
        )
        kinds = [
            SamplingParams(),  # no penalties: must come back bit for bit
            SamplingParams(presence_penalty=1.5),
            SamplingParams(frequency_penalty=-0.7),
            SamplingParams(repetition_penalty=1.8),
            SamplingParams(repetition_penalty=0.5, presence_penalty=-1.0, frequency_penalty=2.0),
            SamplingParams(),
        ]
        params.append(kinds[i % len(kinds)])
    return logits, params, hist


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_penalize_matches_per_row_reference(seed):
    logits, params, hist = _random_case(seed)
    before = logits.clone()
    got = penalize(logits, params, hist)
    assert torch.equal(logits, before)  # the raw logits are kept (logprobs read them)
    for i, (p, (prompt, out)) in enumerate(zip(params, hist, strict=True)):
        want = torch.tensor(ref_penalize(logits[i].tolist(), p, prompt, out))
        if not p.has_penalties:
            assert torch.equal(got[i], logits[i])
        else:
            torch.testing.assert_close(got[i], want, atol=TOL, rtol=TOL)
            assert not torch.equal(got[i], logits[i])


def test_penalize_without_histories_or_penalties_is_free():
    logits, params, hist = _random_case(3)
    assert penalize(logits, params, None) is logits
    plain = [SamplingParams()] * len(params)
    assert penalize(logits, plain, hist) is logits


def test_greedy_is_argmax_of_penalised_logits():
    logits, params, hist = _random_case(4)
    gens = [generator(p) for p in params]
    want = [
        max(range(logits.shape[1]), key=ref_penalize(logits[i].tolist(), p, *hist[i]).__getitem__)
        for i, p in enumerate(params)
    ]
    assert sample(logits, params, gens, histories=hist) == want
    assert sample(logits, params, gens) == logits.argmax(-1).tolist()  # no histories: none
    assert want != logits.argmax(-1).tolist()


def test_seeded_sampling_with_penalties_is_deterministic():
    logits, _, hist = _random_case(5, rows=1, vocab=30)
    hist = [([1, 2, 3, 4], [5, 5, 5, 6, 7, 8])]

    def draws(seed, **pen):
        p = SamplingParams(temperature=1.0, seed=seed, **pen)
        g = generator(p)
        return [sample(logits, [p], [g], histories=hist)[0] for _ in range(40)]

    pen = dict(frequency_penalty=2.0, presence_penalty=2.0, repetition_penalty=3.0)
    a = draws(7, **pen)
    assert a == draws(7, **pen)
    assert a != draws(8, **pen)
    assert a != draws(7)  # same seed without penalties: another distribution
    assert not {5, 6, 7, 8} & set(a)  # heavily penalised tokens are (nearly) never drawn


@pytest.mark.parametrize(
    "field,value,msg",
    [
        ("presence_penalty", 2.5, "presence_penalty"),
        ("frequency_penalty", -3.0, "frequency_penalty"),
        ("frequency_penalty", float("nan"), "frequency_penalty"),
        ("repetition_penalty", 0.0, "repetition_penalty"),
        ("repetition_penalty", 10.5, "repetition_penalty"),
        ("stop", ["a"] * 17, "stop"),
        ("stop", [""], "stop"),
        ("stop", ["x" * 257], "stop"),
        ("stop", "abc", "stop"),
        ("stop_token_ids", [-1], "stop_token_ids"),
        ("stop_token_ids", list(range(65)), "stop_token_ids"),
        ("logprobs", 21, "logprobs"),
        ("logprobs", -1, "logprobs"),
    ],
)
def test_validation_names_the_field(field, value, msg):
    with pytest.raises(ValueError, match=msg):
        SamplingParams(**{field: value})


def test_lists_become_tuples_and_defaults_are_off():
    p = SamplingParams(stop=["a", "bc"], stop_token_ids=[3, 4], logprobs=0)
    assert p.stop == ("a", "bc") and p.stop_token_ids == (3, 4) and p.logprobs == 0
    assert hash(p) == hash(SamplingParams(stop=("a", "bc"), stop_token_ids=(3, 4), logprobs=0))
    assert not SamplingParams().has_penalties
    assert SamplingParams(repetition_penalty=1.1).has_penalties


def _hf_logits(prompt: list[int], output: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return rm.hf_model("llama")(torch.tensor([prompt + output])).logits[0, -1].float()


def hf_penalised_greedy(prompt: list[int], p: SamplingParams) -> list[int]:
    """Independent reference: transformers forward over the whole text each step, the reference
    formula (and transformers' own RepetitionPenaltyLogitsProcessor for repetition)."""
    from transformers import RepetitionPenaltyLogitsProcessor

    out: list[int] = []
    rep = RepetitionPenaltyLogitsProcessor(p.repetition_penalty)
    for _ in range(p.max_tokens):
        row = _hf_logits(prompt, out)
        ids = torch.tensor([prompt + out])
        row = rep(ids, row[None].clone())[0]  # repetition on prompt + output, as vLLM
        counts = Counter(out)
        for t, c in counts.items():
            row[t] -= c * p.frequency_penalty + p.presence_penalty
        out.append(int(row.argmax()))
    return out


@pytest.mark.parametrize(
    "pen",
    [
        dict(repetition_penalty=1.6),
        dict(frequency_penalty=1.2),
        dict(presence_penalty=1.5, repetition_penalty=1.3, frequency_penalty=0.4),
    ],
)
def test_engine_greedy_with_penalties_equals_reference(llama, pen):
    prompts = [rm.random_prompt(n, seed=40 + n) for n in (3, 9)]
    base = SamplingParams(max_tokens=14, ignore_eos=True)
    engine = LLMEngine(llama, llama.make_pool(64, 4), max_batch=4)
    reqs = [(p, dataclasses.replace(base, **pen)) for p in prompts] + [(prompts[0], base)]
    seqs = engine.generate(reqs)  # penalised and plain rows in the same batches
    for p, s in zip(prompts, seqs, strict=False):
        assert s.output_ids == hf_penalised_greedy(p, s.params)
    assert seqs[2].output_ids == rm.hf_greedy("llama", prompts[0], 14)
    assert seqs[0].output_ids != seqs[2].output_ids  # the penalties changed the output
    assert engine.pool.num_free == 64
