"""fp8 KV cache (``kv_cache_dtype float8_e4m3fn``): quantization, the layout and its handshake
field, the C++ decode kernel on fp8 pages, and greedy output against the model-dtype KV.

The oracle for fp8 is the same runtime with model-dtype KV: fp8 output must equal it token for
token up to the first step where the reference's top two logits are within ``MARGIN`` (there a
KV rounding may flip the choice). The tests print the equal-token counts they saw."""

from __future__ import annotations

import os

import pytest
import runtime_models as rm
import torch

from backends.runtime import kv_quant
from backends.runtime.decode_attn import cpu_decode_attention
from backends.runtime.engine import LLMEngine
from backends.runtime.loader import load_runner
from backends.runtime.paged import BatchMeta, SeqInput, paged_attention
from backends.runtime.sampling_params import SamplingParams
from kvtransfer.memory.layout import EntryLayout, check_compatible

FP8 = "float8_e4m3fn"
MARGIN = 0.5
KINDS = ["llama", "qwen2", "mistral", "deepseek_v3", "deepseek_v2"]
MODEL = os.path.join(os.path.dirname(__file__), "..", "..", "models", "smollm2-135m-instruct")


def test_quantize_saturates_and_roundtrips_within_e4m3_precision():
    x = torch.tensor([1000.0, -1000.0, 0.3, -0.02, 0.0])
    q = kv_quant.quantize(x, 0.25)
    assert q.dtype == torch.float8_e4m3fn
    back = kv_quant.dequantize(q, 0.25, torch.float32)
    assert back[:2].tolist() == [448 * 0.25, -448 * 0.25]  # saturated, not NaN
    torch.testing.assert_close(back[2:], x[2:], rtol=2**-3, atol=0)  # 3 mantissa bits
    assert kv_quant.scale_of(16.0) == -2  # 4 x 16 = 64 -> 64 / 0.25 = 256 <= 448
    assert kv_quant.scale_of(0.0) == 0
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        kv_quant.resolve("int8", "float32")


def test_layout_carries_scales_into_the_handshake():
    base = dict(role="target", attn="gqa", dtype=FP8, page_size=16, num_layers=2, num_pages=4,
                kv_heads=2, head_dim=8)  # fmt: skip
    a = EntryLayout(**base, scale_log2=(-3, -4, -2, -5))
    assert a.elem_size == 1 and a.signature()["scale_log2"] == [-3, -4, -2, -5]
    wire = EntryLayout(**{**a.signature(), "num_pages": 4})  # rebuilt from the wire
    assert wire.signature() == a.signature() and wire.scale_log2 == (-3, -4, -2, -5)
    b = EntryLayout(**base, scale_log2=(-3, -4, -2, -4))
    assert check_compatible(a, b.signature()) == (
        "entry target: scale_log2 differs (local [-3, -4, -2, -5], remote [-3, -4, -2, -4])"
    )
    with pytest.raises(ValueError, match="scale_log2 must hold 4"):
        EntryLayout(**base)  # fp8 without its scales
    with pytest.raises(ValueError, match="scale_log2 must hold 0"):
        EntryLayout(**{**base, "dtype": "bfloat16"}, scale_log2=(1, 1, 1, 1))
    bf16 = EntryLayout(**{**base, "dtype": "bfloat16"})
    assert 2 * a.nbytes == bf16.nbytes


def test_fp8_is_part_of_the_deployment_identity():
    """A prefill with fp8 KV and a decode without it differ at first contact (the fingerprint's
    KV field), before any layout is compared; tensor parallelism refuses fp8 clearly."""
    from backends.stages.fingerprint import stage_identity
    from backends.stages.params import StageParams

    tiny = rm.checkpoint("llama")  # no default model needed (the GPU check runs without it)
    base = dict(model_dir=tiny, dtype="bfloat16")
    fp8 = stage_identity(StageParams(**base, kv_cache_dtype=FP8))
    assert fp8.kv == "float8_e4m3fn/page16" and stage_identity(StageParams(**base)).kv == (
        "bfloat16/page16"
    )
    with pytest.raises(ValueError, match="not supported with tensor parallelism"):
        load_runner(tiny, kv_cache_dtype=FP8, tensor_parallel_size=2)


