"""The CUDA attention dispatch (``backends/runtime/cuda_attn.py``) without a GPU: CPU forwards
never import triton, a kernel that cannot be built for the GPU (Triton's compilation, ptxas and
out-of-resources errors) falls back to SDPA once and for all with one warning
(``PD_RUNTIME_ATTENTION=triton``: the failure raises), any other kernel error fails that forward
only, and ``PD_RUNTIME_ATTENTION=sdpa`` never calls the kernel."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import types

import pytest
import runtime_models as rm
import torch

from backends.runtime import cuda_attn
from backends.runtime.loader import load_runner
from backends.runtime.paged import SeqInput


def forward(runner, prompt):
    pool = runner.make_pool(8, 4)
    return runner.forward(pool, [SeqInput(prompt, 0, pool.alloc(6))])[0]


def test_cpu_forward_does_not_import_triton():
    code = (
        "import sys\n"
        "from backends.runtime.loader import load_runner\n"
        "from backends.runtime.paged import SeqInput\n"
        f"r = load_runner({rm.checkpoint('llama')!r})\n"
        "p = r.make_pool(4, 4)\n"
        "r.forward(p, [SeqInput([5, 6, 7], 0, p.alloc(1))])\n"
        "r.decode(p, [8], [3], [p.alloc(0) + [0]])\n"
        "assert 'triton' not in sys.modules, 'triton imported'\n"
    )
    root = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
    path = os.pathsep.join([root, os.path.join(root, "tests", "helpers")])
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join([path, env.get("PYTHONPATH", "")])
    env.pop("TRITON_INTERPRET", None)
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env
    )
    assert proc.returncode == 0, proc.stderr[-2000:]


def unbuildable() -> list[Exception]:
    """What Triton raises when a kernel cannot be built for the GPU at hand."""
    from triton.compiler.errors import CompilationError
    from triton.runtime.errors import OutOfResources, PTXASError

    return [
        CompilationError("def k(): ...", None, "type fp8e4nv not supported in this architecture"),
        PTXASError("ptxas fatal: Value 'sm_120' is not defined for option 'gpu-name'"),
        OutOfResources(232448, 101376, "shared memory"),
    ]


@pytest.mark.parametrize("error", unbuildable(), ids=lambda e: type(e).__name__)
def test_a_kernel_that_cannot_be_built_falls_back_to_sdpa_once(monkeypatch, caplog, error):
    monkeypatch.setenv("PD_RUNTIME_ATTENTION", "auto")  # gpu_check.sh runs with triton
    runner = load_runner(rm.checkpoint("llama"))
    prompt = rm.random_prompt(11, seed=3)
    want = forward(runner, prompt)
    calls = []

    def broken(*args, **kwargs):
        calls.append(1)
        raise error

    monkeypatch.setattr(cuda_attn, "DEVICE_TYPES", ("cuda", "cpu"))
    monkeypatch.setattr(cuda_attn, "_module", types.SimpleNamespace(paged_attention=broken))
    with caplog.at_level(logging.WARNING, logger=cuda_attn.__name__):
        got = forward(runner, prompt)
        again = forward(runner, prompt)
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(again, want)
    assert calls == [1] and cuda_attn._module is False  # tried once, then SDPA for good
    said = [r for r in caplog.records if "Triton attention cannot run here" in r.message]
    assert len(said) == 1 and type(error).__name__ in said[0].message


@pytest.mark.parametrize(
    "error",
    [
        RuntimeError("CUDA error: an illegal memory access was encountered"),
        ValueError("12 query heads do not group over 5 KV heads"),
        torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"),
    ],
    ids=lambda e: type(e).__name__,
)
def test_any_other_kernel_error_fails_the_forward_and_keeps_the_kernel(monkeypatch, caplog, error):
    """Only a kernel that cannot be built is what SDPA stands in for: an error of one call
    fails that forward (the request), and the next forward runs the kernel again."""
    monkeypatch.setenv("PD_RUNTIME_ATTENTION", "auto")
    runner = load_runner(rm.checkpoint("llama"))
    calls = []

    def broken(*args, **kwargs):
        calls.append(1)
        raise error

    kernel = types.SimpleNamespace(paged_attention=broken)
    monkeypatch.setattr(cuda_attn, "DEVICE_TYPES", ("cuda", "cpu"))
    monkeypatch.setattr(cuda_attn, "_module", kernel)
    with caplog.at_level(logging.WARNING, logger=cuda_attn.__name__):
        for _ in range(2):
            with pytest.raises(type(error), match=str(error)[:20]):
                forward(runner, rm.random_prompt(7, seed=1))
    assert calls == [1, 1] and cuda_attn._module is kernel and cuda_attn.kernels_ok()
    assert not [r for r in caplog.records if "SDPA" in r.message]


def test_triton_setting_raises_the_kernel_failure(monkeypatch):
    monkeypatch.setenv("PD_RUNTIME_ATTENTION", "triton")
    runner = load_runner(rm.checkpoint("llama"))

    def broken(*args, **kwargs):
        raise RuntimeError("no kernel for this GPU")

    monkeypatch.setattr(cuda_attn, "DEVICE_TYPES", ("cuda", "cpu"))
    monkeypatch.setattr(cuda_attn, "_module", types.SimpleNamespace(paged_attention=broken))
    with pytest.raises(RuntimeError, match="no kernel for this GPU"):
        forward(runner, rm.random_prompt(7, seed=1))
    assert cuda_attn._module is not False  # no silent switch to SDPA either


def test_sdpa_setting_never_calls_the_kernel(monkeypatch):
    monkeypatch.setenv("PD_RUNTIME_ATTENTION", "sdpa")
    runner = load_runner(rm.checkpoint("llama"))
    calls = []
    kernel = types.SimpleNamespace(paged_attention=lambda *a, **k: calls.append(1))
    monkeypatch.setattr(cuda_attn, "DEVICE_TYPES", ("cuda", "cpu"))
    monkeypatch.setattr(cuda_attn, "_module", kernel)
    forward(runner, rm.random_prompt(7, seed=1))
    assert calls == []
