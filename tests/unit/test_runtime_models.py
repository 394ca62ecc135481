"""Runtime vs transformers on tiny random checkpoints: prefill logits and greedy generation."""

from __future__ import annotations

import pytest
import runtime_models as rm

from backends.runtime.loader import load_runner

KINDS = ["llama", "qwen2", "mistral", "deepseek_v3", "deepseek_v2"]


@pytest.fixture(scope="module", params=KINDS)
def kind(request):
    return request.param


@pytest.fixture(scope="module")
def runner(kind):
    return load_runner(rm.checkpoint(kind))


def test_config_parsed(kind, runner):
    cfg = runner.config
    assert cfg.attn == ("mla" if kind.startswith("deepseek") else "gqa")
    assert cfg.num_layers == 4 and cfg.vocab_size == 256
    assert cfg.eos_token_ids == (2,)


def test_prefill_logits_match_transformers(kind, runner):
    prompt, ref = rm.forward_vs_transformers(kind, runner)
    pool2 = runner.make_pool(16, 4)
    last = runner.prefill(pool2, prompt, pool2.alloc(6))
    rm.assert_close_to_reference(last, ref[-1])


@pytest.mark.parametrize("seed", [0, 7])
def test_greedy_matches_transformers_generate(kind, runner, seed):
    rm.assert_greedy_generate_matches(kind, runner, seed)
