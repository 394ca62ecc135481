"""Fixtures shared by the unit tests: runners of the tiny random checkpoints (built once), and
the device switch: with ``PD_TEST_DEVICE=cuda`` (scripts/gpu_check.sh) every ModelRunner the
tests load runs on that device, so the same oracle tests check the CUDA path."""

import pytest
import runtime_models as rm

from backends.runtime.runner import ModelRunner


@pytest.fixture(scope="session", autouse=True)
def _runtime_device():
    if rm.DEVICE == "cpu":
        yield
        return
    load = ModelRunner.load.__func__

    def on_device(cls, path, *, dtype="float32", device=rm.DEVICE, num_layers=None, **kw):
        return load(cls, path, dtype=dtype, device=device, num_layers=num_layers, **kw)

    ModelRunner.load = classmethod(on_device)
    yield
    ModelRunner.load = classmethod(load)


@pytest.fixture(scope="session")
def llama() -> ModelRunner:
    """Tiny random Llama (GQA, 4 layers)."""
    return ModelRunner.load(rm.checkpoint("llama"))


@pytest.fixture(scope="session")
def mla() -> ModelRunner:
    """Tiny random DeepSeek-V3 (MLA + MoE)."""
    return ModelRunner.load(rm.checkpoint("deepseek_v3"))
