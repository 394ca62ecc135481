"""Kernel choices: the small-row linear kernel equals F.linear; the settings turn it off; batched
prefill (several prompts in one forward, chunked by a token budget) equals one-by-one."""

from __future__ import annotations

import pytest
import runtime_models as rm
import torch
import torch.nn.functional as F

from backends.runtime.cpu_kernels import cpu_ops, paged_decode_op
from backends.runtime.engine import LLMEngine
from backends.runtime.kernels import SMALL_ROWS, KernelSettings, Linear, slow_bf16_gemm
from backends.runtime.loader import load_runner
from backends.runtime.paged import SeqInput
from backends.runtime.sampling_params import SamplingParams


@pytest.mark.parametrize("rows", [1, 2, 3, 5, 6, 8, 33, SMALL_ROWS, SMALL_ROWS + 1])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_linear_matches_f_linear(rows, bias, dtype):
    """Row counts that hit every tile shape and remainder of the small-row kernel (and the
    F.linear side of SMALL_ROWS); 50 outputs and 43 inputs leave tails in both dimensions.
    bfloat16 / float16: within one rounding of the exact result (float32 sums, y rounded once)."""
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(50, 43, generator=g).to(dtype)
    b = torch.randn(50, generator=g).to(dtype) if bias else None
    x = torch.randn(rows, 43, generator=g).to(dtype)
    lin = Linear(w, b, KernelSettings())
    exact = F.linear(x.double(), w.double(), None if b is None else b.double())
    tol = {
        torch.float32: dict(atol=1e-4, rtol=1e-5),
        torch.bfloat16: dict(atol=1e-2, rtol=2**-7),
        torch.float16: dict(atol=2e-3, rtol=2**-10),
    }[dtype]
    got = lin(x)
    assert got.dtype == dtype
    torch.testing.assert_close(got.double(), exact, **tol)
    torch.testing.assert_close(lin(x.t().contiguous().t()), got)
    wide = torch.randn(rows, 2 * 43, generator=g).to(dtype)
    wide[:, :43] = x  # rows 86 floats apart (a slice of a wider tensor): read in place
    torch.testing.assert_close(lin(wide[:, :43]), got)


@pytest.mark.parametrize("rows", [1, SMALL_ROWS + 1, 512])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_residual_add_gives_the_bits_of_the_separate_add(rows, dtype):
    """``Linear.add``: float32 on oneDNN-packed weights adds the residual in the GEMM's
    epilogue (a decoder layer's o and down projections); it must equal ``residual + linear(x)``
    bit for bit, as every other case computes it."""
    g = torch.Generator().manual_seed(rows)
    w, b = torch.randn(96, 80, generator=g).to(dtype), torch.randn(96, generator=g).to(dtype)
    x, residual = (torch.randn(rows, n, generator=g).to(dtype) for n in (80, 96))
    lin = Linear(w, b, KernelSettings())
    packed_float32 = lin.packed is not None and dtype == torch.float32 and rows > lin.small_rows
    assert lin.fuses_add(x) == packed_float32
    assert torch.equal(lin.add(x, residual), residual + lin(x))
    assert not Linear(w, b, KernelSettings(fused="torch")).fuses_add(x)  # torch's ops only


@pytest.mark.parametrize("rows", [1, 3, SMALL_ROWS, SMALL_ROWS + 1])
def test_half_weights_keep_bfloat16_weights_and_float32_activations(rows):
    """``half_weights``: the weight is rounded to bfloat16 once; every row count (the small-row
    kernel and the widened F.linear beyond it) computes float32 sums over those same weights."""
    g = torch.Generator().manual_seed(rows)
    w, b, x = (
        torch.randn(50, 43, generator=g),
        torch.randn(50, generator=g),
        torch.randn(rows, 43, generator=g),
    )
    lin = Linear(w, b, KernelSettings(half_weights=True))
    assert lin.weight.dtype == torch.bfloat16 and lin.packed is None
    got = lin(x)
    assert got.dtype == torch.float32
    exact = F.linear(x.double(), w.bfloat16().double(), b.double())
    torch.testing.assert_close(got.double(), exact, atol=1e-4, rtol=1e-5)
    assert (got.double() - F.linear(x, w, b).double()).abs().max() > 1e-4  # not float32 weights
    off = KernelSettings(linear="torch", half_weights=True)  # no small-row kernel: as loaded
    assert Linear(w, b, off).weight.dtype == torch.float32


