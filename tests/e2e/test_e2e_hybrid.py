"""The model families whose state is more than full-attention KV, served disaggregated through a
real tritonserver (one server: preprocess, prefill, decode, postprocess): a sliding-window family
(Gemma 3) and a recurrent one (gated DeltaNet: Qwen3-Next; Mamba2's state crosses the same way,
through the stage cores with real Mooncake: tests/integration/test_stages_hybrid.py), tiny
random checkpoints, prompts longer than the window and spanning several layer groups and pages,
one streamed and one not. Greedy output equals transformers' token for token, and every page
and state slot comes back on both stages."""

from __future__ import annotations

import pytest
from runtime_models import checkpoint, hf_greedy, random_prompt
from triton_harness import MODEL, generated_ids, launch, stop, wait_pages_free

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]
NEW = 16


@pytest.mark.parametrize("kind", ["gemma3", "qwen3_next"])
def test_a_hybrid_family_through_the_ensemble_equals_transformers(tmp_path, kind):
    target = checkpoint(kind)
    sets = [
        "num_pages=128", "max_context=512", "max_tokens_limit=128", "bootstrap_timeout_s=20",
        f"prefill.model_dir={target}", f"decode.model_dir={target}",
        f"preprocess.model_dir={MODEL}",  # tokenizer stages: ids < 256 are valid there too
        f"postprocess.model_dir={MODEL}",
        "page_size=4", "prefill.lg_fixed_group_size=1",  # one layer a group, many pages
    ]  # fmt: skip
    srv, serve, env = launch(tmp_path, sets)
    try:
        for n, stream in ((45, True), (70, False)):  # the tiny Gemma 3's window is 16 tokens
            ids = random_prompt(n, seed=n)
            want = hf_greedy(kind, ids, NEW)
            got = generated_ids(srv, {"input_ids": ids, "max_tokens": NEW}, stream)
            assert got == want, kind
        used = wait_pages_free(srv)
        assert used[("pd_kv_pages_in_use", "prefill")] == 0
        assert used[("pd_kv_pages_in_use", "decode")] == 0
    finally:
        stop(srv, serve, env)
