"""Fixtures shared by the unit tests: runners of the tiny random checkpoints (built once), and
the device switch: with ``PD_TEST_DEVICE=cuda`` (scripts/gpu_check.sh) every runner the tests
load without naming a device runs on that device, so the same oracle tests check the CUDA path."""

import pytest
import runtime_models as rm

from backends.runtime.loader import load_runner
from backends.runtime.runner import ModelRunner


@pytest.fixture(scope="session", autouse=True)
def _runtime_device():
    if rm.DEVICE == "cpu":
        yield
        return
    # the loader's default device, changed on the function itself: every module that imported
    # load_runner sees it (a replaced module attribute would miss those)
    defaults = load_runner.__kwdefaults__
    was = defaults["device"]
    defaults["device"] = rm.DEVICE
    yield
    defaults["device"] = was


@pytest.fixture(scope="session")
def llama() -> ModelRunner:
    """Tiny random Llama (GQA, 4 layers)."""
    return load_runner(rm.checkpoint("llama"))


@pytest.fixture(scope="session")
def mla() -> ModelRunner:
    """Tiny random DeepSeek-V3 (MLA + MoE)."""
    return load_runner(rm.checkpoint("deepseek_v3"))
