"""Fixtures shared by the unit tests: runners of the tiny random checkpoints (built once)."""

import pytest
import runtime_models as rm

from backends.runtime.runner import ModelRunner


@pytest.fixture(scope="session")
def llama() -> ModelRunner:
    """Tiny random Llama (GQA, 4 layers)."""
    return ModelRunner.load(rm.checkpoint("llama"))


@pytest.fixture(scope="session")
def mla() -> ModelRunner:
    """Tiny random DeepSeek-V3 (MLA + MoE)."""
    return ModelRunner.load(rm.checkpoint("deepseek_v3"))
