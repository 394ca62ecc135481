"""The runtime's fused C++ CPU ops and its C++ prefill attention against torch's own code.

Fused ops: RMSNorm (and residual add + RMSNorm), SiLU-and-multiply, rotary embedding + KV
write. In bfloat16 and float16 they round every intermediate where the torch code does, so they
must equal it exactly (bf16); float32 differs only by the norm's summation order. The rotary +
KV write is bitwise equal in every dtype and never writes outside the slots it is given.
Prefill attention: against a float64 dense reference (GQA, MLA-style values, sliding windows,
mixed lengths), and through whole generations against SDPA.
"""

from __future__ import annotations

import pytest
import runtime_models as rm
import torch
import torch.nn.functional as F

from backends.runtime.config import RopeConfig
from backends.runtime.cpu_kernels import cpu_ops
from backends.runtime.engine import LLMEngine
from backends.runtime.kernels import KernelSettings
from backends.runtime.layers import RMSNorm
from backends.runtime.loader import load_runner
from backends.runtime.paged import BatchMeta
from backends.runtime.prefill_attn import cpu_prefill_attention
from backends.runtime.rope import RotaryEmbedding
from backends.runtime.sampling_params import SamplingParams

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@pytest.fixture(scope="module")
def ops():
    ops = cpu_ops()
    assert ops is not None, "the C++ kernels must build on the test machine"
    return ops


