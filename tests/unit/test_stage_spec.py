"""Speculative decoding parameters of the stages: validation, draft loading, make_repo."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import runtime_models as rm

from backends.runtime.loader import load_runner
from backends.stages.draft import explain_failure, load_stage_draft, make_draft_pool
from backends.stages.params import StageParams, parse_params

ROOT = os.path.join(os.path.dirname(__file__), "..", "..")


@pytest.mark.parametrize(
    "raw,words",
    [
        ({"spec_tokens": "0"}, ["spec_tokens", ">= 1"]),
        ({"draft_layers": "0"}, ["draft_layers", ">= 1"]),
        ({"spec_enabled": "perhaps"}, ["spec_enabled", "true or false"]),
    ],
)
def test_bad_spec_parameters_name_the_parameter(raw, words):
    with pytest.raises(ValueError) as e:
        parse_params(raw)
    for w in words:
        assert w in str(e.value)


def test_defaults_are_off_and_parse():
    p = StageParams()
    assert p.spec_enabled is False and p.draft_path is None
    q = parse_params({"spec_enabled": "true", "draft_model_dir": "x/y", "spec_tokens": "3"})
    assert q.spec_enabled and q.spec_tokens == 3 and os.path.isabs(q.draft_path)


def test_load_stage_draft(llama):
    assert load_stage_draft(StageParams(), llama) is None  # spec off
    d = load_stage_draft(StageParams(spec_enabled=True, draft_layers=3), llama)
    assert d.config.num_layers == 3 and d.model.layers[0] is llama.model.layers[0]  # shared
    pool = make_draft_pool(StageParams(num_pages=7, page_size=4), d)
    assert pool.layout.role == "draft" and pool.num_pages == 7 and pool.layout.num_layers == 3
    with pytest.raises(ValueError, match="draft_layers .4. must be smaller than the target's 4"):
        load_stage_draft(StageParams(spec_enabled=True, draft_layers=4), llama)
    mla = load_stage_draft(
        StageParams(spec_enabled=True, draft_model_dir=rm.checkpoint("deepseek_v3")), llama
    )
    assert mla.config.attn == "mla"  # any supported family can be the draft
    with pytest.raises(ValueError, match="draft_model_dir"):
        load_stage_draft(StageParams(spec_enabled=True, draft_model_dir="/nonexistent"), llama)


def test_failure_hint_only_for_draft_layout_errors():
    assert "configured identically" in explain_failure(
        "incompatible layout: decode did not register entry 'draft'"
    )
    assert "configured identically" in explain_failure(
        "prefill 10.0.0.1:1: incompatible deployment: draft model differs: prefill none, decode x"
    )
    assert explain_failure("transfer timeout") == "transfer timeout"


def test_make_repo_turns_spec_on_in_prefill_and_decode(tmp_path):
    out = tmp_path / "repo"
    cmd = [sys.executable, os.path.join(ROOT, "scripts", "make_repo.py"), "--out", str(out)]
    cmd += ["--set", "spec_enabled=true", "--set", "draft_layers=20", "--set", "spec_tokens=3"]
    subprocess.run(cmd, check=True, capture_output=True)
    for stage in ("prefill", "decode"):
        text = (out / stage / "config.pbtxt").read_text()
        assert 'key: "spec_enabled" value: { string_value: "true" }' in text
        assert 'key: "draft_layers" value: { string_value: "20" }' in text
    assert (
        'key: "spec_tokens" value: { string_value: "3" }'
        in (out / "decode/config.pbtxt").read_text()
    )
    assert "spec_enabled" not in (out / "preprocess" / "config.pbtxt").read_text()


@pytest.mark.parametrize("kind", ["llama", "deepseek_v3"])
def test_self_draft_prompt_kv_is_the_targets_first_layers(kind):
    """Prefill copies a self-draft's prompt KV from the target's pages: byte-equal to running
    the self-draft over the prompt (GQA and MLA layouts)."""
    import torch

    from backends.stages.draft import copy_prefix_kv, shares_target_layers

    target = load_runner(rm.checkpoint(kind))
    draft = load_stage_draft(StageParams(spec_enabled=True, draft_layers=2), target)
    other = load_runner(rm.checkpoint("llama"), num_layers=2)
    assert shares_target_layers(draft, target) and not shares_target_layers(other, target)
    prompt = rm.random_prompt(13, seed=2)
    pool, dpool, ref = (
        target.make_pool(16, 4),
        make_draft_pool(StageParams(num_pages=16, page_size=4), draft),
        draft.make_pool(16, 4, role="draft"),
    )
    pool.shuffle_free_list(seed=1)
    pages, dpages, rpages = pool.alloc(4), dpool.alloc(4), ref.alloc(4)
    target.prefill(pool, prompt, pages, groups=[(0, 1), (1, 3), (3, 4)])
    copy_prefix_kv(pool, pages, dpool, dpages)
    draft.prefill(ref, prompt, rpages)
    dim = 2 if pool.layout.attn == "gqa" else 1
    got = dpool.tensor.index_select(dim, torch.tensor(dpages)).flatten(dim, dim + 1)
    want = ref.tensor.index_select(dim, torch.tensor(rpages)).flatten(dim, dim + 1)
    assert torch.equal(got.narrow(dim, 0, 13), want.narrow(dim, 0, 13))
