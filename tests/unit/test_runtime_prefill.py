"""Layer-grouped prefill (KV streaming hook) and prefill continuation at start_pos."""

from __future__ import annotations

import pytest
import runtime_models as rm
import torch

from backends.runtime.loader import load_runner
from backends.runtime.paged import SeqInput


@pytest.fixture(scope="module", params=["llama", "deepseek_v3"])
def runner(request):
    return load_runner(rm.checkpoint(request.param))


def _prefill(runner, prompt, groups):
    pool = runner.make_pool(12, 4)
    pool.shuffle_free_list(seed=3)
    pages = pool.alloc(pool.pages_needed(len(prompt)))
    seen = []
    logits = runner.prefill(
        pool, prompt, pages, groups=groups, on_group=lambda a, b: seen.append((a, b))
    )
    return pool, logits, seen


@pytest.mark.parametrize(
    "groups", [[(0, 4)], [(0, 1), (1, 3), (3, 4)], [(i, i + 1) for i in range(4)]]
)
def test_grouped_prefill_bit_identical(runner, groups):
    prompt = rm.random_prompt(30, seed=2)
    ref_pool, ref_logits, _ = _prefill(runner, prompt, None)
    pool, logits, seen = _prefill(runner, prompt, groups)
    assert seen == groups
    assert torch.equal(pool.tensor, ref_pool.tensor)
    assert torch.equal(logits, ref_logits)
    assert pool.tensor.abs().sum() > 0


def test_on_group_sees_kv_of_finished_layers(runner):
    prompt = rm.random_prompt(9, seed=4)
    pool = runner.make_pool(4, 4)
    pages = pool.alloc(3)
    filled = []

    def on_group(a, b):  # layers [a, b) written, later layers still zero
        filled.append([bool(pool.tensor[i].abs().sum() > 0) for i in range(4)])

    runner.prefill(pool, prompt, pages, groups=[(0, 2), (2, 4)], on_group=on_group)
    assert filled == [[True, True, False, False], [True, True, True, True]]


def test_groups_must_tile_layers(runner):
    pool = runner.make_pool(4, 4)
    with pytest.raises(ValueError, match="tile"):
        runner.prefill(pool, [5, 6], pool.alloc(1), groups=[(0, 2), (3, 4)])


def test_prefill_continues_at_start_pos(runner):
    """Prefill in two chunks (second at start_pos) gives the one-shot last logits."""
    prompt = rm.random_prompt(23, seed=5)
    pool = runner.make_pool(8, 4)
    pages = pool.alloc(6)
    one_shot = runner.prefill(pool, prompt, pages)
    pool2 = runner.make_pool(8, 4)
    pages2 = pool2.alloc(6)
    runner.prefill(pool2, prompt[:10], pages2)
    chunked = runner.prefill(pool2, prompt[10:], pages2, start_pos=10)
    torch.testing.assert_close(chunked, one_shot, atol=1e-5, rtol=1e-5)
    # verification-style extend: k+1 tokens at once returns logits for every position
    out = runner.forward(pool2, [SeqInput(prompt[20:], 20, pages2)])[0]
    assert out.shape == (3, runner.config.vocab_size)
    torch.testing.assert_close(out[-1], one_shot, atol=1e-5, rtol=1e-5)
