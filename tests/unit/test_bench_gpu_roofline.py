"""benchmarks.gpu_roofline where CI can run it: its tiny CPU shapes go through the code paths of
the GPU run and print the keys the GPU run prints, each fraction a number in a sane range, the
CUDA-only parts null with their reason; the 8B shapes have the published sizes (built on the
meta device), and a run out of time still prints every key."""

from __future__ import annotations

import json

import pytest
import torch

from backends.runtime.config import SUPPORTED_ARCHITECTURES
from benchmarks.gpu_roofline import run
from benchmarks.gpu_roofline.shapes import SHAPES, Arithmetic, build_hf_model, shape_config

SHAPE_KEYS = {"device", *run.KEYS}


def tiny(capsys, *args: str) -> dict:
    assert run.main(["--tiny", "--json", *args]) == 0
    return json.loads(capsys.readouterr().out)


def supported(name: str) -> bool:
    return SHAPES[name]["architectures"][0] in SUPPORTED_ARCHITECTURES


def test_tiny_run_has_the_gpu_keys_and_sane_fractions(capsys):
    out = tiny(capsys)
    assert out["mode"] == "tiny" and out["device"].startswith("cpu")
    assert out["limits"]["copy"]["gbps"] > 0 and out["limits"]["matmul"]["tflops"] > 0
    assert set(out["shapes"]) == set(SHAPES)
    for name, sh in out["shapes"].items():
        assert SHAPE_KEYS <= set(sh) and sh["device"] == out["device"]
        # KV transfer and generate's compile are CUDA-only: null, with the reason
        assert "CUDA only" in sh["transfer"]["kvtransfer"]["skipped"]
        assert "CUDA only" in sh["transfer"]["d2h"]["skipped"]
        assert sh["kvtransfer_over_d2h"] is None
        if not supported(name):
            assert all(sh[k] is None for k in run.KEYS)
            assert any(s.startswith("runtime:") for s in sh["skipped"])
            continue
        assert not [s for s in sh["skipped"] if "error" in s]
        assert sh["same_weights"]["ok"], sh["same_weights"]
        assert 0 < sh["decode_b1_roofline_fraction"] < 1.5
        assert 0 < sh["prefill_8x2048_peak_fraction"] < 1.5
        assert sh["decode_b1_over_transformers"] > 0 and sh["decode_b32_over_transformers"] > 0
        sizes = out["sizes"]
        assert set(sh["decode"]) == {
            f"b{b}_{c}" for b in sizes["batches"] for c in sizes["contexts"]
        }
        for point in sh["decode"].values():
            ours, ref = point["runtime"], point["transformers"]
            assert ours["step_ms"]["runs"] == sizes["steps"]
            assert ref["step_ms"]["runs"] == sizes["hf_steps"]
            assert 0 < ours["step_ms"]["p50"] <= ours["step_ms"]["p99"]
            assert ours["graphs"] is False  # CUDA graphs need CUDA
            assert 0 < ours["roofline_fraction"] < 1.5 and 0 < ref["roofline_fraction"] < 1.5
        for b, c in sizes["compile_points"]:  # generate compiles on CUDA only
            assert "CUDA only" in sh["decode"][f"b{b}_{c}"]["transformers_compiled"]["skipped"]
        for key, (b, n) in sizes["prefill"].items():
            p = sh["prefill"][key]
            assert (p["batch"], p["tokens"]) == (b, n)
            assert 0 < p["runtime"]["peak_fraction"] < 1.5 and p["over_transformers"] > 0
        fp8 = sh["fp8_kv"]
        assert fp8["fp8"]["bytes_per_step"] < fp8["bfloat16"]["bytes_per_step"]
        assert fp8["fp8_over_bfloat16"] > 0


def test_out_of_time_still_prints_every_key(capsys, tmp_path):
    path = tmp_path / "r.json"
    out = tiny(capsys, "--budget-s", "0", "--shapes", "llama-3.1-8b", "--out", str(path))
    assert json.loads(path.read_text()) == out
    sh = out["shapes"]["llama-3.1-8b"]
    assert SHAPE_KEYS <= set(sh) and all(sh[k] is None for k in run.KEYS)
    assert sh["decode"]["b1_1k"]["runtime"] == {"skipped": "time budget"}
    assert any("time budget" in s for s in sh["skipped"])


@pytest.mark.parametrize(
    "name, params",
    # the published parameter counts (Llama-3.1-8B: 8,030,261,248; Qwen3-8B: 8,190,735,360)
    [("llama-3.1-8b", 8_030_261_248), ("qwen3-8b", 8_190_735_360)],
)
def test_8b_shapes_and_their_arithmetic(name, params):
    model = build_hf_model(shape_config(name, tiny=False), torch.bfloat16, "meta")
    a = Arithmetic.of(model)
    assert a.params == params
    cfg = model.config
    embed = cfg.vocab_size * cfg.hidden_size * 2
    assert a.weight_bytes == 2 * params - embed  # the embedding table is not read, the head is
    assert a.kv_bytes_per_token(2) == 2 * cfg.num_hidden_layers * 8 * 128 * 2
    # batch 1: weights dominate; 2,048 tokens: the layers' matmuls dominate the FLOPs
    assert a.decode_bytes(1, 1024, 2) == a.weight_bytes + 1024 * a.kv_bytes_per_token(2)
    flops = a.prefill_flops(8, 2048)
    assert 2 * a.layer_params * 8 * 2048 < flops < 1.1 * 2 * params * 8 * 2048
