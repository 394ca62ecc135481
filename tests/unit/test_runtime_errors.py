"""Clear, typed errors for bad checkpoints, bad requests and bad pool use."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import runtime_models as rm

from backends.runtime.config import (
    SUPPORTED_ARCHITECTURES,
    ModelConfig,
    UnsupportedArchitectureError,
)
from backends.runtime.engine import LLMEngine
from backends.runtime.kv_pool import OutOfPagesError
from backends.runtime.loader import load_runner
from backends.runtime.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def runner():
    return load_runner(rm.checkpoint("llama"))


def _copy_with_config(tmp_path, **changes):
    src = rm.checkpoint("llama")
    dst = tmp_path / "model"
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg.update(changes)
    (dst / "config.json").write_text(json.dumps(cfg))
    return str(dst)


def test_unsupported_architecture_lists_supported(tmp_path):
    path = _copy_with_config(tmp_path, architectures=["GPT2LMHeadModel"], model_type="gpt2")
    with pytest.raises(UnsupportedArchitectureError) as err:
        load_runner(path)
    for arch in SUPPORTED_ARCHITECTURES:
        assert arch in str(err.value)
    assert "GPT2LMHeadModel" in str(err.value)


def test_unsupported_rope_type_named(tmp_path):
    path = _copy_with_config(tmp_path, rope_parameters={"rope_type": "longrope", "rope_theta": 1.0})
    with pytest.raises(UnsupportedArchitectureError, match="longrope.*supported: default"):
        ModelConfig.from_pretrained(path)


def test_legacy_rope_scaling_keys():
    raw = json.loads(open(os.path.join(rm.checkpoint("llama"), "config.json")).read())
    raw.pop("rope_parameters")
    raw["rope_theta"] = 5e5
    raw["rope_scaling"] = {"type": "linear", "factor": 2.0}
    rope = ModelConfig.from_dict(raw).rope
    assert (rope.type, rope.theta, rope.factor) == ("linear", 5e5, 2.0)


def test_missing_weight_files(tmp_path):
    path = tmp_path / "model"
    shutil.copytree(rm.checkpoint("llama"), path)
    os.remove(path / "model.safetensors")
    with pytest.raises(FileNotFoundError, match=r"no weights in model directory.*safetensors"):
        load_runner(str(path))
    (path / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"x": "model-00001-of-00002.safetensors"}})
    )
    with pytest.raises(FileNotFoundError, match="model-00001-of-00002.safetensors"):
        load_runner(str(path))


def test_missing_config(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_runner(str(tmp_path))


def test_request_errors(runner):
    engine = LLMEngine(runner, runner.make_pool(64, 4), max_context=40)
    with pytest.raises(ValueError, match="exceeds the context limit of 40"):
        engine.add_request("a", list(range(3, 33)), SamplingParams(max_tokens=11))
    engine.add_request("ok", list(range(3, 33)), SamplingParams(max_tokens=10))  # exactly 40
    with pytest.raises(ValueError, match="already in the engine"):
        engine.add_request("ok", [5], SamplingParams())
    with pytest.raises(ValueError, match="prompt is empty"):
        engine.add_request("b", [], SamplingParams())
    with pytest.raises(ValueError, match="outside the vocabulary"):
        engine.add_request("c", [5, 10_000], SamplingParams())
    small = LLMEngine(runner, runner.make_pool(2, 4))
    with pytest.raises(ValueError, match="needs 3 KV pages but the pool only has 2"):
        small.add_request("d", [5] * 8, SamplingParams(max_tokens=4))


@pytest.mark.parametrize("bad", [0, -3, 1.5, True])
def test_max_tokens_must_be_positive(bad):
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=bad)


@pytest.mark.parametrize(
    "field,value", [("temperature", -0.1), ("top_p", 0.0), ("top_p", 1.5), ("top_k", -1)]
)
def test_sampling_params_validated(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


@pytest.mark.parametrize("page_size", [0, -4, 2.5])
def test_page_size_must_be_positive_int(runner, page_size):
    with pytest.raises(ValueError, match="page_size must be a positive integer"):
        runner.make_pool(8, page_size)


def test_engine_limits_validated(runner):
    pool = runner.make_pool(4, 4)
    with pytest.raises(ValueError, match="max_batch"):
        LLMEngine(runner, pool, max_batch=0)
    with pytest.raises(ValueError, match="max_context"):
        LLMEngine(runner, pool, max_context=10**9)


def test_pool_out_of_pages_and_double_free(runner):
    pool = runner.make_pool(4, 4)
    pages = pool.alloc(3)
    with pytest.raises(OutOfPagesError, match="requested 2, free 1 of 4"):
        pool.alloc(2)
    pool.free(pages[:1])
    with pytest.raises(ValueError, match="double free"):
        pool.free(pages[:1])
    with pytest.raises(ValueError, match="not allocated"):
        pool.free([3, 3])
    assert pool.num_free == 2


def test_pool_matches_layout(runner):
    pool = runner.make_pool(5, 4)
    layout = pool.layout
    assert tuple(pool.tensor.shape) == layout.buffer_shape() == (4, 2, 5, 4, 2, 16)
    assert layout.base_addr == pool.tensor.data_ptr()
    assert layout.nbytes == pool.tensor.numel() * pool.tensor.element_size()
    mla = load_runner(rm.checkpoint("deepseek_v3")).make_pool(5, 4, role="draft")
    assert tuple(mla.tensor.shape) == (4, 5, 4, 16 + 8)
    assert (mla.layout.kv_lora_rank, mla.layout.rope_dim, mla.layout.role) == (16, 8, "draft")


def test_prefill_needs_enough_pages(runner):
    pool = runner.make_pool(4, 4)
    with pytest.raises(ValueError, match="need 3 pages"):
        runner.prefill(pool, list(range(3, 13)), pool.alloc(2))