def test_linear_setting_and_fallbacks():
    w = torch.randn(16, 8)
    assert Linear(w, None, KernelSettings(linear="torch")).small is None
    double = Linear(w.double(), None, KernelSettings())  # the C++ kernel: float32, bf16, fp16
    assert double.small is None and double(torch.ones(2, 8).double()).shape == (2, 16)
    assert Linear(w.half(), None, KernelSettings()).small is not None
    assert Linear(w, None, KernelSettings()).small is not None
    bf16 = Linear(w.bfloat16(), None, KernelSettings())
    assert bf16.small is not None
    # oneDNN's packed copy where the CPU has bf16 GEMM instructions (AMX), from 3 rows
    assert (bf16.packed is not None) == (not slow_bf16_gemm())
    assert Linear(w.bfloat16(), None, KernelSettings(linear="mkl")).packed is None
    with pytest.raises(ValueError, match="PD_RUNTIME_LINEAR"):
        KernelSettings(linear="fast")


@pytest.mark.parametrize("rows", [4, 5, 6, 8, 11, 12, 19, 33])
@pytest.mark.parametrize("wdtype", [torch.float32, torch.bfloat16])
def test_linear_small_every_row_tile(rows, wdtype):
    """The op itself (whichever rows the runtime gives it): up to 6 rows 4-row tiles over
    8-output strips on AVX-512 (50 outputs: 6 strips plus a tail of 2), from 7 rows full 8-row
    tiles whose sums are reduced eight at a time (3-output strips plus a tail), then each
    remainder tile; 300 inputs (a 16-float tail of 12)."""
    op = cpu_ops().linear_small
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(50, 300, generator=g).to(wdtype)
    x, b = torch.randn(rows, 300, generator=g), torch.randn(50, generator=g)
    y = op(x, w, b)
    exact = F.linear(x.double(), w.double(), b.double())
    torch.testing.assert_close(y.double(), exact, atol=1e-4, rtol=1e-5)
    for r in range(0, rows, 3):  # 3-row calls (one tile, each sum reduced alone): bit for bit
        assert torch.equal(op(x[r : r + 3], w, b), y[r : r + 3]) or rows - r < 3


def test_linear_small_rejects_what_it_cannot_compute():
    op = cpu_ops().linear_small
    w = torch.randn(16, 8)
    with pytest.raises(RuntimeError, match="float16 w with x of its dtype or float32"):
        op(torch.ones(2, 8, dtype=torch.float64), w.double(), None)
    with pytest.raises(RuntimeError, match="float16 w with x of its dtype or float32"):
        op(torch.ones(2, 8, dtype=torch.bfloat16), w, None)
    with pytest.raises(RuntimeError, match="x has 9 features, w 8"):
        op(torch.ones(2, 9), w, None)
    with pytest.raises(RuntimeError, match=r"bias must be \[16\] in Float or Float"):
        op(torch.ones(2, 8), w, torch.ones(15))
    with pytest.raises(RuntimeError, match="w must be contiguous"):
        op(torch.ones(2, 16), w.t(), None)
    assert op(torch.ones(0, 8), w, None).shape == (0, 16)


def test_settings_from_env(monkeypatch):
    monkeypatch.setenv("PD_RUNTIME_LINEAR", "torch")
    assert KernelSettings.from_env() == KernelSettings(linear="torch")
    monkeypatch.delenv("PD_RUNTIME_LINEAR")
    assert KernelSettings.from_env() == KernelSettings()


def test_model_with_torch_linear_gives_the_same_tokens(monkeypatch):
    prompts = [rm.random_prompt(n, seed=n) for n in (3, 9, 14)]
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    outs = []
    for choice in ("auto", "torch"):
        monkeypatch.setenv("PD_RUNTIME_LINEAR", choice)
        runner = load_runner(rm.checkpoint("llama"))
        engine = LLMEngine(runner, runner.make_pool(40, 4), max_batch=4)
        outs.append([s.output_ids for s in engine.generate([(p, params) for p in prompts])])
    assert outs[0] == outs[1]