def exact_or_close(got, want, dtype):
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=2e-6, atol=2e-6)
    elif dtype == torch.bfloat16:
        assert torch.equal(got, want)
    else:  # float16: its finer mantissa shows the summation order in one value in ~1e4
        torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_norms_match_torch(ops, dtype):
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(19, 100, generator=g) * 3).to(dtype)
    delta = torch.randn(19, 100, generator=g).to(dtype)
    w = torch.randn(100, generator=g).to(dtype)
    fused, plain = RMSNorm(w, 1e-5, KernelSettings()), RMSNorm(w, 1e-5, None)
    assert fused.fused is not None and plain.fused is None
    exact_or_close(fused(x), plain(x), dtype)
    s, y = fused.add(x, delta)
    s_ref, y_ref = plain.add(x, delta)
    assert torch.equal(s, s_ref)  # the residual stream itself is exact
    exact_or_close(y, y_ref, dtype)
    rows = torch.randn(19, 140, generator=g).to(dtype)[:, 20:120]  # strided rows (MLA's slice)
    exact_or_close(fused(rows), plain(rows.contiguous()), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul_matches_torch(ops, dtype):
    g = torch.Generator().manual_seed(2)
    gate_up = (torch.randn(7, 2 * 37, generator=g) * 6).to(dtype)  # 37: a vector tail too
    gate, up = gate_up.split(37, dim=-1)
    exact_or_close(ops.silu_mul(gate_up), F.silu(gate) * up, dtype)
    big = torch.tensor([[-200.0, -90.0, -1e-30, 0.0, 90.0, 200.0] * 2]).to(dtype)  # no overflow
    exact_or_close(ops.silu_mul(big), F.silu(big[:, :6]) * big[:, 6:], dtype)


def rope_case(dtype, T=11, H=6, Hkv=2, D=16, S=40):
    rope = RotaryEmbedding(RopeConfig(dim=D, theta=10000.0), 64, "cpu", dtype)
    g = torch.Generator().manual_seed(3)
    qkv = torch.randn(T, (H + 2 * Hkv) * D, generator=g).to(dtype)
    positions = torch.randint(0, 64, (T,), generator=g)
    slots = torch.randperm(S, generator=g)[:T]
    caches = [torch.full((S, Hkv, D), 7.0, dtype=dtype) for _ in range(2)]
    return rope, qkv, positions, slots, caches, (T, H, Hkv, D)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_write_kv_matches_rope_and_write(ops, dtype):
    rope, qkv, positions, slots, (kc, vc), (T, H, Hkv, D) = rope_case(dtype)
    cos, sin = rope.tables()
    q, k = ops.rope_write_kv(qkv, cos, sin, positions, slots, kc, vc, H, Hkv)
    heads = qkv.view(T, H + 2 * Hkv, D)
    want = rope.apply(heads[:, : H + Hkv], positions)
    assert torch.equal(q, want[:, :H]) and torch.equal(k, want[:, H:])
    assert torch.equal(kc[slots], k) and torch.equal(vc[slots], heads[:, H + Hkv :])
    untouched = torch.ones(kc.shape[0], dtype=torch.bool)
    untouched[slots] = False
    assert bool((kc[untouched] == 7).all() and (vc[untouched] == 7).all())


def test_rope_write_kv_refuses_bad_positions_and_slots(ops):
    rope, qkv, positions, slots, (kc, vc), (T, H, Hkv, D) = rope_case(torch.float32)
    cos, sin = rope.tables()
    bad_slots, bad_pos = slots.clone(), positions.clone()
    bad_slots[-1], bad_pos[-1] = kc.shape[0], 64
    with pytest.raises(RuntimeError, match="slot 40 outside"):
        ops.rope_write_kv(qkv, cos, sin, positions, bad_slots, kc, vc, H, Hkv)
    with pytest.raises(RuntimeError, match="position 64 outside"):
        ops.rope_write_kv(qkv, cos, sin, bad_pos, slots, kc, vc, H, Hkv)
    with pytest.raises(RuntimeError, match="dtypes differ"):
        ops.rope_write_kv(qkv, cos, sin, positions, slots, kc.double(), vc, H, Hkv)
    assert bool((kc == 7).all() and (vc == 7).all())  # checked before the first write


def dense_reference(q, k, v, lengths, scale, window):
    out, start = [], 0
    for n in lengths:
        qq, kk, vv = (t[start : start + n].double().transpose(0, 1) for t in (q, k, v))
        G = qq.shape[0] // kk.shape[0]
        kk, vv = kk.repeat_interleave(G, 0), vv.repeat_interleave(G, 0)
        i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
        seen = (j <= i) & ((j > i - window) if window else True)
        s = (qq @ kk.transpose(1, 2) * scale).masked_fill(~seen, float("-inf"))
        out.append((s.softmax(-1) @ vv).transpose(0, 1))
        start += n
    return torch.cat(out).float()


@pytest.mark.parametrize(
    "H, Hkv, Dk, Dv, lengths, window",
    [
        (9, 3, 64, 64, [512], None),  # SmolLM2's heads, one query block per 32 tokens
        (6, 2, 16, 16, [100, 700, 3, 33], None),  # keys in more than one chunk of 512
        (8, 1, 40, 32, [300, 77], None),  # MLA: the values are the keys' first channels
        (9, 3, 64, 64, [600, 20, 129], 128),  # sliding window
    ],
)
def test_prefill_attention_matches_reference(ops, H, Hkv, Dk, Dv, lengths, window):
    g = torch.Generator().manual_seed(len(lengths))
    T = sum(lengths)
    q, k = torch.randn(T, H, Dk, generator=g), torch.randn(T, Hkv, Dk, generator=g)
    v_new, v_dim = (None, Dv) if Dv != Dk else (torch.randn(T, Hkv, Dv, generator=g), None)
    seqs = [(0, n, list(range(-(-n // 16)))) for n in lengths]
    meta = BatchMeta.build(seqs, 16, 64, "cpu", window)
    out = cpu_prefill_attention(q, k, v_new, v_dim, meta, Dk**-0.5)
    v = k[..., :Dv] if v_new is None else v_new
    torch.testing.assert_close(out, dense_reference(q, k, v, lengths, Dk**-0.5, window))


def test_prefill_attention_refuses_bad_boundaries_and_other_dtypes(ops):
    q, k = torch.randn(10, 4, 8), torch.randn(10, 2, 8)
    with pytest.raises(RuntimeError, match="from 0 to T"):
        ops.prefill_attention(q, k, k, torch.tensor([0, 4, 9]), 1.0, 0)
    with pytest.raises(RuntimeError, match="empty or unordered"):
        ops.prefill_attention(q, k, k, torch.tensor([0, 6, 6, 10]), 1.0, 0)
    meta = BatchMeta.build([(0, 10, [0, 1, 2])], 4, 8, "cpu")
    assert cpu_prefill_attention(q.bfloat16(), k.bfloat16(), None, 8, meta, 1.0) is None


@pytest.mark.parametrize("kind", ["llama", "mistral", "deepseek_v2"])
def test_runtime_kernels_give_the_tokens_of_torch_ops(monkeypatch, kind):
    """Whole generations with the fused ops and the C++ attention (prefill and decode) against
    torch's ops and SDPA: GQA, a sliding window (mistral), MLA (deepseek_v2)."""
    prompts = [rm.random_prompt(n, seed=n) for n in (3, 9, 14, 30)]
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    outs = []
    for attention, fused in (("auto", "auto"), ("sdpa", "torch")):
        monkeypatch.setenv("PD_RUNTIME_ATTENTION", attention)
        monkeypatch.setenv("PD_RUNTIME_FUSED", fused)
        runner = load_runner(rm.checkpoint(kind))
        engine = LLMEngine(runner, runner.make_pool(64, 4), max_batch=4)
        outs.append([s.output_ids for s in engine.generate([(p, params) for p in prompts])])
    assert outs[0] == outs[1]


def test_fused_setting(monkeypatch):
    assert KernelSettings().fused == "auto"
    monkeypatch.setenv("PD_RUNTIME_FUSED", "torch")
    assert KernelSettings.from_env().fused == "torch"
    with pytest.raises(ValueError, match="PD_RUNTIME_FUSED"):
        KernelSettings(fused="fast")
    assert RMSNorm(torch.ones(4), 1e-6, KernelSettings(fused="torch")).fused is None
    assert RMSNorm(torch.ones(4, dtype=torch.float64), 1e-6, KernelSettings()).fused is None


def test_without_a_compiler_torch_ops_run(monkeypatch, tmp_path):
    from backends.runtime import cpu_kernels

    monkeypatch.setattr(cpu_kernels, "_state", {})
    monkeypatch.setenv("PD_RUNTIME_KERNEL_DIR", str(tmp_path))
    monkeypatch.setenv("CXX", "false")  # a "compiler" that always fails
    norm = RMSNorm(torch.ones(8), 1e-6, KernelSettings())
    assert norm.fused is None and norm(torch.ones(2, 8)).shape == (2, 8)
    meta = BatchMeta.build([(0, 4, [0])], 4, 2, "cpu")
    q, k = torch.randn(4, 2, 8), torch.randn(4, 1, 8)
    assert cpu_prefill_attention(q, k, None, 8, meta, 1.0) is None


def test_kernel_library_is_the_same_however_the_package_is_found(tmp_path):
    """A checkout found through an unnormalised path (``scripts/..`` on PYTHONPATH, as scripts
    once put it first on the import path) must load the library setup.sh built (a cache key
    over the unnormalised path rebuilt the kernels, ~40 s, on a script's first run)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    from backends.runtime import cpu_kernels

    root = Path(cpu_kernels.__file__).resolve().parents[2]
    code = "from backends.runtime import cpu_kernels; print(cpu_kernels.library_path())"
    env = dict(os.environ, PYTHONPATH=str(root / "scripts" / ".."))
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env,
                         capture_output=True, text=True, check=True, timeout=120)  # fmt: skip
    assert out.stdout.strip() == str(cpu_kernels.library_path())