@pytest.mark.parametrize("mla", [False, True])
def test_cpu_decode_kernel_reads_fp8_pages(mla):
    """The C++ decode kernel on an fp8 pool equals gather + dequantize + SDPA (fragmented
    pages, mixed lengths, a sliding window for GQA)."""
    torch.manual_seed(0)
    page_size, pages, H = 8, 40, 6
    hkv, dk = (1, 40) if mla else (2, 32)
    window = None if mla else 11
    ks, vs = (0.0625,) * 2 if mla else (0.125, 0.03125)
    k = kv_quant.quantize(torch.randn(pages * page_size, hkv, dk) * 3, ks)
    v = None if mla else kv_quant.quantize(torch.randn(pages * page_size, hkv, dk), vs)
    perm = torch.randperm(pages).tolist()
    seqs = [(37, 1, perm[:5]), (5, 1, perm[5:6]), (90, 1, perm[6:18])]
    meta = BatchMeta.build(seqs, page_size, pages, "cpu", window)
    q = torch.randn(3, H, dk)
    v_dim = 24 if mla else None
    got = cpu_decode_attention(q, k, v, v_dim, meta, 0.2, (ks, vs))
    want = paged_attention(q, None, k, meta, 0.2, None, v, v_dim, (ks, vs))
    assert got is not None and got.shape == want.shape
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert float(want.abs().max()) > 0.1  # a real output: the scales were applied


def _margins(runner, prompt: list[int], out: list[int]) -> torch.Tensor:
    """The reference's top-1 minus top-2 logit at each generated position."""
    pool = runner.make_pool(64, 16)
    full = prompt + out
    logits = runner.forward(pool, [SeqInput(full, 0, pool.alloc(pool.pages_needed(len(full))))])
    top = logits[0][len(prompt) - 1 : -1].topk(2, dim=-1).values
    return top[:, 0] - top[:, 1]


def equal_until_low_margin(path: str, prompts: list[list[int]], max_tokens: int) -> list[int]:
    """fp8 greedy equals model-dtype greedy up to the reference's first step with a top-2
    margin under MARGIN; -> the equal-token count of each prompt."""
    outs = {}
    for kv in ("auto", FP8):
        runner = load_runner(path, kv_cache_dtype=kv)
        pool = runner.make_pool(96, 16)
        pool.shuffle_free_list(seed=3)
        engine = LLMEngine(runner, pool, max_batch=4)
        seqs = engine.generate([(p, SamplingParams(max_tokens=max_tokens)) for p in prompts])
        outs[kv] = [s.output_ids for s in seqs]
        assert pool.num_free == 96
        if kv == "auto":
            reference = runner
        else:
            assert pool.tensor.dtype == torch.float8_e4m3fn and pool.layout.scale_log2
    counts = []
    for prompt, want, got in zip(prompts, outs["auto"], outs[FP8], strict=True):
        diff = [i for i, (a, b) in enumerate(zip(want, got, strict=False)) if a != b]
        equal = diff[0] if diff else min(len(want), len(got))  # or one stopped earlier
        low = (_margins(reference, prompt, want) < MARGIN).nonzero()
        first_low = int(low[0]) if len(low) else len(want)
        assert equal >= min(first_low, len(want)), (equal, first_low)
        counts.append(equal)
    return counts


@pytest.mark.parametrize("kind", KINDS)
def test_fp8_greedy_equals_model_dtype_until_a_near_tie(kind):
    prompts = [rm.random_prompt(5 + 4 * seed, seed=seed) for seed in (0, 7, 11)]
    counts = equal_until_low_margin(rm.checkpoint(kind), prompts, 32)
    print(f"{kind}: fp8 equal tokens {counts} of 32")


@pytest.mark.slow  # the default model
def test_fp8_smollm2_greedy_and_scales():
    from backends.runtime.tokenizer import Tokenizer

    tok = Tokenizer(MODEL)
    texts = ["What is the capital of France?", "Explain photosynthesis briefly.",
             "Write a haiku about the sea.", "List three prime numbers."]  # fmt: skip
    counts = equal_until_low_margin(MODEL, [tok.encode(t, chat=True) for t in texts], 48)
    print(f"smollm2: fp8 equal tokens {counts} of 48 (or EOS)")
    runner = load_runner(MODEL, kv_cache_dtype=FP8)
    assert len(runner.kv_scale_log2) == 2 * runner.config.num_layers
    assert runner.kv_scale_log2 == load_runner(MODEL, kv_cache_dtype=FP8).kv_scale_log2
