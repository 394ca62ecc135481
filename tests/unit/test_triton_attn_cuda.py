"""The Triton paged-attention kernel compiled for the GPU, every case of
``tests/helpers/triton_attn_cases.py`` against the float64 reference (the interpreter checks the
same cases on CPU in test_triton_attn.py). Skipped without CUDA; scripts/gpu_check.sh runs it."""

from __future__ import annotations

import pytest
import torch
import triton_attn_cases as cases

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.fixture(scope="module")
def ta():
    from backends.runtime import triton_attn

    return triton_attn


@pytest.mark.parametrize("name", list(cases.suite()))
def test_cuda_kernel_matches_float64_reference(ta, name):
    kw, tol = cases.suite()[name]
    out, ref = cases.run_case(ta, **kw, device="cuda")
    torch.testing.assert_close(out, ref, atol=tol, rtol=tol)


@pytest.mark.parametrize("splits", [None, 1, 8])
def test_cuda_long_decode_splits_agree(ta, splits):
    """A 4k-key decode batch of 2 (auto splits it over the SMs), forced 1 and 8 splits."""
    cases.CASES["long4k"] = [(4095, 1), (1500, 1)]
    kw = dict(case="long4k", page_size=16, H=32, hkv=8, dk=128, dv=128, window=None)
    out, ref = cases.run_case(ta, **kw, dtype=torch.float16, splits=splits, device="cuda")
    torch.testing.assert_close(out, ref, atol=3e-3, rtol=3e-3)