@pytest.mark.parametrize("kind", ["llama", "mistral", "deepseek_v2"])
def test_cpu_decode_kernel_gives_the_tokens_of_sdpa(monkeypatch, kind):
    """The default C++ decode attention against gather + SDPA through whole generations: GQA,
    a sliding window (mistral) and MLA's latent (deepseek_v2), mixed lengths in one batch."""
    prompts = [rm.random_prompt(n, seed=n) for n in (3, 9, 14, 30)]
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    outs = []
    for choice in ("auto", "sdpa"):
        monkeypatch.setenv("PD_RUNTIME_ATTENTION", choice)
        runner = load_runner(rm.checkpoint(kind))
        engine = LLMEngine(runner, runner.make_pool(64, 4), max_batch=4)
        outs.append([s.output_ids for s in engine.generate([(p, params) for p in prompts])])
    assert paged_decode_op() is not None
    assert outs[0] == outs[1]


def test_attention_setting():
    assert KernelSettings().attention == "auto"
    with pytest.raises(ValueError, match="PD_RUNTIME_ATTENTION"):
        KernelSettings(attention="flash")


@pytest.mark.parametrize("budget", [1, 20, 4096])
def test_batched_prefill_equals_one_by_one(llama, budget):
    prompts = [rm.random_prompt(n, seed=n) for n in (7, 2, 16, 11, 5)]
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    solo = []
    for p in prompts:
        engine = LLMEngine(llama, llama.make_pool(8, 4), max_batch=1)
        solo.append(engine.generate([(p, params)])[0].output_ids)
    pool = llama.make_pool(40, 4)
    pool.shuffle_free_list(seed=5)
    engine = LLMEngine(llama, pool, max_batch=8, prefill_tokens=budget)
    seqs = engine.generate([(p, params) for p in prompts])
    assert [s.output_ids for s in seqs] == solo and pool.num_free == 40


@pytest.mark.parametrize("kind", ["llama", "deepseek_v2"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_prefill_runs_the_last_layer_on_the_last_rows_with_the_same_bits(kind, dtype):
    """prefill_batch and forward(last_only) need only each sequence's last position from the
    last layer, so that layer's o projection and MLP run on those rows alone (padded past
    SMALL_ROWS). Their logits must equal the whole forward's (every row through every layer,
    as ``features`` asks) bit for bit: in a batch past the padding (GQA, and MLA with MoE) and
    in one under it."""
    runner = load_runner(rm.checkpoint(kind), dtype=dtype)
    for lengths in [(40, 33, 27), (5, 9)]:
        prompts = [rm.random_prompt(n, seed=n) for n in lengths]
        got = []
        for path in ("prefill_batch", "last_only", "whole"):
            pool = runner.make_pool(64, 4)
            seqs = [SeqInput(p, 0, pool.alloc(-(-len(p) // 4))) for p in prompts]
            if path == "prefill_batch":
                got.append(runner.prefill_batch(pool, seqs))
            else:
                out = runner.forward(pool, seqs, last_only=True, features=path == "whole")
                got.append(torch.cat(out[0] if path == "whole" else out))
        assert got[0].shape == (len(prompts), runner.config.vocab_size)
        assert torch.equal(got[0], got[2]) and torch.equal(got[1], got[2])


def test_prefill_chunks_follow_the_token_budget(llama):
    engine = LLMEngine(llama, llama.make_pool(40, 4), prefill_tokens=20)
    params = SamplingParams(max_tokens=2)
    seqs = [engine.add_request(f"c{n}", [5] * n, params) for n in (7, 2, 16, 11, 5, 30)]
    chunks = engine._prefill_chunks(seqs)
    assert [[len(s.prompt_ids) for s in c] for c in chunks] == [[7, 2], [16], [11, 5], [30]]


def test_prefill_tokens_must_be_positive(llama):
    with pytest.raises(ValueError, match="prefill_tokens"):
        LLMEngine(llama, llama.make_pool(4, 4), prefill_tokens=0)


def test_linear_small_widens_every_float16_value_exactly():
    """The kernel's own half -> float conversion (no F16C): subnormals, zeros of both signs, the
    largest half, infinities and NaN, in the vector body (16 inputs) and the scalar tail (3)."""
    op = cpu_ops().linear_small
    vals = torch.tensor(
        [2**-24, 3 * 2**-24, 1023 * 2**-24, 2**-14, -0.0, 0.0, 65504.0, -65504.0, 1.5, -2.75,
         float("inf"), float("-inf"), float("nan"), 1e-3, 333.25, -7e-6, 0.1, -0.5, 42.0],
        dtype=torch.float16,
    )  # fmt: skip
    w = torch.diag(vals)  # [19, 19]: row r holds vals[r] at column r
    y = op(torch.ones(1, 19, dtype=torch.float16), w, None)
    torch.testing.assert_close(y[0], vals, equal_nan=True, atol=0, rtol=0)
